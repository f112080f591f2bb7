"""Deviceless XLA:GPU compiles for 8 x H200 (mlir_train/targets/h200.txtpb): the MoE layer's
expert matmul FLOPs against the routed FLOPs, and the flash attention's FLOPs against the causal
count, read from the optimized HLO (mlir_train.planner.hlo). Skipped, with the reason, where
jax-cuda12-plugin (and -pjrt, nvidia-cuda-nvcc-cu12) is not installed."""


import jax
import jax.numpy as jnp
import pytest

from mlir_train.planner.targets import DEVICE_KINDS
from mlir_train.families import get_model_config
from mlir_train.planner.hlo import matmul_flops
from mlir_train.planner.moe_audit import audit_moe_layer, compile_without_cache
from sharding import Layout

H200 = DEVICE_KINDS["h200"]  # mlir_train/targets/h200.txtpb


# A quarter-size Qwen3-30B-A3B MoE layer: same top-k, E/K = 4 (the real one: 16).
SMALL = get_model_config("qwen3-30b-a3b", num_layers=1).replace(hidden_size=256, moe_intermediate_size=128, num_experts=32)


@pytest.mark.parametrize("layout, parallel", [
    ("DP8", Layout(num_devices=8)),
    pytest.param("EP8", Layout(expert=8, num_devices=8), marks=pytest.mark.slow),
    ("TP2xEP4", Layout(tensor=2, expert=4, num_devices=8)),
])
def test_grouped_moe_does_the_routed_work_on_h200(h200_devices, layout, parallel):
    """~30-60 s each on 2 busy cores (the kernels' compiles): DP8 and TP2xEP4 run by default."""
    a = audit_moe_layer(SMALL, parallel, h200_devices, impl="grouped", tokens_per_rank=1024, layout=layout)
    assert a.kernel_calls == 9  # 3 forward, 3 input-gradient, 3 weight-gradient matmuls
    assert a.while_loops == 0
    assert a.ratio <= 1.3, a
    # No all-reduce of top-k-expanded rows or of the receive buffer: only the [S, D] partial sums
    # over the tensor ranks (forward output, backward input gradient). The receive buffer typed
    # as the same on every rank used to be all-reduced over every manual axis in the backward.
    if parallel.expert > 1:  # (under DP8 the expert weights' gradients are all-reduced over the data ranks)
        rows_bytes = 1024 * SMALL.top_k * SMALL.hidden_size * 2
        assert a.collectives.get("all-reduce", 0) < rows_bytes, a.collectives
    if parallel.expert > 1:
        # The exchange's buffers: --moe-ep-buffer-factor (2) x the rows sent, plus a block per
        # local expert, not EP x (the worst routing), on the no-overflow path.
        ex = a.ep_exchange
        assert ex.kind == "ragged-all-to-all" and ex.exchanges == 4, ex
        el = SMALL.num_experts // parallel.expert
        assert ex.buffer_bytes <= (2 + el * 64 / ex.rows_sent) * ex.traffic_bytes, ex


@pytest.mark.slow
def test_ep_buffer_factor_bounds_the_compiled_buffers_on_h200(h200_devices):
    """EP8: the worst-case sizing (factor = EP, the program before the flag) against the default
    factor: buffers, activations kept for the backward and temp memory shrink; the expert FLOPs
    at a balanced routing stay the same."""
    kw = dict(impl="grouped", tokens_per_rank=1024, residuals=True)
    worst = audit_moe_layer(SMALL, Layout(expert=8, num_devices=8), h200_devices, ep_buffer_factor=8.0, **kw)
    bounded = audit_moe_layer(SMALL, Layout(expert=8, num_devices=8), h200_devices, **kw)
    # E 32 over EP8 is 4 local experts for top-8: the worst routing sends a rank 4 x the balanced rows.
    assert bounded.ep_exchange.buffer_bytes < 0.55 * worst.ep_exchange.buffer_bytes
    assert bounded.residual_bytes < worst.residual_bytes and bounded.temp_bytes < worst.temp_bytes
    assert bounded.expert_flops == pytest.approx(worst.expert_flops, rel=1e-6)


