"""The Qwen3.5 / Qwen3-Next causal LM: :class:`CausalLM` with the family's decoder layer, as HF's
``Qwen3NextForCausalLM`` / ``Qwen3_5MoeForCausalLM`` / ``Qwen3_5ForCausalLM`` compute it:

    x = x + mixer(norm(x))        gated DeltaNet, or gated attention (q/k norms, partial RoPE)
    x = x + mlp(norm(x))          routed experts + sigmoid-gated shared expert, or a dense SwiGLU

with every RMSNorm but the DeltaNet's output norm zero-centred (``x_norm * (1 + w)``). The
pieces are the shared ones of :mod:`mlir_train.model` with their options on; packed documents
restart the DeltaNet's state and conv window at every segment boundary as attention's mask does.
"""

from __future__ import annotations

from flax import nnx

from mlir_train.config.models import LayerKind
from mlir_train.families.qwen3_5.config import ATTENTION, GATED_DELTANET, Qwen35Config
from mlir_train.families.qwen3_5.params import TABLE
from mlir_train.model import decoder
from mlir_train.model.layers import Attention, RMSNorm
from mlir_train.model.linear_attention import GatedDeltaNet
from mlir_train.model.lora import Adapters
from mlir_train.model.options import ModelOptions
from mlir_train.model.transformer import CausalLM
from sharding import constrain


def zero_centred_norm(cfg: Qwen35Config, dim: int, dtype) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, dtype=dtype, zero_centred=True)


class DecoderLayer(decoder.DecoderLayer):
    def __init__(self, cfg: Qwen35Config, kind: LayerKind, rngs: nnx.Rngs, options: ModelOptions = ModelOptions()):
        o, dtype = options, options.param_dtype
        # LoRA: the weights the policy's Megatron module names select, from the family's table.
        lora = Adapters.of(o.lora, TABLE.lora_weights(o.lora, kind) if o.lora else ())
        under = lambda name: None if lora is None else lora.under(name)
        recompute_core = o.remat.recomputes("core_attn")
        self.input_norm = zero_centred_norm(cfg, cfg.hidden_size, dtype)
        self.mixer = kind.mixer
        if kind.mixer == ATTENTION:
            self.attn = Attention(cfg, rngs, decoder.output_std(cfg), dtype, impl=o.attention_impl,
                                  recompute_core_attn=recompute_core, lora=under("attn"), output_gate=True,
                                  zero_centred_norms=True, interpret=o.kernel_interpret,
                                  compute_capability=o.compute_capability)
        elif kind.mixer == GATED_DELTANET:
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                cfg.linear_value_head_dim, conv_width=cfg.linear_conv_kernel_dim, eps=cfg.rms_norm_eps, rngs=rngs,
                std=cfg.init_std, out_std=decoder.output_std(cfg), dtype=dtype, lora=under("linear_attn"),
                recompute_core=recompute_core)
        else:
            raise ValueError(f"{cfg.name}: no {kind.mixer!r} layers in Qwen3.5 / Qwen3-Next")
        self.init_mlp(cfg, kind.moe, rngs, o, zero_centred_norm(cfg, cfg.hidden_size, dtype), under("mlp"),
                      shared_expert_size=cfg.shared_expert_intermediate_size, shared_expert_gate=True)

    def __call__(self, x_BTD, cos_BTH, sin_BTH, mask, segment_ids_BT):
        # The input norm runs inside the mixer (the "layernorm" recompute's checkpoint, as Qwen3's).
        if self.mixer == ATTENTION:
            y_BTD = self.attn(x_BTD, cos_BTH, sin_BTH, mask, self.input_norm, self.recompute_norms)
        else:
            y_BTD, _ = self.linear_attn(x_BTD, segment_ids_BT, norm=self.input_norm, recompute_norm=self.recompute_norms)
        return self.mlp_residual(constrain(x_BTD + y_BTD, decoder.RESIDUAL), segment_ids_BT)


class Qwen35(CausalLM):
    """Qwen3.5 / Qwen3.6 (MoE and dense) and Qwen3-Next:
    ``Qwen35(cfg, rngs=nnx.Rngs(seed), options=ModelOptions(...))``."""

    def make_layer(self, kind: LayerKind, rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(self.cfg, kind, rngs, self.options)

    def make_norm(self, dim: int) -> RMSNorm:
        return zero_centred_norm(self.cfg, dim, self.options.param_dtype)
