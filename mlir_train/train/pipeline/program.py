"""The stage program: which decoder layers every chunk of every stage runs, and how the
weights are stored for it.

Every decoder-layer parameter is stacked ``[L_k, ...]`` per layer stack (one stack per layer
kind, its rows the layers of that kind in layer order: :mod:`mlir_train.model.periods`; one stack
for the released Qwen3 models) with the logical axis
``"layers"``, which the pipeline rule table maps to the ``"stage"`` mesh axis, so the stored
(and checkpointed) weights are the real layers split contiguously over the stages (a stack
whose length P does not divide is stored whole on every stage, :func:`storage_axes`). Inside
the step every chunk runs the same *stage program* (:func:`stage_program`): a list of
segments, each a run of same-kind layers ``[P, R, S, ...]``, with padding slots that are
identity layers (``run_stack(active=...)``: they add nothing to the activations, their router
statistics are masked and their weights get exactly zero gradient). Where a chunk's segments
repeat (two or more periods of the model's layer pattern: Qwen3.5's [D x 3, A], dense / MoE
alternation), the repeats are one *period scan*: one segment per run of the period holding that
run's slots of every period, and the chunk runs one ``lax.scan`` over the periods
(:func:`_period_scans`, planned by :func:`mlir_train.model.periods.plan_periods` as the
unpipelined decoder is), so the stage program does not grow with depth. Layer
``l = (r * P + s) * V + j`` is chunk ``r``, layer ``j`` of stage ``s`` (Megatron's interleaved
assignment); ``--decoder-first/last-pipeline-num-layers`` give the first/last stage their own
count and the middle stages share the rest, as Megatron does. For an even split of one stack
with R = 1 the segment is a pure reshape of the stored split, no data moves. For R > 1, uneven
splits or mixed stacks XLA moves the layer weights a stage runs but does not store, once per
step (the gradients go back the same way). Only ``"stage"`` is manual (``shard_map`` via
:func:`sharding.logical_shard_map` with ``manual=("layers",)``); data, expert and tensor stay
under XLA's automatic partitioning, so TP, SP, DP and ZeRO-1 compose unchanged, and the
expert-parallel ``shard_map`` of the MoE block nests inside (manual over data and expert).

Shape suffixes as in :mod:`mlir_train.train.pipeline.schedule`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mlir_train.config.models import LayerKind
from mlir_train.config.policies import RecomputePolicy
from mlir_train.model.periods import layer_runs, plan_periods
from mlir_train.train.pipeline.schedule import Schedule, to_stages


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """One run of same-kind layers in every chunk's program, ``S`` slots long.

    ``src[s, r, j]`` is the layer at slot ``j`` of chunk ``r`` of stage ``s``, as a row of the
    concatenation (in layer order) of all stacks of this :class:`LayerKind`; ``active`` is
    False for padding slots (identity layers) where that chunk has fewer layers of this run
    than another; ``moe_rows[s, r, j]`` is that layer's index among all MoE layers (the router
    statistics' order; MoE kinds only)."""
    kind: LayerKind
    src: np.ndarray     # [P, R, S] int
    active: np.ndarray  # [P, R, S] bool
    # where slot 0 sits in its chunk, over the chunks that run layers here (for the recompute
    # method's per-chunk layer positions: one value unless stages start this run differently)
    offsets: tuple[int, ...] = (0,)
    moe_rows: np.ndarray | None = None  # [P, R, S] int
    # A segment of a period scan holds its run in ``periods`` periods, period-major (slot
    # ``p * S / periods + j`` is period p's j-th); the consecutive segments of one ``scan`` run
    # as one lax.scan over the periods. ``offsets`` are then period 0's.
    periods: int = 1
    scan: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.kind.moe

    @property
    def slots(self) -> int:
        return self.src.shape[-1]

    @property
    def count(self) -> int:
        """Slots per period (what :func:`periods.plan_periods` lines up)."""
        return self.slots // self.periods


