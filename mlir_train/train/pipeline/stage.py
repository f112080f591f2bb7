"""What every compiled schedule runs on a stage: the setup (stage axes, stage program, the
model around the non-layer weights), one chunk's forward, the router-loss terms and the
per-stage accumulators they add to (per (chunk, slot), back in layer order by
:func:`aux_out`), and the ``shard_map`` over the stages.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mlir_train.config import policies
from mlir_train.model import logical_axes, losses
from mlir_train.model.moe.dispatch import COUNTS as DISPATCH_COUNTS
from mlir_train.model.transformer import run_pieces, stack_pieces
from mlir_train.train.pipeline.program import Segment, layer_order, stage_program, to_segments
from mlir_train.train.reduction import is_names, partial_specs, rank_axis, row_names, token_partial
from sharding import constrain, logical_shard_map, mesh_axes_of


def chunk_forward(stack_graphs, program, states_r, active_r, x, context, remat):
    """One chunk: its segments in order; the MoE segments' router stats, one dict each."""
    return run_chunk(stack_graphs, program, chunk_pieces(program, states_r, active_r, remat), x, context)


def chunk_pieces(program, states_r, active_r, remat):
    """Every segment's layer state cut into the pieces its recompute policy scans
    (:func:`~mlir_train.model.transformer.stack_pieces`), one list per segment; a period scan's
    segment ``[periods, slots per period, ...]``, each period cut alike."""
    out = []
    for seg, state, on in zip(program, states_r, active_r):
        on = None if seg.active.all() else on
        if seg.periods > 1:
            state, on = jax.tree.map(lambda a: a.reshape(seg.periods, seg.count, *a.shape[1:]), (state, on))
        out.append(stack_pieces(state, on, remat, seg.offsets, lead=int(seg.periods > 1)))
    return out


def run_chunk(stack_graphs, program, pieces_r, x, context):
    """:func:`chunk_forward` from the pieces of :func:`chunk_pieces`: a segment at a time, or
    the segments of one period scan as one ``lax.scan`` over their periods."""
    stats = []
    for _, group in itertools.groupby(range(len(program)), key=lambda i: program[i].scan):
        group = list(group)
        if program[group[0]].scan is None:
            for i in group:
                x, st = run_pieces(stack_graphs[program[i].kind], pieces_r[i], x, context)
                stats.append((program[i], st))
        else:
            x, got = _period_scan(stack_graphs, [program[i] for i in group], [pieces_r[i] for i in group], x, context)
            stats.extend(zip([program[i] for i in group], got))
    return x, [st for seg, st in stats if seg.is_moe]


def _period_scan(stack_graphs, segs, pieces_r, x, context):
    """One ``lax.scan`` over the periods of a period scan's segments (pieces with a leading
    period axis); each segment's stats ``[periods * slots per period, ...]``, period-major."""
    sizes = [[size for _, _, size in pieces] for pieces in pieces_r]
    xs = [[(state, on) for state, on, _ in pieces] for pieces in pieces_r]

    def body(x, xs):
        out = []
        for seg, group_sizes, arrays in zip(segs, sizes, xs):
            pieces = [(state, on, size) for (state, on), size in zip(arrays, group_sizes)]
            x, st = run_pieces(stack_graphs[seg.kind], pieces, x, context)
            out.append(st)
        return x, out

    x, got = jax.lax.scan(body, x, xs)
    return x, [jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), st) for st in got]


def router_terms(program, stats, active_r, keep, balancing, top_k, m, counts=None, micro_index=None,
                 loss_tokens=None):
    """This chunk's router-loss objective (:func:`losses.router_losses`, over ``m``
    micro-batches; ``loss_tokens`` under ``--calculate-per-token-loss``), its per-slot sums for the logs and, under ``global_aux_loss``, the running
    expert counts (``counts``: one ``[S, E]`` per MoE segment, the sum over the micro-batches
    before ``micro_index``). MoE segments only, in program order. The stats of padding slots
    and of items not ``keep`` are zeroed first, which makes every router term (and its
    gradient) of theirs exactly zero and leaves their running counts unchanged."""
    objective, sums, new_counts = 0.0, [], []
    moe_active = [on for seg, on in zip(program, active_r) if seg.is_moe]
    for i, (st, on) in enumerate(zip(stats, moe_active)):
        k_S = keep & on
        st = jax.tree.map(lambda x: jnp.where(k_S.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x)), st)
        obj, per_layer, c = losses.router_losses(st, balancing, top_k, None if counts is None else counts[i],
                                                 micro_index, num_micro_batches=m, loss_tokens=loss_tokens)
        objective = objective + obj
        sums.append(dict(layers=per_layer, tokens_per_expert=st["tokens_per_expert"],
                         **{name: jnp.sum(st[name]) for name in DISPATCH_COUNTS}))
        new_counts.append(c)
    return objective, sums, (new_counts if counts is not None else None)


