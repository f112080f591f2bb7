"""Our document-skipping Pallas-Triton attention (mlir_train.model.kernels.docs_flash, ``--attention-kernel
mlir``, ``attention_impl="docs-flash"``): equal to masked_attention (values and dq, dk, dv) in
Pallas' interpreter on packed rows; compiled deviceless for an H200 its HLO holds the three kernel
calls and no dense attention, the kernels issue wgmma without spills; the tiles it visits on
packed rows count less attention work than Megatron's causal count."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlir_train.model.kernels.docs_flash import Tiles, docs_flash_attention, document_bounds
from mlir_train.model.attention import attention_mask, masked_attention

# Row 0: documents of 40, 1 and 59 tokens (crossing 16-token tile edges), then 28 of padding;
# row 1: one document.
SEG = np.zeros((2, 128), np.int32)
SEG[0, :40], SEG[0, 40], SEG[0, 41:100] = 1, 2, 3
SEG[1, :] = 1


def _case(g, dtype, seed=0, b=2, t=128, kv=2, h=32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, kv * g, h)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kv, h)), dtype) for _ in range(2))
    w = jnp.asarray(rng.standard_normal((b, t, kv * g, h)), jnp.float32)
    return q, k, v, w


def _check(g, dtype, atol, rtol, tiles=Tiles(16, 16, 16, 16)):
    q, k, v, w = _case(g, dtype)
    b, t, n, h = q.shape
    kv = k.shape[2]
    seg = jnp.asarray(SEG)

    def ref(q, k, v):
        o = masked_attention(q.reshape(b, t, kv, g, h), k, v, attention_mask(seg)).reshape(q.shape)
        return jnp.sum(o.astype(jnp.float32) * w), o

    def got(q, k, v):
        o = docs_flash_attention(q, k, v, seg, tiles=tiles, interpret=True)
        return jnp.sum(o.astype(jnp.float32) * w), o

    (_, ref_o), ref_g = jax.value_and_grad(ref, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    (_, got_o), got_g = jax.value_and_grad(got, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert got_o.dtype == dtype and got_g[1].dtype == dtype
    f32 = lambda a: np.asarray(a, np.float32)
    np.testing.assert_allclose(f32(got_o), f32(ref_o), atol=atol, rtol=rtol)
    for name, a, r in zip(("dq", "dk", "dv"), got_g, ref_g):
        np.testing.assert_allclose(f32(a), f32(r), atol=atol, rtol=rtol, err_msg=name)


def test_split_backward_equals_masked_attention():
    """The split dQ and dK/dV kernels (``Tiles(fused_dq=False)``, summing dQ in a fixed order)
    give the same values and gradients as the fused backward's reference."""
    _check(2, jnp.float32, atol=2e-5, rtol=1e-5, tiles=Tiles(16, 16, 16, 16, fused_dq=False))


def test_document_bounds():
    start, end = (np.asarray(a) for a in document_bounds(jnp.asarray(SEG)))
    assert list(start[0, [0, 39, 40, 41, 99, 100, 127]]) == [0, 0, 40, 41, 41, 100, 100]
    assert list(end[0, [0, 39, 40, 41, 99, 100, 127]]) == [39, 39, 40, 99, 99, 127, 127]
    assert (start[1] == 0).all() and (end[1] == 127).all()


