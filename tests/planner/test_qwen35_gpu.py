"""The Qwen3.5 / Qwen3-Next token mixers compiled deviceless for an H200
(mlir_train/targets/h200.txtpb): the chunked gated DeltaNet's matmul FLOPs, read from the
optimized HLO as the planner reads them (mlir_train.planner.hlo), against the chunked algorithm's
analytic count (mlir_train.model.gated_deltanet.chunk_flops), and the gated attention's
256-wide heads through the Pallas flash kernel (its 128 x 128 forward tiles used to ask for
320 KiB of shared memory, which XLA:GPU refused). Skipped, with the reason, where the deviceless
GPU compiler is absent."""

import re

import jax
import jax.numpy as jnp
import pytest

from mlir_train.model import gated_deltanet as gdn
from mlir_train.planner.hlo import analyze
from mlir_train.planner.moe_audit import compile_without_cache
from tests.helpers import one_device_mesh


def _compiled_deltanet_grads(devices, *, t: int, g: int, h: int, k: int, v: int, chunk: int) -> str:
    from jax.sharding import NamedSharding, PartitionSpec

    rep = NamedSharding(one_device_mesh(devices), PartitionSpec())
    sds = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
    args = (sds((1, t, g, k)), sds((1, t, g, k)), sds((1, t, h, v)), sds((1, t, h), jnp.float32), sds((1, t, h)),
            sds((1, t), jnp.int32))

    def loss(q, kk, vv, decay, beta, seg):
        o, _ = gdn.chunk_gated_delta_rule(q, kk, vv, decay, beta, seg, chunk_size=chunk)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    return compile_without_cache(grads.lower(*args)).as_text()


def test_chunked_deltanet_compiles_to_its_chunked_flops_on_h200(h200_devices):
    """Forward and backward of one DeltaNet core at Qwen3.5's head sizes (K = V = 128, chunk 64;
    8 value heads over 4 key heads, 1024 tokens, ~10 s alone): 3x the chunked count (the backward runs
    each matmul twice more), within 1 %; no token-by-token loop (the only while loops are the
    scan over chunks and its transpose, 16 trips each). Against Megatron's recurrent-form core
    count (8 K V per token and head, times 3) the chunked algorithm pays 1.40x at C = 64."""
    t, g, h, k, v, chunk = 1024, 4, 8, 128, 128, 64
    text = _compiled_deltanet_grads(h200_devices, t=t, g=g, h=h, k=k, v=v, chunk=chunk)
    compiled = analyze(text).flops.total_flops
    analytic = 3 * gdn.chunk_flops(1, t, h, k, v, chunk)
    assert 1.0 <= compiled / analytic < 1.01, (compiled, analytic)
    megatron_core = 3 * 2 * 4 * h * k * v * t
    assert 1.35 < compiled / megatron_core < 1.45, compiled / megatron_core
    trips = [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"', text)]
    assert trips and max(trips) == t // chunk, trips


def test_flash_attention_tiles_fit_256_wide_heads():
    from mlir_train.model.attention import flash_block_sizes

    assert flash_block_sizes(4096, "9.0", head_dim=256).block_q == 64
    assert flash_block_sizes(4096, "9.0", head_dim=128).block_q == 128


@pytest.mark.slow  # ~15 s alone, 75 s on the shared 2 cores; the tile rule above runs by default
def test_flash_attention_with_256_wide_heads_compiles_for_h200(h200_devices, tmp_path):
    """Qwen3.5 / Qwen3-Next attention heads are 256 wide: the flash forward's tiles shrink to
    64 x 64 there (flash_block_sizes), which fits the H200's shared memory; its wgmma loops do not
    spill, forward or backward (~15 s alone)."""
    from mlir_train.model.attention import pallas_mha_missing

    if pallas_mha_missing():
        pytest.skip(pallas_mha_missing())
    from mlir_train.model.attention import flash_attention
    from mlir_train.planner.kernel_audit import audit_xla_dump
    from tests.helpers import compiled_attention_grads

    compiled_attention_grads(flash_attention, one_device_mesh(h200_devices), t=1024, h=256, dump_to=tmp_path)
    reports = {r.name: r for r in audit_xla_dump(str(tmp_path))}
    fwd, bwd = reports["mha_forward"], reports["mha_backward"]
    assert fwd.spill_bytes == 0 and fwd.registers <= fwd.register_limit, fwd.row()
    # The dK/dV loop steps 16 query rows at this width (flash_backward_tiles): no spills
    # (tests/planner/test_gpu_kernels_ptx.py pins it in the default suite).
    assert bwd.wgmma > 0 and bwd.spill_bytes == 0, bwd.row()