def run_period(kinds: list[LayerKind]) -> int:
    """The smallest ``q`` with ``kinds[i] == kinds[i + q]`` for every ``i``: the period of the
    runs' kinds (2 for dense/MoE alternation and for Qwen3.5's DeltaNet/attention runs)."""
    return next(q for q in range(1, len(kinds) + 1) if all(kinds[i] == kinds[i + q] for i in range(len(kinds) - q)))


def _chunk_runs(chunk: list[int], stack_of: np.ndarray) -> list[list[int]]:
    """A chunk's layers split into runs at the model's run boundaries (``stack_of``: each
    layer's run)."""
    runs: list[list[int]] = []
    for l in chunk:
        if runs and stack_of[l] == stack_of[runs[-1][-1]]:
            runs[-1].append(l)
        else:
            runs.append([l])
    return runs


def stage_program(schedule: Schedule, stack_kinds, remat: RecomputePolicy | str = "none") -> list[Segment]:
    """Every chunk runs the same sequence of segments (SPMD: one program on every stage).

    A chunk's layers split into runs (:func:`periods.layer_runs`: consecutive layers of one
    kind), and the runs line up on the model's run kinds repeated with its period (:func:`run_period`: dense / MoE alternating, or
    Qwen3.5's DeltaNet x 3 / attention x 1), a chunk's first run at its stack's place in the
    period; a segment is as long as the longest run mapped to it. Even splits of a single
    stack give one segment without padding; a period of layers that divides the stage length
    gives one segment per run without padding; a split that breaks the period pads the
    chunks' missing runs (identity slots). Where the segments repeat (two or more periods of
    the pattern in a chunk, padded or not) they become one period scan (:func:`_period_scans`)."""
    runs = layer_runs(stack_kinds)
    kinds = [r.kind for r in runs]
    period = run_period(kinds)
    stack_of = np.concatenate([[k] * r.count for k, r in enumerate(runs)])  # each layer's run
    num_layers = len(stack_of)
    kind_row, moe_row = np.zeros(num_layers, np.int64), np.cumsum([kinds[k].moe for k in stack_of]) - 1
    for r in runs:  # a layer's row in its kind's stack
        kind_row[r.first:r.first + r.count] = np.arange(r.row, r.row + r.count)
    chunks = schedule.chunk_layers(num_layers)
    p, r = schedule.stages, schedule.virtual
    placed: dict[tuple[int, int], list[list[int]]] = {}  # (stage, chunk) -> layers per program segment
    for s in range(p):
        for c in range(r):
            runs = _chunk_runs(chunks[s][c], stack_of)
            placed[s, c] = [[] for _ in range(stack_of[runs[0][0]] % period)] + runs
    length = max(len(v) for v in placed.values())
    segments = []
    for g in range(length):
        runs = {sc: (segs[g] if g < len(segs) else []) for sc, segs in placed.items()}
        slots = max(len(run) for run in runs.values())
        if not slots:
            continue
        src, active, rows_moe = (np.zeros((p, r, slots), t) for t in (np.int64, bool, np.int64))
        for (s, c), run in runs.items():
            n = len(run)
            src[s, c, :n], rows_moe[s, c, :n] = kind_row[run], moe_row[run]
            src[s, c, n:], rows_moe[s, c, n:] = (kind_row[run[-1]], moe_row[run[-1]]) if run else (0, 0)
            active[s, c, :n] = True
        offsets = {sum(len(x) for x in placed[sc][:g]) for sc, run in runs.items() if run}
        kind = kinds[g % period]
        segments.append(Segment(kind=kind, src=src, active=active, offsets=tuple(sorted(offsets)),
                                moe_rows=rows_moe if kind.moe else None))
    return _period_scans(segments, remat)


