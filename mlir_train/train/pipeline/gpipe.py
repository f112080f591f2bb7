"""GPipe (R = 1) and circular (R > 1) schedules, ``--pipeline-schedule gpipe|circular``, and the
forward-only pass of every schedule (evaluation): :func:`pipeline_loss`.

Stage ``s`` runs item ``w = t - s``, ``w = r * M + m`` (all micro-batches through chunk 0, then
chunk 1, ...); for R > 1 (circular) stage 0 parks what comes round the ring in an M-slot
buffer until its turn (needs ``M >= P``): the one difference between the two, so they share
one tick loop. Autodiff through the scan gives the backward (the reverse pipeline, with the
transposed permutes), keeping every tick's residuals. Shape suffixes as in
:mod:`mlir_train.train.pipeline.schedule`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mlir_train.config import policies
from mlir_train.config.policies import RecomputePolicy
from mlir_train.model import losses
from mlir_train.train.pipeline.schedule import Schedule
from mlir_train.train.pipeline.stage import (add_sums, aux_out, chunk_forward, merge, prepare, router_terms,
                                             stage_shard_map, zero_acc)
from mlir_train.train.reduction import reduced_aux

TRAVELLING = ("segment_ids", "positions", "labels", "loss_mask", "loss_weight")


def pipeline_loss(graphdef, params: dict[str, Any], batch: dict[str, jax.Array], *, schedule: Schedule,
                  scale, top_k: int, remat: RecomputePolicy | str, balancing: policies.LoadBalancing,
                  data_manual: tuple[str, ...] = ()):
    """The scaled training objective of all ``M`` micro-batches of ``batch`` (leaves
    ``[M, B, T]``, with the per-token ``loss_weight`` of :func:`losses.loss_token_weights`)
    through the pipeline, and the same ``aux`` the non-pipelined step collects: the GPipe /
    circular schedule, whose gradient is autodiff through its tick scan (the forward-only pass
    of every schedule, e.g. for evaluation, which passes ``loss_weight = loss_mask``).

    ``params`` are the compute-layout weights as a pure dict (``params["layers"][k]`` the layer
    stacks, leaves ``[L_k, ...]``). Must run under the trainer's mesh and rules. With
    ``data_manual`` (:func:`~mlir_train.train.reduction.data_manual_names`) each data rank runs
    its own rows, and the region's transpose sums the weights' gradients once, after the ticks.
    """
    stage_axes, setup, stacks, rest, segs, active = prepare(graphdef, params, schedule, remat)
    m = batch["input_ids"].shape[0]

    def body(segs_1RS, active_1RS, rest, batch, scalars):
        return _stage_ticks(graphdef, setup, stage_axes, schedule, m, top_k, remat, balancing,
                            segs_1RS, active_1RS, rest, batch)

    acc = stage_shard_map(body, setup, segs, active, rest, batch, (), ("layers",), data_manual)
    objective = jnp.sum(acc["objective"])
    return objective * scale, aux_out(acc, setup.program, m, setup.num_moe)


def _stage_ticks(graphdef, setup, stage_axes, schedule: Schedule, m: int, top_k: int, remat, balancing,
                 segs_1RS, active_1RS, rest, batch):
    """One stage's ``M * R + P - 1`` ticks (inside the stage-manual region): each runs item
    ``w = t - stage`` through its chunk, the last stage's last chunk adds the LM head's loss,
    and the output moves one stage on. Returns the stage's accumulators (leading axis 1)."""
    p, r_chunks, program = schedule.stages, schedule.virtual, setup.program
    stage = jax.lax.axis_index(stage_axes)
    segs_RS = [jax.tree.map(lambda x: x[0], s) for s in segs_1RS]
    active_RS = [a[0] for a in active_1RS]
    model = merge(graphdef, setup, rest)
    dtype = jax.tree.leaves(segs_RS)[0].dtype

    def inject(i):  # micro-batch i enters stage 0, its context with it
        mb = {k: jax.lax.dynamic_index_in_dim(batch[k], i, keepdims=False) for k in ("input_ids",) + TRAVELLING}
        return {"x": model.embed_tokens(mb.pop("input_ids")).astype(dtype), **mb}

    empty = jax.tree.map(jnp.zeros_like, jax.eval_shape(inject, 0))
    # --calculate-per-token-loss: the global batch's loss tokens, which weigh the router losses
    loss_tokens = batch[losses.ROUTER_LOSS_TOKENS][0] if losses.ROUTER_LOSS_TOKENS in batch else None

    @jax.checkpoint
    def head_loss(x_BTD, labels_BT, mask_BT, weight_BT):
        return model.weighted_loss_sums(model.final_norm(x_BTD), labels_BT, mask_BT, weight_BT)

    def tick(carry, t):
        received, ring, acc = carry
        ring, first = _stage0_input(inject, ring, received, t, m, p, r_chunks)
        cur = jax.tree.map(lambda a, b: jnp.where(stage == 0, a, b), first, received)
        w = t - stage
        valid = (w >= 0) & (w < m * r_chunks)
        chunk = jnp.clip(w // m, 0, r_chunks - 1)
        states = [jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, chunk, keepdims=False), s) for s in segs_RS]
        on = [jax.lax.dynamic_index_in_dim(a, chunk, keepdims=False) for a in active_RS]
        context = model.layer_context(cur["segment_ids"], cur["positions"])
        x, stats = chunk_forward(setup.stack_graphs, program, states, on, cur["x"], context, remat)
        last = valid & (stage == p - 1) & (chunk == r_chunks - 1)
        objective, ce_sum, count = head_loss(x, cur["labels"], cur["loss_mask"] * last.astype(cur["loss_mask"].dtype),
                                             cur["loss_weight"] * last.astype(cur["loss_weight"].dtype))
        # global_aux_loss: this chunk's running counts over the micro-batches before item w.
        counts = [c[chunk] for c in acc["counts"]] if "counts" in acc else None
        router_objective, sums, counts = router_terms(program, stats, on, valid, balancing, top_k, m,
                                                      counts, jnp.clip(w - chunk * m, 0, m - 1), loss_tokens)
        acc = _add_tick(acc, chunk, objective, ce_sum, count, router_objective, sums, counts)
        shift = [(i, (i + 1) % p) for i in range(p if r_chunks > 1 else p - 1)]
        sent = jax.lax.ppermute(dict(cur, x=x), stage_axes, shift)
        return (sent, ring, acc), None

    acc = zero_acc(program, r_chunks, setup, balancing, ("objective", "ce_sum", "loss_tokens", "lm_objective"))
    ring = jax.tree.map(lambda x: jnp.zeros((m,) + x.shape, x.dtype), empty) if r_chunks > 1 else None
    (_, _, acc), _ = jax.lax.scan(tick, (empty, ring, acc), jnp.arange(m * r_chunks + p - 1))
    return jax.tree.map(lambda x: x[None], reduced_aux(acc))


