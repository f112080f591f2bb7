"""The communication audit's pieces: Megatron's analytic volumes (mlir_train.planner.comm) against
hand counts and megatron-core's own pipeline message shape, the HLO reader's replica groups,
overlap counter, ragged traffic and HBM bytes on a handwritten scheduled module, and the
roofline's arithmetic (mlir_train.planner.roofline)."""

import types

import pytest

import sharding
from mlir_train.families import get_model_config
from mlir_train.planner import comm, hlo, hlo_text, roofline
from mlir_train.planner.targets import DEVICE_KINDS

TINY = get_model_config("qwen3-moe-tiny")


def _kinds(volumes):
    out = {}
    for v in volumes:
        c, b = out.get(v.kind, (0, 0))
        out[v.kind] = (c + v.count, b + v.bytes)
    return out


def _params(cfg, tp, ep, etp):
    """Per device of one stage holding every layer (hand count): TP-split, TP-replicated, expert."""
    h, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    attn = (h * d * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * d * h) // tp
    dense = L * attn + 2 * cfg.vocab_size * h // tp
    replicated = L * (2 * h + 2 * d + h * cfg.num_experts) + h
    expert = L * cfg.num_experts // ep * 3 * h * cfg.moe_intermediate_size // etp
    return dense, replicated, expert


def test_megatron_volumes_tp2_sp_ep2_distopt_by_hand():
    """8 devices, TP2 + SP, EP2 (ETP = TP), no pipeline, distributed optimizer: DP 4, expert DP 2."""
    cfg, seq, m = TINY, 64, 3
    lay = comm.CommLayout(8, tensor=2, expert=2, sequence_parallel=True, distributed_optimizer=True)
    stage, vols = comm.megatron_volumes(cfg, lay, seq=seq, micro_batch=1, num_micro=m)
    assert stage == 0
    h, L, k = cfg.hidden_size, cfg.num_layers, cfg.top_k
    act = seq * h * 2                          # one [T, h] bf16 buffer
    rows = seq // 2 * k                        # each TP rank routes its T/TP tokens
    dense, replicated, expert = _params(cfg, 2, 2, 2)
    got = _kinds(vols)
    # Attention: forward AG + RS; backward AG (output grad) + AG (input again) + RS (input grad).
    # MoE: ETP all-gather after the dispatch, reduce-scatter before the combine, forward and backward.
    # Embedding RS + its backward AG; LM head AG forward, AG + RS backward (its vocab-split
    # output gradient is not gathered).
    assert got["all-gather"] == (3 * m * L + 2 * m * L + m + 2 * m + 2,
                                 3 * m * L * act + 2 * m * L * rows * 2 * h * 2 + m * act + 2 * m * act
                                 + (dense + replicated) * 2 + expert * 2)
    assert got["reduce-scatter"] == (2 * m * L + 2 * m * L + m + m + 2,
                                     2 * m * L * act + 2 * m * L * rows * 2 * h * 2 + 2 * m * act
                                     + (dense + replicated) * 4 + expert * 4)
    # Dispatch + combine of top-k rows, forward and backward, and the routing probabilities (float32).
    assert got["all-to-all"] == (4 * m * L + 2 * m * L, 4 * m * L * rows * h * 2 + 2 * m * L * rows * 4)
    # The norms' and router's gradients over TP once; the vocab-parallel loss's three [T] float32 reductions.
    assert got["all-reduce"] == (1 + 3 * m, replicated * 4 + 3 * m * seq * 4)
    assert "send/recv" not in got
    groups = {(v.purpose.split()[0], v.group, v.group_size) for v in vols if "grads" in v.purpose}
    assert ("dense", "dp", 4) in groups and ("expert", "edp", 2) in groups


def test_megatron_volumes_count_the_routers_expert_count_reductions():
    """megatron-core's aux losses all-reduce the expert counts per MoE layer and forward pass
    (``get_tokens_per_expert_and_token_count``: int64 sums of the routing map): ``aux_loss`` E
    counts over TP x CP, ``seq_aux_loss`` micro-batch x E over the same group, ``global_aux_loss``
    E over TP x DP x CP; a zero coefficient runs none, and a full recompute reruns them."""
    from mlir_train.config.policies import LoadBalancing

    cfg, seq, m, mb = TINY, 64, 3, 2
    lay = comm.CommLayout(8, tensor=2, expert=2, sequence_parallel=True, distributed_optimizer=True)
    e, L = cfg.num_experts, cfg.num_layers

    def router(balancing, **kw):
        _, vols = comm.megatron_volumes(cfg, lay, seq=seq, micro_batch=mb, num_micro=m, balancing=balancing, **kw)
        return {(v.purpose.split()[1], v.group, v.group_size): (v.count, v.bytes) for v in vols
                if v.purpose.startswith("router")}

    assert router(None) == {} and router(LoadBalancing.from_flags("aux_loss", 0.0)) == {}
    assert router(LoadBalancing.from_flags("aux_loss", 1e-2)) == {("aux_loss", "tp", 2): (m * L, m * L * e * 8)}
    both = router(LoadBalancing.from_flags(["seq_aux_loss", "global_aux_loss"], [1e-3, 1e-3]))
    assert both == {("seq_aux_loss", "tp", 2): (m * L, m * L * mb * e * 8),
                    ("global_aux_loss", "tp+dp", 8): (m * L, m * L * e * 8)}
    assert router(LoadBalancing.from_flags("aux_loss", 1e-2), recompute_fraction=1.0) == {
        ("aux_loss", "tp", 2): (2 * m * L, 2 * m * L * e * 8)}