def _router_names(balancing) -> list[str]:
    return ["load_balancing_loss", "z_loss"] + [
        policies.TRACKER_NAMES[k] for k in ("seq_aux_loss", "global_aux_loss") if balancing.coeff(k) > 0]


def zero_acc(program, r, setup, balancing, scalars):
    acc = {k: jnp.zeros((), jnp.float32) for k in scalars}
    if setup.num_moe:
        moe = [seg for seg in program if seg.is_moe]
        acc["moe"] = [dict(layers={k: jnp.zeros((r, seg.slots)) for k in _router_names(balancing)},
                           tokens_per_expert=jnp.zeros((r, seg.slots, setup.num_experts)),
                           **{name: jnp.zeros(()) for name in DISPATCH_COUNTS}) for seg in moe]
        if balancing.uses_global:
            acc["counts"] = [jnp.zeros((r, seg.slots, setup.num_experts)) for seg in moe]
    return acc


def add_sums(acc, sums, chunk):
    return [dict(layers={k: a["layers"][k].at[chunk].add(s["layers"][k]) for k in a["layers"]},
                 tokens_per_expert=a["tokens_per_expert"].at[chunk].add(s["tokens_per_expert"]),
                 **{name: a[name] + s[name] for name in DISPATCH_COUNTS}) for a, s in zip(acc, sums)]


def aux_out(acc, program, m, num_moe):
    """The step's ``aux`` from the per-stage accumulators (leading stage axis)."""
    aux = {k: jnp.sum(acc[k]) for k in ("ce_sum", "loss_tokens", "lm_objective")}
    moe = acc.get("moe")
    if moe:
        order = lambda get: layer_order(program, [get(s) for s in moe], num_moe)
        # Per-layer sums over micro-batches, back in layer order; /M gives the per-micro mean the
        # non-pipelined step logs, and a leading axis of 1 stands for its micro-batch axis.
        aux.update(router_layers={k: (order(lambda s: s["layers"][k]) / m)[None] for k in moe[0]["layers"]},
                   tokens_per_expert=order(lambda s: s["tokens_per_expert"])[None],
                   **{name: sum(jnp.sum(s[name]) for s in moe) for name in DISPATCH_COUNTS})
    return aux


@dataclasses.dataclass(frozen=True)
class StageSetup:
    program: list[Segment]
    stack_kinds: tuple
    stack_graphs: dict  # LayerKind -> one layer stack's graphdef
    placeholder: Any
    num_moe: int
    num_experts: int
    seg_names: list  # per segment: its weights' logical axes, leaves [P, R, S, ...]
    rest_names: dict  # the non-layer weights' logical axes


def _setup(graphdef, params, schedule, remat):
    stages_axes, p = mesh_axes_of("layers")
    if p != schedule.stages:
        raise ValueError(f"'layers' is split over {p} devices but the schedule has {schedule.stages} stages")
    model = nnx.merge(graphdef, params)
    kinds = model.stack_kinds
    program = stage_program(schedule, kinds, remat)
    graphs = {}
    for k, s in enumerate(kinds):
        graphs.setdefault(s.kind, nnx.split(model.layers[k])[0])
    moe_layers = [k for k, s in enumerate(kinds) if s.moe]
    num_experts = model.layers[moe_layers[0]].mlp.num_experts if moe_layers else 0
    placeholder = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params["layers"])
    names = nnx.to_pure_dict(logical_axes(model))
    stack_names = {}
    for k, s in enumerate(kinds):
        stack_names.setdefault(s.kind, names["layers"][k])
    # A segment's leaves are [P, R, S, ...] of the stacks' [L, ...].
    seg_names = [jax.tree.map(lambda n: ("layers", None, None) + tuple(n[1:]), stack_names[seg.kind],
                              is_leaf=is_names) for seg in program]
    return stages_axes, StageSetup(program, kinds, graphs, placeholder, sum(s.count for s in kinds if s.moe),
                                   num_experts, seg_names, {k: v for k, v in names.items() if k != "layers"})


def merge(graphdef, setup, rest):
    """The model around ``rest`` (embedding, final norm, head); its layer stacks are shapes only."""
    return nnx.merge(graphdef, {**rest, "layers": setup.placeholder})


def prepare(graphdef, params, schedule, remat):
    """What every schedule starts from: the stage axes and stage program (its period scans
    planned for ``remat``), the layer stacks and the rest of the weights, the stacks as the
    program's segments and each segment's active-slot mask."""
    stage_axes, setup = _setup(graphdef, params, schedule, remat)
    stacks, rest = _split_params(params, setup)
    segs = to_segments(stacks, setup.stack_kinds, setup.program, schedule)
    active = [jnp.asarray(seg.active) for seg in setup.program]
    return stage_axes, setup, stacks, rest, segs, active