def test_equals_masked_attention_fp32_gqa():
    """Several documents crossing tile edges, a one-token document, padding, G = 2: forward and
    dq, dk, dv at float32 tolerance (about 6 s in the interpreter)."""
    _check(2, jnp.float32, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("g", [1, 4])
def test_equals_masked_attention_fp32_other_groups(g):
    _check(g, jnp.float32, atol=2e-5, rtol=1e-5, tiles=Tiles(32, 16, 16, 32))


@pytest.mark.slow
def test_equals_masked_attention_bf16():
    _check(2, jnp.bfloat16, atol=6e-2, rtol=5e-2)


@pytest.mark.parametrize("tp", [2, 4])  # TP4 over 2 kv heads: each rank holds both, uses its query heads' one
def test_under_data_and_tensor_parallelism(tp):
    """The kernels run per (batch, head) shard in a manual region: same values and gradients as
    unsharded, also where TP exceeds the kv heads (the heads replicated, each rank picking its own)."""
    import sharding
    from sharding import Layout

    from mlir_train.model.attention import docs_flash_attention as sharded

    b, t, kv, g, h = 2, 32, 2, 2, 16
    q, k, v, w = _case(g, jnp.float32, seed=1, b=b, t=t, kv=kv, h=h)
    seg = jnp.asarray(np.repeat(np.array([[1] * 20 + [2] * 12]), b, axis=0), jnp.int32)
    ref_fn = lambda q, k, v: jnp.sum(masked_attention(q.reshape(b, t, kv, g, h), k, v, attention_mask(seg))
                                     .reshape(q.shape) * w)
    cfg = Layout(tensor=tp, num_devices=2 * tp)  # DP2 x TP
    rules = sharding.rules_for(cfg, {"num_kv_heads": kv})
    with jax.set_mesh(sharding.make_mesh(cfg)), sharding.use_rules(rules):
        got_fn = lambda q, k, v: jnp.sum(sharded(q, k, v, seg, interpret=True) * w)
        got, got_g = jax.jit(jax.value_and_grad(got_fn, argnums=(0, 1, 2)))(q, k, v)
    ref, ref_g = jax.value_and_grad(ref_fn, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4, rtol=1e-5)
    for name, a, r in zip(("dq", "dk", "dv"), got_g, ref_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=2e-5, rtol=1e-4, err_msg=name)


def test_flag_selects_it_and_refuses_context_parallelism_and_cpu():
    from mlir_train.model import kernel_options

    assert kernel_options("gpu", is_moe=False, attention_backend="mlir").attention_impl == "docs-flash"
    with pytest.raises(ValueError, match="--attention-kernel mlir does not run with --context-parallel-size"):
        kernel_options("gpu", is_moe=False, attention_backend="mlir", context_parallel=2)
    with pytest.raises(ValueError, match="--attention-kernel mlir: a GPU kernel"):
        kernel_options("cpu", is_moe=False, attention_backend="mlir")
    from mlir_train.train.kernel_check import ATTENTION_KERNELS, FALLBACKS

    assert "docs-flash" in ATTENTION_KERNELS and FALLBACKS["docs-flash"].value == "xla"


def _packed_starts(t, docs):
    seg = np.repeat(np.arange(1, docs + 1), -(-t // docs))[:t]
    return np.asarray(document_bounds(jnp.asarray(seg)[None])[0])[0]


def test_counted_work_on_packed_rows_is_below_megatrons_causal_count():
    """qwen3-0.6b's attention at seq 4096 (N 16, H 128, 64x64 tiles): Megatron counts 3 x 2 x T^2
    x N x H for causal attention; the tiles our kernels visit come below it on 4 and 8 documents
    per row, and on one document the forward is below pallas-mha's 128x128 forward."""
    from mlir_train.planner.hlo_kernels import DocsFlashCall

    t, n, h = 4096, 16, 128
    calls = [DocsFlashCall(kind, 1, t, n, h, 64, 64) for kind in ("fwd", "dq", "dkv")]
    megatron = 3 * 2.0 * t * t * n * h
    work = {d: sum(c.flops(_packed_starts(t, d)) for c in calls) for d in (1, 4, 8)}
    assert work[1] == sum(c.flops() for c in calls)
    assert work[4] < megatron and work[8] < work[4], (work, megatron)
    # dK/dV visits, per key tile, the query tiles from the diagonal to the document's end
    dkv = calls[2]
    starts = _packed_starts(t, 4)
    assert dkv.pairs(starts) == sum(min((j // 16 + 1) * 16, 64) - j for j in range(64))
    mha_forward = 2 * 2.0 * n * h * sum(i + 1 for i in range(t // 128)) * 128 * 128
    assert calls[0].flops() < mha_forward


@pytest.fixture(scope="module")
def h200_mesh(h200_devices):
    from tests.helpers import one_device_mesh

    return one_device_mesh(h200_devices)


@pytest.mark.parametrize("fused", [True, False])
def test_h200_compile_holds_the_kernels_and_their_ptx_uses_wgmma_without_spills(h200_mesh, tmp_path, fused):
    """Forward and backward compiled deviceless for an H200 (bf16, T 2048, G 2, H 128): the
    forward and the fused backward (or, split, the dQ and dK/dV kernels) as Triton kernel calls,
    no dot or GEMM (no dense attention fallback); each kernel's PTX issues wgmma, no mma.sync, no
    spills, registers within the limit; the fused backward adds dQ with float32 atomics, which no
    other kernel does (about 20 s)."""
    from tests.helpers import compiled_attention_grads
    from mlir_train.planner.hlo import matmul_flops
    from mlir_train.planner.kernel_audit import audit_xla_dump
    from mlir_train.model.kernels import docs_flash

    tiles = Tiles(fused_dq=fused)
    attend = lambda q, k, v, s: docs_flash.docs_flash_attention(q, k, v, s, tiles=tiles)
    hlo = compiled_attention_grads(attend, h200_mesh, t=2048, dump_to=tmp_path).as_text()
    flops = matmul_flops(hlo)
    kinds = ["bwd", "fwd"] if fused else ["dkv", "dq", "fwd"]
    assert sorted(c.kind for c in flops.attention_calls) == kinds, flops
    assert flops.dot_flops == 0 and " dot(" not in hlo and "__cublas" not in hlo
    # 5 matmuls a tile pair fused, 3 + 4 split; the forward's 2
    calls = {c.kind: c for c in flops.attention_calls}
    assert flops.attention_flops == pytest.approx(sum(c.flops() for c in calls.values()))
    if fused:
        assert calls["bwd"].flops() == pytest.approx(5 / 4 * dataclasses.replace(calls["bwd"], kind="dkv").flops())
    _require_ptx(tmp_path)
    reports = {r.name: r for r in audit_xla_dump(str(tmp_path))}
    for kind in kinds:
        r = reports[f"docs_flash_{kind}_q64_k64"]
        assert r.wgmma > 0 and r.mma_sync == 0, (r.row(), r.wgmma, r.mma_sync)
        assert r.spill_bytes == 0 and r.registers <= r.register_limit, r.row()
        assert (r.float_atomic_adds > 0) == (kind == "bwd"), (r.row(), r.float_atomic_adds)


def _require_ptx(dump_dir):
    from mlir_train.planner.kernel_audit import ptx_dumped

    if not ptx_dumped(str(dump_dir)):
        pytest.skip(f"jax {jax.__version__}'s XLA wrote no PTX into --xla_dump_to (jaxlib 0.10.2's does): the "
                    "machine-code audit runs in the default lane; the compiled program was checked above")


@pytest.mark.parametrize("t", [1024, 1056])  # 64-row tiles; 32-row where 64 does not divide t
def test_h200_ptx_for_256_wide_heads_does_not_spill(h200_mesh, tmp_path, t):
    """Qwen3.5 / Qwen3-Next's 256-wide heads, the GPU default's tiles for them
    (:meth:`Tiles.for_head_dim`: 8 warps forward and dQ, a 16 x 64 dK/dV loop): no kernel spills
    (the 128-wide tiles spilled 48 / 356 / 1296 bytes here), registers within the limit, wgmma at
    64-row tiles; the planner counts each kernel by its own tiles (about 10 s each)."""
    from tests.helpers import compiled_attention_grads
    from mlir_train.planner.hlo import matmul_flops
    from mlir_train.planner.kernel_audit import audit_xla_dump
    from mlir_train.model.attention import docs_flash_attention

    hlo = compiled_attention_grads(docs_flash_attention, h200_mesh, t=t, h=256, dump_to=tmp_path).as_text()
    calls = {c.kind: c for c in matmul_flops(hlo).attention_calls}
    tile = 64 if t % 64 == 0 else 32
    assert (calls["bwd"].tile_q, calls["bwd"].tile_k) == (16, tile) and calls["fwd"].tile_q == tile
    _require_ptx(tmp_path)
    reports = {r.name: r for r in audit_xla_dump(str(tmp_path)) if r.name.startswith("docs_flash_")}
    assert sorted(reports) == sorted([f"docs_flash_fwd_q{tile}_k{tile}", f"docs_flash_bwd_q16_k{tile}"]), sorted(reports)
    for r in reports.values():
        assert r.spill_store_bytes == 0 and r.spill_load_bytes == 0, r.row()
        assert r.registers <= r.register_limit, r.row()
        assert (r.wgmma > 0) == (t % 64 == 0) and r.wgmma + r.mma_sync > 0, (r.row(), r.wgmma, r.mma_sync)


def test_wide_head_tiles_equal_masked_attention():
    """The wide-head tile set (the dK/dV kernel on its own 16 x 32 tiles, dQ and forward 32 x 32)
    in the interpreter: forward and dq, dk, dv equal masked_attention on packed rows."""
    _check(2, jnp.float32, atol=2e-5, rtol=1e-5, tiles=Tiles(32, 32, 32, 32, fwd_warps=8, dq_warps=8, dkv_q=16, dkv_k=32))


def test_tiles_for_head_dim():
    assert Tiles.for_head_dim(128) == Tiles() and Tiles().dkv == (64, 64)
    wide = Tiles.for_head_dim(256)
    assert (wide.fwd_warps, wide.dq_warps, wide.dkv_warps, wide.dkv) == (8, 8, 8, (16, 64))
    assert wide.fit(1056).dkv == (16, 32) and wide.fit(1056).fwd_q == 32


def test_kernel_self_check_passes_in_the_interpreter(capsys):
    """The start-up self-check (mlir_train.train.kernel_check) runs the kernel's row in interpret mode."""
    from mlir_train.train import kernel_check

    shapes = kernel_check.Shapes(hidden=64, moe_width=64, experts=2, heads=4, kv_heads=2, head_dim=32,
                                 seq_length=64, dtype="float32")
    kernels = kernel_check.selected("docs-flash", None, interpret=True)
    assert [k.key for k in kernels] == ["docs-flash"]
    assert kernel_check.self_check(kernels, shapes) == {}
    assert "document-skipping flash attention" in capsys.readouterr().out