def test_megatron_volumes_without_sp_or_distopt_are_all_reduces():
    cfg, seq, m = get_model_config("qwen3-tiny"), 32, 2
    lay = comm.CommLayout(4, tensor=2)
    _, vols = comm.megatron_volumes(cfg, lay, seq=seq, micro_batch=2, num_micro=m)
    got = _kinds(vols)
    assert set(got) == {"all-reduce"}
    act = 2 * seq * cfg.hidden_size * 2
    blocks = 2 * cfg.num_layers            # attention and MLP per layer: forward + backward all-reduce each
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = (h * d * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size) // 2
    embeddings = cfg.vocab_size * h // 2 * (1 if cfg.tie_word_embeddings else 2)
    grads = (cfg.num_layers * (per_layer + 2 * h + 2 * d) + embeddings + h) * 4
    count, nbytes = got["all-reduce"]
    assert count == 2 * m * blocks + m + m + 3 * m + 1  # blocks, embedding, LM head input grad, loss, grads
    assert nbytes == 2 * m * blocks * act + 2 * m * act + 3 * m * 2 * seq * 4 + grads


def test_full_recompute_reruns_the_forward_collectives():
    lay = comm.CommLayout(8, tensor=2, expert=4, expert_tensor=1, sequence_parallel=True)
    _, none = comm.megatron_volumes(TINY, lay, seq=64, micro_batch=1, num_micro=2)
    _, full = comm.megatron_volumes(TINY, lay, seq=64, micro_batch=1, num_micro=2, recompute_fraction=1.0)
    a2a = lambda vols: [v for v in vols if v.purpose.startswith("MoE dispatch")][0]  # noqa: E731
    assert a2a(full).count == a2a(none).count * 3 // 2      # dispatch + combine: 1 -> 2 forwards, 1 backward
    assert not [v for v in none if "ETP" in v.purpose]      # ETP1: no expert-tensor gather


