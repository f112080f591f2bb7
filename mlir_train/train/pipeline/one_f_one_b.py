"""1F1B, ``--pipeline-schedule 1f1b`` (the default), plain (R = 1) and interleaved (R > 1,
``--num-layers-per-virtual-pipeline-stage``): :func:`pipeline_value_and_grad`. The two are one
tick loop, R a number in it. Shape suffixes as in :mod:`mlir_train.train.pipeline.schedule`.

At tick ``t`` stage ``s`` runs the forward of item ``t - s`` and the backward of item
``t - (R*P - 1) - (P - 1 - s)``, items taken in Megatron's order (groups of P micro-batches,
chunk by chunk forward and in reverse backward, so a micro-batch coming round the ring is
needed the very next tick: no ring buffer). The forward runs the chunk under ``jax.vjp`` and
keeps its residuals (what the layers' ``--recompute-granularity`` policy saves: every
activation without recompute, each recomputed layer's input under ``full``) in a slot buffer
in the scan carry, ``2*R*P - 2`` slots (stage 0's longest forward-to-backward lifetime; the
backward reads its slot before the forward refills it). The weights and the micro-batch's
layer context among the residuals are not stored: the backward takes them from its own item.
On the last chunk of the last stage the head's loss and gradient are taken in the forward's
tick, and that item's backward, in the same tick, starts from them with this tick's residuals.
Elsewhere the backward starts from the cotangent the next stage sent the tick before, applies
the saved pullback (so the step does Megatron's 3 passes, 4 with full recompute, where the
only recompute is the checkpointed layers' own), adds the weight gradients to float32
accumulators in the scan carry and sends the input cotangent back with a second
``ppermute``. The step takes these gradients directly (``Trainer._pipeline_value_and_grad``),
not autodiff through the scan. Under LoRA (``trainable``) every ``jax.vjp`` is taken with respect
to the adapters alone, the frozen base closed over: no base weight gradients, no accumulators for
them, and the base, like the adapters, never copied into the residual slots.

The ticks are three ``lax.scan`` phases over one carry (named scopes ``pipeline_warmup``,
``pipeline_steady``, ``pipeline_cooldown``): forward items exist in ticks ``[0, M*R + P - 1)``
and backward items in ``[R*P - 1, M*R + R*P + P - 2)``, so warm-up ``[0, R*P - 1)`` runs the
forward half alone, the steady phase both (the forward's collectives and permute first, as in
one tick before), cool-down ``[M*R + P - 1, ...)`` the backward half alone. Each stage then
computes ``M*R + P - 1`` forwards and as many backwards, not ``M*R + R*P + P - 2`` of each
(the seed, P = 2, R = 1, M = 64: 65 where it was 66); its idle halves still compute on zeros,
masked. The zero-lifetime items (the head's) have their forward and backward in one tick, a
steady one, so neither single-half phase needs the head or this tick's residuals. The head
(final norm, LM head, CE, and its gradient; scope ``pipeline_head``) runs in the steady ticks,
its loss masked but on the last chunk of the last stage. Not in a ``lax.cond``: there the head's
data-partial weight gradient would be all-reduced on every tick (:meth:`_OneFOneB.head_grad`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mlir_train.config import policies
from mlir_train.config.policies import RecomputePolicy
from mlir_train.model import losses, tree
from mlir_train.train.pipeline.program import to_segments
from mlir_train.train.pipeline.residuals import Residuals
from mlir_train.train.pipeline.schedule import Schedule
from mlir_train.train.pipeline.stage import (StageSetup, add_sums, aux_out, chunk_pieces, grad_out_specs, merge, prepare,
                                             router_terms, run_chunk, seg_grad_zeros, stage_shard_map,
                                             token_partial_segments, token_ranks_summed, zero_acc)
from mlir_train.train.reduction import reduced_aux
from sharding import constrain, mesh_axes_of

SCALARS = ("objective", "ce_sum", "loss_tokens", "lm_objective")


def pipeline_value_and_grad(graphdef, params: dict[str, Any], batch: dict[str, jax.Array], *, schedule: Schedule,
                            scale, top_k: int, remat: RecomputePolicy | str, balancing: policies.LoadBalancing,
                            trainable: Any = None, data_manual: tuple[str, ...] = ()):
    """``((objective * scale, aux), d(objective * scale)/d params)`` by the 1F1B schedule
    (interleaved when ``schedule.virtual > 1``): the arguments and the first two results are
    :func:`mlir_train.train.pipeline.gpipe.pipeline_loss`'s; the gradients are float32, shaped
    like ``params``, or under ``trainable`` (a nested dict whose keys are the trainable part of
    ``params``, e.g. LoRA's adapters; None: all of it) like that part alone. Each data rank (the
    region is manual over ``data_manual`` too) accumulates its own over the ticks; they are summed
    once, after them (:mod:`mlir_train.train.reduction`), for the caller to place. The frozen weights
    are closed over, not differentiated: no weight-gradient matmuls, no accumulators for them,
    and (like the trainable ones) no copies of them among the residuals.

    Three ``lax.scan`` phases over ticks (warm-up: forwards only; steady: both; cool-down:
    backwards only). At tick ``t`` stage ``s`` runs the forward of item ``w = t - s`` and the
    backward of item ``u = t - (R*P - 1) - (P - 1 - s)``: an item is one chunk of one
    micro-batch, taken in Megatron's order (groups of ``P`` micro-batches, chunk by chunk
    forward and in reverse backward). The forward runs the chunk under ``jax.vjp`` and keeps
    its residuals until the item's backward (``2*R*P - 2`` slots, whatever ``M``); the backward
    applies that pullback to the cotangent its successor sent the tick before (or, on the last
    chunk of the last stage, the head's, from the same tick; the head's loss is masked
    elsewhere), accumulates the weight gradients in float32 and sends the input cotangent back
    with one ``ppermute``. Each stage runs ``M*R + P - 1`` forward and as many backward halves
    (seed, M = 64, P = 2: 65 each, where one loop of ``M*R + R*P + P - 2`` ticks ran 66 of both).
    """
    stage_axes, setup, stacks, rest, segs, active = prepare(graphdef, params, schedule, remat)
    mask = tree.mask(params, trainable)
    stack_masks = [mask["layers"][k] for k in range(len(setup.stack_kinds))]
    segs, setup, seg_masks = token_partial_segments(setup, segs, stack_masks, data_manual)
    run = _OneFOneB(graphdef, setup, stage_axes, balancing, top_k, remat,
                    m=batch["input_ids"].shape[0], p=schedule.stages, r=schedule.virtual,
                    seg_masks=seg_masks, rest_mask={k: v for k, v in mask.items() if k != "layers"})
    # Unreduced: each data rank's own gradients ([P, data ranks, ...]), summed once by the caller.
    out = grad_out_specs(setup, stage_axes, seg_masks, run.rest_mask, data_manual) + (("layers",),)
    g_segs, g_rest, acc = stage_shard_map(run.body, setup, segs, active, rest, batch, scale, out, data_manual)
    aux = aux_out(acc, setup.program, run.m, setup.num_moe)
    # The objective is the sum of the terms the forward ticks differentiated (weighted CE + router losses).
    objective = jnp.sum(acc["objective"])
    stacks = [tree.split(s, m)[0] for s, m in zip(stacks, stack_masks)]
    return (objective * scale, aux), tree.prune(_param_grads(params, stacks, g_segs, g_rest, setup, schedule))


def _param_grads(params, stacks, g_segs, g_rest, setup: StageSetup, schedule: Schedule):
    """The per-stage, per-data-rank accumulators (leading axes ``[P, data ranks]``) -> gradients
    shaped like ``params``: summed over the data ranks and the router's over its token ranks (the
    step's one reduction; the caller places it in the optimizer's layout: a reduce-scatter), the
    segments' back onto the layer stacks (the transpose of :func:`to_segments`), the rest summed
    over the stages (the embedding's on stage 0, the head's on P-1)."""
    f32 = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), t)
    transpose = jax.linear_transpose(lambda st: to_segments(st, setup.stack_kinds, setup.program, schedule), f32(stacks))
    (g_stacks,) = transpose(token_ranks_summed(g_segs, setup))
    grads = jax.tree.map(lambda x: jnp.sum(x, axis=(0, 1)), g_rest)
    grads["layers"] = type(params["layers"])({k: g for k, g in enumerate(g_stacks)}) if isinstance(
        params["layers"], dict) else type(params["layers"])(g_stacks)
    return grads


def _at(t, i):
    """Row ``i`` (traced) of every leaf of ``t``."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), t)


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
    seg_masks: list  # per segment: its layer tree, True where trainable
    rest_mask: dict  # the non-layer weights, True where trainable

    def split_pieces(self, weights_r):
        """Piece weights (:func:`_piece_weights`) -> (trainable, frozen), None in each other's place."""
        parts = [[tree.split(w, m) for w in ws] for ws, m in zip(weights_r, self.seg_masks)]
        return [[t for t, _ in ps] for ps in parts], [[f for _, f in ps] for ps in parts]

    @functools.cached_property
    def head_in_embed(self) -> bool:
        """Whether the LM head's float32 gradient accumulator is the embedding's, transposed: with
        two or more stages the embedding's gradient is taken on stage 0 alone and the head's on the
        last stage alone (each is exactly zero on the other stages: the head's loss is masked,
        the embedding's rows selected), so one ``[V, D]`` buffer per stage holds whichever its
        stage takes, split after the ticks (the seed: 594 MiB a device). Both trained, untied."""
        m = self.rest_mask
        return self.p > 1 and m.get("embed") is True and m.get("lm_head") is True

    def add_head(self, acc, g):
        """The head's weight gradients ``g`` added to the non-layer accumulators ``acc`` (the
        head's into the embedding's, transposed, under :attr:`head_in_embed`)."""
        add = lambda a, x: a + x.astype(jnp.float32)
        if not self.head_in_embed:
            return jax.tree.map(add, acc, g)
        head = g["lm_head"]
        acc = jax.tree.map(add, acc, dict(g, lm_head=None))
        return dict(acc, embed=add(acc["embed"], head.T))

    @property
    def delay(self) -> int:
        """Ticks between an item's forward and its backward on the last stage."""
        return self.r * self.p - 1

    @functools.cached_property
    def lifetimes(self) -> np.ndarray:
        """``[P, M*R]``: ticks from each item's forward to its backward on each stage (0 for the
        last chunk on the last stage, whose backward starts from the head in the same tick)."""
        out = np.zeros((self.p, self.m * self.r), np.int64)
        for s in range(self.p):
            for u in range(self.m * self.r):
                chunk, _, w = self.item(u, backward=True, xp=np)
                out[s, w] = (u + self.delay + self.p - 1 - s) - (w + s)
                assert (out[s, w] == 0) == (s == self.p - 1 and chunk == self.r - 1), (s, u, out[s, w])
        return out

    @property
    def slots(self) -> int:
        """Items whose residuals a stage keeps between ticks: the longest forward-to-backward
        lifetime (stage 0's; the backward reads its slot before the forward refills it, and
        the zero-lifetime items never enter the buffer)."""
        return max(1, int(self.lifetimes.max()))

    @property
    def num_ticks(self) -> int:
        return self.m * self.r + self.delay + self.p - 1

    def permutes(self, backward: bool) -> list[tuple[int, int]]:
        """The ``ppermute`` pairs to the next (previous) stage, round the ring when R > 1."""
        p = self.p
        pairs = [(i, (i + 1) % p) for i in range(p if self.r > 1 else p - 1)]
        return [(b, a) for a, b in pairs] if backward else pairs

    def item(self, i, backward: bool, xp=jnp):
        """(chunk, micro-batch, forward index) of forward/backward item ``i``."""
        m, p, r = self.m, self.p, self.r
        i = xp.clip(i, 0, m * r - 1)
        group, within = i // (p * r), i % (p * r)
        chunk = within // p
        if backward:
            chunk = r - 1 - chunk
        mb = group * p + within % p
        return chunk, mb, group * p * r + chunk * p + within % p

    @functools.cached_property
    def phases(self) -> list[tuple[int, int, bool, bool]]:
        """The tick loop's phases, ``(first tick, end, forward, backward)``: which halves of a
        tick any stage has work for. Forward items run in ticks ``[0, M*R + P - 1)`` (stage
        ``s``: ``[s, M*R + s)``), backward items in ``[R*P - 1, num_ticks)``, so warm-up
        ``[0, R*P - 1)`` is forwards only, cool-down ``[M*R + P - 1, num_ticks)`` backwards
        only, and each stage statically runs ``M*R + P - 1`` of each half, not ``num_ticks``.
        Phases of no tick are left out."""
        f_end = self.m * self.r + self.p - 1
        cuts = sorted({0, self.delay, f_end, self.num_ticks})
        out = [(a, b, a < f_end, a >= self.delay) for a, b in zip(cuts, cuts[1:])]
        out = [phase for phase in out if phase[2] or phase[3]]
        # The head runs in the forward of a zero-lifetime item (the last chunk on the last
        # stage), whose backward is in the same tick: such ticks must hold both halves, so a
        # forward-only tick needs no head and a backward-only tick no fresh residuals.
        s = self.p - 1
        both = [t for a, b, f, bw in out if f and bw for t in range(a, b)]
        for w in range(self.m * self.r):
            if self.lifetimes[s, w] == 0:
                assert w + s in both, (w, out)
        assert sum(b - a for a, b, f, _ in out if f) == f_end, out
        assert sum(b - a for a, b, _, bw in out if bw) == f_end, out
        return out

    def body(self, segs_1RS, active_1RS, rest, batch, scale):
        """One stage's whole step: the tick scans of :attr:`phases` over one carry, from zeros;
        its gradient and loss accumulators, with a leading stage axis of 1."""
        stage = jax.lax.axis_index(self.stage_axes)
        segs_RS = [jax.tree.map(lambda x: x[0], s) for s in segs_1RS]
        active_RS = [a[0] for a in active_1RS]
        model = merge(self.graphdef, self.setup, rest)
        dtype = jax.tree.leaves(segs_RS)[0].dtype
        local = _Local(stage, segs_RS, active_RS, rest, batch, model, dtype)
        shape = jax.eval_shape(lambda: model.embed_tokens(batch["input_ids"][0]).astype(dtype))
        zeros_x = jnp.zeros(shape.shape, shape.dtype)
        f32_zeros = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), t)
        acc = zero_acc(self.setup.program, self.r, self.setup, self.balancing, SCALARS)
        # The residuals one item keeps: their shapes, and where the pullback takes each of its
        # leaves from (the backward-only ticks have no forward of their own to rebuild it from).
        traced = []

        def trace(t, x):
            traced.append(self.forward_vjp(local, t, x, acc)[1])
            return traced[-1].kept

        kept = jax.eval_shape(trace, jax.ShapeDtypeStruct((), jnp.int32), zeros_x)
        saved = [jnp.zeros((self.slots,) + k.shape, k.dtype) for k in kept]
        g_rest = f32_zeros(tree.split(rest, self.rest_mask)[0])
        if self.head_in_embed:
            g_rest = dict(g_rest, lm_head=None)
        carry = (zeros_x, zeros_x, saved, (seg_grad_zeros(segs_RS, self.seg_masks, self.setup), g_rest), acc)
        for first, end, forward, backward in self.phases:
            name = {(True, False): "pipeline_warmup", (True, True): "pipeline_steady",
                    (False, True): "pipeline_cooldown"}[forward, backward]
            tick = functools.partial(self.tick, local, scale, traced[0], forward, backward)
            with jax.named_scope(name):
                carry, _ = jax.lax.scan(tick, carry, jnp.arange(first, end))
        _, _, _, (g_segs, g_rest), acc = carry
        if self.head_in_embed:
            both = g_rest["embed"]
            g_rest = dict(g_rest, embed=jnp.where(stage == 0, both, jnp.zeros_like(both)),
                          lm_head=jnp.where(stage == self.p - 1, both.T, jnp.zeros_like(both.T)))
        per_rank = jax.tree.map(lambda x: x[None, None], (g_segs, g_rest))
        return per_rank + (jax.tree.map(lambda x: x[None], reduced_aux(acc)),)

    def tick(self, local: _Local, scale, residuals: "Residuals", forward: bool, backward: bool, carry, t):
        """One tick of a phase: the forward half, the backward half, or both (the forward's
        first). ``residuals``: the structure of a forward's pullback, for a backward-only tick."""
        received, cotangent, saved, grads, acc = carry
        stage = local.stage
        w = t - stage
        rest_b, segs_b = local.rest, local.segs_RS
        if forward:
            received, fresh, ct_head, grads, acc = self.forward_half(local, scale, received, grads, acc, t, backward)
            assert [k.shape for k in fresh.kept] == [b.shape[1:] for b in saved], "the residuals changed between traces"
            if not backward:
                return (received, cotangent, self.write_slot(saved, fresh.kept, w), grads, acc), None
            residuals = fresh
            # One order of collectives on every device: the forward's (its TP/EP ones, then the
            # permute) before the backward's. XLA:CPU otherwise runs independent collectives in
            # whatever order its thread pool picks per device, and on a loaded machine devices
            # waiting in different rendezvous time out.
            received, saved, fresh_kept, cotangent, ct_head, rest_b, segs_b = jax.lax.optimization_barrier(
                (received, saved, fresh.kept, cotangent, ct_head, rest_b, segs_b))
        # Backward of item u: its residuals from its slot (read before this tick's forward refills
        # it), or this tick's own on the last chunk of the last stage (lifetime 0: always a tick
        # with a forward, see phases).
        u = t - self.delay - (self.p - 1 - stage)
        chunk_b, _, w_b = self.item(u, backward=True)
        read = [jax.lax.dynamic_index_in_dim(buf, w_b % self.slots, keepdims=False) for buf in saved]
        if forward:
            last_b = (stage == self.p - 1) & (chunk_b == self.r - 1)
            kept_b = [jnp.where(last_b, k, r) for k, r in zip(fresh_kept, read)]
            kept_b, saved = jax.lax.optimization_barrier((kept_b, saved))  # the reads before the write
            saved = self.write_slot(saved, fresh_kept, w)
            ct_x = jnp.where(last_b, ct_head.astype(cotangent.dtype), cotangent)
        else:
            kept_b, ct_x = read, cotangent
        cotangent, grads = self.backward_half(local, scale, residuals, rest_b, segs_b, u, kept_b, ct_x, grads)
        return (received, cotangent, saved, grads, acc), None

    def write_slot(self, saved, kept, w):
        """The forward item ``w``'s residuals into its slot."""
        return [jax.lax.dynamic_update_index_in_dim(buf, k, jnp.clip(w, 0, None) % self.slots, 0)
                for buf, k in zip(saved, kept)]

    def forward_half(self, local: _Local, scale, received, grads, acc, t, head: bool):
        """Forward of item ``w = t - s``: its chunk under ``jax.vjp`` (the residuals stay for its
        backward), the activation sent on, and with ``head`` the head's loss and gradient
        (:meth:`head_grad`, on the last chunk of the last stage). ``(received, residuals, the
        head's input cotangent or None, grads, acc)``."""
        stage = local.stage
        w = t - stage
        chunk_f, mb_f, _ = self.item(w, backward=False)
        valid_f = (w >= 0) & (w < self.m * self.r)
        batch_f = _at(local.batch, mb_f)
        first_f = (stage == 0) & (chunk_f == 0)
        x_in = jnp.where(first_f, local.model.embed_tokens(batch_f["input_ids"]).astype(local.dtype), received)
        x_out, fresh, terms = self.forward_vjp(local, t, x_in, acc)
        ct_head, head_terms = None, None
        if head:
            last_f = valid_f & (stage == self.p - 1) & (chunk_f == self.r - 1)
            head_terms, g_rest_head, ct_head = self.head_grad(local.rest, x_out, batch_f, last_f, scale)
            # The head's loss collectives before the permute on every device (XLA:CPU would
            # otherwise pick either order per device, and two devices in different rendezvous
            # wait forever). Its weight gradient stays out of the barrier: added straight into
            # its accumulator, its data-parallel all-reduce is one XLA:GPU moves out of the loop
            # (while-loop-all-reduce-code-motion); through a barrier it ran on every tick.
            x_out, head_terms, ct_head = jax.lax.optimization_barrier((x_out, head_terms, ct_head))
            grads = (grads[0], self.add_head(grads[1], g_rest_head))
        acc = _add_terms(acc, chunk_f, valid_f, terms, head_terms)
        received = jax.lax.ppermute(x_out, self.stage_axes, self.permutes(backward=False))
        return received, fresh, ct_head, grads, acc

    def backward_half(self, local: _Local, scale, residuals: "Residuals", rest_b, segs_b, u, kept_b, ct_x, grads):
        """Backward of item ``u``: the saved pullback (``residuals`` rebuilt over ``kept_b`` and
        the item's own weights and context) applied to ``ct_x``, the weight gradients added to
        the accumulators and the input cotangent sent back. ``(cotangent, grads)``."""
        stage = local.stage
        valid_b = (u >= 0) & (u < self.m * self.r)
        chunk_b, mb_b, _ = self.item(u, backward=True)
        batch_b = _at(local.batch, mb_b)
        first_b = (stage == 0) & (chunk_b == 0)
        on_b = [_at(a, chunk_b) for a in local.active_RS]
        states_b = [tree.split(_at(s, chunk_b), m) for s, m in zip(segs_b, self.seg_masks)]
        pieces_of = lambda states: _piece_weights(chunk_pieces(self.setup.program, states, on_b, self.remat))
        frozen_b = self.split_pieces(pieces_of([tree.join(t, f) for t, f in states_b]))[1]
        trained_b, split_pullback = jax.vjp(
            lambda trained: self.split_pieces(pieces_of([tree.join(t, f) for t, (_, f) in zip(trained, states_b)]))[0],
            [t for t, _ in states_b])
        weights_b = [[tree.join(t, f) for t, f in zip(ts, fs)] for ts, fs in zip(trained_b, frozen_b)]
        context_b = merge(self.graphdef, self.setup, rest_b).layer_context(batch_b["segment_ids"], batch_b["positions"])
        pullback = residuals.rebuild(kept_b, weights_b, context_b)
        g_weights, g_x = pullback((ct_x, scale))
        (g_states,) = split_pullback(g_weights)
        # An idle tick's slot may hold no item yet (zeros, where e.g. a normalisation's
        # reciprocal is infinite): its gradients are selected away, not multiplied by zero.
        g_states, g_x = jax.tree.map(lambda g: jnp.where(valid_b, g, jnp.zeros_like(g)), (g_states, g_x))
        g_embedded = jnp.where(first_b, g_x, jnp.zeros_like(g_x))
        grads = _add_grads(grads, chunk_b, batch_b, g_states, g_embedded)
        # The input cotangent goes back to the previous stage (round the ring when R > 1; the
        # first chunk's belongs to the embedding, so stage 0 sends zeros then).
        cotangent = jax.lax.ppermute(jnp.where(first_b, jnp.zeros_like(g_x), g_x), self.stage_axes,
                                     self.permutes(backward=True))
        return cotangent, grads

    def forward_vjp(self, local: _Local, t, x_in, acc):
        """The forward of this tick's item ``w = t - s`` under ``jax.vjp``: its output, its
        :class:`Residuals` and its terms (router objective and sums, running counts)."""
        w = t - local.stage
        chunk, mb_index, _ = self.item(w, backward=False)
        mb = _at(local.batch, mb_index)
        on = [_at(a, chunk) for a in local.active_RS]
        # The vjp is taken with respect to the recompute pieces of the chunk's weights
        # (stack_pieces): the residuals that are weights are then these very arrays, which the
        # backward takes again from its own item's weights instead of keeping a copy per slot.
        pieces = chunk_pieces(self.setup.program, [_at(s, chunk) for s in local.segs_RS], on, self.remat)
        weights = _piece_weights(pieces)
        # Differentiated by the trainable weights only; the frozen ones are closed over (their
        # weight gradients are never formed) and recognised among the residuals all the same.
        trained, frozen = self.split_pieces(weights)
        context = local.model.layer_context(mb["segment_ids"], mb["positions"])
        # global_aux_loss: the chunk's running counts over the micro-batches before this one
        # (a chunk's forward items come in micro-batch order).
        counts = [c[chunk] for c in acc["counts"]] if "counts" in acc else None

        def chunk_objective(trained, x_in):
            """The chunk's output and router objective (/M, as without the pipeline)."""
            weights = [[tree.join(t, f) for t, f in zip(ts, fs)] for ts, fs in zip(trained, frozen)]
            x_out, stats = run_chunk(self.setup.stack_graphs, self.setup.program, _with_weights(pieces, weights),
                                     x_in, context)
            router_objective, sums, new_counts = router_terms(self.setup.program, stats, on, jnp.bool_(True),
                                                              self.balancing, self.top_k, self.m, counts, mb_index,
                                                              mb.get(losses.ROUTER_LOSS_TOKENS))
            return (x_out, router_objective), (router_objective, sums, new_counts)

        (x_out, _), pullback, terms = jax.vjp(chunk_objective, trained, x_in, has_aux=True)
        return x_out, Residuals.of(pullback, weights, context), terms

    def head_grad(self, rest, x_out, mb, last, scale):
        """Final norm, LM head and weighted CE of the chunk's output, counted where ``last`` (the
        last chunk on the last stage), and their gradient: ``((objective, CE sum, loss tokens),
        the head's trainable weights' gradients, the input cotangent)``, zeros elsewhere.

        Computed on every forward half and masked (op_name scope ``pipeline_head``), not under a
        ``lax.cond`` on ``last``: in a conditional the head's weight gradient, partial over the
        data ranks, is all-reduced inside the branch on every tick that takes it (seed layout:
        64 float32 ``[2048, 76032]`` all-reduces, 37 GiB per step on the last stage), where a
        plain accumulation lets XLA:GPU move that one all-reduce out of the tick loop. The
        other stages' head matmuls cost no step time (every stage runs the same ticks in
        lockstep); the per-device FLOP count is the last stage's, Megatron's busiest."""
        trained, frozen = tree.split(rest, self.rest_mask)

        def head(trained, x):
            model = merge(self.graphdef, self.setup, tree.join(trained, frozen))
            on = last.astype(mb["loss_mask"].dtype)
            objective, ce_sum, count = model.weighted_loss_sums(model.final_norm(x), mb["labels"], mb["loss_mask"] * on,
                                                                mb["loss_weight"] * last.astype(mb["loss_weight"].dtype))
            return objective, (ce_sum, count)

        with jax.named_scope("pipeline_head"):
            objective, pullback, (ce_sum, count) = jax.vjp(head, trained, x_out, has_aux=True)
            g_trained, ct_x = pullback(scale)
        return (objective, ce_sum, count), g_trained, ct_x


