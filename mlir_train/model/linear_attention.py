"""The gated-DeltaNet token mixer (HF's ``linear_attn``, megatron-core's ``GatedDeltaNet``) as an
nnx layer, written once with logical axis names: its projections, causal conv, gates, the chunked
delta rule of :mod:`mlir_train.model.gated_deltanet` and the gated output norm.

Parameters are stored per head (Qwen3.5's split projections; HF's fused ``in_proj_qkv`` and
``conv1d`` are the q | k | v sections concatenated, Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``
map onto them with :func:`~mlir_train.model.gated_deltanet.split_qwen3_next_projections`), so
heads split cleanly over the tensor ranks: ``gdn_key_heads`` (G) and ``gdn_heads`` (H) go to the
tensor axis (:mod:`sharding.rules`), ``embed`` is D, ``head_dim`` K and V, and W has none. A key
head and its ``H // G`` value heads sit on one rank when TP divides G (value head ``h`` reads key
head ``h // (H // G)``, and both split contiguously), so the recurrence runs rank-locally; the
output projection is row-parallel like attention's.

Shape suffixes as in :mod:`mlir_train.model.gated_deltanet`: B batch, T sequence, D hidden, G
key heads, H value heads, K key head dim, V value head dim, W conv width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mlir_train.model.gated_deltanet import (
    causal_conv1d, chunk_gated_delta_rule, decay_and_beta, gated_rms_norm, recurrent_gated_delta_rule,
)
from mlir_train.model.gdn_context import context_parallel_core
from mlir_train.model.layers import row_parallel_out
from mlir_train.model.lora import LoRA, adapted, maybe
from mlir_train.model.recompute import checkpointed
from sharding import constrain
from sharding.context import context_parallel_size

KEY_HEADS = ("act_batch", "act_seq", "act_gdn_key_heads", "act_head_dim")
VALUE_HEADS = ("act_batch", "act_seq", "act_gdn_heads", "act_head_dim")
PER_HEAD = ("act_batch", "act_seq", "act_gdn_heads")


class GatedDeltaNetState(NamedTuple):
    """What one rank passes the next within a document: the conv windows (last W - 1 inputs of
    q, k and v) and the recurrent state."""
    conv_q_BWGK: jax.Array
    conv_k_BWGK: jax.Array
    conv_v_BWHV: jax.Array
    recurrent_BHKV: jax.Array


def _normal(rngs: nnx.Rngs, shape, axes, std, dtype) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype), logical_axes=axes)


# The input projections: (weight, its output shape's letters, their logical axes, activation axes).
_IN_PROJ = (("wq_DGK", "gk", ("gdn_key_heads", "head_dim"), KEY_HEADS),
            ("wk_DGK", "gk", ("gdn_key_heads", "head_dim"), KEY_HEADS),
            ("wv_DHV", "hv", ("gdn_heads", "head_dim"), VALUE_HEADS),
            ("wz_DHV", "hv", ("gdn_heads", "head_dim"), VALUE_HEADS),
            ("wb_DH", "h", ("gdn_heads",), PER_HEAD),
            ("wa_DH", "h", ("gdn_heads",), PER_HEAD))


class GatedDeltaNet(nnx.Module):
    """The ``linear_attn`` token mixer of Qwen3.5 and Qwen3-Next:

        q, k, v = silu(conv(x Wq)), silu(conv(x Wk)), silu(conv(x Wv))   per-channel conv, width W
        z = x Wz,  beta = sigmoid(x Wb),  g = -exp(A_log) softplus(x Wa + dt_bias)
        y = (gated_rms_norm(delta_rule(q, k, v, g, beta), z) reshaped to H V) Wout

    ``lora`` (the :class:`~mlir_train.model.lora.Adapters` of this module): an adapter
    ``<weight>_lora`` beside each input projection and the output projection it selects.
    ``recompute_core``: the delta rule as a normal checkpoint (megatron-core's ``core_attn``
    recompute: its inputs kept, its insides rerun in the backward). ``chunk_size``: the chunked
    form's chunk (HF's and FLA's 64)."""

    def __init__(self, hidden: int, num_key_heads: int, num_value_heads: int, key_dim: int, value_dim: int,
                 *, conv_width: int = 4, eps: float = 1e-6, rngs: nnx.Rngs, std: float = 0.02,
                 out_std: float | None = None, dtype=jnp.float32, lora=None, recompute_core: bool = False,
                 chunk_size: int = 64):
        d, g, h, k, v, w = hidden, num_key_heads, num_value_heads, key_dim, value_dim, conv_width
        out_std = std if out_std is None else out_std
        sizes = {"g": g, "h": h, "k": k, "v": v}
        for name, letters, axes, _ in _IN_PROJ:
            shape = tuple(sizes[c] for c in letters)
            setattr(self, name, _normal(rngs, (d, *shape), ("embed", *axes), std, dtype))
            setattr(self, f"{name}_lora", maybe(lora, name, lambda shape=shape, axes=axes: LoRA(
                rngs, (d,), ("embed",), shape, axes, lora.dim, lora.scaling, dtype=dtype)))
        self.conv_q_WGK = _normal(rngs, (w, g, k), (None, "gdn_key_heads", "head_dim"), std, dtype)
        self.conv_k_WGK = _normal(rngs, (w, g, k), (None, "gdn_key_heads", "head_dim"), std, dtype)
        self.conv_v_WHV = _normal(rngs, (w, h, v), (None, "gdn_heads", "head_dim"), std, dtype)
        # HF init: dt_bias ones, A = U(0.01, 16) (A_log = log A), gated-norm weight ones.
        self.dt_bias_H = nnx.Param(jnp.ones((h,), dtype), logical_axes=("gdn_heads",))
        self.a_log_H = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (h,), jnp.float32, 0.01, 16.0)).astype(dtype),
                                 logical_axes=("gdn_heads",))
        self.norm_V = nnx.Param(jnp.ones((v,), dtype), logical_axes=("head_dim",))
        self.wout_HVD = _normal(rngs, (h, v, d), ("gdn_heads", "head_dim", "embed"), out_std, dtype)
        self.wout_HVD_lora = maybe(lora, "wout_HVD", lambda: LoRA(
            rngs, (h, v), ("gdn_heads", "head_dim"), (d,), ("embed",), lora.dim, lora.scaling, dtype=dtype))
        self.eps = eps
        self.recompute_core = recompute_core
        self.chunk_size = chunk_size

    def zero_state(self, batch: int, dtype=jnp.float32) -> GatedDeltaNetState:
        """The state a row that starts a document begins from (``dtype``: the activations', for
        the conv windows; the recurrent state is float32)."""
        w, g, k = self.conv_q_WGK.shape
        h, v = self.conv_v_WHV.shape[1:]
        return GatedDeltaNetState(jnp.zeros((batch, w - 1, g, k), dtype), jnp.zeros((batch, w - 1, g, k), dtype),
                                  jnp.zeros((batch, w - 1, h, v), dtype), jnp.zeros((batch, h, k, v), jnp.float32))

    def _project(self, x_BTD: jax.Array, norm) -> tuple[jax.Array, ...]:
        """``norm(x)`` (when given) through the six input projections: q, k, v, z, b, a."""
        if norm is not None:
            x_BTD = norm(x_BTD)
        dt = x_BTD.dtype
        out = []
        for name, letters, _, act_axes in _IN_PROJ:
            y = jnp.einsum(f"btd,d{letters}->bt{letters}", x_BTD, getattr(self, name)[...].astype(dt))
            out.append(constrain(adapted(x_BTD, y, getattr(self, f"{name}_lora")), act_axes))
        return tuple(out)

    def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array | None = None,
                 state: GatedDeltaNetState | None = None, *, norm=None, recompute_norm: bool = False,
                 recurrent: bool = False) -> tuple[jax.Array, GatedDeltaNetState]:
        """``y_BTD`` and the state after the row's last token. ``norm`` (the layer's input norm)
        runs first when given; ``recompute_norm`` makes it megatron-core's output-discarding
        "layernorm" recompute (norm and projections one checkpoint, as
        :meth:`mlir_train.model.layers.Attention.__call__`'s). ``recurrent=True`` runs the
        token-by-token oracle instead of the chunked form. Under context parallelism (the
        sequence split over ``"act_seq"``, no ``state`` given) the conv windows and the state pass
        between the context ranks (:func:`~mlir_train.model.gdn_context.context_parallel_core`)
        and the returned state is None."""
        dt = x_BTD.dtype
        q, k, v, z_BTHV, b_BTH, a_BTH = checkpointed(lambda x: self._project(x, norm), recompute_norm)(x_BTD)
        if context_parallel_size() > 1 and state is None and not recurrent:
            # The sequence is split over the context ranks: the windows and state pass between them.
            g_BTH, beta_BTH = decay_and_beta(a_BTH, b_BTH, self.a_log_H[...], self.dt_bias_H[...])
            weights = (self.conv_q_WGK[...], self.conv_k_WGK[...], self.conv_v_WHV[...])
            core = lambda *a: context_parallel_core(*a, weights, self.chunk_size)
            o_BTHV = checkpointed(core, self.recompute_core)(q, k, v, g_BTH, beta_BTH, segment_ids_BT)
            return self._out(o_BTHV, z_BTHV, dt), None
        conv_state = (None, None, None) if state is None else state[:3]
        q, cq = causal_conv1d(q, self.conv_q_WGK[...], segment_ids_BT, conv_state[0])
        k, ck = causal_conv1d(k, self.conv_k_WGK[...], segment_ids_BT, conv_state[1])
        v, cv = causal_conv1d(v, self.conv_v_WHV[...], segment_ids_BT, conv_state[2])
        g_BTH, beta_BTH = decay_and_beta(a_BTH, b_BTH, self.a_log_H[...], self.dt_bias_H[...])
        if recurrent:
            rule = recurrent_gated_delta_rule
        else:
            rule = lambda *a: chunk_gated_delta_rule(*a, chunk_size=self.chunk_size)
        s0 = None if state is None else state.recurrent_BHKV
        o_BTHV, s_BHKV = checkpointed(rule, self.recompute_core)(q, k, v, g_BTH, beta_BTH, segment_ids_BT, s0)
        return self._out(o_BTHV, z_BTHV, dt), GatedDeltaNetState(cq, ck, cv, s_BHKV)

    def _out(self, o_BTHV, z_BTHV, dt):
        """The gated output norm and the output projection."""
        o_BTHV = constrain(gated_rms_norm(o_BTHV, z_BTHV, self.norm_V[...], self.eps), VALUE_HEADS)
        y_BTD = jnp.einsum("bthv,hvd->btd", o_BTHV, self.wout_HVD[...].astype(dt))
        return row_parallel_out(adapted(o_BTHV, y_BTD, self.wout_HVD_lora))