def test_pipeline_message_is_megatron_cores_tensor_shape():
    """Megatron-core's own p2p shape (schedules.get_tensor_shapes): [s / CP / TP (SP), mb, h]."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    cfg, seq, mb, m = TINY, 128, 2, 4
    for tp, sp in ((2, True), (2, False), (1, False)):
        group = lambda n: types.SimpleNamespace(size=lambda: n)  # noqa: E731
        (shape,) = schedules.get_tensor_shapes(
            seq_length=seq, micro_batch_size=mb, decoder_seq_length=None,
            config=types.SimpleNamespace(sequence_parallel=sp, hidden_size=cfg.hidden_size),
            tp_group=group(tp), cp_group=group(1))
        lay = comm.CommLayout(8, tensor=tp, pipeline=2, sequence_parallel=sp)
        first = comm.megatron_stage_volumes(cfg, lay, seq=seq, micro_batch=mb, num_micro=m, stage=0)
        (pp,) = [v for v in first if v.kind == "send/recv"]
        assert pp.count == m and pp.bytes == m * shape[0] * shape[1] * shape[2] * 2


def test_pipeline_stages_and_busiest_stage():
    assert [len(r) for r in comm.stage_layers(10, 3, first=2)] == [2, 4, 4]
    with pytest.raises(ValueError):
        comm.stage_layers(10, 3)
    lay = comm.CommLayout(8, tensor=2, pipeline=4, sequence_parallel=True)
    middle = comm.megatron_stage_volumes(TINY, lay, seq=64, micro_batch=1, num_micro=4, stage=1)
    (pp,) = [v for v in middle if v.kind == "send/recv"]
    assert pp.count == 8                     # a middle stage sends activations forward and gradients back
    assert not [v for v in middle if "embedding" in v.purpose or "LM head" in v.purpose]


def test_compare_sums_the_compiled_kinds():
    vols = [comm.Volume("all-to-all", "x", "ep", 2, 4, 400), comm.Volume("send/recv", "p", "pp", 2, 2, 100)]
    rows = {r.kind: r for r in comm.compare({"all-to-all": {"count": 1, "bytes": 100},
                                             "ragged-all-to-all": {"count": 2, "bytes": 500},
                                             "all-reduce": {"count": 1, "bytes": 8}}, vols)}
    assert rows["all-to-all"].compiled_bytes == 600 and rows["all-to-all"].ratio == 1.5
    assert rows["all-reduce"].ratio is None and rows["send/recv"].compiled_bytes == 0


def test_balanced_kernel_rows_and_group_axes():
    # The seed's receive buffer: EP2, 2048 tokens x top-8 per rank, 64 local experts, blocks of 64.
    assert comm.balanced_kernel_rows(36864, expert_ranks=2, num_experts=128, top_k=8, block=64) == 16384
    # --moe-ep-buffer-factor F: the round holds F x S K rows (here F 2 = the worst case at EP2),
    # or the worst case where that is smaller; folding (EP4, 32 local experts) and EP8 at F 2.
    assert comm.balanced_kernel_rows(36864, expert_ranks=2, num_experts=128, top_k=8, block=64, buffer_factor=2) == 16384
    assert comm.balanced_kernel_rows(2 * 8192 + 32 * 64, expert_ranks=4, num_experts=128, top_k=8, block=64,
                                     buffer_factor=2) == 8192
    assert comm.balanced_kernel_rows(2 * 4096 + 16 * 64, expert_ranks=8, num_experts=128, top_k=8, block=64,
                                     buffer_factor=2) == 4096
    assert comm.balanced_kernel_rows(2 * 4096 + 16 * 64, expert_ranks=8, num_experts=128, top_k=8, block=64,
                                     buffer_factor=100) == 1024  # read as the worst-case buffer, EP x S K
    # 100 rows per expert round up to two blocks of 64.
    assert comm.balanced_kernel_rows(4 * 800 + 8 * 64, expert_ranks=4, num_experts=32, top_k=8, block=64) == 8 * 128
    # The seed's gathered chunks (ETP = TP under SP): two tensor ranks' 1024 x 8 rows each (factor
    # 1) and a block per local expert; the kernels' rows are the TP group's 16384.
    assert sharding.rules.expert_rows_gathered(sharding.Layout(tensor=2, pipeline=2, expert=2, sequence_parallel=True,
                                                               num_devices=8))
    assert not sharding.rules.expert_rows_gathered(sharding.Layout(tensor=2, pipeline=2, expert=4, expert_tensor=1,
                                                                   sequence_parallel=True, num_devices=8))
    assert comm.balanced_kernel_rows(2 * 8192 + 64 * 64, expert_ranks=2, num_experts=128, top_k=8, block=64,
                                     buffer_factor=1.0) == 16384
    mesh = {"stage": 2, "data": 1, "expert": 2, "tensor": 2}
    assert comm.group_axes((0, 1), mesh) == "tensor"
    assert comm.group_axes((0, 2), mesh) == "expert"
    assert comm.group_axes((0, 1, 2, 3), mesh) == "expert+tensor"
    assert comm.group_axes((1, 5), mesh) == "stage"


SCHEDULED = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_mm (p0: f32[64,64], p1: f32[64,64]) -> f32[64,64] {
  %p0 = f32[64,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  ROOT %d = f32[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_neg (q0: f32[64,64]) -> f32[64,64] {
  %q0 = f32[64,64]{1,0} parameter(0)
  ROOT %n = f32[64,64]{1,0} negate(%q0)
}

%fused_slice (r0: s32[], r1: f32[8,64,64]) -> f32[1,64,64] {
  %r1 = f32[8,64,64]{2,1,0} parameter(1)
  %bc = f32[8,64,64]{2,1,0} bitcast(%r1)
  %r0 = s32[] parameter(0)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,64,64]{2,1,0} dynamic-slice(%bc, %r0, %z, %z), dynamic_slice_sizes={1,64,64}
}

ENTRY %main (x: f32[64,64], y: f32[64,64], w: f32[8,64,64], i: s32[]) -> f32[64,64] {
  %x = f32[64,64]{1,0} parameter(0)
  %y = f32[64,64]{1,0} parameter(1)
  %w = f32[8,64,64]{2,1,0} parameter(2)
  %i = s32[] parameter(3)
  %ar-start = f32[64,64]{1,0} all-reduce-start(%x), replica_groups={{0,1},{2,3}}, to_apply=%add
  %mm = f32[64,64]{1,0} fusion(%x, %y), kind=kOutput, calls=%fused_mm
  %ar-done = f32[64,64]{1,0} all-reduce-done(%ar-start)
  %ag-start = (f32[64,64]{1,0}, f32[128,64]{1,0}) all-gather-start(%mm), replica_groups=[2,2]<=[4], dimensions={0}
  %neg = f32[64,64]{1,0} fusion(%ar-done), kind=kLoop, calls=%fused_neg
  %ag-done = f32[128,64]{1,0} all-gather-done(%ag-start)
  %rs-start = ((f32[128,64]{1,0}), f32[64,64]{1,0}) reduce-scatter-start(%ag-done), replica_groups=mesh['a'=2,'b'=2] {'a'}, dimensions={0}, to_apply=%add
  %rs-done = f32[64,64]{1,0} reduce-scatter-done(%rs-start)
  %cp-start = (f32[64,64]{1,0}, f32[64,64]{1,0}) collective-permute-start(%rs-done), source_target_pairs={{0,2},{1,3}}, backend_config={"collective_backend_config":{"is_sync":true}}
  %sl = f32[1,64,64]{2,1,0} fusion(%i, %w), kind=kLoop, calls=%fused_slice
  %cp-done = f32[64,64]{1,0} collective-permute-done(%cp-start)
  ROOT %out = f32[64,64]{1,0} fusion(%cp-done), kind=kLoop, calls=%fused_neg
}
"""