def _piece_weights(pieces_r):
    """The weights of :func:`chunk_pieces` (what the chunk is differentiated by)."""
    return [[state for state, _, _ in pieces] for pieces in pieces_r]


def _with_weights(pieces_r, weights_r):
    return [[(w, active, size) for w, (_, active, size) in zip(ws, pieces)] for ws, pieces in zip(weights_r, pieces_r)]


def _add_grads(grads, chunk, mb, g_states, g_embedded):
    """The backward's gradients added to the float32 accumulators ``(per segment [R, S, ...], rest)``.
    Under CP the embedding gradient's rows come whole over the context ranks before its scatter-add
    (an all-gather of this micro-batch's [B, T, D], cheaper than all-reducing partial [V, D] sums):
    XLA 0.12.1's SPMD partitioner aborts (HandleScatter) on context-split rows into a tensor-split
    vocabulary under CP x TP x PP."""
    g_segs = [jax.tree.map(lambda a, g: a.at[chunk].add(g.astype(jnp.float32)), acc_s, g_s)
              for acc_s, g_s in zip(grads[0], g_states)]
    # The lookup's gradient goes straight into the accumulator's rows (a scatter-add of
    # B*T rows), not through a zero [V, D] buffer per tick as the lookup's transpose would.
    if grads[1].get("embed") is None:  # a frozen embedding
        return (g_segs, grads[1])
    ids = mb["input_ids"]
    if mesh_axes_of("act_seq")[1] > 1:  # CP: rows whole first (XLA 0.12.1 aborts on CP x TP x PP's scatter)
        ids, g_embedded = constrain(ids, ("act_batch", None)), constrain(g_embedded, ("act_batch", None, None))
    g_embed = grads[1]["embed"].at[ids].add(g_embedded.astype(jnp.float32))
    return (g_segs, dict(grads[1], embed=g_embed))


def _add_terms(acc, chunk, valid, terms, head_terms=None):
    """The item's objective terms and router sums added to the accumulators (nothing on idle
    ticks); ``head_terms`` (objective, CE sum, loss tokens) are zero but on the last chunk of the
    last stage, None in the ticks that run no head."""
    router_objective, sums, counts = terms
    keep = valid.astype(jnp.float32)
    lm_objective = 0.0
    if head_terms is not None:
        lm_objective, ce_sum, count = head_terms
        acc = dict(acc, ce_sum=acc["ce_sum"] + ce_sum * keep, loss_tokens=acc["loss_tokens"] + count * keep,
                   lm_objective=acc["lm_objective"] + lm_objective * keep)
    acc = dict(acc, objective=acc["objective"] + (lm_objective + router_objective) * keep)
    if sums:
        sums = jax.tree.map(lambda x: x * keep, sums)
        acc["moe"] = add_sums(acc["moe"], sums, chunk)
    if counts is not None:
        acc["counts"] = [a.at[chunk].set(jnp.where(valid, c, a[chunk])) for a, c in zip(acc["counts"], counts)]
    return acc
