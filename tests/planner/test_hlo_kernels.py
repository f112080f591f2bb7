"""mlir_train.planner.hlo and its kernel recognisers (hlo_kernels) on hand-written HLO and on an XLA:CPU compile (no GPU needed)."""

import jax
import pytest
import jax.numpy as jnp

from mlir_train.planner.hlo import analyze, matmul_flops
from mlir_train.planner.hlo_kernels import _causal_tile_pairs, _dkv_tile_pairs

HLO = """
%body (p: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,4]{1,0} parameter(1)
  ROOT %d = f32[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[2,4,8], y: f32[2,8,4]) -> f32[2,4,4] {
  %x = f32[2,4,8]{2,1,0} parameter(0)
  %y = f32[2,8,4]{2,1,0} parameter(1)
  %w = (s32[], f32[4,4]{1,0}, f32[], f32[], f32[], /*index=5*/f32[]) while(%t), condition=%c, body=%body
  %k = bf16[384,768]{1,0} custom-call(%e, %u, %l, %r), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={s32[6]{0}, s32[1]{0}, bf16[384,2048]{1,0}, bf16[3,2048,768]{2,1,0}}, api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(f)/moe_block_matmul/mpmd_map"}
  ROOT %r = f32[2,4,4]{2,1,0} dot(%x, %y), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""


def test_counts_dots_loops_and_block_kernels():
    f = matmul_flops(HLO)
    assert f.dot_flops == 2 * 4 * 4 * 8 + 2 * 2 * 4 * 4 * 8
    assert f.batched_dot_flops == 2 * 2 * 4 * 4 * 8
    assert f.while_loops == 1
    (k,) = f.kernels
    assert (k.name, k.rows, k.flops_bound) == ("moe_block_matmul", 384, 2 * 384 * 2048 * 768)
    assert f.kernel_flops_for_rows({384: 192}) == k.flops_bound / 2


def test_counts_an_xla_cpu_compile():
    a, b = jnp.ones((3, 16, 32)), jnp.ones((3, 32, 8))
    f = matmul_flops(jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b)).lower(a, b).compile().as_text())
    assert f.dot_flops == 2 * 3 * 16 * 32 * 8


def test_causal_tile_pairs():
    assert _causal_tile_pairs(256, 128, 128) == 3  # 1 + 2
    assert _causal_tile_pairs(128, 32, 32) == 10


def test_dkv_tile_pairs_cover_the_causal_area_of_any_query_step():
    """The Pallas backward's dK/dV loop starts each key tile at its first key's query row: square
    tiles visit the causal pairs, 16-row query steps under 64-wide key tiles (256-wide heads) the
    same area."""
    assert _dkv_tile_pairs(128, 32, 32) == _causal_tile_pairs(128, 32, 32) == 10
    assert _dkv_tile_pairs(4096, 16, 64) * 16 * 64 == _causal_tile_pairs(4096, 64, 64) * 64 * 64


def test_loop_bodies_count_their_known_trip_count():
    def f(x, w):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]

    flops = matmul_flops(jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((3, 8, 8))).compile().as_text())
    assert flops.while_loops == 1 and flops.unknown_trip_count_loops == 0
    assert flops.dot_flops == 3 * 2 * 4 * 8 * 8


# A pipelined step's shape, as XLA:GPU leaves it: the schedule's tick loop has lost its
# known_trip_count in XLA's loop rewrites (only the induction variable is recorded; it runs
# 1 <= i < 5), its body holds a dot and an MoE block kernel, and a conditional picks one of two
# branches. The two counters this reader replaced disagreed here: hlo_flops counted the tick loop
# once (unknown trip count) and every branch as taken; hlo_stats read the loop's 4 ticks and the
# costliest branch. On the folding layout of benchmarks/README.md (TP2 PP2 EP4 ETP1, 64
# micro-batches: 65 ticks) that was 8.84e13 against 3.21e15 FLOPs per device, 36x.
PIPELINED = """HloModule m, entry_computation_layout={()->()}

