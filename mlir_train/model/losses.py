"""Losses as Megatron forms them: token cross-entropy sums, the router's load-balancing losses
(``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``) and z-loss.

Everything is float32. Cross-entropy returns a (sum, count) pair; the training objective
weights each token by :func:`loss_token_weights`, Megatron's loss normalisation turned into one
per-token weight computed once per step from the loss mask, so the non-pipelined step and the
pipeline form the same objective however the batch is split or sharded.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from mlir_train.config.policies import LoadBalancing
from sharding import manual_axes_of


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
    total, _, count = _linear_ce(h_BTD, w_DV, labels_BT, loss_mask_BT, loss_mask_BT, constrain_logits)
    return total, count


def weighted_linear_cross_entropy(
    h_BTD: jax.Array, w_DV: jax.Array, labels_BT: jax.Array, loss_mask_BT: jax.Array, weight_BT: jax.Array,
    constrain_logits=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(sum(ce * weight), sum(ce * loss_mask), sum(loss_mask))`` of ``h @ w`` in one fused pass.

    The first is the training objective (its gradients are those of
    :func:`linear_cross_entropy_sum` with ``weight`` as the mask); the other two are for
    reporting ``lm loss`` and carry no gradient.
    """
    return _linear_ce(h_BTD, w_DV, labels_BT, loss_mask_BT, weight_BT, constrain_logits)


def _linear_ce_parts(h_BTD, w_DV, labels_BT, loss_mask_BT, weight_BT, constrain_logits):
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
    ce_BT = lse_BT - label_logit_BT
    mask = loss_mask_BT.astype(jnp.float32)
    weight = weight_BT.astype(jnp.float32)
    sums = (jnp.sum(ce_BT * weight), jnp.sum(ce_BT * mask), jnp.sum(mask))
    dlogits_BTV = (e_BTV / z_BT1 - is_label_BTV.astype(jnp.float32)) * weight[..., None]
    dlogits_BTV = dlogits_BTV.astype(h_BTD.dtype)
    dh_BTD = jnp.einsum("btv,dv->btd", dlogits_BTV, w_DV, preferred_element_type=jnp.float32).astype(h_BTD.dtype)
    dw_DV = jnp.einsum("btd,btv->dv", h_BTD, dlogits_BTV, preferred_element_type=jnp.float32).astype(w_DV.dtype)
    return sums, (dh_BTD, dw_DV)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _linear_ce(h_BTD, w_DV, labels_BT, loss_mask_BT, weight_BT, constrain_logits):
    return _linear_ce_parts(h_BTD, w_DV, labels_BT, loss_mask_BT, weight_BT, constrain_logits)[0]


def _linear_ce_fwd(h_BTD, w_DV, labels_BT, loss_mask_BT, weight_BT, constrain_logits):
    return _linear_ce_parts(h_BTD, w_DV, labels_BT, loss_mask_BT, weight_BT, constrain_logits)


def _linear_ce_bwd(constrain_logits, grads, cotangents):
    dh_BTD, dw_DV = grads
    g = cotangents[0]  # only the weighted sum is differentiated; the reported sums and count are not
    return (g * dh_BTD).astype(dh_BTD.dtype), (g * dw_DV).astype(dw_DV.dtype), None, None, None


_linear_ce.defvjp(_linear_ce_fwd, _linear_ce_bwd)


def loss_token_weights(loss_mask_MBT: jax.Array, *, micro_batch_size: int, per_token: bool) -> jax.Array:
    """Per-token weights ``w`` such that Megatron's training objective is ``sum(w * token_ce)``.

    ``loss_mask_MBT`` is the step's whole global batch ``[M, B, T]``: ``M`` micro-batches whose
    ``B = --micro-batch-size x DP`` rows are the data-parallel ranks' micro-batches side by side
    (rank ``d`` holds rows ``d*mbs : (d+1)*mbs``, as ``Trainer.shard_batch`` places them and as
    Megatron's sampler hands them out).

    * Megatron's default (no ``--calculate-per-token-loss``): each rank divides a micro-batch's
      summed token loss by that micro-batch's loss tokens (at least 1) and by the number of
      micro-batches, and the data-parallel ranks average their gradients
      (``schedules.forward_step_calc_loss`` and DDP's ``1 / dp_size`` gradient scaling). That
      is the mean over the ``M x B / mbs`` groups of ``micro_batch_size`` consecutive rows of
      (group's CE sum / group's loss tokens): ``w = mask / group_tokens / num_groups``. A
      grouping fixed by ``micro_batch_size`` alone, so any layout equals one device with the
      same ``--micro-batch-size``.
    * ``--calculate-per-token-loss``: the sum over all loss tokens of the global batch divided
      by their number (``finalize_model_grads`` scales by ``1 / num_tokens``):
      ``w = mask / global_tokens``; then how the batch is split does not matter at all.
    """
    mask = loss_mask_MBT.astype(jnp.float32)
    if per_token:
        return mask / jnp.maximum(jnp.sum(mask), 1.0)
    m, b = mask.shape[:2]
    if micro_batch_size < 1 or b % micro_batch_size:
        raise ValueError(f"a micro-batch slice of {b} rows does not split into data-parallel micro-batches of "
                         f"--micro-batch-size {micro_batch_size} rows")
    groups = b // micro_batch_size
    grouped = mask.reshape(m, groups, micro_batch_size, *mask.shape[2:])
    tokens = jnp.sum(grouped, axis=tuple(range(2, grouped.ndim)), keepdims=True)
    return (grouped / jnp.maximum(tokens, 1.0) / (m * groups)).reshape(mask.shape)