def test_overlap_groups_and_hbm_bytes_of_a_scheduled_module():
    st = hlo.analyze(SCHEDULED)
    ov = st.overlap()
    # all-reduce: a matmul fusion between start and done; all-gather: an elementwise fusion only;
    # reduce-scatter: nothing between; the permute has a fusion between but runs synchronously.
    assert ov["all-reduce"]["overlapped"] == 1 and ov["all-reduce"]["matmul_overlapped"] == 1
    assert ov["all-gather"]["overlapped"] == 1 and ov["all-gather"]["matmul_overlapped"] == 0
    assert ov["reduce-scatter"]["overlapped"] == 0
    assert ov["collective-permute"]["overlapped"] == 0
    groups = {g.kind: g for g in st.collective_groups}
    assert groups["all-reduce"].group == (0, 1)
    assert groups["all-gather"].group == (0, 1)              # [2,2]<=[4]: {0,1},{2,3}
    assert groups["reduce-scatter"].group == (0, 2)          # mesh a x b, groups over a
    assert groups["collective-permute"].pairs == ((0, 2), (1, 3))
    assert st.collectives["all-gather"].bytes == 128 * 64 * 4  # the gathered buffer
    f = 64 * 64 * 4
    # Launched work reads its operands and writes its result once; the dynamic-slice fusion reads
    # one [64, 64] slice of the stacked [8, 64, 64] operand, not all of it.
    hbm = (2 * f)            # all-reduce
    hbm += 3 * f             # matmul fusion
    hbm += f + 2 * f         # all-gather (in, out)
    hbm += 2 * f             # negate
    hbm += 2 * f + f         # reduce-scatter
    hbm += 2 * f             # permute (operand, output)
    hbm += 4 + f + f         # slice fusion: index, the slice read, the slice written
    hbm += 2 * f             # root negate
    assert st.hbm_bytes == hbm


def test_ragged_all_to_all_traffic_is_the_smaller_buffer():
    text = """HloModule m, is_scheduled=true

ENTRY %main (x: bf16[16,8], o: s64[2]) -> bf16[64,8] {
  %x = bf16[16,8]{1,0} parameter(0)
  %o = s64[2]{0} parameter(1)
  %z = bf16[64,8]{1,0} constant({...})
  %r-start = ((bf16[16,8]{1,0}, bf16[64,8]{1,0}, s64[2]{0}, s64[2]{0}, s64[2]{0}, s64[2]{0}), bf16[64,8]{1,0}) ragged-all-to-all-start(%x, %z, %o, %o, %o, %o), replica_groups={{0,1}}
  ROOT %r-done = bf16[64,8]{1,0} ragged-all-to-all-done(%r-start)
}
"""
    st = hlo.analyze(text)
    assert st.collectives["ragged-all-to-all"].bytes == 64 * 8 * 2 + 16 * 8 * 2 + 4 * 16  # operands (worst case)
    assert st.ragged_traffic_bytes == 16 * 8 * 2
    assert st.traffic()["ragged-all-to-all"]["bytes"] == 16 * 8 * 2


def test_permute_traffic_is_what_the_busiest_device_sends():
    """A pipeline's two permutes per tick: every device runs both, each sends in one (the
    forward's sources are stage 0's devices, the backward's stage 1's), so each device sends
    one operand's bytes per tick, what Megatron's send/recv counts."""
    text = """HloModule m, is_scheduled=true

ENTRY %main (x: bf16[16,8]) -> bf16[16,8] {
  %x = bf16[16,8]{1,0} parameter(0)
  %f = bf16[16,8]{1,0} collective-permute(%x), source_target_pairs={{0,2},{1,3}}
  ROOT %b = bf16[16,8]{1,0} collective-permute(%f), source_target_pairs={{2,0},{3,1}}
}
"""
    st = hlo.analyze(text)
    assert st.collectives["collective-permute"].bytes == 2 * 16 * 8 * 2  # both run on every device
    assert st.traffic()["collective-permute"] == {"count": 2, "bytes": 16 * 8 * 2}  # each device sends one


