"""Losses as Megatron forms them: token cross-entropy sums, switch aux loss, router z-loss.

Everything is float32. Cross-entropy returns a (sum, count) pair so the trainer can divide the
sum over the whole global batch by the number of loss tokens in it (Megatron's
``calculate_per_token_loss``-style normalisation), however the batch was split.
"""

from __future__ import annotations

from functools import partial

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


def linear_cross_entropy_sum(
    h_BTD: jax.Array, w_DV: jax.Array, labels_BT: jax.Array, loss_mask_BT: jax.Array, constrain_logits=None
) -> tuple[jax.Array, jax.Array]:
    """:func:`cross_entropy_sum` of ``h @ w`` with the LM head fused in ("fused linear
    cross-entropy").

    The forward pass also forms the gradients of the sum with respect to ``h`` and ``w``
    (``softmax - onehot`` needs the logits' exponentials, which the forward computes anyway),
    so the backward pass only scales them: the ``[B, T, V]`` logits and probabilities are
    never kept for the backward pass and the softmax is not recomputed. Same value and
    gradients as ``cross_entropy_sum(einsum(h, w), ...)``. ``constrain_logits`` annotates the
    logits' sharding (the model's, vocab split over the tensor axis under TP).
    """
    return _linear_ce(h_BTD, w_DV, labels_BT, loss_mask_BT, constrain_logits)


def _linear_ce_parts(h_BTD, w_DV, labels_BT, loss_mask_BT, constrain_logits):
    logits = jnp.einsum("btd,dv->btv", h_BTD, w_DV, preferred_element_type=jnp.float32)
    if constrain_logits is not None:
        logits = constrain_logits(logits)
    m_BT1 = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e_BTV = jnp.exp(logits - m_BT1)
    z_BT1 = jnp.sum(e_BTV, axis=-1, keepdims=True)
    lse_BT = (m_BT1 + jnp.log(z_BT1))[..., 0]
    # The label logit by an iota comparison (one-hot without materialising it): under a
    # vocab-sharded layout each shard contributes its part and XLA reduces over the shards.
    is_label_BTV = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == labels_BT[..., None]
    label_logit_BT = jnp.sum(jnp.where(is_label_BTV, logits, 0.0), axis=-1)
    mask = loss_mask_BT.astype(jnp.float32)
    total = jnp.sum((lse_BT - label_logit_BT) * mask)
    dlogits_BTV = (e_BTV / z_BT1 - is_label_BTV.astype(jnp.float32)) * mask[..., None]
    dlogits_BTV = dlogits_BTV.astype(h_BTD.dtype)
    dh_BTD = jnp.einsum("btv,dv->btd", dlogits_BTV, w_DV, preferred_element_type=jnp.float32).astype(h_BTD.dtype)
    dw_DV = jnp.einsum("btd,btv->dv", h_BTD, dlogits_BTV, preferred_element_type=jnp.float32).astype(w_DV.dtype)
    return (total, jnp.sum(mask)), (dh_BTD, dw_DV)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _linear_ce(h_BTD, w_DV, labels_BT, loss_mask_BT, constrain_logits):
    return _linear_ce_parts(h_BTD, w_DV, labels_BT, loss_mask_BT, constrain_logits)[0]


def _linear_ce_fwd(h_BTD, w_DV, labels_BT, loss_mask_BT, constrain_logits):
    return _linear_ce_parts(h_BTD, w_DV, labels_BT, loss_mask_BT, constrain_logits)


def _linear_ce_bwd(constrain_logits, grads, cotangents):
    dh_BTD, dw_DV = grads
    g = cotangents[0]  # the count has no gradient
    return (g * dh_BTD).astype(dh_BTD.dtype), (g * dw_DV).astype(dw_DV.dtype), None, None


_linear_ce.defvjp(_linear_ce_fwd, _linear_ce_bwd)


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