# The batch key that carries, under ``--calculate-per-token-loss``, the global batch's number of
# loss tokens (one value per micro-batch, ``[M]``), which the router losses are weighted by.
ROUTER_LOSS_TOKENS = "router_loss_tokens"


def switch_aux_loss(stats: dict[str, jax.Array], top_k: int, counts: jax.Array | None = None,
                    num_tokens: jax.Array | None = None) -> jax.Array:
    """Megatron's ``switch_load_balancing_loss_func`` per MoE layer and balancing group (leaves
    ``[..., G, E]`` / ``[..., G]``), without the coefficient.

    ``E / (k * N^2) * sum_e P_e * c_e`` with ``P_e`` the summed router scores (softmax
    probabilities, or normalised sigmoid scores) and ``c_e`` the top-k assignments of expert
    ``e`` over the N non-padding tokens, i.e. ``E * sum_e f_e * P̄_e`` with ``f_e = c_e / (k N)``
    and ``P̄_e = P_e / N``. A perfectly balanced router gives 1.0. ``counts`` and ``num_tokens``
    replace the group's own (``global_aux_loss`` passes the counts of all groups, averaged over
    the micro-batches so far, and the token count of all groups).
    """
    if counts is None:
        counts = stats.get("aux_tokens_per_expert", stats["tokens_per_expert"])
    n = jnp.maximum(stats["num_tokens"] if num_tokens is None else num_tokens, 1.0)
    probs = stats["probs_per_expert"]
    return probs.shape[-1] * jnp.sum(counts * probs, axis=-1) / (top_k * n * n)


def seq_aux_loss(stats: dict[str, jax.Array]) -> jax.Array:
    """Megatron's ``seq_aux_loss`` per MoE layer and balancing group, no coefficient: the mean
    over the group's packed documents of each document's own switch loss (see
    :mod:`mlir_train.model.moe.router`)."""
    if "seq_aux_sum" not in stats:
        raise ValueError("seq_aux_loss needs per-document router statistics: build the model with "
                         "RouterConfig(per_sequence_stats=True)")
    return stats["seq_aux_sum"] / jnp.maximum(stats["num_sequences"], 1.0)


