"""mlir_train.planner.hlo and its kernel recognisers (hlo_kernels) on hand-written HLO and on an XLA:CPU compile (no GPU needed)."""

import jax
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