@pytest.mark.slow
def test_xla_ragged_dot_on_h200_is_dense(h200_devices):
    """What "grouped" replaces: XLA:GPU's ragged_dot is a dense dot over every expert."""
    ragged = audit_moe_layer(SMALL, Layout(num_devices=8), h200_devices, impl="ragged", tokens_per_rank=1024)
    assert ragged.ratio > 0.9 * SMALL.num_experts


@pytest.mark.slow
def test_capacity_moe_flops_on_h200(h200_devices):
    a = audit_moe_layer(SMALL, Layout(expert=8, num_devices=8), h200_devices, impl="grouped",
                        capacity_factor=1.0, tokens_per_rank=1024)
    assert a.kernel_calls == 0 and 0.99 <= a.ratio <= 1.3, a


def test_flash_attention_compiles_and_skips_the_masked_half(h200_devices):
    """--attention-kernel pallas-mha (jax < 0.12): the kernel's FLOPs are about the causal half."""
    import contextlib

    from mlir_train.model.attention import pallas_mha_missing

    if pallas_mha_missing():
        pytest.skip(pallas_mha_missing())

    from tests.helpers import compiled_attention_grads, one_device_mesh
    from mlir_train.model.attention import attention_mask, flash_attention, masked_attention

    b, t, kv, g, h = 1, 1024, 2, 4, 128
    mesh = one_device_mesh(h200_devices)

    def compiled(attend):  # traced without a mesh set: the kernel's default (non-Hopper) tiles
        return compiled_attention_grads(attend, mesh, t=t, kv=kv, g=g, h=h, under=contextlib.nullcontext()).as_text()

    flash = matmul_flops(compiled(flash_attention))
    xla = matmul_flops(compiled(lambda q, k, v, s: masked_attention(q.reshape(b, t, kv, g, h), k, v, attention_mask(s))))
    full = 2.0 * b * kv * g * t * t * h  # one [T, S] matmul over every position pair
    assert xla.attention_flops == 0 and xla.dot_flops == pytest.approx(6 * full, rel=0.01)  # fwd 2 + bwd 4, unmasked
    # Causal: about half of the pairs; the kernel's backward does 7 matmuls (fwd 2).
    assert flash.dot_flops == 0
    assert 0.5 * 9 * full / 2 <= flash.attention_flops <= 1.1 * 9 * full / 2


@pytest.mark.slow
def test_train_step_with_gpu_kernels_compiles_for_h200(h200_devices):
    """The whole Trainer step (scanned layers, optimizer) with the kernels kernel_options
    picks for GPU compiles for 8 x H200 under EP4xTP2: 9 MoE kernel calls per MoE layer (~60 s). (The
    kernels want expert widths per tensor rank that are multiples of 64: F 128 here.)"""
    from mlir_train.model import kernel_options
    from mlir_train.train.optim import make_optimizer
    from mlir_train.train.build import build_trainer
    from mlir_train.train.trainer import BATCH_KEYS, StepConfig
    from mlir_train.planner.moe_audit import compile_without_cache
    from sharding import make_mesh

    cfg = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=2, moe_intermediate_size=128)
    parallel = Layout(expert=4, tensor=2, num_devices=8)
    trainer = build_trainer(cfg, StepConfig(num_micro_batches=1, compute_dtype="bfloat16"), make_optimizer(lr_schedule=1e-4, weight_decay=0.1),
                      parallel, make_mesh(parallel, devices=h200_devices),
                      options=kernel_options("gpu", is_moe=True))
    batch = {k: jax.ShapeDtypeStruct((1, 4, 128), jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=trainer.batch_sharding) for k in BATCH_KEYS}
    compiled = compile_without_cache(trainer.lower_train_step(trainer.abstract_state(), batch))
    from mlir_train.model.moe.dispatch import OVERFLOW_SCOPE
    from mlir_train.planner.hlo import analyze

    text = compiled.as_text()
    # On the no-overflow path (EP4 at the default --moe-ep-buffer-factor 2 has overflow rounds,
    # each with its own kernel calls, under a conditional).
    flops = analyze(text, branch="balanced", min_scopes=(OVERFLOW_SCOPE,)).flops
    assert len(flops.kernels) == 9 * cfg.num_layers and flops.attention_flops > 0
    assert flops.unknown_trip_count_loops == 0
    assert len(matmul_flops(text).kernels) > len(flops.kernels)  # every overflow round taken