def _split_params(params, setup):
    stacks = [params["layers"][k] for k in range(len(setup.stack_kinds))]
    rest = {k: v for k, v in params.items() if k != "layers"}
    return stacks, rest


def grad_out_specs(setup: StageSetup, stage_axes, seg_masks, rest_mask, data_manual) -> tuple:
    """Out specs of 1F1B's per-stage, per-data-rank gradient accumulators (leading axes ``[P,
    data ranks]``; :func:`~mlir_train.train.reduction.partial_specs`), the trained weights'
    only (``seg_masks`` per segment, ``rest_mask``: True where trained)."""
    trained = lambda names, m: jax.tree.map(lambda keep, n: n if keep else None, m, names)
    g_names = ([trained(jax.tree.map(lambda n: (None, None) + n[3:], names, is_leaf=is_names), m)
                for names, m in zip(setup.seg_names, seg_masks)], trained(setup.rest_names, rest_mask))
    lead = (stage_axes[0] if len(stage_axes) == 1 else tuple(stage_axes),)
    return partial_specs(g_names, data_manual, lead)


def token_partial_segments(setup: StageSetup, segs: list, stack_masks: list,
                           data_manual: tuple[str, ...] = ()) -> tuple[list, StageSetup, list]:
    """``(segments, setup, each segment's trained mask)`` (``stack_masks``: per layer stack; the
    region manual over ``data_manual``) with
    the segments' trained :data:`~mlir_train.train.reduction.TOKEN_PARTIAL` weights (the
    router's) broadcast over the MoE token ranks that are not data ranks, before the ticks
    (:func:`~mlir_train.train.reduction.token_partial`): each of those ranks accumulates its own
    gradient, summed once after them (:func:`token_ranks_summed`)."""
    seg_masks = [next(m for m, s in zip(stack_masks, setup.stack_kinds) if s.kind == seg.kind)
                 for seg in setup.program]
    out_segs, out_names = [], []
    for seg, names, mask in zip(segs, setup.seg_names, seg_masks):
        trained = jax.tree.map(lambda keep, n: n if keep else (), mask, names)
        seg, expanded = token_partial(seg, trained, data_manual)
        out_segs.append(seg)
        out_names.append(jax.tree.map(lambda keep, n, e: e if keep else n, mask, names, expanded))
    return out_segs, dataclasses.replace(setup, seg_names=out_names), seg_masks


def seg_grad_zeros(segs_RS: list, seg_masks: list, setup: StageSetup) -> list:
    """A stage's float32 gradient accumulators of its trained segment weights (leaves ``[R, S,
    ...]``; None where frozen), the token-rank axis of :func:`token_partial_segments` kept split
    over its ranks (left to XLA, the tick loop gathered each tick's router gradient instead)."""
    def one(names, x, keep):
        zeros = jnp.zeros(x.shape, jnp.float32) if keep else None
        return constrain(zeros, names[1:]) if keep and rank_axis(names) is not None else zeros

    return [jax.tree.map(one, n, s, m, is_leaf=is_names) for n, s, m in zip(setup.seg_names, segs_RS, seg_masks)]


def token_ranks_summed(g_segs: list, setup: StageSetup) -> list:
    """1F1B's per-stage accumulators (``[P, data ranks, R, S, ...]``) summed over the data ranks
    and, where :func:`token_partial_segments` added it, the token-rank axis: once per step."""
    def one(names, g):
        if g is None:
            return None
        at = None if rank_axis(names) is None else rank_axis(names) + 1
        return jnp.sum(g, axis=1 if at is None else (1, at))

    return [jax.tree.map(one, names, g, is_leaf=is_names) for names, g in zip(setup.seg_names, g_segs)]


def stage_shard_map(body, setup: StageSetup, segs, active, rest, batch, scalars, out_names, data_manual=()):
    """``body`` per stage and data rank: manual over the stages and the batch rows' data axes
    (:mod:`mlir_train.train.reduction`: each rank accumulates its own weight gradients, reduced
    once after the ticks; ``data_manual``: :func:`~mlir_train.train.reduction.data_manual_names`),
    the weights entering split as their logical axes say (routed experts over the expert ranks,
    which are data ranks too); ``out_names`` name the outputs' leading axes."""
    per_stage = ("layers",)
    return logical_shard_map(
        body,
        in_names=(setup.seg_names, jax.tree.map(lambda _: per_stage, active), setup.rest_names,
                  jax.tree.map(row_names, batch), jax.tree.map(lambda _: (), scalars)),
        out_names=out_names,
        manual=("layers",) + tuple(data_manual),
        # jax 0.10's transpose of a shard_map nested in a vma-checked one (the expert-parallel
        # dispatch inside a stage) names the outer manual axis in the inner region's shardings,
        # which Shardy rejects; unchecked, the outer region transposes cleanly.
        check_vma=False,
    )(segs, active, rest, batch, scalars)
