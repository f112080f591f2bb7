"""The Qwen3 / Qwen3-MoE causal LM: :class:`CausalLM` with Qwen3's decoder layer (pre-norm GQA
attention with q/k norms and RoPE, then a SwiGLU MLP or a routed MoE block), as HF's
``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` compute it."""

from __future__ import annotations

import math

from flax import nnx

from mlir_train.config.models import LayerKind, ModelConfig
from mlir_train.families.qwen3.params import TABLE
from mlir_train.model.layers import MLP, Attention, RMSNorm
from mlir_train.model.lora import Adapters
from mlir_train.model.moe.block import MoE
from mlir_train.model.options import ModelOptions
from mlir_train.model.transformer import CausalLM, call_checkpointed
from sharding import constrain


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, moe: bool, rngs: nnx.Rngs, options: ModelOptions = ModelOptions()):
        o, dtype, recompute = options, options.param_dtype, options.remat
        # LoRA: the weights the policy's Megatron module names select, from the family's table.
        lora = Adapters.of(o.lora, TABLE.lora_weights(o.lora, LayerKind(moe=moe)) if o.lora else ())
        attn_lora, mlp_lora = (None, None) if lora is None else (lora.under("attn"), lora.under("mlp"))
        # Megatron scales the init of the two output projections by 1/sqrt(2 * num_layers).
        out_std = cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, rngs, out_std, dtype, impl=o.attention_impl,
                              recompute_core_attn=recompute.recomputes("core_attn"), lora=attn_lora,
                              interpret=o.kernel_interpret, compute_capability=o.compute_capability)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.is_moe = moe
        # megatron-core's "moe" (the whole MoE layer) and "mlp" (a dense layer's MLP) modules.
        self.recompute_mlp = recompute.recomputes("moe" if moe else "mlp")
        self.recompute_norms = recompute.recomputes("layernorm")
        if moe:
            self.mlp = MoE(cfg, rngs, out_std, impl=o.moe_impl, capacity_factor=o.capacity_factor,
                           drop_policy=o.drop_policy, dtype=dtype, block_loop=o.moe_block_loop, platform=o.moe_platform,
                           ragged_all_to_all=o.ragged_all_to_all, router=o.router,
                           recompute_act=recompute.recomputes("moe_act"), block_kernels=o.moe_kernels,
                           lora=mlp_lora,
                           ep_buffer_factor=o.ep_buffer_factor)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.init_std, out_std, rngs, dtype,
                           lora=mlp_lora)

    def __call__(self, x_BTD, cos_BTH, sin_BTH, mask_BTS, segment_ids_BT):
        # The norms run inside their consumers, which make them output-discarding checkpoints
        # under the "layernorm" recompute.
        x_BTD = x_BTD + self.attn(x_BTD, cos_BTH, sin_BTH, mask_BTS, self.input_norm, self.recompute_norms)
        x_BTD = constrain(x_BTD, ("act_batch", "act_res_seq", "act_embed"))
        norm = (self.post_attn_norm, self.recompute_norms)
        if self.is_moe:
            y_BTD, stats = call_checkpointed(self.mlp, self.recompute_mlp, x_BTD, segment_ids_BT != 0, segment_ids_BT,
                                             *norm)
        else:
            y_BTD, stats = call_checkpointed(self.mlp, self.recompute_mlp, x_BTD, *norm), {}
        x_BTD = constrain(x_BTD + y_BTD, ("act_batch", "act_res_seq", "act_embed"))
        return x_BTD, stats


class Qwen3(CausalLM):
    """Qwen3 (dense) and Qwen3-MoE: ``Qwen3(cfg, rngs=nnx.Rngs(seed), options=ModelOptions(...))``."""

    def make_layer(self, kind: LayerKind, rngs: nnx.Rngs) -> DecoderLayer:
        if kind.mixer != "attention":
            raise ValueError(f"{self.cfg.name}: Qwen3 has no {kind.mixer!r} layers")
        return DecoderLayer(self.cfg, kind.moe, rngs, self.options)
