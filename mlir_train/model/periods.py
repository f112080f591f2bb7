"""How the decoder's layers are stored and scanned: one stack per layer kind, and the plan that
runs them as one ``lax.scan`` over the layer pattern's periods.

A model stores one :class:`Stack` per :class:`~mlir_train.config.models.LayerKind`: all the
layers of that kind, in layer order (Qwen3.5's 3:1 DeltaNet/attention pattern of 40 layers is two
stacks, 30 and 10 layers; the released Qwen3 models one). The layers run in layer order as
*runs* of consecutive equal kinds (:func:`layer_runs`). Where the runs repeat (the pattern's
period: ``[D x 3, A x 1]``), :func:`decoder_plan` makes them one :class:`PeriodScan`: a
``lax.scan`` over the periods whose body runs one period's runs, so compile time does not grow
with depth. A prefix or remainder that breaks the period (Qwen3's ``mlp_only_layers``, a layer
count that is not a whole number of periods) runs as separate runs, one scan each.

Recompute is compile structure, not semantics: every run keeps the checkpoints its policy gives
it at its place in the model (:meth:`~mlir_train.config.policies.RecomputePolicy.pieces` with the
run's first layer as offset), exactly as when each run was its own scan. Consecutive periods
whose runs get the same pieces share one period scan; where a policy's grouping differs from
one period to the next (``block`` over its first N layers, ``uniform`` groups that do not divide
the period) the periods split into several period scans, or, for a single period, into
per-run scans. Pure planning (no JAX): the model's forward (:func:`transformer.run_layers`)
and the pipeline's stage program (:mod:`mlir_train.train.pipeline.program`: a chunk's segments,
:func:`plan_periods`) use it.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from mlir_train.config.models import LayerKind, ModelConfig
from mlir_train.config.policies import RecomputePolicy


class Stack(NamedTuple):
    """All decoder layers of one :class:`LayerKind`: their global indices, in layer order (row
    ``i`` of the stack's parameters is layer ``layers[i]``)."""

    kind: LayerKind
    layers: tuple[int, ...]

    @property
    def moe(self) -> bool:
        return self.kind.moe

    @property
    def count(self) -> int:
        return len(self.layers)

    @property
    def first(self) -> int:
        return self.layers[0]


class Run(NamedTuple):
    """Consecutive layers of one kind: ``count`` layers from layer ``first``, rows ``row ..
    row + count - 1`` of stack ``stack`` (the index of its kind's :class:`Stack`)."""

    kind: LayerKind
    first: int
    count: int
    stack: int
    row: int


class PeriodScan(NamedTuple):
    """``reps`` consecutive periods of the same runs: ``runs`` are the first period's, period
    ``p``'s run ``i`` is ``runs[i]`` moved by ``p * layers`` layers and ``p * per_stack[s]`` rows
    of its stack ``s``."""

    runs: tuple[Run, ...]
    reps: int

    @property
    def layers(self) -> int:
        return sum(r.count for r in self.runs)

    def per_stack(self) -> dict[int, int]:
        """Rows each stack contributes to one period."""
        out: dict[int, int] = {}
        for r in self.runs:
            out[r.stack] = out.get(r.stack, 0) + r.count
        return out

    def first_row(self) -> dict[int, int]:
        """Each stack's first row in this scan."""
        out: dict[int, int] = {}
        for r in self.runs:
            out.setdefault(r.stack, r.row)
        return out


def layer_stacks(cfg: ModelConfig) -> tuple[Stack, ...]:
    """The stacks a model of ``cfg`` is built of: one per layer kind, in order of first use."""
    by_kind: dict[LayerKind, list[int]] = {}
    for l, kind in enumerate(cfg.layer_kinds()):
        by_kind.setdefault(kind, []).append(l)
    return tuple(Stack(kind, tuple(layers)) for kind, layers in by_kind.items())


def layer_runs(stacks) -> list[Run]:
    """The runs of consecutive equal kinds, in layer order."""
    where = {l: (k, i) for k, s in enumerate(stacks) for i, l in enumerate(s.layers)}
    runs: list[Run] = []
    for _, group in itertools.groupby(range(len(where)), key=lambda l: where[l][0]):
        group = list(group)
        k, row = where[group[0]]
        runs.append(Run(stacks[k].kind, group[0], len(group), k, row))
    return runs


def period_of(runs: list[Run]) -> tuple[int, int, int] | None:
    """``(start, q, reps)``: runs ``start ..`` repeat with a period of ``q`` runs ``reps >= 2``
    times, covering the most layers (then the shortest period); None if nothing repeats."""
    best, best_cover = None, 0
    key = [(r.kind, r.count) for r in runs]
    for q in range(1, len(runs) // 2 + 1):
        for start in range(0, len(runs) - 2 * q + 1):
            reps = 1
            nxt = lambda i: key[start + i * q:start + (i + 1) * q]
            while start + (reps + 1) * q <= len(runs) and nxt(reps) == nxt(0):
                reps += 1
            cover = reps * sum(c for _, c in key[start:start + q])
            if reps >= 2 and cover > best_cover:
                best, best_cover = (start, q, reps), cover
    return best


def decoder_plan(stacks, remat: RecomputePolicy | str = "none") -> list[Run | PeriodScan]:
    """The model's layers as the scans that run them, in order: single runs and period scans
    (the module docstring says when which)."""
    policy = RecomputePolicy.of(remat)
    return plan_periods(layer_runs(stacks), lambda r: tuple(policy.pieces(r.count, (r.first,))))


def plan_periods(runs: list, pieces) -> list:
    """``runs`` (anything with ``kind`` and ``count``, in order) as single runs and
    period scans (:class:`PeriodScan`) over the repeating part (:func:`period_of`), consecutive periods
    grouped while every run's recompute ``pieces(run)`` is the same (a lone period stays single
    runs). :func:`decoder_plan` plans the model's layers with it, the pipeline's stage program
    (:func:`mlir_train.train.pipeline.program.stage_program`) a chunk's segments."""
    found = period_of(runs)
    if found is None:
        return list(runs)
    start, q, reps = found
    periods = [tuple(runs[start + p * q:start + (p + 1) * q]) for p in range(reps)]
    keys = [tuple(pieces(r) for r in period) for period in periods]
    plan: list = list(runs[:start])
    for _, group in itertools.groupby(range(reps), key=lambda p: keys[p]):
        group = list(group)
        if len(group) == 1:
            plan.extend(periods[group[0]])
        else:
            plan.append(PeriodScan(periods[group[0]], len(group)))
    return plan + list(runs[start + reps * q:])