def test_replica_group_forms():
    assert hlo_text.replica_groups("replica_groups=[4,2]<=[2,2,2]T(0,2,1), x") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert hlo_text.replica_groups("replica_groups=mesh['a'=2,'b'=1,'c'=4] {'a'}, x") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo_text.replica_groups("replica_groups=mesh['a'=2,'b'=2,'c'=2], device_ids=([2,2,2]T(0,2,1)) {'a'}, x") \
        == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert hlo_text.replica_groups("replica_groups={{0,1,2,3}}, x") == [[0, 1, 2, 3]]
    assert hlo_text.replica_groups("channel_id=1, x") is None


def test_roofline_arithmetic_and_constants():
    k = roofline.device_constants(DEVICE_KINDS["h200"])
    assert k.hbm_bytes_per_s == 4.8e12 and k.active_links == 18 and k.link_bytes_per_s == 450e9
    assert k.peak_flops == 989e12 and "h200.txtpb" in k.sources["hbm"] and "active_links" in k.sources["links"]
    assert roofline.device_constants(DEVICE_KINDS["b200"]).link_bytes_per_s == 900e9
    assert roofline.bus_factor("all-reduce", 4) == 1.5
    assert roofline.bus_factor("all-gather", 4) == 0.75 and roofline.bus_factor("collective-permute", 2) == 1
    assert roofline.bus_factor("all-reduce", 1) == 0
    r = roofline.roofline(989e12 * 2, 4.8e12, [("all-reduce", 2, 450e9), ("all-gather", 4, 600e9)], k,
                          model_flops_per_device=989e12, tokens_per_step=1000)
    assert r.compute_s == pytest.approx(2.0) and r.memory_s == pytest.approx(1.0)
    assert r.comm_s == pytest.approx(1.0 + 1.0)          # 450e9 x 1 and 600e9 x 3/4 over 450 GB/s
    assert r.step_s == pytest.approx(4.0) and r.bound == "compute"
    assert r.model_tflops_per_device == pytest.approx(989 / 4) and r.tokens_per_s == pytest.approx(250)
    ex = roofline.exposed_collectives({
        hlo.CollectiveGroup("all-reduce", (0, 1), (), False, False): hlo.Collective(3, 300),
        hlo.CollectiveGroup("all-gather", (0, 1), (), True, True): hlo.Collective(3, 900)})
    assert ex == [("all-reduce", 2, 300.0)]


def test_natural_routing_prices_the_busiest_ranks_experts_and_all_to_all():
    """Issue 37: step time at a given ``ep-load-max-over-mean``: the experts' matmuls and the
    exposed all-to-all scale by it (every rank waits for the busiest), nothing else does."""
    k = roofline.device_constants(DEVICE_KINDS["h200"])
    r = roofline.roofline(989e12 * 2, 4.8e12, [], k, model_flops_per_device=989e12, tokens_per_step=1000)
    assert roofline.at_imbalance(r, 1.0, 989e12, 0.5, k) == pytest.approx(r.step_s) == pytest.approx(2.0)
    # half the matmul work is experts: 1.5x -> 0.5 s more compute, and 0.25 s more all-to-all
    assert roofline.at_imbalance(r, 1.5, 989e12, 0.5, k) == pytest.approx(2.75)
    assert roofline.IMBALANCES[0] == 1.0


@pytest.mark.skipif(__import__("tests.helpers", fromlist=["GPU_MISSING"]).GPU_MISSING is not None,
                    reason="needs the deviceless XLA:GPU compiler")