%cond (c: (s32[], f32[4,8])) -> pred[] {
  %c = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%tick (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %w = f32[8,8]{1,0} constant({...})
  %d = f32[4,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %k = bf16[384,768]{1,0} custom-call(%e, %u, %l, %r), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={s32[6]{0}, s32[1]{0}, bf16[384,2048]{1,0}, bf16[3,2048,768]{2,1,0}}, api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(f)/moe_block_matmul/mpmd_map"}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %d)
}

%small (a: f32[4,8]) -> f32[4,8] {
  ROOT %a = f32[4,8]{1,0} parameter(0)
}

%big (b: f32[4,8]) -> f32[4,8] {
  %b = f32[4,8]{1,0} parameter(0)
  %m = f32[8,8]{1,0} constant({...})
  ROOT %e = f32[4,8]{1,0} dot(%b, %m), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main () -> f32[4,8] {
  %one = s32[] constant(1)
  %x0 = f32[4,8]{1,0} constant({...})
  %init = (s32[], f32[4,8]{1,0}) tuple(%one, %x0)
  %loop = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%tick, backend_config={"known_induction_variable":{"tuple_index":"0"}}
  %y = f32[4,8]{1,0} get-tuple-element(%loop), index=1
  %z = s32[] constant(0)
  ROOT %r = f32[4,8]{1,0} conditional(%z, %y, %y), branch_computations={%small, %big}
}
"""


def test_both_views_of_one_program_agree():
    """analyze (the planner's Stats) and matmul_flops (the MoE audit's breakdown) are one parse
    and one traversal: the same loop rule (the tick loop's 4 ticks read from the loop) and the
    same branch rule (the costliest)."""
    dot, kernel = 2 * 4 * 8 * 8, 2 * 384 * 2048 * 768
    stats, flops = analyze(PIPELINED), matmul_flops(PIPELINED)
    assert flops.unknown_trip_count_loops == stats.unknown_loops == 0 and flops.while_loops == 1
    assert len(flops.kernels) == 4 and flops.kernel_flops_bound == 4 * kernel
    assert flops.dot_flops == 4 * dot + dot  # 4 ticks + the costliest branch
    assert stats.matmul_flops == flops.total_flops == 4 * (dot + kernel) + dot
    assert stats.conditionals == 1
    assert analyze(PIPELINED, branch="min").matmul_flops == 4 * (dot + kernel)


def test_both_views_agree_on_an_xla_cpu_compile():
    """A scanned layer stack's gradient: the compiled program's two views agree (no kernels on
    CPU: every FLOP is a dot)."""
    def loss(w, x):
        return jax.lax.scan(lambda h, w_l: (jnp.tanh(h @ w_l), None), x, w)[0].sum()

    text = jax.jit(jax.grad(loss)).lower(jnp.ones((3, 16, 16)), jnp.ones((8, 16))).compile().as_text()
    stats, flops = analyze(text), matmul_flops(text)
    assert stats.matmul_flops == flops.total_flops == flops.dot_flops == 3 * 3 * 2 * 8 * 16 * 16
    assert stats.unknown_loops == flops.unknown_trip_count_loops == 0


def test_balanced_branch_rule_picks_by_scope_on_an_xla_cpu_compile():
    """``branch="balanced"``: the cheapest branch of a conditional traced under one of
    ``min_scopes`` (the EP overflow rounds a balanced routing never enters), the costliest of any
    other (e.g. the LM head only the last pipeline stage runs)."""
    small, big = jnp.ones((8, 8)), jnp.ones((8, 32))

    def f(x, p, q):
        with jax.named_scope("ep_overflow_rounds"):
            y = jax.lax.cond(p, lambda: x @ small @ small, lambda: x)
        with jax.named_scope("pipeline_head_last_stage"):
            z = jax.lax.cond(q, lambda: (y @ big).sum(axis=1, keepdims=True) * y, lambda: y)
        return z

    text = jax.jit(f).lower(jnp.ones((4, 8)), True, False).compile().as_text()
    two, head = 2 * (2 * 4 * 8 * 8), 2 * 4 * 8 * 32
    assert analyze(text).flops.dot_flops == two + head
    assert analyze(text, branch="min").flops.dot_flops == 0
    balanced = analyze(text, branch="balanced", min_scopes=("ep_overflow_rounds",))
    assert balanced.flops.dot_flops == head and balanced.conditionals == 2


def test_the_overflow_rounds_conditionals_carry_the_scope_the_planner_reads():
    """The dispatcher's overflow rounds (forward and backward) are traced under
    ``dispatch.OVERFLOW_SCOPE``, the scope the planner passes as ``min_scopes``."""
    import re

    from mlir_train.model.moe import dispatch

    def round_fn(r, args, ints):
        (w,) = args
        return jnp.where(jnp.arange(4)[:, None] // 2 == r, ints @ w, 0.0)

    def loss(w, ints, n):
        return dispatch.in_rounds(round_fn, (w,), ints, n, max_rounds=2).sum()

    text = jax.jit(jax.grad(loss)).lower(jnp.ones((8, 8)), jnp.ones((4, 8)), jnp.int32(2)).compile().as_text()
    names = re.findall(r"conditional\(.*op_name=\"([^\"]*)\"", text)
    assert names and all(dispatch.OVERFLOW_SCOPE in n for n in names), names
    assert analyze(text).conditionals >= 2


# ----- tokamax's kernel metadata: 0.0.12 (op_name) and 0.0.17 (metadata_payload) ---------------
# One tokamax Mosaic-GPU ragged dot ([512, 256] x [4, 256, 128], block_m 64) as each version's
# optimized HLO prints it (deviceless H200 compiles; backend configs and unread JSON fields cut).
_RAGGED_JSON = ('{\\"op\\":{\\"__type\\":\\"tokamax._src.ops.ragged_dot.pallas_mosaic_gpu.PallasMosaicGpuRaggedDot\\",'
                '\\"config\\":{\\"block_m\\":64,\\"block_n\\":64,\\"block_k\\":128}},\\"arguments\\":{\\"group_sizes\\":'
                '{\\"num_groups\\":4,\\"total_size\\":512},\\"lhs\\":\\"bf16[512,256]\\",\\"rhs\\":\\"bf16[4,256,128]\\"}}')
TOKAMAX_0012 = ('  %mpmd_map.2 = bf16[512,128]{1,0} custom-call(%g6, %g5, %x.1, %w.1), custom_call_target="mosaic_gpu_v2", '
                'operand_layout_constraints={s32[11]{0}, s32[11]{0}, bf16[512,256]{1,0}, bf16[4,256,128]{2,1,0}}, '
                'api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(f)/tokamax:' + _RAGGED_JSON
                + '/ragged_dot_sm90/mpmd_map" scheduling_name="mpmd_map.2"}')
TOKAMAX_0017 = ('  %mpmd_map.2 = bf16[512,128]{1,0} custom-call(%x.1, %w.1, %g6, %g3), custom_call_target="mosaic_gpu_v2", '
                'operand_layout_constraints={bf16[512,256]{1,0}, bf16[4,256,128]{2,1,0}, s32[11]{0}, s32[11]{0}}, '
                'api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(f)/ragged_dot_sm90/mpmd_map" '
                'scheduling_name="mpmd_map.2" stack_frame_id=55 metadata_payload="tokamax:' + _RAGGED_JSON + '"}')


def _module(line: str) -> str:
    return ("HloModule m\n\nENTRY %main (x.1: bf16[512,256], w.1: bf16[4,256,128]) -> bf16[512,128] {\n"
            "  %x.1 = bf16[512,256]{1,0} parameter(0)\n  %w.1 = bf16[4,256,128]{2,1,0} parameter(1)\n"
            "  %g6 = s32[11]{0} constant({...})\n  %g5 = s32[11]{0} constant({...})\n  %g3 = s32[11]{0} constant({...})\n"
            f"  ROOT{line[line.index('%mpmd_map.2') - 1:]}\n}}\n")


@pytest.mark.parametrize("line", [TOKAMAX_0012, TOKAMAX_0017], ids=["tokamax-0.0.12-op_name", "tokamax-0.0.17-payload"])
def test_tokamax_ragged_dot_is_read_from_either_versions_metadata(line):
    """tokamax 0.0.17 moved the op's JSON from a ``tokamax:{...}`` name scope (``op_name``) to the
    XLA metadata payload (``metadata_payload="tokamax:{...}"``): both read as the same kernel."""
    from mlir_train.planner.hlo_kernels import KernelCall

    (k,) = matmul_flops(_module(line)).kernels
    assert k == KernelCall("tokamax_ragged_dot", 512, 2.0 * 512 * 256 * 128, 64)


def test_tokamax_payload_of_nested_ops_reads_the_innermost():
    """tokamax 0.0.17 stacks nested ops' payloads outermost-first (``tokamax:{A}/tokamax:{B}``):
    the kernel is the innermost op's."""
    from mlir_train.planner.hlo_kernels import _tokamax_json

    outer = '{\\"op\\":{\\"__type\\":\\"my.Outer\\"},\\"arguments\\":{}}'
    line = TOKAMAX_0017.replace('metadata_payload="tokamax:', f'metadata_payload="tokamax:{outer}/tokamax:')
    assert _tokamax_json(line)["op"]["__type"].endswith("PallasMosaicGpuRaggedDot")
    assert _tokamax_json('metadata={op_name="jit(f)/dot"}') is None


# ----- XLA:GPU of jax 0.12.1: async fusions -----------------------------------------------------
# jax 0.12.1's XLA:GPU wraps small all-reduces in Triton collective fusions run asynchronously
# (fusion-start / fusion-done around a synchronous all-reduce, where 0.10.2 had all-reduce-start /
# -done) and runs dynamic-slice fusions asynchronously (a layer's weights sliced out of the stack).
ASYNC_FUSIONS = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_all-reduce.1 (p0: f32[1,128]) -> f32[1,128] {
  %p0 = f32[1,128]{1,0} parameter(0)
  ROOT %ar = f32[1,128]{1,0} all-reduce(%p0), replica_groups={{0,1}}, to_apply=%add, backend_config={"is_sync":true}
}

%fused_dynamic_slice.1 (q0: bf16[24,64,128], q1: s32[]) -> bf16[1,64,128] {
  %q0 = bf16[24,64,128]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%q0, %q1, %z, %z), dynamic_slice_sizes={1,64,128}
}

ENTRY %main (x: f32[1,128], w: bf16[24,64,128], i: s32[], a: f32[128,128]) -> (f32[1,128], bf16[1,64,128], f32[128,128]) {
  %x = f32[1,128]{1,0} parameter(0)
  %w = bf16[24,64,128]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %a = f32[128,128]{1,0} parameter(3)
  %fs = ((f32[1,128]{1,0}), f32[1,128]{1,0}, u32[]) fusion-start(%x), kind=kCustom, calls=%fused_all-reduce.1, backend_config={"fusion_backend_config":{"kind":"__triton_collective"}}
  %ds = ((bf16[24,64,128]{2,1,0}, s32[]), bf16[1,64,128]{2,1,0}, u32[]) fusion-start(%w, %i), kind=kLoop, calls=%fused_dynamic_slice.1
  %d = f32[128,128]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %fd = f32[1,128]{1,0} fusion-done(%fs)
  %dd = bf16[1,64,128]{2,1,0} fusion-done(%ds)
  ROOT %t = (f32[1,128]{1,0}, bf16[1,64,128]{2,1,0}, f32[128,128]{1,0}) tuple(%fd, %dd, %d)
}
"""


def test_async_fusions_of_newer_xla():
    """The all-reduce inside an async Triton collective fusion is counted once, overlapped (with
    the matmul scheduled between the fusion's start and done); the async dynamic-slice fusion
    reads the slice, not the whole stack, as its plain-fusion form did."""
    stats = analyze(ASYNC_FUSIONS)
    assert stats.collectives["all-reduce"].count == 1 and stats.collectives["all-reduce"].bytes == 512
    row = stats.overlap()["all-reduce"]
    assert (row["count"], row["overlapped"], row["matmul_overlapped"]) == (1, 1, 1)
    matmul = 3 * 128 * 128 * 4                  # the dot: two operands and its result
    all_reduce = 2 * 512                        # the collective fusion's operand and result
    dynamic_slice = 2 * 64 * 128 * 2 + 4        # the slice read and written, the index
    context = 2 * 4                             # each start's u32 context scalar, counted as written
    assert stats.hbm_bytes == matmul + all_reduce + dynamic_slice + context


def test_tokamax_ragged_dot_inside_shard_map_is_read_by_its_kernel_name():
    """Inside a ``shard_map`` (every kernel of a training step) jax 0.12.1 drops tokamax 0.0.17's
    metadata payload: the kernel is read from its name (``ragged_dot_sm90``,
    ``ragged_contracting_dim_dot_sm90``) and operand shapes, at tokamax's default 64-row tile."""
    from mlir_train.planner.hlo_kernels import KernelCall

    line = TOKAMAX_0017[:TOKAMAX_0017.index(" metadata_payload=")].replace("jit(f)/", "jit(f)/shard_map/") + "}"
    (k,) = matmul_flops(_module(line)).kernels
    assert k == KernelCall("tokamax_ragged_dot", 512, 2.0 * 512 * 256 * 128, 64)
    grad = ('  %mpmd_map.2 = f32[4,256,128]{2,1,0} custom-call(%g6, %g3, %x.1, %w.1), custom_call_target="mosaic_gpu_v2", '
            'operand_layout_constraints={s32[4]{0}, s32[4]{0}, bf16[256,512]{1,0}, bf16[512,128]{1,0}}, '
            'api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(f)/transpose(jvp())/shard_map/'
            'ragged_contracting_dim_dot_sm90/mpmd_map"}')
    (k,) = matmul_flops(_module(grad)).kernels
    assert k == KernelCall("tokamax_ragged_dot_t", 512, 2.0 * 512 * 256 * 128, 64)
