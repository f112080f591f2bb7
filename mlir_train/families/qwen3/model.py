"""The Qwen3 / Qwen3-MoE causal LM: :class:`CausalLM` with Qwen3's decoder layer (pre-norm GQA
attention with q/k norms and RoPE, then a SwiGLU MLP or a routed MoE block), as HF's
``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` compute it."""

from __future__ import annotations

from flax import nnx

from mlir_train.config.models import LayerKind, ModelConfig
from mlir_train.families.qwen3.params import TABLE
from mlir_train.model import decoder
from mlir_train.model.layers import Attention, RMSNorm
from mlir_train.model.lora import Adapters
from mlir_train.model.options import ModelOptions
from mlir_train.model.transformer import CausalLM
from sharding import constrain


class DecoderLayer(decoder.DecoderLayer):
    def __init__(self, cfg: ModelConfig, moe: bool, rngs: nnx.Rngs, options: ModelOptions = ModelOptions()):
        o, dtype = options, options.param_dtype
        # LoRA: the weights the policy's Megatron module names select, from the family's table.
        lora = Adapters.of(o.lora, TABLE.lora_weights(o.lora, LayerKind(moe=moe)) if o.lora else ())
        attn_lora, mlp_lora = (None, None) if lora is None else (lora.under("attn"), lora.under("mlp"))
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, rngs, decoder.output_std(cfg), dtype, impl=o.attention_impl,
                              recompute_core_attn=o.remat.recomputes("core_attn"), lora=attn_lora,
                              interpret=o.kernel_interpret, compute_capability=o.compute_capability)
        self.init_mlp(cfg, moe, rngs, o, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype), mlp_lora)

    def __call__(self, x_BTD, cos_BTH, sin_BTH, mask_BTS, segment_ids_BT):
        # The norms run inside their consumers, which make them output-discarding checkpoints
        # under the "layernorm" recompute.
        x_BTD = x_BTD + self.attn(x_BTD, cos_BTH, sin_BTH, mask_BTS, self.input_norm, self.recompute_norms)
        return self.mlp_residual(constrain(x_BTD, decoder.RESIDUAL), segment_ids_BT)


class Qwen3(CausalLM):
    """Qwen3 (dense) and Qwen3-MoE: ``Qwen3(cfg, rngs=nnx.Rngs(seed), options=ModelOptions(...))``."""

    def make_layer(self, kind: LayerKind, rngs: nnx.Rngs) -> DecoderLayer:
        if kind.mixer != "attention":
            raise ValueError(f"{self.cfg.name}: Qwen3 has no {kind.mixer!r} layers")
        return DecoderLayer(self.cfg, kind.moe, rngs, self.options)
