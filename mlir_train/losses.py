"""Losses as Megatron forms them: token cross-entropy sums, switch aux loss, router z-loss.

Everything is float32. Cross-entropy returns a (sum, count) pair so the trainer can divide the
sum over the whole global batch by the number of loss tokens in it (Megatron's
``calculate_per_token_loss``-style normalisation), however the batch was split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy_sum(logits_BTV: jax.Array, labels_BT: jax.Array, loss_mask_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sum of masked token losses and number of loss tokens.

    The label logit is picked with a one-hot contraction rather than a gather, so that with a
    vocab-sharded ``logits`` XLA reduces partial sums across the tensor axis instead of
    gathering full-vocabulary rows (Megatron's vocab-parallel cross-entropy).
    """
    logits = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits, axis=-1)
    label_logit_BT = jnp.einsum("btv,btv->bt", logits, jax.nn.one_hot(labels_BT, logits.shape[-1], dtype=jnp.float32))
    mask = loss_mask_BT.astype(jnp.float32)
    return jnp.sum((lse_BT - label_logit_BT) * mask), jnp.sum(mask)


def switch_aux_loss_per_layer(stats: dict[str, jax.Array], top_k: int) -> jax.Array:
    """Megatron's ``switch_load_balancing_loss_func`` per MoE layer, without the coefficient.

    ``E / (k * N^2) * sum_e P_e * c_e`` with ``P_e`` the summed softmax probabilities and
    ``c_e`` the routed-token counts of expert ``e`` over the N non-padding tokens, i.e.
    ``E * sum_e f_e * P̄_e`` with ``f_e = c_e / (k N)`` and ``P̄_e = P_e / N``. A perfectly
    balanced router gives 1.0.
    """
    counts_LE, probs_LE = stats["tokens_per_expert"], stats["probs_per_expert"]
    n_L = jnp.maximum(stats["num_tokens"], 1.0)
    num_experts = counts_LE.shape[-1]
    return num_experts * jnp.sum(counts_LE * probs_LE, axis=-1) / (top_k * n_L * n_L)


def hf_aux_loss(stats: dict[str, jax.Array]) -> jax.Array:
    """transformers' ``load_balancing_loss_func`` (all layers' tokens pooled, no 1/k)."""
    total = jnp.maximum(jnp.sum(stats["num_tokens"]), 1.0)
    f_E = jnp.sum(stats["tokens_per_expert"], axis=0) / total
    p_E = jnp.sum(stats["probs_per_expert"], axis=0) / total
    return f_E.shape[-1] * jnp.sum(f_E * p_E)


def z_loss_per_layer(stats: dict[str, jax.Array]) -> jax.Array:
    """Megatron's router z-loss ``mean_tokens(logsumexp(logits)^2)`` per layer, no coefficient."""
    return stats["z_loss_sum"] / jnp.maximum(stats["num_tokens"], 1.0)