def test_tp4_ep8_step_does_megatrons_three_passes_with_the_gpu_flags():
    """The communication audit's TP4 PP1 EP8 layout at toy widths (2 layers, 8 micro-batches per
    data rank), in its own process so XLA gets the flags ``sft`` runs with on GPU
    (``platform_setup.GPU_XLA_FLAGS``; this session's conftest sets up CPU). With the pipelined
    all-gather on, XLA's collective pipeliner cloned each micro-batch's forward layer scan:
    1.92x Megatron's executed FLOPs and 1.87x its EP all-to-all bytes here (1.53x, 6.77x at full
    size); one forward, one backward is 1.08x and 1.00x. ~15-25 s of CPU."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "comm_audit.py"), "--quick", "--layouts", "tp4ep8"],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
    ratios = dict(re.findall(r"ratio tp4ep8 (flops|all-to-all): ([0-9.]+)x", out.stdout))
    assert set(ratios) == {"flops", "all-to-all"}, out.stdout
    assert float(ratios["flops"]) <= 1.10, out.stdout
    assert float(ratios["all-to-all"]) <= 1.10, out.stdout


@pytest.mark.skipif(__import__("tests.helpers", fromlist=["GPU_MISSING"]).GPU_MISSING is not None,
                    reason="needs the deviceless XLA:GPU compiler")
@pytest.mark.slow  # 74 s on 2 cores (a folding compile of its own); the seed and TP4 EP8 pins stay default
def test_folding_backward_all_gathers_no_gradient_twice(tmp_path):
    """The audit's folding layout (TP2 PP2 EP4 ETP1, SP, 1F1B) at toy widths, compiled with the
    GPU flags in its own process: no buffer the backward produces (a cotangent) is all-gathered
    twice by one computation of the optimized HLO. XLA:GPU did, per layer and tick: the
    attention block's output gradient, once for each gradient of o_proj (the all-gather
    combiner then listed the operand twice in one op); ``layers.row_parallel_out`` gathers it
    once, as Megatron's RowParallelLinear backward does. At full size that was 12.4 of the
    53.1 GiB of all-gather per step and device (1.39x Megatron's analytic volume; 1.07x
    without). (The fused LM head's forward still gathers its input twice, for the logits and
    the weight gradient: not a backward buffer.) ~20 s of CPU."""
    import collections
    import re
    comps, _ = _quick_audit_module("folding", tmp_path)
    twice = {}
    for name, instrs in comps.items():
        op_names = {i.name: (re.search(r'op_name="([^"]*)"', i.attrs) or [None, ""])[1] for i in instrs}
        gathered = collections.Counter(o for i in instrs if i.opcode in ("all-gather", "all-gather-start") for o in i.operands)
        twice.update({(name, o): op_names.get(o) for o, n in gathered.items() if n > 1})
    assert not {k: v for k, v in twice.items() if "transpose(" in (v or "")}, twice


@pytest.mark.skipif(__import__("tests.helpers", fromlist=["GPU_MISSING"]).GPU_MISSING is not None,
                    reason="needs the deviceless XLA:GPU compiler")
def test_seed_weight_gradients_are_reduced_once_per_step_not_per_tick(seed_quick):
    """Issue 37 item 1 on the seed layout (TP2 PP2 EP2, SP, distributed optimizer) at toy widths,
    compiled for GPU in its own process (the GPU flags): no all-reduce or reduce-scatter over
    the data axes runs inside the 1F1B tick loops (each data rank accumulates its own float32
    gradients; at full size the attention gradients were all-reduced on every tick, 1560 per
    step, 27.4 GiB per device); the weight gradients, the LM head's among them, are summed over
    the data ranks once, after the loops, in float32. ~20 s of CPU."""
    comps, _ = seed_quick
    found = _data_axis_reductions(comps, "seed")
    assert not [f for f in found if f["in_loop"] and f["elements"] > 64], found  # the MoE's counts only
    head_elems = 256 * 4096 // 2  # --quick: hidden 256, vocab 4096, over TP2
    assert [f for f in found if not f["in_loop"] and f["dtype"] == "f32" and f["elements"] >= head_elems], found


@pytest.mark.skipif(__import__("tests.helpers", fromlist=["GPU_MISSING"]).GPU_MISSING is not None,
                    reason="needs the deviceless XLA:GPU compiler")
def test_seed_router_gradient_is_reduced_over_the_tensor_ranks_once_per_step(seed_quick):
    """Issue 37 item 4 on the seed layout at toy widths (hidden 256, 16 experts): under SP each
    tensor rank routes its own tokens, so the router weight's gradient is partial over them. It
    was all-reduced over the tensor ranks per MoE layer and 1F1B tick (1.50 of the seed's 1.54
    GiB of all-reduce at full size); now each tensor rank accumulates its own
    (``reduction.token_partial``) and the sum is taken once, after the ticks."""
    import math
    import re

    comps, _ = seed_quick
    lay = sharding.Layout(**_audit_layouts()["seed"], sequence_parallel=True, distributed_optimizer=True, num_devices=8)
    loops, router = _loop_computations(comps), math.prod((256, 16))
    in_loop = []
    for name in loops:
        for i in comps[name]:
            groups = hlo_text.replica_groups(i.attrs) if i.opcode.removesuffix("-start") == "all-reduce" else None
            if groups and "tensor" in comm.group_axes(tuple(groups[0]), lay.mesh_shape()).split("+"):
                sizes = [math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", i.result_type)]
                in_loop += [(name, i.result_type) for n in sizes if n % router == 0]
    assert not in_loop, in_loop


@pytest.mark.skipif(__import__("tests.helpers", fromlist=["GPU_MISSING"]).GPU_MISSING is not None,
                    reason="needs the deviceless XLA:GPU compiler")
def test_seed_norm_gradients_are_reduced_over_the_tensor_ranks_once_per_step(seed_quick):
    """Issue 49 item 2 on the seed layout at toy widths (hidden 256, head dim 64): under SP each
    tensor rank normalises its own rows, so the residual-stream norms' scale gradients are
    partial over the tensor ranks; they were all-reduced per layer and 1F1B tick (in-loop
    ``bf16[640]``: two 256-wide norms and the 64-wide q/k norms; 12 of the seed's 40 MiB of
    all-reduce at full size, 1.54x Megatron's). Now each rank accumulates its own
    (``reduction.token_partial``'s ``"seq_ranks"``) and the sum is taken once, after the ticks:
    what stays in the loops over the tensor ranks is narrower than one hidden-wide norm."""
    import math
    import re

    comps, _ = seed_quick
    lay = sharding.Layout(**_audit_layouts()["seed"], sequence_parallel=True, distributed_optimizer=True, num_devices=8)
    in_loop = []
    for name in _loop_computations(comps):
        for i in comps[name]:
            groups = hlo_text.replica_groups(i.attrs) if i.opcode.removesuffix("-start") == "all-reduce" else None
            if groups and comm.group_axes(tuple(groups[0]), lay.mesh_shape()) == "tensor":
                sizes = [math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"bf16\[([\d,]*)\]", i.result_type)]
                in_loop += [(name, i.result_type) for n in sizes if n >= 256]
    assert not in_loop, in_loop


@pytest.fixture(scope="module")
def seed_quick(tmp_path_factory):
    """The seed layout's ``comm_audit.py --quick`` module, compiled once for the tests below."""
    return _quick_audit_module("seed", tmp_path_factory.mktemp("seed_quick"))


@pytest.mark.skipif(__import__("tests.helpers", fromlist=["GPU_MISSING"]).GPU_MISSING is not None,
                    reason="needs the deviceless XLA:GPU compiler")
def test_seed_expert_tensor_gather_moves_the_used_rows_only(seed_quick):
    """Issue 37 on the seed layout (ETP = TP under SP) at toy widths (hidden 256, 128 tokens per
    tensor rank, top-8): the MoE's all-gathers and reduce-scatters over the tensor ranks inside
    the 1F1B ticks move one round's rows per rank, the 128 x 8 = 1024 a balanced routing brings
    (``exchange.GATHER_CHUNK_FACTOR``), not a whole block-layout receive buffer (2 x 1024 + 8
    local experts x a 64-row block = 2560 rows: 2.24x / 2.36x Megatron's all-gather /
    reduce-scatter at full size). At full size the slow test below checks the ratios."""
    import math
    import re

    comps, _ = seed_quick
    lay = sharding.Layout(**_audit_layouts()["seed"], sequence_parallel=True, distributed_optimizer=True, num_devices=8)
    loops, per_rank_rows = _loop_computations(comps), []
    for name in loops:
        types = {i.name: i.result_type for i in comps[name]}
        for i in comps[name]:
            base = i.opcode.removesuffix("-start")
            groups = hlo_text.replica_groups(i.attrs) if base in ("all-gather", "reduce-scatter") else None
            if not groups or comm.group_axes(tuple(groups[0]), lay.mesh_shape()) != "tensor":
                continue
            operands = " ".join(types.get(o, "") for o in i.operands)  # a rank's rows (gather) or every rank's (scatter)
            shapes = [[int(d) for d in dims.split(",")] for dims in re.findall(r"bf16\[([\d,]+)\]", operands)]
            per_rank_rows += [math.prod(d[:-1]) // (1 if base == "all-gather" else 2) for d in shapes if d[-1] == 256]
    assert per_rank_rows and max(per_rank_rows) == 1024, sorted(set(per_rank_rows))


@pytest.mark.slow
@pytest.mark.skipif(__import__("tests.helpers", fromlist=["GPU_MISSING"]).GPU_MISSING is not None,
                    reason="needs the deviceless XLA:GPU compiler")
def test_seed_full_size_meets_the_gather_flop_and_memory_targets():
    """``comm_audit.py --layouts seed`` at full size (Qwen3-30B-A3B, about a minute of CPU): every
    collective (all-gather, reduce-scatter, all-to-all, all-reduce, send/recv) within 1.1x of
    Megatron's, matmul FLOPs at most 1.08x its busiest stage's device, memory at most 88 GiB
    (issue 37: 2.24x, 2.36x, 1.02x, 1.20x, 101.6 GiB with the whole receive buffers gathered;
    issue 49: all-reduce 1.54x, send/recv 2.02x, 94.88 GiB)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    import jax

    jax_version = lambda: tuple(int(p) for p in jax.__version__.split(".")[:2])
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "comm_audit.py"), "--layouts", "seed"],
                         capture_output=True, text=True, timeout=1800, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
    kinds = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce", "send/recv")
    ratios = {k: float(v) for k, v in re.findall(r"ratio seed (flops|[a-z/-]+): ([0-9.]+)x", out.stdout)}
    assert set(ratios) == {"flops", *kinds}, out.stdout
    assert ratios["flops"] <= 1.08 and max(ratios[k] for k in kinds) <= 1.1, ratios  # issue 49 item 2
    ((all_reduce, unit),) = re.findall(r"all-reduce +compiled +([0-9.]+) ([MG])iB", out.stdout)
    assert float(all_reduce) / (1024 if unit == "M" else 1) < 1.6, out.stdout
    (memory,) = re.findall(r"ratio seed memory: ([0-9.]+) GiB", out.stdout)
    # The seed's own flags, no recompute: issue 49's 88 GiB (94.88 before it; 101.6 before issue 37).
    # XLA 0.12 (the newest lane) lays the expert stacks out transposed for the backward and copies
    # them every 1F1B tick: 104.91 GiB there (113.47 before issue 49), benchmarks/README.md.
    assert float(memory) <= (88.0 if jax_version() < (0, 11) else 106.0), out.stdout


@pytest.mark.slow
@pytest.mark.skipif(__import__("tests.helpers", fromlist=["GPU_MISSING"]).GPU_MISSING is not None,
                    reason="needs the deviceless XLA:GPU compiler")
@pytest.mark.parametrize("layout", ["folding", "tp4ep8"])
def test_other_audit_layouts_reduce_weight_gradients_once_per_step(layout, tmp_path):
    """Issue 37 item 1 on the audit's other layouts at toy widths: folding's 1F1B ticks and TP4
    EP8's micro-batch scan run no data-axis reduction bigger than the MoE's expert counts; the
    weight gradients are reduced after the loops (TP4 EP8 reduce-scattered its gradients per
    micro-batch, in bf16: 48.6 GiB per device and step at full size). ~20 s of CPU each."""
    comps, _ = _quick_audit_module(layout, tmp_path)
    found = _data_axis_reductions(comps, layout)
    assert not [f for f in found if f["in_loop"] and f["elements"] > 64], found
    assert [f for f in found if not f["in_loop"] and f["op"].startswith("reduce-scatter") and f["dtype"] == "f32"], found


def _data_axis_reductions(comps, layout: str) -> list[dict]:
    """The all-reduces and reduce-scatters of a parsed ``comm_audit.py`` module whose device
    groups span a data axis of ``layout``: whether a loop body runs them, their largest buffer."""
    import math
    import re

    import sharding

    lay = sharding.Layout(**_audit_layouts()[layout], sequence_parallel=True, distributed_optimizer=True, num_devices=8)
    shape, data = lay.mesh_shape(), set(lay.data_axes()) | set(lay.data_axes(expert=True))
    loops = _loop_computations(comps)
    out = []
    for name, instrs in comps.items():
        for i in instrs:
            groups = hlo_text.replica_groups(i.attrs) if i.opcode.removesuffix("-start") in (
                "all-reduce", "reduce-scatter") else None
            if groups and set(comm.group_axes(tuple(groups[0]), shape).split("+")) & data:
                shapes = re.findall(r"(\w+)\[([\d,]*)\]", i.result_type)
                dtype, elements = max(((t, math.prod(int(d) for d in dims.split(",") if d)) for t, dims in shapes),
                                      key=lambda x: x[1])
                out.append(dict(op=i.opcode, computation=name, in_loop=name in loops, dtype=dtype, elements=elements))
    return out


def _audit_layouts() -> dict:
    """``benchmarks/comm_audit.py``'s LAYOUTS (read from its source: importing it sets up a platform)."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[2] / "benchmarks" / "comm_audit.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "LAYOUTS")
    return eval(compile(ast.Expression(node.value), "LAYOUTS", "eval"), {"dict": dict})


def _loop_computations(comps) -> set[str]:
    """Every computation a while loop's body runs, through calls, fusions and branches."""
    in_loops, frontier = set(), [b for instrs in comps.values() for i in instrs if i.opcode == "while"
                                 for b in hlo_text.computations(i.attrs, "body")]
    while frontier:
        c = frontier.pop()
        if c in in_loops or c not in comps:
            continue
        in_loops.add(c)
        for i in comps[c]:
            for key in ("body", "calls", "to_apply", "branch_computations", "condition"):
                frontier += hlo_text.computations(i.attrs, key)
    return in_loops


def _quick_audit_module(layout: str, tmp_path):
    """The parsed optimized HLO of ``comm_audit.py --quick --layouts <layout>``, compiled in its
    own process so XLA gets the GPU flags."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "comm_audit.py"), "--quick", "--layouts", layout,
                          "--hlo-dir", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
    (path,) = tmp_path.glob("*.hlo.txt")
    return hlo_text.parse_module(path.read_text())
