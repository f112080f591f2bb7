"""Model FLOPs per training step as Megatron-LM counts them, and throughput / MFU helpers.

Megatron's ``num_floating_point_operations`` (megatron/training/training.py, standard
transformer branch, no MLA, no MTP), for ``B`` sequences of ``s`` tokens, hidden size ``h``,
``L`` layers, ``q = heads * head_dim``, ``kv = kv_heads * head_dim``, vocab ``V``:

    FLOPs = 3 * 2 * B * s * [ h * ( 3 * ffn * L_dense                      dense SwiGLU MLPs
                                  + 3 * moe_ffn * top_k * L_moe           routed experts
                                  + 3 * shared_ffn * L_moe )              shared experts (Qwen3: 0)
                            + L * ( h * (q + 2 kv)                        QKV projections (GQA)
                                  + q * s / 2 * 2                         QK^T and PV, causal half
                                  + q * h )                               output projection
                            + h * V ]                                     LM head

* 3 = forward + backward (weight grad + data grad); 2 = multiply-add.
* Core attention is halved for the causal mask (Megatron's current formula; versions before
  2024 counted the full ``s x s`` square). ``causal=False`` gives the old count.
* Not counted, as in Megatron: the router (``h * E`` per token), norms, RoPE, softmax, the
  input embedding lookup, the loss.
* Activation recomputation is not counted: this is *model* FLOPs, and MFU compares it with the
  peak, as Megatron's "TFLOP/s/GPU" does. ``recompute_full=True`` adds one more forward pass
  (factor 4 instead of 3) for a hardware-FLOPs figure; a float adds that fraction of one
  (``--recompute-method block``: the share of each stage's layers recomputed).
* MoE vs dense layers follow the HF Qwen3-MoE rule (``ModelConfig.layer_kinds``), where Megatron
  reads ``--moe-layer-freq``.
* The per-layer terms are the model family's (``ModelConfig.layer_flops``): the formula above is
  the base config's; a family with other token mixers (a gated-DeltaNet layer, a gated
  attention's extra projection) counts them as Megatron's branch for them does.
* A gated-DeltaNet layer's core is Megatron's recurrent-form ``8 K V`` per token and value head
  (``gated_deltanet.megatron_flops_per_token``); the chunked algorithm that trains it does
  ``gated_deltanet.chunk_flops_per_token`` (``6 K V + 4 C K + 2 C V + 2 C (K + V) + 2 (C^2 - 1) / 3``:
  1.40x the core term at K = V = 128, C = 64, 1.02x a whole Qwen3.5 DeltaNet layer's term), and
  its compiled forward and backward on H200 are 1.00x three times that chunked count
  (``tests/planner/test_qwen35_gpu.py``). Model FLOPs (and MFU) keep Megatron's count.

The per-token cost is thus ``6 * N_matmul + 6 * L * q * s`` with ``N_matmul`` the active
parameters that sit in matmuls (attention projections, active experts, LM head).
"""

from __future__ import annotations

from mlir_train.config.models import ModelConfig

# Dense (no sparsity) peak TFLOP/s per JAX device, matched as case-insensitive substrings of
# ``jax.devices()[0].device_kind``, first match wins (so specific names come first).
# Columns: bf16, fp32. GPU fp32 is the TF32 tensor-core peak (XLA's default f32 matmul precision
# on NVIDIA GPUs); None where there is no meaningful fp32 matmul peak (TPU MXUs run bf16 passes).
# The Kunlun P800 (the user's AIAK target) has no JAX backend and no published peak we could
# confirm: pass --peak-tflops for it, and on CPU.
PEAK_TFLOPS: tuple[tuple[str, float, float | None], ...] = (
    ("GB200", 2500.0, 1250.0),
    ("B200", 2250.0, 1100.0),
    ("H100 PCIe", 756.0, 378.0),
    ("H100 NVL", 835.0, 417.5),
    ("H200", 989.0, 494.5),
    ("H100", 989.0, 494.5),  # SXM; "NVIDIA H100 80GB HBM3"
    ("H800", 989.0, 494.5),
    ("H20", 148.0, 74.0),
    ("A100", 312.0, 156.0),
    ("A800", 312.0, 156.0),
    ("L40S", 362.0, 183.0),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 60.0),
    ("TPU v6 lite", 918.0, None),  # v6e (Trillium)
    ("TPU v6e", 918.0, None),
    ("TPU v5 lite", 197.0, None),  # v5e
    ("TPU v5e", 197.0, None),
    ("TPU v5p", 459.0, None),
    ("TPU v5", 459.0, None),  # v5p reports "TPU v5"
    ("TPU v4", 275.0, None),
    ("TPU v3", 61.5, None),  # per TensorCore; each v3 core is one JAX device
)


