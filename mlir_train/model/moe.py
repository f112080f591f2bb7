"""Qwen3-MoE sparse block: float32 top-k router, SwiGLU experts, dropless by default.

Shape suffixes: S flat tokens (batch*seq), D hidden, E experts, K top-k slots, F expert
width, C per-expert capacity (token slots in the padded dispatch buffer), A = S*K assignments.

Three ways to run the experts, all computing the same function (tests compare them):

* ``"dense"``   reference: every expert on every token, combined by the routing weights.
                Plain and obviously right; costs E/K times the routed work.
* ``"padded"``  sort assignments by expert, scatter into a ``[E, C, D]`` buffer, one batched
                matmul per weight. Dropless: C is a static guess (``2 * S*K/E``) and a
                ``lax.cond`` falls back to C = S (the most any expert can receive) when an
                expert overflows it, so nothing is ever dropped. The fast path on CPU.
* ``"ragged"``  sort assignments by expert and run ``jax.lax.ragged_dot`` on the groups:
                dropless by construction; the fast path on GPU/TPU.

With ``capacity_factor`` set (Megatron's ``--moe-expert-capacity-factor``) the padded buffer
has C = ceil(capacity_factor * S*K/E) and overflowing assignments are dropped, by position
(later tokens first) or by probability (``--moe-token-drop-policy probs``); drops are counted.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mlir_train.model.layers import param
from sharding import constrain

MOE_IMPLS = ("dense", "padded", "ragged")


class MoE(nnx.Module):
    def __init__(
        self,
        cfg,
        rngs: nnx.Rngs,
        out_std: float,
        *,
        impl: str = "padded",
        capacity_factor: float | None = None,
        drop_policy: str = "probs",
        dtype=jnp.float32,
    ):
        if impl not in MOE_IMPLS:
            raise ValueError(f"unknown MoE implementation {impl!r}; choose one of {MOE_IMPLS}")
        if drop_policy not in ("probs", "position"):
            raise ValueError(f"--moe-token-drop-policy must be 'probs' or 'position', got {drop_policy!r}")
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.router = param(rngs, (d, e), ("embed", "router_exp"), cfg.init_std, dtype)
        self.gate_proj = param(rngs, (e, d, f), ("exp", "embed", "moe_mlp"), cfg.init_std, dtype)
        self.up_proj = param(rngs, (e, d, f), ("exp", "embed", "moe_mlp"), cfg.init_std, dtype)
        self.down_proj = param(rngs, (e, f, d), ("exp", "moe_mlp", "embed"), out_std, dtype)
        self.num_experts = e
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.impl = impl
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy

    # ----- routing -----------------------------------------------------------------------
    def route(self, x_SD: jax.Array, valid_S: jax.Array):
        """Router in float32 (Megatron and HF both softmax in fp32; we also matmul in fp32)."""
        logits_SE = jnp.einsum(
            "sd,de->se", x_SD.astype(jnp.float32), self.router[...].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        probs_SE = jax.nn.softmax(logits_SE, axis=-1)
        weights_SK, experts_SK = jax.lax.top_k(probs_SE, self.top_k)
        if self.norm_topk_prob:
            weights_SK = weights_SK / jnp.sum(weights_SK, axis=-1, keepdims=True)
        valid = valid_S.astype(jnp.float32)
        counts_E = jnp.sum(jax.nn.one_hot(experts_SK, self.num_experts, dtype=jnp.float32) * valid[:, None, None], axis=(0, 1))
        lse_S = jax.nn.logsumexp(logits_SE, axis=-1)
        stats = {
            # Everything the trainer needs for Megatron's aux loss / z-loss and load logging,
            # with padding tokens excluded.
            "tokens_per_expert": counts_E,
            "probs_per_expert": jnp.sum(probs_SE * valid[:, None], axis=0),
            "num_tokens": jnp.sum(valid),
            "z_loss_sum": jnp.sum(jnp.square(lse_S) * valid),
        }
        return weights_SK, experts_SK, stats

    # ----- experts -------------------------------------------------------------------------
    def __call__(self, x_BTD: jax.Array, valid_BT: jax.Array):
        b, t, d = x_BTD.shape
        x_SD = constrain(x_BTD.reshape(b * t, d), ("act_tokens", "act_embed"))
        weights_SK, experts_SK, stats = self.route(x_SD, valid_BT.reshape(-1))
        weights_SK = weights_SK.astype(x_SD.dtype)
        if self.impl == "dense":
            y_SD, dropped = self._dense(x_SD, weights_SK, experts_SK), jnp.zeros((), jnp.float32)
        elif self.impl == "ragged" and self.capacity_factor is None:
            y_SD, dropped = self._ragged(x_SD, weights_SK, experts_SK), jnp.zeros((), jnp.float32)
        else:
            y_SD, dropped = self._padded(x_SD, weights_SK, experts_SK, valid_BT.reshape(-1))
        stats["dropped_tokens"] = dropped
        return y_SD.reshape(b, t, d), stats

    def _weights(self, dt):
        return self.gate_proj[...].astype(dt), self.up_proj[...].astype(dt), self.down_proj[...].astype(dt)

    def _dense(self, x_SD, weights_SK, experts_SK):
        wg, wu, wd = self._weights(x_SD.dtype)
        combine_SE = jnp.sum(jax.nn.one_hot(experts_SK, self.num_experts, dtype=x_SD.dtype) * weights_SK[..., None], axis=1)
        g_SEF = jnp.einsum("sd,edf->sef", x_SD, wg)
        u_SEF = jnp.einsum("sd,edf->sef", x_SD, wu)
        y_SED = jnp.einsum("sef,efd->sed", jax.nn.silu(g_SEF) * u_SEF, wd)
        return jnp.einsum("sed,se->sd", y_SED, combine_SE)

    def _sort(self, weights_SK, experts_SK):
        """Assignments ordered by expert; within an expert by token (or by weight for 'probs')."""
        s, k = experts_SK.shape
        experts_A = experts_SK.reshape(-1)
        weights_A = weights_SK.reshape(-1)
        if self.capacity_factor is not None and self.drop_policy == "probs":
            order_A = jnp.lexsort((-weights_A.astype(jnp.float32), experts_A))
        else:
            order_A = jnp.argsort(experts_A, stable=True)
        return order_A // k, experts_A[order_A], weights_A[order_A]

    def _ragged(self, x_SD, weights_SK, experts_SK):
        wg, wu, wd = self._weights(x_SD.dtype)
        token_A, expert_A, weight_A = self._sort(weights_SK, experts_SK)
        group_sizes_E = jnp.bincount(expert_A, length=self.num_experts).astype(jnp.int32)
        x_AD = x_SD[token_A]
        g_AF = jax.lax.ragged_dot(x_AD, wg, group_sizes_E)
        u_AF = jax.lax.ragged_dot(x_AD, wu, group_sizes_E)
        y_AD = jax.lax.ragged_dot(jax.nn.silu(g_AF) * u_AF, wd, group_sizes_E)
        return jnp.zeros_like(x_SD).at[token_A].add(y_AD * weight_A[:, None])

    def _padded(self, x_SD, weights_SK, experts_SK, valid_S):
        s, k = experts_SK.shape
        e = self.num_experts
        token_A, expert_A, weight_A = self._sort(weights_SK, experts_SK)
        group_sizes_E = jnp.bincount(expert_A, length=e)
        starts_E = jnp.cumsum(group_sizes_E) - group_sizes_E
        slot_A = jnp.arange(s * k) - starts_E[expert_A]

        def run(capacity: int):
            keep_A = slot_A < capacity
            # Dropped assignments go to an out-of-range slot, which scatter mode="drop" ignores.
            safe_slot_A = jnp.where(keep_A, slot_A, capacity)
            buf_ECD = jnp.zeros((e, capacity, x_SD.shape[1]), x_SD.dtype)
            buf_ECD = buf_ECD.at[expert_A, safe_slot_A].set(x_SD[token_A], mode="drop")
            buf_ECD = constrain(buf_ECD, ("act_exp", "act_capacity", "act_embed"))
            wg, wu, wd = self._weights(x_SD.dtype)
            h_ECF = jax.nn.silu(jnp.einsum("ecd,edf->ecf", buf_ECD, wg)) * jnp.einsum("ecd,edf->ecf", buf_ECD, wu)
            out_ECD = constrain(jnp.einsum("ecf,efd->ecd", h_ECF, wd), ("act_exp", "act_capacity", "act_embed"))
            y_AD = out_ECD.at[expert_A, safe_slot_A].get(mode="fill", fill_value=0)
            y_SD = jnp.zeros_like(x_SD).at[token_A].add(y_AD * (weight_A * keep_A)[:, None])
            dropped = jnp.sum((~keep_A) & valid_S[token_A].astype(bool)).astype(jnp.float32)
            return y_SD, dropped

        if self.capacity_factor is not None:
            return run(max(1, math.ceil(self.capacity_factor * s * k / e)))
        # Dropless: an expert receives at most one assignment per token, so C = S never drops.
        guess = min(s, _round_up(max(1, math.ceil(2 * s * k / e)), 8))
        if guess >= s:
            return run(s)
        return jax.lax.cond(jnp.max(group_sizes_E) <= guess, lambda: run(guess), lambda: run(s))


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
