"""Multi-token prediction's inputs and loss weights, as megatron-core forms them (the depths
themselves are :class:`mlir_train.model.transformer.MTPDepth`).

Depth ``k`` (1-based) at position ``t`` reads the token ``k`` ahead and predicts the label ``k``
ahead: megatron-core rolls ``input_ids``, ``labels`` and ``loss_mask`` left by one per depth
(``roll_tensor``), within each packed sequence (``_roll_tensor_packed_seq``), zero-filling what
rolls in past a sequence's end. Here a document is a run of one segment id, so a position whose
``k``-ahead neighbour lies in another document (or past the row) gets id 0, label 0 and mask 0:
no depth-``k`` prediction crosses a document boundary. Under context parallelism the rows are
in the layout's load-balanced order (:func:`sharding.context.sequence_order`); the shift is
taken in the original order.

The objective adds, per depth, ``mtp_loss_scaling_factor / N`` times the depth's LM loss
normalised as the main one (``GPTModel._postprocess`` with ``MTPLossAutoScaler``): by default
per data-parallel micro-batch over its own depth-``k`` loss tokens; under
``--calculate-per-token-loss`` its token-loss sum over the global batch's main loss tokens
(``finalize_model_grads`` divides every gradient by those). Logged ``mtp_k loss`` is the
depth's mean of per-micro-batch token means (``MTPLossLoggingHelper``), unscaled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mlir_train.model import losses
from sharding.context import context_parallel_size, zigzag_order

# The batch entries a step adds per depth k: f"{key}_{k}", each [M, B, T] as the batch's own.
KEYS = ("mtp_input_ids", "mtp_labels", "mtp_log_weight", "mtp_weight")


def key(name: str, k: int) -> str:
    return f"{name}_{k}"


def shifted(x_BT: jax.Array, segment_ids_BT: jax.Array, k: int) -> jax.Array:
    """``x`` taken ``k`` positions ahead in the same document, 0 where that position is in
    another document or past the row (any leading axes; the last is the sequence, in the
    active layout's order)."""
    t = x_BT.shape[-1]
    order = zigzag_order(t, context_parallel_size())
    natural = bool(np.all(order == np.arange(t)))
    if not natural:  # back to the original order, shift, and lay out again
        inverse = np.argsort(order)
        x_BT, segment_ids_BT = x_BT[..., inverse], segment_ids_BT[..., inverse]
    pad = [(0, 0)] * (x_BT.ndim - 1) + [(0, k)]
    x_ahead = jnp.pad(x_BT, pad)[..., k:]
    seg_ahead = jnp.pad(segment_ids_BT, pad, constant_values=-1)[..., k:]
    out = jnp.where(seg_ahead == segment_ids_BT, x_ahead, jnp.zeros_like(x_ahead))
    return out if natural else out[..., order]


def depth_inputs(batch: dict, depths: int, scaling_factor: float, *, micro_batch_size: int,
                 per_token: bool) -> dict[str, jax.Array]:
    """The step's MTP batch entries for ``depths`` depths (:data:`KEYS` per depth, :func:`key`,
    each ``[M, B, T]``) from a global batch ``[M, B, T]``: each depth's input ids, labels, the
    weights of its logged loss and of its term in the objective."""
    seg = batch["segment_ids"]
    ids, labels, mask = [], [], []
    for k in range(1, depths + 1):
        ids.append(shifted(batch["input_ids"], seg, k))
        labels.append(shifted(batch["labels"], seg, k))
        mask.append(shifted(batch["loss_mask"].astype(jnp.float32), seg, k))
    log_weight = [losses.loss_token_weights(m, micro_batch_size=micro_batch_size, per_token=False) for m in mask]
    scale = scaling_factor / depths
    if per_token:
        main = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        weight = [scale * m / main for m in mask]
    else:
        weight = [scale * w for w in log_weight]
    return {key(name, k + 1): v for name, values in zip(KEYS, (ids, labels, log_weight, weight))
            for k, v in enumerate(values)}


def depth_loss(model, h_list: list[jax.Array], mb: dict) -> tuple[jax.Array, jax.Array]:
    """``(objective, logged loss per depth [N])`` of the depths' hidden states ``h_list`` on a
    micro-batch's :data:`KEYS` entries."""
    objective, logged = jnp.float32(0.0), []
    for k, h in enumerate(h_list, 1):
        # weighted_loss_sums' second sum is sum(ce * its mask argument): given the log weights, the logged loss.
        obj, log, _ = model.weighted_loss_sums(h, mb[key("mtp_labels", k)], mb[key("mtp_log_weight", k)],
                                               mb[key("mtp_weight", k)])
        objective, logged = objective + obj, logged + [log]
    return objective, jnp.stack(logged)
