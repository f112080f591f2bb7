"""What the decoder layers of every family share: the second half of a pre-norm layer (the norm,
then a dense SwiGLU MLP or a routed MoE block, added to the residual stream), built from the
run's :class:`~mlir_train.model.options.ModelOptions`. A family's decoder layer
(:mod:`mlir_train.families`) subclasses :class:`DecoderLayer`, builds its token mixer and calls
:meth:`DecoderLayer.mlp_residual` after it."""

from __future__ import annotations

import math

import jax
from flax import nnx

from mlir_train.model.layers import MLP
from mlir_train.model.moe.block import MoE
from mlir_train.model.options import ModelOptions
from mlir_train.model.transformer import call_checkpointed
from sharding import constrain

RESIDUAL = ("act_batch", "act_res_seq", "act_embed")


def output_std(cfg) -> float:
    """Megatron scales the init of the two output projections by ``1 / sqrt(2 * num_layers)``."""
    return cfg.init_std / math.sqrt(2.0 * cfg.num_layers)


def moe_block(cfg, rngs: nnx.Rngs, out_std: float, o: ModelOptions, lora=None, **block) -> MoE:
    """The routed MoE block of ``cfg`` as the options build it (``block``: the block's own
    options a family adds, e.g. a shared expert)."""
    return MoE(cfg, rngs, out_std, impl=o.moe_impl, capacity_factor=o.capacity_factor, drop_policy=o.drop_policy,
               dtype=o.param_dtype, block_loop=o.moe_block_loop, platform=o.moe_platform,
               ragged_all_to_all=o.ragged_all_to_all, router=o.router, recompute_act=o.remat.recomputes("moe_act"),
               block_kernels=o.moe_kernels, lora=lora, ep_buffer_factor=o.ep_buffer_factor, **block)


class DecoderLayer(nnx.Module):
    """A pre-norm decoder layer's MLP half: ``post_attn_norm`` (the pre-MLP norm) and ``mlp``,
    which :meth:`init_mlp` builds and :meth:`mlp_residual` runs."""

    def init_mlp(self, cfg, moe: bool, rngs: nnx.Rngs, options: ModelOptions, norm: nnx.Module, lora=None,
                 **block) -> None:
        """``norm`` before a routed MoE block (``moe``; ``block``: its extra options) or a dense
        SwiGLU MLP of ``cfg.intermediate_size``; ``lora``: the MLP's adapters."""
        recompute = options.remat
        self.post_attn_norm = norm
        self.is_moe = moe
        # megatron-core's "moe" (the whole MoE layer) and "mlp" (a dense layer's MLP) modules.
        self.recompute_mlp = recompute.recomputes("moe" if moe else "mlp")
        self.recompute_norms = recompute.recomputes("layernorm")
        if moe:
            self.mlp = moe_block(cfg, rngs, output_std(cfg), options, lora, **block)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.init_std, output_std(cfg), rngs,
                           options.param_dtype, lora=lora)

    def mlp_residual(self, x_BTD: jax.Array, segment_ids_BT: jax.Array) -> tuple[jax.Array, dict]:
        """``x + mlp(norm(x))`` and the MoE block's router stats ({} for a dense MLP). The norm
        runs inside the MLP, which makes it an output-discarding checkpoint under the
        "layernorm" recompute."""
        norm = (self.post_attn_norm, self.recompute_norms)
        if self.is_moe:
            y_BTD, stats = call_checkpointed(self.mlp, self.recompute_mlp, x_BTD, segment_ids_BT != 0, segment_ids_BT,
                                             *norm)
        else:
            y_BTD, stats = call_checkpointed(self.mlp, self.recompute_mlp, x_BTD, *norm), {}
        return constrain(x_BTD + y_BTD, RESIDUAL), stats
