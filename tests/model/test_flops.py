"""Megatron's FLOPs count, checked by hand and against the active-parameter rule of thumb."""

import pytest

from mlir_train.families.qwen3 import MODELS
from mlir_train.model.flops import (
    device_peak_tflops,
    flops_per_token,
    mfu,
    num_floating_point_operations,
    peak_tflops,
    tflops_per_device,
    tokens_per_second,
)


def test_tiny_moe_by_hand():
    # qwen3-moe-tiny: h=128, L=4 (all MoE), q = 4*32 = 128, kv = 2*32 = 64, experts 64 wide, top-2,
    # V=2048. Per token, before the 3 (fwd+bwd) * 2 (FMA) factor:
    #   experts 128*3*64*2*4 = 196608; attention per layer 128*(128+128) + 128*16 + 128*128 = 51200,
    #   times 4 = 204800; LM head 128*2048 = 262144; sum 663552. Step of B=2, s=16: 6*663552*32.
    cfg = MODELS["qwen3-moe-tiny"]
    assert num_floating_point_operations(cfg, seq_length=16, batch_size=2) == 127_401_984
    # Without the causal halving the core attention term doubles: +4 layers * 128*16 per token.
    assert num_floating_point_operations(cfg, 16, 2, causal=False) == 6 * 32 * (663552 + 4 * 2048)
    # Full recompute as hardware FLOPs: one more forward.
    assert num_floating_point_operations(cfg, 16, 2, recompute_full=True) == 8 * 32 * 663552


def test_tiny_dense_by_hand():
    # qwen3-tiny: dense 384-wide SwiGLU: 128*3*384*4 = 589824; attention 204800; tied LM head still
    # a matmul: 262144. 6 * (589824 + 204800 + 262144) * 2 * 16.
    cfg = MODELS["qwen3-tiny"]
    assert num_floating_point_operations(cfg, 16, 2) == 6 * 32 * 1_056_768
    assert flops_per_token(cfg, 16) == 6 * 1_056_768


def test_mixed_dense_and_moe_layers():
    moe = MODELS["qwen3-moe-tiny"]
    mixed = moe.replace(mlp_only_layers=(0,))  # layer 0 dense (256 wide), layers 1-3 MoE
    per_token_mlp = 128 * 3 * 256 * 1 + 128 * 3 * 64 * 2 * 3
    base = num_floating_point_operations(moe, 16, 1) / (6 * 16) - 128 * 3 * 64 * 2 * 4
    assert num_floating_point_operations(mixed, 16, 1) == 6 * 16 * (base + per_token_mlp)


def test_qwen3_30b_a3b_is_6_n_active_plus_attention():
    """Megatron's count = 6 * (active matmul params) * tokens + 6 * L * q * s * tokens, where the
    active matmul params are HF's parameter count less the 120 idle experts per layer, the
    input embedding, the router and the norms (none of which Megatron counts)."""
    cfg = MODELS["qwen3-30b-a3b"]
    h, L, E, k, f = cfg.hidden_size, cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size
    idle_experts = (E - k) * 3 * h * f * L
    embed = cfg.vocab_size * h
    router = h * E * L
    norms = L * (2 * h + 2 * cfg.head_dim) + h
    n_active = cfg.num_params() - idle_experts
    assert 3.2e9 < n_active < 3.4e9  # Qwen: "3.3B activated"
    n_matmul = n_active - embed - router - norms
    s, batch = 2048, 128  # the seed's step
    tokens = s * batch
    attention = 6 * L * (cfg.num_heads * cfg.head_dim) * s * tokens
    flops = num_floating_point_operations(cfg, s, batch)
    assert flops == pytest.approx(6 * n_matmul * tokens + attention, rel=1e-12)
    # The seed's step (262144 tokens) is about 5.4 PFLOP, of which core attention is ~12%.
    assert 5.3e15 < flops < 5.5e15
    assert 0.10 < attention / flops < 0.13


@pytest.mark.parametrize(
    "kind, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA H200", "fp32", 494.5),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H20", "bf16", 148.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA L40S", "bf16", 362.0),
        ("TPU v4", "bf16", 275.0),
        ("TPU v5 lite", "bf16", 197.0),
        ("TPU v5", "bf16", 459.0),
        ("TPU v6 lite", "bf16", 918.0),
        ("TPU v5 lite", "fp32", None),
        ("cpu", "bf16", None),
    ],
)
def test_peak_table(kind, dtype, peak):
    assert peak_tflops(kind, dtype) == peak


def test_throughput_helpers():
    assert device_peak_tflops(override=123.0) == 123.0
    assert device_peak_tflops() is None  # tests run on CPU devices
    assert tokens_per_second(4096, 2.0) == 2048.0
    assert tflops_per_device(8 * 989e12 * 2.0, 2.0, 8) == pytest.approx(989.0)
    assert mfu(8 * 989e12 * 2.0 * 0.4, 2.0, 8, 989.0) == pytest.approx(0.4)
    assert mfu(1e12, 1.0, 1, None) is None


def test_stage_flops_sum_to_the_model_and_put_the_head_on_the_last_stage():
    from mlir_train.model.flops import stage_floating_point_operations
    from mlir_train.planner.comm import stage_layers

    for name in ("qwen3-moe-tiny", "qwen3-30b-a3b"):
        cfg = MODELS[name]
        stages = stage_layers(cfg.num_layers, 2)
        parts = [stage_floating_point_operations(cfg, 64, 3, r, head=i == 1) for i, r in enumerate(stages)]
        assert sum(parts) == pytest.approx(num_floating_point_operations(cfg, 64, 3))
        assert parts[1] - parts[0] == pytest.approx(3 * 2 * 3 * 64 * cfg.hidden_size * cfg.vocab_size)
        # Full recompute reruns the layers' forward, not the output layer's.
        full = stage_floating_point_operations(cfg, 64, 3, stages[1], head=True, recompute_fraction=1.0)
        assert full - parts[1] == pytest.approx((parts[0]) / 3)


def test_qwen3_next_80b_by_hand():
    """Qwen3-Next-80B-A3B as Megatron-LM counts it: 12 gated attention layers (their q_proj
    doubled by the output gate, ``attention_output_gate``), 36 gated-DeltaNet layers (the
    ``gated_delta_net`` term), each MoE layer its 10 routed experts and the shared expert."""
    from mlir_train.families import get_model_config
    from mlir_train.model.gated_deltanet import megatron_flops_per_token

    cfg = get_model_config("qwen3-next-80b-a3b")
    h, s, q, kv = 2048, 4096, 16 * 256, 2 * 256
    attention = h * (2 * q + 2 * kv) + q * s + q * h
    deltanet = megatron_flops_per_token(h, 16, 32, 128, 128, 4) // 2
    mlp = 3 * h * 512 * 10 + 3 * h * 512
    per_token = 12 * attention + 36 * deltanet + 48 * mlp + h * 151936
    assert num_floating_point_operations(cfg, seq_length=s, batch_size=1) == 6 * s * per_token
    # Qwen3.5-27B, dense: the same mixers, a 17408-wide SwiGLU in every layer.
    cfg = get_model_config("qwen3.5-27b")
    h, q, kv = 5120, 24 * 256, 4 * 256
    attention = h * (2 * q + 2 * kv) + q * s + q * h
    deltanet = megatron_flops_per_token(h, 16, 48, 128, 128, 4) // 2
    per_token = 16 * attention + 48 * deltanet + 64 * 3 * h * 17408 + h * 248320
    assert num_floating_point_operations(cfg, seq_length=s, batch_size=1) == 6 * s * per_token
