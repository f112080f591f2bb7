"""Which schedule a run uses (:func:`make_schedule`, from Megatron's flags) and what it costs.

Shape suffixes (the whole package): M micro-batches, B rows per micro-batch, T sequence, D
hidden, P pipeline stages, R virtual stages (layer chunks) per stage, V layers per chunk
(L = P * R * V), S slots of a stage-program segment, E experts.

The schedules run inside the one compiled train step. All are one ``lax.scan`` over ticks
inside a ``shard_map`` over the stages; an *item* is one chunk of one micro-batch, and an
activation moves to the next stage with one ``ppermute`` per tick (stage P-1 -> 0 closes the
ring when R > 1). Every stage builds the attention mask and RoPE tables of the micro-batch it
works on from that micro-batch's ids and positions.

* **1F1B**, plain and interleaved (:mod:`~mlir_train.train.pipeline.one_f_one_b`): one
  forward (under ``jax.vjp``, its residuals kept) and one backward (that pullback) per tick,
  the gradients accumulated in the scan; three scans over one carry, the warm-up ticks
  running forwards only and the cool-down ticks backwards only.
* **GPipe** and **circular** (:mod:`~mlir_train.train.pipeline.gpipe`): forwards only, the
  backward by autodiff through the scan. Evaluation runs this forward for every schedule.

The layers each chunk runs are the stage program (:mod:`~mlir_train.train.pipeline.program`);
what every schedule does on a stage is :mod:`~mlir_train.train.pipeline.stage`.

The embedding is looked up on every stage each tick and used on stage 0 (a gather of ``B*T``
rows: no matmul; under 1F1B its gradient is scattered straight into its accumulator). Under
1F1B final norm, LM head and cross-entropy (and their gradient) run on every stage in the
steady ticks (a ``lax.cond`` would all-reduce the head's data-partial weight gradient every
tick), under GPipe and circular each tick; they count only on the last chunk of the last stage
(their loss mask is zeroed elsewhere): in lockstep (SPMD) this costs
no wall time over doing it on the last stage alone (that stage is on every tick's critical
path), only idle-rank FLOPs, ``2*B*T*D*V`` per tick. Either way the last stage adds the head
to its ``P``-th of the layers' work, the imbalance Megatron has too (hence its
``--decoder-last-pipeline-num-layers``). Router statistics are accumulated per (chunk, slot)
over valid items and come back in layer order, so aux and z losses are the sums over all
stages, as without the pipeline.

Cost per schedule, in ticks of one chunk's work (F forward, B = 2F backward):

==================  ======================  ==============================  ===============================
schedule            ticks (work per tick)   idle fraction of the ticks      activations per device
==================  ======================  ==============================  ===============================
GPipe (R = 1)       M + P - 1 fwd, as many  (P - 1) / (M + P - 1)           M micro-batches x L/P layers
                    bwd (F, then B)                                         (their saved residuals)
circular (R)        M*R + P - 1 each way    (P - 1) / (M*R + P - 1)         the same, plus an M-slot ring
                                                                            buffer [B, T, D]
1F1B (R = 1)        M + P - 1 fwd, as many  (P - 1) / (M + P - 1)           2P - 1 micro-batches' stage
                    bwd (P - 1 ticks F,                                     residuals (2P - 2 slots + the
                    M ticks F + B, P - 1 B)                                 one in its backward)
interleaved 1F1B    M*R + P - 1 each way    (P - 1) / (M*R + P - 1)         2RP - 1 chunks' residuals
(R, M % P = 0)      (RP - 1 ticks F, then                                   (2RP - 2 slots + one)
                    F + B, RP - 1 ticks B)
==================  ======================  ==============================  ===============================

The 1F1B tick is lockstep: the forward and backward waves each advance one stage per tick, so
a micro-batch's round trip takes about 2P ticks (Megatron's asynchronous ranks: P), hence the
~2P items whose residuals stage 0 keeps where Megatron holds P micro-batches' activations
(the last stage keeps none: its last chunk's backward runs in the forward's tick). The backward
applies the pullback its item's forward saved, so a step does Megatron's passes: 3 without
recompute, 4 with ``--recompute-granularity full`` (whose checkpointed layers keep only their
inputs, and are recomputed once, in the backward), and activation memory does not grow with M.
Measured by the compiled program (``tests/train/test_pipeline.py``: matmul FLOPs of the step
against one device, temporaries flat in M for 1F1B, linear in M for GPipe; ``python -m
mlir_train.plan`` on the seed's TP2 PP2 EP2 layout). Bubble halves compute on zeros and are
masked out (1F1B's warm-up and cool-down ticks run one half, so a stage computes
``M*R + P - 1`` of each, not ``M*R + R*P + P - 2``); ``benchmarks/pipeline.py`` measures them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sharding.layout import LayoutError

SCHEDULES = ("1f1b", "gpipe", "circular")  # --pipeline-schedule


@dataclasses.dataclass(frozen=True)
class Schedule:
    stages: int        # P, --pipeline-model-parallel-size
    virtual: int = 1   # R chunks per stage (--num-layers-per-virtual-pipeline-stage)
    kind: str = "1f1b"  # 1f1b (interleaved when R > 1) | gpipe (R = 1) | circular (R > 1)
    # layers per stage when they differ (--decoder-first/last-pipeline-num-layers), else None
    stage_layers: tuple[int, ...] | None = None

    def items_in_flight(self) -> int | None:
        """Items (one chunk of one micro-batch) whose saved residuals a stage holds at once
        under 1F1B: its ``2RP - 2`` slots and the one its backward is using (None: GPipe /
        circular keep every micro-batch's)."""
        return 2 * self.virtual * self.stages - 1 if self.kind == "1f1b" else None

    def step_factor(self, num_micro: int) -> float:
        """Step time over the no-bubble ideal of the same work: the idle halves (the work per
        item is Megatron's under every schedule: no extra forward). 1F1B runs forwards alone in
        its warm-up ticks and backwards alone in its cool-down: ``M*R + P - 1`` of each, as GPipe."""
        m, p, r = num_micro, self.stages, self.virtual
        return (m * r + p - 1) / (m * r)

    def chunk_layers(self, num_layers: int) -> list[list[list[int]]]:
        """``[stage][chunk]`` -> the decoder layers it runs, in order: Megatron's assignment
        (layer ``(r * P + s) * V + j`` is chunk ``r``, layer ``j`` of stage ``s``)."""
        p, r = self.stages, self.virtual
        if self.stage_layers is not None:
            starts = np.cumsum((0,) + self.stage_layers)
            return [[list(range(starts[s], starts[s + 1]))] for s in range(p)]
        v = num_layers // (p * r)
        return [[list(range((c * p + s) * v, (c * p + s + 1) * v)) for c in range(r)] for s in range(p)]


def _stage_layer_counts(num_layers: int, p: int, first: int | None, last: int | None) -> tuple[int, ...] | None:
    """Megatron's uneven split: the first/last stage hold the given layers, the middle stages
    share the rest equally. None when every stage holds ``num_layers / p``."""
    if first is None and last is None:
        if num_layers % p:
            raise LayoutError(
                f"decoder layers (num_layers={num_layers}) are not divisible by --pipeline-model-parallel-size ({p}); "
                "give the first/last stage's share with --decoder-first-pipeline-num-layers / "
                "--decoder-last-pipeline-num-layers")
        return None
    rest, middle = num_layers, p
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if n is not None:
            if not 0 < n < num_layers:
                raise LayoutError(f"{flag} {n}: must be between 1 and num_layers - 1 = {num_layers - 1}")
            rest, middle = rest - n, middle - 1
    if middle == 0 and rest != 0 or middle and (rest <= 0 or rest % middle):
        given = " + ".join(f"{f} {n}" for f, n in (("--decoder-first-pipeline-num-layers", first),
                                                  ("--decoder-last-pipeline-num-layers", last)) if n is not None)
        raise LayoutError(
            f"{given}: the other {middle} of the {p} stages cannot share the remaining {rest} of "
            f"{num_layers} layers equally")
    counts = [rest // middle if middle else 0] * p
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return None if len(set(counts)) == 1 else tuple(counts)


def make_schedule(
    num_layers: int,
    stages: int,
    *,
    kind: str = "1f1b",
    layers_per_virtual_stage: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    num_micro_batches: int | None = None,
) -> Schedule:
    """The schedule Megatron's flags ask for, or a :class:`LayoutError` naming the flag."""
    p = stages
    if kind not in SCHEDULES:
        raise LayoutError(f"--pipeline-schedule {kind}: choose one of {', '.join(SCHEDULES)}")
    counts = _stage_layer_counts(num_layers, p, first_stage_layers, last_stage_layers)
    virtual = 1
    if layers_per_virtual_stage is not None:
        if counts is not None:
            raise LayoutError(
                f"--num-layers-per-virtual-pipeline-stage with uneven stages (--decoder-first/last-pipeline-"
                f"num-layers: {counts}) is not implemented; drop one of them")
        per_stage = num_layers // p
        if layers_per_virtual_stage < 1 or per_stage % layers_per_virtual_stage:
            raise LayoutError(
                f"--num-layers-per-virtual-pipeline-stage ({layers_per_virtual_stage}) must divide the "
                f"{per_stage} layers of each of the {p} pipeline stages"
            )
        virtual = per_stage // layers_per_virtual_stage
    if kind == "gpipe" and virtual > 1:
        raise LayoutError(
            "--pipeline-schedule gpipe runs one chunk per stage; with --num-layers-per-virtual-pipeline-stage "
            "use --pipeline-schedule circular or 1f1b (interleaved)")
    if kind == "circular" and virtual == 1:
        raise LayoutError(
            "--pipeline-schedule circular needs --num-layers-per-virtual-pipeline-stage (chunks per stage)")
    if virtual > 1 and num_micro_batches is not None:
        if num_micro_batches < p:
            raise LayoutError(
                f"the interleaved/circular schedule (--num-layers-per-virtual-pipeline-stage) needs at least as "
                f"many micro-batches as stages: {num_micro_batches} < --pipeline-model-parallel-size ({p})")
        if kind == "1f1b" and num_micro_batches % p:
            raise LayoutError(
                f"interleaved 1F1B (--num-layers-per-virtual-pipeline-stage) runs micro-batches in groups of "
                f"--pipeline-model-parallel-size ({p}), as Megatron's: {num_micro_batches} micro-batches do not "
                "divide; change --global-batch-size or use --pipeline-schedule circular")
    return Schedule(stages=p, virtual=virtual, kind=kind, stage_layers=counts)


def to_stages(x_L: jax.Array, schedule: Schedule) -> jax.Array:
    """``[L, ...]`` -> ``[P, R, V, ...]``: layer ``(r * P + s) * V + j`` at ``[s, r, j]``."""
    p, r = schedule.stages, schedule.virtual
    x = x_L.reshape(r, p, x_L.shape[0] // (p * r), *x_L.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def from_stages(x_PRV: jax.Array) -> jax.Array:
    """Inverse of :func:`to_stages`."""
    x = jnp.swapaxes(x_PRV, 0, 1)
    return x.reshape(-1, *x.shape[3:])