def _period_scans(segments: list[Segment], remat: RecomputePolicy | str) -> list[Segment]:
    """The chunk program's repeating segments as period scans: :func:`periods.plan_periods`
    (the plan the unpipelined decoder uses) over the segments, each period scan's segments
    merged period-major into one per run of the period (``periods``, ``scan``: its first
    segment's index). Recompute means the same layers as with a scan per segment: periods
    only scan together while every segment's pieces (``remat.pieces(slots, offsets)``) are
    the same; where a policy's groups do not line up with the period (``block`` over part of
    a chunk, ``uniform`` groups that do not divide it) the periods that differ stay one scan
    per segment."""
    policy = RecomputePolicy.of(remat)
    out: list[Segment] = []
    for item in plan_periods(segments, lambda seg: tuple(policy.pieces(seg.count, seg.offsets))):
        if isinstance(item, Segment):
            out.append(item)
            continue
        at, q = segments.index(item.runs[0]), len(item.runs)
        for i, first in enumerate(item.runs):
            parts = [segments[at + p * q + i] for p in range(item.reps)]
            cat = lambda name: np.concatenate([getattr(x, name) for x in parts], axis=-1)
            out.append(dataclasses.replace(first, src=cat("src"), active=cat("active"), periods=item.reps, scan=at,
                                           moe_rows=cat("moe_rows") if first.is_moe else None))
    return out


def _canonical(seg: Segment, schedule: Schedule) -> bool:
    """Whether the segment is the plain ``to_stages`` view of its kind's rows (the caller checks
    that it holds all of them: a period scan's segment can be the view of a kind's first rows)."""
    p, r, v = seg.src.shape
    return bool(seg.active.all()) and np.array_equal(
        seg.src, np.arange(p * r * v).reshape(r, p, v).swapaxes(0, 1))


def to_segments(stacks: list[Any], stack_kinds, program: list[Segment], schedule: Schedule) -> list[Any]:
    """The stacks' ``[L_k, ...]`` weights -> each segment's ``[P, R, S, ...]`` (linear)."""
    by_kind = {}
    for kind in dict.fromkeys(s.kind for s in stack_kinds):
        trees = [t for t, s in zip(stacks, stack_kinds) if s.kind == kind]
        by_kind[kind] = trees[0] if len(trees) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *trees)
    out = []
    for seg in program:
        tree = by_kind[seg.kind]
        if jax.tree.leaves(tree)[0].shape[0] == seg.src.size and _canonical(seg, schedule):
            out.append(jax.tree.map(lambda x: to_stages(x, schedule), tree))
        else:  # uneven or mixed: XLA moves the layers a stage runs but does not store
            flat = seg.src.reshape(-1)
            out.append(jax.tree.map(lambda x: jnp.take(x, flat, axis=0).reshape(*seg.src.shape, *x.shape[1:]), tree))
    return out


def layer_order(program: list[Segment], per_moe_segment: list[jax.Array], num_moe: int) -> jax.Array:
    """Per-(stage, chunk, slot) MoE sums ``[P, R, S, ...]`` -> ``[L_moe, ...]`` in layer order."""
    out = None
    for seg, x in zip([s for s in program if s.is_moe], per_moe_segment):
        real = x.reshape(-1, *x.shape[3:])[np.flatnonzero(seg.active.reshape(-1))]
        part = jnp.zeros((num_moe,) + x.shape[3:], x.dtype).at[seg.moe_rows[seg.active]].add(real)
        out = part if out is None else out + part
    return out


def storage_axes(logical: dict[str, Any], stack_kinds, stages: int) -> dict[str, Any]:
    """The logical axes to store the weights with: a layer stack whose length the stages do not
    divide (a short run of a mixed dense/MoE model, or an uneven split's odd total) keeps its
    ``"layers"`` axis unsplit, i.e. every stage stores it whole and computes the layers it runs."""
    layers = dict(logical["layers"])
    for k, stack in enumerate(stack_kinds):
        if stack.count % stages:
            layers[k] = jax.tree.map(lambda names: tuple(None if a == "layers" else a for a in names), layers[k],
                                     is_leaf=lambda x: isinstance(x, tuple))
    return {**logical, "layers": layers}