def _stage0_input(inject, ring, received, t, m: int, p: int, r_chunks: int):
    """``(ring, first)``: what stage 0 takes at tick ``t``, micro-batch ``t`` for the first M
    ticks; after them (circular) what came round the ring, parked in the M-slot ``ring``
    buffer until stage 0's turn for it."""
    if r_chunks > 1:
        ring = jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, (t - p) % m, 0),
                            ring, received)
        from_ring = jax.tree.map(lambda buf: jax.lax.dynamic_index_in_dim(buf, t % m, keepdims=False), ring)
        first = jax.tree.map(lambda a, b: jnp.where(t < m, a, b), inject(jnp.minimum(t, m - 1)), from_ring)
    else:
        first = inject(jnp.minimum(t, m - 1))
    return ring, first


def _add_tick(acc, chunk, objective, ce_sum, count, router_objective, sums, counts):
    """The accumulators after a tick: the LM head's sums, the objective with the router terms,
    the chunk's MoE statistics and running expert counts."""
    acc = dict(acc, ce_sum=acc["ce_sum"] + ce_sum, loss_tokens=acc["loss_tokens"] + count,
               lm_objective=acc["lm_objective"] + objective,
               objective=acc["objective"] + objective + router_objective)
    if sums:
        acc["moe"] = add_sums(acc["moe"], sums, chunk)
    if counts is not None:  # masked stats leave the counts as they were on idle ticks
        acc["counts"] = [a.at[chunk].set(c) for a, c in zip(acc["counts"], counts)]
    return acc