def router_losses(stats: dict[str, jax.Array], balancing: LoadBalancing, top_k: int,
                  global_counts_LE: jax.Array | None = None, micro_index=None, *, num_micro_batches: int = 1,
                  loss_tokens: jax.Array | None = None):
    """One micro-batch's router losses, from the stats of its MoE layers (leaves ``[L, G, ...]``:
    ``G`` balancing groups, one per data-parallel rank's micro-batch), as megatron-core 0.16.1
    forms them on each data-parallel rank and its gradient scaling combines them:

    * by default each rank's loss is scaled by ``1 / num_micro_batches`` and the data-parallel
      ranks average their gradients: each group weighs ``1 / (G * M)``;
    * under ``--calculate-per-token-loss`` (``loss_tokens``: the global batch's loss tokens)
      Megatron scales each rank's aux loss by that rank's router tokens (``valid_token_count``,
      padding excluded) and every gradient by ``1 / loss_tokens``: each group weighs
      ``n_g / loss_tokens`` (``seq_aux_loss``: ``n_g / documents_g / loss_tokens``, Megatron's
      tokens per sequence; ``global_aux_loss``: all groups' tokens over ``loss_tokens``, as
      megatron-core 0.16.1 counts them there);
    * ``aux_loss``, ``seq_aux_loss`` and z-loss are each group's own; ``global_aux_loss`` scores
      each group's router probabilities against the expert counts of all groups (summed over
      this and the earlier micro-batches of the step, divided by their number: Megatron's
      ``global_tokens_per_expert / ga_steps``) over all groups' tokens, so its groups sum to the
      pooled switch loss.

    Returns ``(objective, per_layer, global_counts_LE)``: the weighted sum to add to the step's
    objective as it is (no further division); the raw (coefficient-free) per-layer values by
    Megatron tracker name for logging (the mean over groups, as Megatron averages its tracker
    over data-parallel ranks; ``global_load_balancing_loss`` their sum, the pooled value
    Megatron's tracker sums over its data-parallel group), the aux loss and z-loss always; and,
    under ``global_aux_loss``, the running sum of the expert counts ``[L, E]`` including this
    micro-batch (``global_counts_LE`` is the sum over the ``micro_index`` micro-batches before
    it; both are ignored otherwise).
    """
    n_LG = stats["num_tokens"]
    # Inside the trainer's data-manual region a rank holds its own rows' groups: the weights
    # are over all ranks' groups, so the ranks' terms sum to the objective (and their
    # unreduced gradients to its gradient).
    batch_axes, batch_ranks = manual_axes_of("act_batch")
    groups = n_LG.shape[-1] * batch_ranks
    if loss_tokens is None:
        weight_LG = jnp.full(n_LG.shape, 1.0 / (groups * num_micro_batches), jnp.float32)
    else:
        weight_LG = n_LG / jnp.maximum(loss_tokens, 1.0)
    aux_LG = switch_aux_loss(stats, top_k)
    z_LG = z_loss(stats)
    per_layer = {"load_balancing_loss": jnp.mean(aux_LG, axis=-1), "z_loss": jnp.mean(z_LG, axis=-1)}
    objective = jnp.sum(weight_LG * (balancing.coeff("aux_loss") * aux_LG + balancing.z_loss_coeff * z_LG))
    if balancing.per_sequence:
        seq_LG = seq_aux_loss(stats)
        per_layer["seq_load_balancing_loss"] = jnp.mean(seq_LG, axis=-1)
        seq_weight_LG = weight_LG if loss_tokens is None else weight_LG / jnp.maximum(stats["num_sequences"], 1.0)
        objective = objective + balancing.coeff("seq_aux_loss") * jnp.sum(seq_weight_LG * seq_LG)
    if balancing.uses_global:
        per_layer["global_load_balancing_loss"], glob, global_counts_LE = _global_aux_loss(
            stats, top_k, global_counts_LE, micro_index, weight_LG, loss_tokens, batch_axes)
        objective = objective + balancing.coeff("global_aux_loss") * glob
    return objective, per_layer, global_counts_LE


def _global_aux_loss(stats: dict[str, jax.Array], top_k: int, global_counts_LE: jax.Array | None, micro_index,
                     weight_LG: jax.Array, loss_tokens: jax.Array | None, batch_axes: tuple[str, ...] = ()):
    """:func:`router_losses`' ``global_aux_loss``: ``(per layer, the weighted sum over layers and
    groups, the running expert counts [L, E] including this micro-batch)``. ``batch_axes``: the
    manual data axes whose ranks hold the other groups (their counts are summed in)."""
    n_LG = stats["num_tokens"]
    counts_LE = jax.lax.stop_gradient(jnp.sum(stats.get("aux_tokens_per_expert", stats["tokens_per_expert"]),
                                              axis=-2))
    n_L1 = jax.lax.stop_gradient(jnp.sum(n_LG, axis=-1, keepdims=True))
    if batch_axes:
        counts_LE, n_L1 = jax.lax.psum((counts_LE, n_L1), batch_axes)
    global_counts_LE = counts_LE if global_counts_LE is None else global_counts_LE + counts_LE
    seen = 1.0 if micro_index is None else jnp.asarray(micro_index, jnp.float32) + 1.0
    glob_LG = switch_aux_loss(stats, top_k, counts=(global_counts_LE / seen)[..., None, :], num_tokens=n_L1)
    per_layer_L = jnp.sum(glob_LG, axis=-1)
    glob_weight_LG = weight_LG
    if loss_tokens is not None:
        # megatron-core 0.16.1 scales each rank's global aux loss by the token count of *all*
        # ranks: its all-reduce of the rank's expert counts runs in place, on the tensor it
        # then counts the rank's tokens from (get_tokens_per_expert_and_token_count).
        glob_weight_LG = jnp.broadcast_to(n_L1, n_LG.shape) / jnp.maximum(loss_tokens, 1.0)
    return per_layer_L, jnp.sum(glob_weight_LG * glob_LG), global_counts_LE


def hf_aux_loss(stats: dict[str, jax.Array]) -> jax.Array:
    """transformers' ``load_balancing_loss_func`` (all layers' and groups' tokens pooled, no 1/k)."""
    total = jnp.maximum(jnp.sum(stats["num_tokens"]), 1.0)
    e = stats["probs_per_expert"].shape[-1]
    f_E = jnp.sum(stats["tokens_per_expert"].reshape(-1, e), axis=0) / total
    p_E = jnp.sum(stats["probs_per_expert"].reshape(-1, e), axis=0) / total
    return e * jnp.sum(f_E * p_E)


def z_loss(stats: dict[str, jax.Array]) -> jax.Array:
    """Megatron's router z-loss ``mean_tokens(logsumexp(logits)^2)`` per layer and balancing
    group, no coefficient."""
    return stats["z_loss_sum"] / jnp.maximum(stats["num_tokens"], 1.0)