def _kernel_calls(hlo: str) -> dict[str, int]:
    """Kernel custom calls of an optimized HLO by kernel: the MoE block kernels (Mosaic-GPU) and
    the flash attention's Triton kernels, by the name their op_name ends in."""
    import re

    calls: dict[str, int] = {}
    for line in hlo.splitlines():
        target = re.search(r'custom_call_target="([^"]+)"', line)
        name = re.search(r'op_name="[^"]*?(moe_block_matmul_t|moe_block_matmul|mha_forward|mha_backward|'
                         r'docs_flash_(?:fwd|dq|dkv|bwd))(?:_q\d+_k\d+)?\b', line)
        if target and name and target.group(1) in ("mosaic_gpu", "mosaic_gpu_v2", "__gpu$xla.gpu.triton"):
            calls[name.group(1)] = calls.get(name.group(1), 0) + 1
    return calls


def test_train_step_calls_the_gpu_kernels_without_fallback(h200_devices):
    """One H200, one MoE layer, the Trainer's whole step with the kernels kernel_options
    picks for GPU: per layer 6 block matmuls (3 forward, 3 input gradients) and 3 weight-gradient
    kernels, the GPU default attention's (docs-flash) forward and fused backward Triton kernels, and no ragged-dot (XLA's
    dense-over-every-expert path) anywhere: nothing fell back (~15 s)."""
    from mlir_train.model import kernel_options
    from mlir_train.train.optim import make_optimizer
    from mlir_train.train.build import build_trainer
    from mlir_train.train.trainer import BATCH_KEYS, StepConfig
    from sharding import make_mesh

    cfg = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=1, moe_intermediate_size=128)
    parallel = Layout(num_devices=1)
    trainer = build_trainer(cfg, StepConfig(num_micro_batches=1, compute_dtype="bfloat16"), make_optimizer(lr_schedule=1e-4, weight_decay=0.1),
                      parallel, make_mesh(parallel, devices=h200_devices[:1]),
                      options=kernel_options("gpu", is_moe=True))
    batch = {k: jax.ShapeDtypeStruct((1, 2, 256), jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=trainer.batch_sharding) for k in BATCH_KEYS}
    hlo = compile_without_cache(trainer.lower_train_step(trainer.abstract_state(), batch)).as_text()
    layers = cfg.num_layers
    assert _kernel_calls(hlo) == {"moe_block_matmul": 6 * layers, "moe_block_matmul_t": 3 * layers,
                                  "docs_flash_fwd": layers, "docs_flash_bwd": layers}
    # XLA:GPU expands a ragged-dot into a dense dot over every expert whose op_name keeps
    # "ragged_dot_general".
    assert "ragged-dot" not in hlo and "ragged_dot" not in hlo
    assert matmul_flops(hlo).attention_flops > 0


def test_kernels_refuse_widths_they_cannot_tile():
    from mlir_train.model.kernels import mosaic_moe as moe_gpu

    with pytest.raises(ValueError, match="multiple of 64.*moe_impl='padded'"):
        moe_gpu.block_matmul_t(jnp.ones((32, 128), jnp.bfloat16), jnp.ones((128, 128), jnp.bfloat16),
                               jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32))