def _layer_terms(cfg: ModelConfig, seq_length: int, layer: int, *, causal: bool, shared_expert_ffn: int) -> float:
    """One decoder layer's per-token matmul terms of Megatron's formula (before ``passes * 2``):
    the family's own (:meth:`~mlir_train.config.models.ModelConfig.layer_flops`: its mixer and
    MLP, core attention halved for the causal mask unless ``causal=False``), plus
    ``shared_expert_ffn`` wide shared experts in an MoE layer that its config does not count."""
    shared = 3 * cfg.hidden_size * shared_expert_ffn if cfg.layer_is_moe(layer) else 0
    return cfg.layer_flops(layer, seq_length, causal=causal) + shared


def num_floating_point_operations(
    cfg: ModelConfig,
    seq_length: int,
    batch_size: int,
    *,
    causal: bool = True,
    recompute_full: bool | float = False,
    shared_expert_ffn: int = 0,
) -> float:
    """Megatron's model FLOPs for one step over ``batch_size`` sequences of ``seq_length``."""
    layers = sum(_layer_terms(cfg, seq_length, i, causal=causal, shared_expert_ffn=shared_expert_ffn)
                 for i in range(cfg.num_layers))
    logits = cfg.hidden_size * cfg.vocab_size
    passes = 3 + float(recompute_full)  # a fraction: the share of layers recomputed (--recompute-method block)
    return float(passes * 2 * batch_size * seq_length * (layers + logits))


def stage_floating_point_operations(
    cfg: ModelConfig,
    seq_length: int,
    batch_size: int,
    layers: range,
    *,
    head: bool,
    causal: bool = True,
    recompute_fraction: float = 0.0,
    shared_expert_ffn: int = 0,
) -> float:
    """What Megatron *executes* on one pipeline stage for one step over ``batch_size`` sequences:
    :func:`num_floating_point_operations`'s terms for the decoder layers ``layers`` (indices into
    the model's layers), with ``3 + recompute_fraction`` passes (full recompute reruns that share
    of the stage's layer forwards), plus, where ``head``, the LM head's 3 passes (recompute never
    reruns the output layer). Summed over the stages without recompute it is
    :func:`num_floating_point_operations`."""
    per_layer = sum(_layer_terms(cfg, seq_length, i, causal=causal, shared_expert_ffn=shared_expert_ffn)
                    for i in layers)
    tokens = 2 * batch_size * seq_length
    return float((3 + recompute_fraction) * tokens * per_layer
                 + (3 * tokens * cfg.hidden_size * cfg.vocab_size if head else 0.0))


def flops_per_token(cfg: ModelConfig, seq_length: int, **kwargs) -> float:
    return num_floating_point_operations(cfg, seq_length, 1, **kwargs) / seq_length


def tokens_per_second(num_tokens: float, seconds: float) -> float:
    return num_tokens / seconds if seconds > 0 else 0.0


def tflops_per_device(flops: float, seconds: float, num_devices: int) -> float:
    """Achieved TFLOP/s per device (Megatron's "throughput per GPU (TFLOP/s/GPU)")."""
    if seconds <= 0 or num_devices <= 0:
        return 0.0
    return flops / (seconds * num_devices * 1e12)


def mfu(flops: float, seconds: float, num_devices: int, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None without a known peak."""
    if not peak_tflops:
        return None
    return tflops_per_device(flops, seconds, num_devices) / peak_tflops


def peak_tflops(device_kind: str, dtype: str = "bf16") -> float | None:
    """Per-device dense peak for a ``device_kind`` string; None if unknown (e.g. CPU)."""
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"dtype {dtype!r}: expected bf16, fp16 or fp32")
    kind = device_kind.lower()
    for needle, bf16, fp32 in PEAK_TFLOPS:
        if needle.lower() in kind:
            return fp32 if dtype == "fp32" else bf16  # fp16 peak equals bf16 on these parts
    return None


def device_peak_tflops(dtype: str = "bf16", override: float | None = None) -> float | None:
    """``--peak-tflops`` if given, else the table entry for the first JAX device."""
    if override:
        return float(override)
    import jax

    return peak_tflops(jax.devices()[0].device_kind, dtype)
