"""Megatron's flags that describe a hybrid (gated DeltaNet + gated attention) model such as
Qwen3.5 / Qwen3-Next, checked against the run's model.

LoongForge's and Megatron-LM's Qwen3.5 / Qwen3-Next scripts restate the architecture on the
command line (megatron-core 0.16 ``TransformerConfig``: ``experimental_attention_variant``,
``linear_attention_freq``, ``linear_*``, ``attention_output_gate``, ``layernorm_zero_centered_gamma``
(``--apply-layernorm-1p``), ``moe_shared_expert_*``, ``rotary_percent``). Here the model comes
from ``--model-name`` (or the checkpoint), so each such flag must say what that model is: a value
that differs stops the run naming the flag, the model's value and how to get another
architecture (an HF ``config.json`` that has it). Nothing is overridden and nothing is ignored.

The model's side is read from its config by duck typing (``layer_kinds()``'s mixers, and the
fields a hybrid family's config carries: ``linear_*``, ``partial_rotary_factor``,
``shared_expert_intermediate_size``), so this module needs no family.
"""

from __future__ import annotations

from typing import Any

from mlir_train.runtime.errors import ConfigError

ATTENTION = "attention"  # LayerKind.mixer of a softmax-attention layer
LINEAR_DIMS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
               "linear_num_key_heads", "linear_num_value_heads")


def linear_layers(cfg) -> tuple[int, ...]:
    """Megatron's ``linear_attention_freq`` pattern of ``cfg``: 1 per linear-attention layer,
    0 per softmax-attention one."""
    return tuple(int(kind.mixer != ATTENTION) for kind in cfg.layer_kinds())


def architecture(cfg) -> dict[str, Any]:
    """What each architecture flag must say for ``cfg`` (Megatron's values)."""
    hybrid = any(linear_layers(cfg))
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    arch = {
        "--experimental-attention-variant": "gated_delta_net" if hybrid else None,
        "--linear-attention-freq": linear_layers(cfg),
        # Qwen3.5 / Qwen3-Next: sigmoid-gated attention output, (1 + w) zero-centred RMSNorm,
        # a sigmoid-gated shared expert; Qwen3 has none of them.
        "--attention-output-gate": hybrid,
        "--apply-layernorm-1p": hybrid,
        "--moe-shared-expert-intermediate-size": shared or None,
        "--moe-shared-expert-gate": bool(shared),
        "--rotary-percent": float(getattr(cfg, "partial_rotary_factor", 1.0)),
    }
    for name in LINEAR_DIMS:
        arch["--" + name.replace("_", "-")] = getattr(cfg, name, None) if hybrid else None
    return arch


def linear_attention_pattern(freq: str, num_layers: int) -> tuple[int, ...]:
    """``--linear-attention-freq`` read as megatron-core reads it: an int ``N`` ((N-1) linear
    layers then one softmax-attention layer) or a 0/1 list expression, 1 = linear attention."""
    from mlir_train.config.models import moe_layer_pattern

    text = freq.strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ConfigError(f"--linear-attention-freq {freq}: must be >= 1")
        return tuple(0 if (i + 1) % n == 0 else 1 for i in range(num_layers))
    try:
        return tuple(int(x) for x in moe_layer_pattern(text, num_layers))
    except ValueError as e:
        raise ConfigError(str(e).replace("--moe-layer-freq", "--linear-attention-freq")) from None


def given(flags) -> dict[str, Any]:
    """The architecture flags the user gave (not None), by flag, in Megatron's values."""
    out = {
        "--experimental-attention-variant": flags.experimental_attention_variant,
        "--linear-attention-freq": flags.linear_attention_freq,
        "--attention-output-gate": flags.attention_output_gate or None,
        "--apply-layernorm-1p": flags.apply_layernorm_1p or None,
        "--moe-shared-expert-intermediate-size": flags.moe_shared_expert_intermediate_size,
        "--moe-shared-expert-gate": flags.moe_shared_expert_gate or None,
        "--rotary-percent": flags.rotary_percent,
    }
    for name in LINEAR_DIMS:
        out["--" + name.replace("_", "-")] = getattr(flags, name)
    return {k: v for k, v in out.items() if v is not None}


def check_architecture_flags(flags, cfg) -> None:
    """Raise :class:`ConfigError` naming the first architecture flag that ``cfg`` (the run's
    model) contradicts."""
    model = architecture(cfg)
    for name, value in given(flags).items():
        want = model[name]
        if name == "--linear-attention-freq":
            value = linear_attention_pattern(value, cfg.num_layers)
        elif name == "--rotary-percent":
            value = float(value)
        if value == want:
            continue
        if value is True:
            raise ConfigError(f"{name}: the model {cfg.name} has no {_why(name)}; " + _FIX)
        said = list(value) if isinstance(value, tuple) else value
        has = "none" if want is None else list(want) if isinstance(want, tuple) else want
        raise ConfigError(f"{name} {said}: the model {cfg.name} has {has} ({_why(name)}); " + _FIX)


_FIX = ("the flag describes the model and does not change it: drop it, or give --model-name an HF "
        "config.json (or a checkpoint) of the architecture you mean")


def _why(name: str) -> str:
    return {
        "--experimental-attention-variant": "its linear-attention layers' kind",
        "--linear-attention-freq": "1 per gated-DeltaNet layer, 0 per softmax-attention layer",
        "--attention-output-gate": "sigmoid gate on the attention output",
        "--apply-layernorm-1p": "zero-centred (1 + w) RMSNorm weights",
        "--moe-shared-expert-intermediate-size": "the shared expert's width",
        "--moe-shared-expert-gate": "sigmoid gate on a shared expert",
        "--rotary-percent": "the fraction of each head RoPE rotates",
    }.get(name, "its gated-DeltaNet layers' " + name[2:].replace("-", " "))
