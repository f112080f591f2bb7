"""1F1B, ``--pipeline-schedule 1f1b`` (the default), plain (R = 1) and interleaved (R > 1,
``--num-layers-per-virtual-pipeline-stage``): :func:`pipeline_value_and_grad`. The two are one
tick loop, R a number in it. Shape suffixes as in :mod:`mlir_train.train.pipeline.schedule`.

At tick ``t`` stage ``s`` runs the forward of item ``t - s`` and the backward of item
``t - (R*P - 1) - (P - 1 - s)``, items taken in Megatron's order (groups of P micro-batches,
chunk by chunk forward and in reverse backward, so a micro-batch coming round the ring is
needed the very next tick: no ring buffer). The forward keeps only the item's input in a
``2*R*P - 1``-slot buffer; the backward recomputes the chunk from it under ``jax.vjp`` (with
the layers' own ``--recompute-granularity`` policy inside), starts from the cotangent the next
stage sent the tick before (the head's, on the last chunk of the last stage), adds the weight
gradients to float32 accumulators in the scan carry and sends the input cotangent back with a
second ``ppermute``. The step takes these gradients directly
(``Trainer._pipeline_value_and_grad``), not autodiff through the scan.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mlir_train.config import policies
from mlir_train.config.policies import RecomputePolicy
from mlir_train.model import losses
from mlir_train.train.pipeline.program import to_segments
from mlir_train.train.pipeline.schedule import Schedule
from mlir_train.train.pipeline.stage import (StageSetup, add_sums, aux_out, chunk_forward, merge, prepare, router_terms,
                                             stage_shard_map, zero_acc)

SCALARS = ("objective", "ce_sum", "loss_tokens", "lm_objective")


def pipeline_value_and_grad(graphdef, params: dict[str, Any], batch: dict[str, jax.Array], *, schedule: Schedule,
                            scale, top_k: int, remat: RecomputePolicy | str, balancing: policies.LoadBalancing):
    """``((objective * scale, aux), d(objective * scale)/d params)`` by the 1F1B schedule
    (interleaved when ``schedule.virtual > 1``): the arguments and the first two results are
    :func:`mlir_train.train.pipeline.gpipe.pipeline_loss`'s; the gradients are float32, shaped
    like ``params``.

    One ``lax.scan`` over ticks. At tick ``t`` stage ``s`` runs the forward of item
    ``w = t - s`` and the backward of item ``u = t - (R*P - 1) - (P - 1 - s)``: an item is one
    chunk of one micro-batch, taken in Megatron's order (groups of ``P`` micro-batches, chunk
    by chunk forward and in reverse backward). The forward keeps only the chunk's input, in a
    ``2*R*P - 1``-slot buffer; the backward recomputes the chunk from it under ``jax.vjp``
    (with the layers' own ``remat`` policy inside), takes the cotangent its successor sent the
    tick before (or, on the last chunk of the last stage, the head's), accumulates the weight
    gradients in float32 and sends the input cotangent back with one ``ppermute``.
    """
    stage_axes, setup, stacks, rest, segs, active = prepare(graphdef, params, schedule)
    run = _OneFOneB(graphdef, setup, stage_axes, balancing, top_k, remat,
                    m=batch["input_ids"].shape[0], p=schedule.stages, r=schedule.virtual)
    g_segs, g_rest, acc = stage_shard_map(run.body, segs, active, rest, batch, scale, ("layers",))
    aux = aux_out(acc, setup.program, run.m, setup.num_moe)
    # The objective is the sum of the terms the backward differentiated (weighted CE + router losses).
    objective = jnp.sum(acc["objective"])
    return (objective * scale, aux), _param_grads(params, stacks, g_segs, g_rest, setup, schedule)


def _param_grads(params, stacks, g_segs, g_rest, setup: StageSetup, schedule: Schedule):
    """The per-stage accumulators -> gradients shaped like ``params``: the segments' back onto
    the layer stacks (the transpose of :func:`to_segments`), the rest summed over the stages."""
    f32 = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), tree)
    transpose = jax.linear_transpose(lambda st: to_segments(st, setup.stack_kinds, setup.program, schedule), f32(stacks))
    (g_stacks,) = transpose(g_segs)
    grads = jax.tree.map(lambda x: jnp.sum(x, axis=0), g_rest)  # embedding on stage 0, head on P-1
    grads["layers"] = type(params["layers"])({k: g for k, g in enumerate(g_stacks)}) if isinstance(
        params["layers"], dict) else type(params["layers"])(g_stacks)
    return grads


def _at(tree, i):
    """Row ``i`` (traced) of every leaf of ``tree``."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


class _Local(NamedTuple):
    """One stage's values inside the ``shard_map``: its index, its chunks' segments and
    active-slot masks (leaves ``[R, S, ...]``), the non-layer weights, the micro-batches
    ``[M, B, T]``, the model around the weights and the compute dtype."""
    stage: jax.Array
    segs_RS: list
    active_RS: list
    rest: dict
    batch: dict
    model: Any
    dtype: Any


@dataclasses.dataclass(frozen=True, eq=False)
class _OneFOneB:
    """The static settings of one 1F1B step; its methods are the parts of the stage body."""
    graphdef: Any
    setup: StageSetup
    stage_axes: Any
    balancing: policies.LoadBalancing
    top_k: int
    remat: RecomputePolicy | str
    m: int  # micro-batches
    p: int  # stages
    r: int  # chunks per stage

    @property
    def delay(self) -> int:
        """Ticks between an item's forward and its backward on the last stage."""
        return self.r * self.p - 1

    @property
    def slots(self) -> int:
        """Inputs in flight on stage 0 (fewer further down)."""
        return 2 * self.r * self.p - 1

    @property
    def num_ticks(self) -> int:
        return self.m * self.r + self.delay + self.p - 1

    def permutes(self, backward: bool) -> list[tuple[int, int]]:
        """The ``ppermute`` pairs to the next (previous) stage, round the ring when R > 1."""
        p = self.p
        pairs = [(i, (i + 1) % p) for i in range(p if self.r > 1 else p - 1)]
        return [(b, a) for a, b in pairs] if backward else pairs

    def item(self, i, backward: bool):
        """(chunk, micro-batch, forward index) of forward/backward item ``i``."""
        m, p, r = self.m, self.p, self.r
        i = jnp.clip(i, 0, m * r - 1)
        group, within = i // (p * r), i % (p * r)
        chunk = within // p
        if backward:
            chunk = r - 1 - chunk
        mb = group * p + within % p
        return chunk, mb, group * p * r + chunk * p + within % p

    def body(self, segs_1RS, active_1RS, rest, batch, scale):
        """One stage's whole step: the tick scan from zero carries; its gradient and loss
        accumulators, with a leading stage axis of 1."""
        stage = jax.lax.axis_index(self.stage_axes)
        segs_RS = [jax.tree.map(lambda x: x[0], s) for s in segs_1RS]
        active_RS = [a[0] for a in active_1RS]
        model = merge(self.graphdef, self.setup, rest)
        dtype = jax.tree.leaves(segs_RS)[0].dtype
        local = _Local(stage, segs_RS, active_RS, rest, batch, model, dtype)
        shape = jax.eval_shape(lambda: model.embed_tokens(batch["input_ids"][0]).astype(dtype))
        zeros_x = jnp.zeros(shape.shape, shape.dtype)
        f32_zeros = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)
        acc = zero_acc(self.setup.program, self.r, self.setup, self.balancing, SCALARS)
        carry = (zeros_x, zeros_x, jnp.zeros((self.slots,) + shape.shape, shape.dtype),
                 (f32_zeros(segs_RS), f32_zeros(rest)), acc)
        tick = functools.partial(self.tick, local, scale)
        (_, _, _, (g_segs, g_rest), acc), _ = jax.lax.scan(tick, carry, jnp.arange(self.num_ticks))
        return jax.tree.map(lambda x: x[None], (g_segs, g_rest, acc))

    def tick(self, local: _Local, scale, carry, t):
        received, cotangent, inputs, grads, acc = carry
        received, inputs = self.forward(local, received, inputs, t)
        # One order of collectives on every device: the forward's (its TP/EP ones, then the
        # permute) before the backward's. XLA:CPU otherwise runs independent collectives in
        # whatever order its thread pool picks per device, and on a loaded machine devices
        # waiting in different rendezvous time out.
        received, inputs, cotangent, rest_b, segs_b = jax.lax.optimization_barrier(
            (received, inputs, cotangent, local.rest, local.segs_RS))
        (chunk, mb, valid, terms), (g_states, g_rest, g_x, g_embedded) = self.backward(
            local, scale, t, cotangent, inputs, rest_b, segs_b, acc)
        grads = _add_grads(grads, chunk, mb, g_states, g_rest, g_embedded)
        acc = _add_terms(acc, chunk, valid, terms)
        cotangent = jax.lax.ppermute(g_x, self.stage_axes, self.permutes(backward=True))
        return (received, cotangent, inputs, grads, acc), None

    def forward(self, local: _Local, received, inputs, t):
        """Forward of item ``w = t - s``: keep its input for the backward, pass its output on."""
        w = t - local.stage
        chunk, mb_index, _ = self.item(w, backward=False)
        mb = _at(local.batch, mb_index)
        first = (local.stage == 0) & (chunk == 0)
        x_in = jnp.where(first, local.model.embed_tokens(mb["input_ids"]).astype(local.dtype), received)
        context = local.model.layer_context(mb["segment_ids"], mb["positions"])
        on = [_at(a, chunk) for a in local.active_RS]
        x_out, _ = chunk_forward(self.setup.stack_graphs, self.setup.program, [_at(s, chunk) for s in local.segs_RS],
                                 on, x_in, context, self.remat)
        inputs = jax.lax.dynamic_update_index_in_dim(inputs, x_in, jnp.clip(w, 0, None) % self.slots, 0)
        received = jax.lax.ppermute(x_out, self.stage_axes, self.permutes(backward=False))
        return received, inputs

    def backward(self, local: _Local, scale, t, cotangent, inputs, rest_b, segs_b, acc):
        """Backward of item ``u``, recomputed from its saved input: ``(chunk, micro-batch, valid,
        the item's terms)`` and the pullback's ``(d states, d rest, d input, d embedded)``."""
        stage, p = local.stage, self.p
        u = t - self.delay - (p - 1 - stage)
        valid = (u >= 0) & (u < self.m * self.r)
        chunk, mb_index, w_u = self.item(u, backward=True)
        mb = _at(local.batch, mb_index)
        first, last = (stage == 0) & (chunk == 0), (stage == p - 1) & (chunk == self.r - 1)
        on = [_at(a, chunk) for a in local.active_RS]
        x_saved = jax.lax.dynamic_index_in_dim(inputs, w_u % self.slots, keepdims=False)
        x_embedded = merge(self.graphdef, self.setup, rest_b).embed_tokens(mb["input_ids"]).astype(local.dtype)
        # global_aux_loss: the chunk's running counts over the micro-batches before this one
        # (a chunk's backward items come in micro-batch order).
        counts = [c[chunk] for c in acc["counts"]] if "counts" in acc else None
        f = functools.partial(self.chunk_objective, mb=mb, on=on, first=first, last=last, counts=counts,
                              micro_index=mb_index)
        _, pullback, terms = jax.vjp(f, [_at(s, chunk) for s in segs_b], rest_b, x_saved, x_embedded, has_aux=True)
        # Zero cotangents on idle ticks make every gradient of the tick exactly zero.
        ct_x = jnp.where(last | ~valid, jnp.zeros_like(cotangent), cotangent)
        return (chunk, mb, valid, terms), pullback((ct_x, scale * valid.astype(jnp.float32)))

    def chunk_objective(self, states, rest, x_saved, x_embedded, mb, on, first, last, counts, micro_index):
        """The chunk's output and its part of the objective: on the last chunk of the last
        stage the micro-batch's weighted CE sum (its ``loss_weight`` already carries the
        step's normalisation), plus the chunk's router losses (/M, as without the pipeline)."""
        model = merge(self.graphdef, self.setup, rest)
        x_in = jnp.where(first, x_embedded, x_saved)
        context = model.layer_context(mb["segment_ids"], mb["positions"])
        x_out, stats = chunk_forward(self.setup.stack_graphs, self.setup.program, states, on, x_in, context, self.remat)
        lm_objective, ce_sum, count = model.weighted_loss_sums(
            model.final_norm(x_out), mb["labels"], mb["loss_mask"] * last.astype(mb["loss_mask"].dtype),
            mb["loss_weight"] * last.astype(mb["loss_weight"].dtype))
        router_objective, sums, counts = router_terms(self.setup.program, stats, on, jnp.bool_(True), self.balancing,
                                                      self.top_k, self.m, counts, micro_index,
                                                      mb.get(losses.ROUTER_LOSS_TOKENS))
        objective = lm_objective + router_objective
        return (x_out, objective), (objective, lm_objective, ce_sum, count, sums, counts)


def _add_grads(grads, chunk, mb, g_states, g_rest, g_embedded):
    """The tick's gradients added to the float32 accumulators ``(per segment [R, S, ...], rest)``."""
    grads = ([jax.tree.map(lambda a, g: a.at[chunk].add(g.astype(jnp.float32)), acc_s, g_s)
              for acc_s, g_s in zip(grads[0], g_states)],
             jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads[1], g_rest))
    # The lookup's gradient goes straight into the accumulator's rows (a scatter-add of
    # B*T rows), not through a zero [V, D] buffer per tick as the lookup's transpose would.
    g_embed = grads[1]["embed"].at[mb["input_ids"]].add(g_embedded.astype(jnp.float32))
    return (grads[0], dict(grads[1], embed=g_embed))


def _add_terms(acc, chunk, valid, terms):
    """The item's objective terms and router sums added to the accumulators (nothing on idle ticks)."""
    objective, lm_objective, ce_sum, count, sums, counts = terms
    keep = valid.astype(jnp.float32)
    acc = dict(acc, ce_sum=acc["ce_sum"] + ce_sum * keep, loss_tokens=acc["loss_tokens"] + count * keep,
               lm_objective=acc["lm_objective"] + lm_objective * keep,
               objective=acc["objective"] + objective * keep)
    if sums:
        sums = jax.tree.map(lambda x: x * keep, sums)
        acc["moe"] = add_sums(acc["moe"], sums, chunk)
    if counts is not None:
        acc["counts"] = [a.at[chunk].set(jnp.where(valid, c, a[chunk])) for a, c in zip(acc["counts"], counts)]
    return acc
