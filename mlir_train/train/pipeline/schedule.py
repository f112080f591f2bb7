"""Pipeline parallelism inside the one compiled train step: 1F1B (plain and interleaved),
GPipe and circular schedules, over even, uneven and mixed dense/MoE stages.

Shape suffixes: M micro-batches, B rows per micro-batch, T sequence, D hidden, P pipeline
stages, R virtual stages (layer chunks) per stage, V layers per chunk (L = P * R * V), S slots
of a stage-program segment, E experts.

Layout
------
Every decoder-layer parameter is stacked ``[L_k, ...]`` per layer stack (one stack for the
released Qwen3 models; consecutive dense/MoE runs otherwise) with the logical axis
``"layers"``, which the pipeline rule table maps to the ``"stage"`` mesh axis, so the stored
(and checkpointed) weights are the real layers split contiguously over the stages (a stack
whose length P does not divide is stored whole on every stage, :func:`storage_axes`). Inside
the step every chunk runs the same *stage program* (:func:`stage_program`): a list of
segments, each a run of same-kind layers ``[P, R, S, ...]``, with padding slots that are
identity layers (``run_stack(active=...)``: they add nothing to the activations, their router
statistics are masked and their weights get exactly zero gradient). Layer
``l = (r * P + s) * V + j`` is chunk ``r``, layer ``j`` of stage ``s`` (Megatron's interleaved
assignment); ``--decoder-first/last-pipeline-num-layers`` give the first/last stage their own
count and the middle stages share the rest, as Megatron does. For an even split of one stack
with R = 1 the segment is a pure reshape of the stored split, no data moves. For R > 1, uneven
splits or mixed stacks XLA moves the layer weights a stage runs but does not store, once per
step (the gradients go back the same way). Only ``"stage"`` is manual (``shard_map`` via
:func:`sharding.logical_shard_map` with ``manual=("layers",)``); data, expert and tensor stay
under XLA's automatic partitioning, so TP, SP, DP and ZeRO-1 compose unchanged, and the
expert-parallel ``shard_map`` of the MoE block nests inside (manual over data and expert).

Schedules
---------
All are one ``lax.scan`` over ticks inside that ``shard_map``; an *item* is one chunk of one
micro-batch, and an activation moves to the next stage with one ``ppermute`` per tick (stage
P-1 -> 0 closes the ring when R > 1). Every stage builds the attention mask and RoPE tables of
the micro-batch it works on from that micro-batch's ids and positions.

* **1F1B** (``--pipeline-schedule 1f1b``, the default; interleaved with
  ``--num-layers-per-virtual-pipeline-stage``), :func:`pipeline_value_and_grad`: at tick ``t``
  stage ``s`` runs the forward of item ``t - s`` and the backward of item
  ``t - (R*P - 1) - (P - 1 - s)``, items taken in Megatron's order (groups of P micro-batches,
  chunk by chunk forward and in reverse backward, so a micro-batch coming round the ring is
  needed the very next tick: no ring buffer). The forward keeps only the item's input in a
  ``2*R*P - 1``-slot buffer; the backward recomputes the chunk from it under ``jax.vjp`` (with
  the layers' own ``--recompute-granularity`` policy inside), starts from the cotangent the
  next stage sent the tick before (the head's, on the last chunk of the last stage), adds the
  weight gradients to float32 accumulators in the scan carry and sends the input cotangent
  back with a second ``ppermute``. The step takes these gradients directly
  (``Trainer._pipeline_value_and_grad``), not autodiff through the scan.
* **GPipe** (R = 1) and **circular** (R > 1, ``--pipeline-schedule gpipe|circular``),
  :func:`pipeline_loss`: stage ``s`` runs item ``w = t - s``, ``w = r * M + m`` (all
  micro-batches through chunk 0, then chunk 1, ...); for R > 1 stage 0 parks what comes round
  the ring in an M-slot buffer until its turn (needs ``M >= P``). Autodiff through the scan
  gives the backward (the reverse pipeline, with the transposed permutes), keeping every
  tick's residuals. Evaluation runs this forward for every schedule.

The embedding is looked up on every stage each tick and used on stage 0 (a gather of ``B*T``
rows: no matmul; under 1F1B its gradient is scattered straight into its accumulator); final
norm, LM head and cross-entropy run each tick on every stage and count only on the last stage
for the final chunk (their loss mask is zeroed elsewhere). All stages execute them in
lockstep (SPMD), which costs no wall time over doing it on the last stage alone (that stage is
on every tick's critical path), only idle-rank FLOPs: the head adds ``2*B*T*D*V`` per tick to
the ``P``-th of the layers' work, the imbalance Megatron has too (hence its
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
1F1B (R = 1)        M + 2P - 2 (2F + B)     (2P - 2) / (M + 2P - 2)         2P - 1 stage inputs [B, T, D]
                                                                            + one micro-batch's stage
interleaved 1F1B    M*R + R*P + P - 2       (R*P + P - 2) /                 2RP - 1 chunk inputs + one
(R, M % P = 0)      (2F + B of a chunk)     (M*R + R*P + P - 2)             micro-batch's chunk
==================  ======================  ==============================  ===============================

The 1F1B tick is lockstep: the forward and backward waves each advance one stage per tick, so
a micro-batch's round trip takes about 2P ticks (Megatron's asynchronous ranks: P), hence the
larger idle fraction and the ~2P saved inputs where Megatron holds P micro-batches' full
activations. Its backward recomputes the chunk's forward from the saved input: one more
forward per item (a step does 4 passes of work for Megatron's 3 without recompute, 5 for its 4
with ``--recompute-granularity full``) bought for activation memory that no longer grows with
M. Measured by the compiled program (``tests/train/test_pipeline.py``; ``python -m mlir_train.plan``
on the seed's TP2 PP2 EP2 layout, XLA:CPU temp): flat in M for 1F1B, linear in M for GPipe.
Bubble ticks compute on zeros and are masked out; ``benchmarks/pipeline.py`` measures them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlir_train.config import policies
from mlir_train.model import losses
from mlir_train.config.policies import RecomputePolicy
from mlir_train.model.transformer import run_stack
from sharding import logical_shard_map, mesh_axes_of
from sharding.layout import LayoutError

TRAVELLING = ("segment_ids", "positions", "labels", "loss_mask", "loss_weight")
SCHEDULES = ("1f1b", "gpipe", "circular")  # --pipeline-schedule


@dataclasses.dataclass(frozen=True)
class Schedule:
    stages: int        # P, --pipeline-model-parallel-size
    virtual: int = 1   # R chunks per stage (--num-layers-per-virtual-pipeline-stage)
    kind: str = "1f1b"  # 1f1b (interleaved when R > 1) | gpipe (R = 1) | circular (R > 1)
    # layers per stage when they differ (--decoder-first/last-pipeline-num-layers), else None
    stage_layers: tuple[int, ...] | None = None

    def saved_inputs(self) -> int | None:
        """Chunk inputs a stage keeps for its backward under 1F1B (None: GPipe / circular keep
        every micro-batch's activations)."""
        return 2 * self.virtual * self.stages - 1 if self.kind == "1f1b" else None

    def step_factor(self, num_micro: int, recompute: str = "none") -> float:
        """Step time over the no-bubble ideal of the same work: the idle ticks and, for 1F1B,
        the chunk forward its backward recomputes (one more forward: 4/3 of forward+backward,
        or 5/4 of a fully recomputed step's 4 passes)."""
        m, p, r = num_micro, self.stages, self.virtual
        if self.kind != "1f1b":
            return (m * r + p - 1) / (m * r)
        return (m * r + r * p + p - 2) / (m * r) * (5 / 4 if recompute == "full" else 4 / 3)

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


# ----- the stage program: which layers a chunk runs, over stacks of mixed kinds --------------


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """One run of same-kind layers in every chunk's program, ``S`` slots long.

    ``src[s, r, j]`` is the layer at slot ``j`` of chunk ``r`` of stage ``s``, as a row of the
    concatenation (in layer order) of all stacks of this kind; ``active`` is False for padding
    slots (identity layers) where that chunk has fewer layers of this run than another."""
    is_moe: bool
    src: np.ndarray     # [P, R, S] int
    active: np.ndarray  # [P, R, S] bool
    # where slot 0 sits in its chunk, over the chunks that run layers here (for the recompute
    # method's per-chunk layer positions: one value unless stages start this run differently)
    offsets: tuple[int, ...] = (0,)

    @property
    def slots(self) -> int:
        return self.src.shape[-1]


def stage_program(schedule: Schedule, stack_kinds: tuple[tuple[int, int, bool], ...]) -> list[Segment]:
    """Every chunk runs the same sequence of segments (SPMD: one program on every stage).

    A chunk's layers split into runs at stack boundaries (stacks alternate dense / MoE), and
    the runs line up on an alternating kind sequence starting with layer 0's kind; a segment
    is as long as the longest run mapped to it. Even splits of a single stack give one segment
    without padding; a period of dense/MoE layers that divides the stage length gives one
    segment per run without padding."""
    num_layers = sum(n for _, n, _ in stack_kinds)
    stack_of = np.concatenate([[k] * n for k, (_, n, _) in enumerate(stack_kinds)])
    kind_row = np.zeros(num_layers, np.int64)
    counter = {False: 0, True: 0}
    for l in range(num_layers):
        moe = stack_kinds[stack_of[l]][2]
        kind_row[l], counter[moe] = counter[moe], counter[moe] + 1
    first_kind = stack_kinds[0][2]
    chunks = schedule.chunk_layers(num_layers)
    p, r = schedule.stages, schedule.virtual
    placed: dict[tuple[int, int], list[list[int]]] = {}  # (stage, chunk) -> rows per program segment
    length = 0
    for s in range(p):
        for c in range(r):
            runs: list[list[int]] = []
            for l in chunks[s][c]:
                if runs and stack_of[l] == stack_of[runs[-1][-1]]:
                    runs[-1].append(l)
                else:
                    runs.append([l])
            offset = 0 if stack_kinds[stack_of[runs[0][0]]][2] == first_kind else 1
            placed[s, c] = [[] for _ in range(offset)] + runs
            length = max(length, len(placed[s, c]))
    segments = []
    for g in range(length):
        slots = max(len(placed[s, c][g]) if g < len(placed[s, c]) else 0 for s in range(p) for c in range(r))
        if not slots:
            continue
        is_moe = first_kind if g % 2 == 0 else not first_kind
        src = np.zeros((p, r, slots), np.int64)
        active = np.zeros((p, r, slots), bool)
        offsets = set()
        for (s, c), segs in placed.items():
            run = segs[g] if g < len(segs) else []
            rows = [int(kind_row[l]) for l in run]
            src[s, c, :len(rows)] = rows
            src[s, c, len(rows):] = rows[-1] if rows else 0
            active[s, c, :len(rows)] = True
            if run:
                offsets.add(sum(len(x) for x in segs[:g]))
        segments.append(Segment(is_moe=is_moe, src=src, active=active, offsets=tuple(sorted(offsets))))
    return segments


def _canonical(seg: Segment, schedule: Schedule) -> bool:
    """Whether the segment is the plain ``to_stages`` view of its (single) stack."""
    p, r, v = seg.src.shape
    return bool(seg.active.all()) and np.array_equal(
        seg.src, np.arange(p * r * v).reshape(r, p, v).swapaxes(0, 1))


def _to_segments(stacks: list[Any], stack_kinds, program: list[Segment], schedule: Schedule) -> list[Any]:
    """The stacks' ``[L_k, ...]`` weights -> each segment's ``[P, R, S, ...]`` (linear)."""
    by_kind = {}
    for moe in (False, True):
        trees = [t for t, (_, _, m) in zip(stacks, stack_kinds) if m == moe]
        if trees:
            by_kind[moe] = trees[0] if len(trees) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *trees)
    out = []
    for seg in program:
        tree = by_kind[seg.is_moe]
        if _canonical(seg, schedule):
            out.append(jax.tree.map(lambda x: to_stages(x, schedule), tree))
        else:  # uneven or mixed: XLA moves the layers a stage runs but does not store
            flat = seg.src.reshape(-1)
            out.append(jax.tree.map(lambda x: jnp.take(x, flat, axis=0).reshape(*seg.src.shape, *x.shape[1:]), tree))
    return out


def _layer_order(program: list[Segment], per_moe_segment: list[jax.Array], num_moe: int) -> jax.Array:
    """Per-(stage, chunk, slot) MoE sums ``[P, R, S, ...]`` -> ``[L_moe, ...]`` in layer order."""
    out = None
    for seg, x in zip([s for s in program if s.is_moe], per_moe_segment):
        real = x.reshape(-1, *x.shape[3:])[np.flatnonzero(seg.active.reshape(-1))]
        part = jnp.zeros((num_moe,) + x.shape[3:], x.dtype).at[seg.src[seg.active]].add(real)
        out = part if out is None else out + part
    return out


def _chunk_forward(stack_graphs, program, states_r, active_r, x, context, remat):
    """One chunk: its segments in order; the MoE segments' router stats, one dict each."""
    stats = []
    for seg, state, on in zip(program, states_r, active_r):
        stack = nnx.merge(stack_graphs[seg.is_moe], state)
        x, st = run_stack(stack, x, context, remat, None if seg.active.all() else on, offsets=seg.offsets)
        if seg.is_moe:
            stats.append(st)
    return x, stats


def _default_balancing(aux_loss_coeff: float, z_loss_coeff: float) -> policies.LoadBalancing:
    return policies.LoadBalancing(coeffs=(("aux_loss", aux_loss_coeff),) if aux_loss_coeff else (),
                                z_loss_coeff=z_loss_coeff)


def _router_terms(program, stats, active_r, keep, balancing, top_k, m, counts=None, micro_index=None):
    """This chunk's router-loss objective (:func:`losses.router_losses`, over ``m``
    micro-batches), its per-slot sums for the logs and, under ``global_aux_loss``, the running
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
                                                 micro_index)
        objective = objective + obj / m
        sums.append(dict(layers=per_layer, tokens_per_expert=st["tokens_per_expert"],
                         dropped_tokens=jnp.sum(st["dropped_tokens"])))
        new_counts.append(c)
    return objective, sums, (new_counts if counts is not None else None)


def _router_names(balancing) -> list[str]:
    return ["load_balancing_loss", "z_loss"] + [
        policies.TRACKER_NAMES[k] for k in ("seq_aux_loss", "global_aux_loss") if balancing.coeff(k) > 0]


def _zero_acc(program, r, setup, balancing, scalars):
    acc = {k: jnp.zeros((), jnp.float32) for k in scalars}
    if setup.num_moe:
        moe = [seg for seg in program if seg.is_moe]
        acc["moe"] = [dict(layers={k: jnp.zeros((r, seg.slots)) for k in _router_names(balancing)},
                           tokens_per_expert=jnp.zeros((r, seg.slots, setup.num_experts)),
                           dropped_tokens=jnp.zeros(())) for seg in moe]
        if balancing.uses_global:
            acc["counts"] = [jnp.zeros((r, seg.slots, setup.num_experts)) for seg in moe]
    return acc


def _add_sums(acc, sums, chunk):
    return [dict(layers={k: a["layers"][k].at[chunk].add(s["layers"][k]) for k in a["layers"]},
                 tokens_per_expert=a["tokens_per_expert"].at[chunk].add(s["tokens_per_expert"]),
                 dropped_tokens=a["dropped_tokens"] + s["dropped_tokens"]) for a, s in zip(acc, sums)]


def _aux_out(acc, program, m, num_moe):
    """The step's ``aux`` from the per-stage accumulators (leading stage axis)."""
    aux = {k: jnp.sum(acc[k]) for k in ("ce_sum", "loss_tokens", "lm_objective")}
    moe = acc.get("moe")
    if moe:
        order = lambda get: _layer_order(program, [get(s) for s in moe], num_moe)
        # Per-layer sums over micro-batches, back in layer order; /M gives the per-micro mean the
        # non-pipelined step logs, and a leading axis of 1 stands for its micro-batch axis.
        aux.update(router_layers={k: (order(lambda s: s["layers"][k]) / m)[None] for k in moe[0]["layers"]},
                   tokens_per_expert=order(lambda s: s["tokens_per_expert"])[None],
                   dropped_tokens=sum(jnp.sum(s["dropped_tokens"]) for s in moe))
    return aux


@dataclasses.dataclass(frozen=True)
class _Setup:
    program: list[Segment]
    stack_kinds: tuple
    stack_graphs: dict
    placeholder: Any
    num_moe: int
    num_experts: int


def _setup(graphdef, params, schedule):
    stages_axes, p = mesh_axes_of("layers")
    if p != schedule.stages:
        raise ValueError(f"'layers' is split over {p} devices but the schedule has {schedule.stages} stages")
    model = nnx.merge(graphdef, params)
    kinds = model.stack_kinds
    program = stage_program(schedule, kinds)
    graphs = {}
    for k, (_, _, moe) in enumerate(kinds):
        graphs.setdefault(moe, nnx.split(model.layers[k])[0])
    moe_layers = [k for k, (_, _, moe) in enumerate(kinds) if moe]
    num_experts = model.layers[moe_layers[0]].mlp.num_experts if moe_layers else 0
    placeholder = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params["layers"])
    return stages_axes, _Setup(program, kinds, graphs, placeholder,
                               sum(n for _, n, moe in kinds if moe), num_experts)


def _merge(graphdef, setup, rest):
    """The model around ``rest`` (embedding, final norm, head); its layer stacks are shapes only."""
    return nnx.merge(graphdef, {**rest, "layers": setup.placeholder})


def _prepare(graphdef, params, schedule, balancing, aux_loss_coeff, z_loss_coeff):
    """What every schedule starts from: the stage axes and stage program, the router losses'
    settings, the layer stacks and the rest of the weights, the stacks as the program's
    segments and each segment's active-slot mask."""
    stage_axes, setup = _setup(graphdef, params, schedule)
    if balancing is None:
        balancing = _default_balancing(aux_loss_coeff, z_loss_coeff)
    stacks, rest = _split_params(params, setup)
    segs = _to_segments(stacks, setup.stack_kinds, setup.program, schedule)
    active = [jnp.asarray(seg.active) for seg in setup.program]
    return stage_axes, setup, balancing, stacks, rest, segs, active


def _split_params(params, setup):
    stacks = [params["layers"][k] for k in range(len(setup.stack_kinds))]
    rest = {k: v for k, v in params.items() if k != "layers"}
    return stacks, rest


def _shard_map(body, segs, active, rest, batch, scalars, out_names):
    per_stage = ("layers",)
    return logical_shard_map(
        body,
        in_names=(jax.tree.map(lambda _: per_stage, segs), jax.tree.map(lambda _: per_stage, active),
                  jax.tree.map(lambda _: (), rest), jax.tree.map(lambda _: (), batch),
                  jax.tree.map(lambda _: (), scalars)),
        out_names=out_names,
        manual=("layers",),
        # jax 0.10's transpose of a shard_map nested in a vma-checked one (the expert-parallel
        # dispatch inside a stage) names the outer manual axis in the inner region's shardings,
        # which Shardy rejects; unchecked, the outer region transposes cleanly.
        check_vma=False,
    )(segs, active, rest, batch, scalars)


def pipeline_loss(graphdef, params: dict[str, Any], batch: dict[str, jax.Array], *, schedule: Schedule,
                  scale, top_k: int, aux_loss_coeff: float, z_loss_coeff: float, remat: RecomputePolicy | str,
                  balancing: policies.LoadBalancing | None = None):
    """The scaled training objective of all ``M`` micro-batches of ``batch`` (leaves
    ``[M, B, T]``, with the per-token ``loss_weight`` of :func:`losses.loss_token_weights`)
    through the pipeline, and the same ``aux`` the non-pipelined step collects: the GPipe /
    circular schedule, whose gradient is autodiff through its tick scan (the forward-only pass
    of every schedule, e.g. for evaluation, which passes ``loss_weight = loss_mask``).

    ``params`` are the compute-layout weights as a pure dict (``params["layers"][k]`` the layer
    stacks, leaves ``[L_k, ...]``). Must run under the trainer's mesh and rules.
    """
    stage_axes, setup, balancing, stacks, rest, segs, active = _prepare(
        graphdef, params, schedule, balancing, aux_loss_coeff, z_loss_coeff)
    p, r_chunks, program = schedule.stages, schedule.virtual, setup.program
    m = batch["input_ids"].shape[0]

    def body(segs_1RS, active_1RS, rest, batch, scalars):
        stage = jax.lax.axis_index(stage_axes)
        segs_RS = [jax.tree.map(lambda x: x[0], s) for s in segs_1RS]
        active_RS = [a[0] for a in active_1RS]
        model = _merge(graphdef, setup, rest)
        dtype = jax.tree.leaves(segs_RS)[0].dtype

        def inject(i):  # micro-batch i enters stage 0, its context with it
            mb = {k: jax.lax.dynamic_index_in_dim(batch[k], i, keepdims=False) for k in ("input_ids",) + TRAVELLING}
            return {"x": model.embed_tokens(mb.pop("input_ids")).astype(dtype), **mb}

        empty = jax.tree.map(jnp.zeros_like, jax.eval_shape(inject, 0))

        @jax.checkpoint
        def head_loss(x_BTD, labels_BT, mask_BT, weight_BT):
            return model.weighted_loss_sums(model.final_norm(x_BTD), labels_BT, mask_BT, weight_BT)

        def tick(carry, t):
            received, ring, acc = carry
            if r_chunks > 1:  # park what came round the ring until stage 0's turn for it
                ring = jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, (t - p) % m, 0),
                                    ring, received)
                from_ring = jax.tree.map(lambda buf: jax.lax.dynamic_index_in_dim(buf, t % m, keepdims=False), ring)
                first = jax.tree.map(lambda a, b: jnp.where(t < m, a, b), inject(jnp.minimum(t, m - 1)), from_ring)
            else:
                first = inject(jnp.minimum(t, m - 1))
            cur = jax.tree.map(lambda a, b: jnp.where(stage == 0, a, b), first, received)
            w = t - stage
            valid = (w >= 0) & (w < m * r_chunks)
            chunk = jnp.clip(w // m, 0, r_chunks - 1)
            states = [jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, chunk, keepdims=False), s) for s in segs_RS]
            on = [jax.lax.dynamic_index_in_dim(a, chunk, keepdims=False) for a in active_RS]
            context = model.layer_context(cur["segment_ids"], cur["positions"])
            x, stats = _chunk_forward(setup.stack_graphs, program, states, on, cur["x"], context, remat)
            last = valid & (stage == p - 1) & (chunk == r_chunks - 1)
            objective, ce_sum, count = head_loss(x, cur["labels"], cur["loss_mask"] * last.astype(cur["loss_mask"].dtype),
                                                 cur["loss_weight"] * last.astype(cur["loss_weight"].dtype))
            # global_aux_loss: this chunk's running counts over the micro-batches before item w.
            counts = [c[chunk] for c in acc["counts"]] if "counts" in acc else None
            router_objective, sums, counts = _router_terms(program, stats, on, valid, balancing, top_k, m,
                                                           counts, jnp.clip(w - chunk * m, 0, m - 1))
            acc = dict(acc, ce_sum=acc["ce_sum"] + ce_sum, loss_tokens=acc["loss_tokens"] + count,
                       lm_objective=acc["lm_objective"] + objective,
                       objective=acc["objective"] + objective + router_objective)
            if sums:
                acc["moe"] = _add_sums(acc["moe"], sums, chunk)
            if counts is not None:  # masked stats leave the counts as they were on idle ticks
                acc["counts"] = [a.at[chunk].set(c) for a, c in zip(acc["counts"], counts)]
            shift = [(i, (i + 1) % p) for i in range(p if r_chunks > 1 else p - 1)]
            sent = jax.lax.ppermute(dict(cur, x=x), stage_axes, shift)
            return (sent, ring, acc), None

        acc = _zero_acc(program, r_chunks, setup, balancing, ("objective", "ce_sum", "loss_tokens", "lm_objective"))
        ring = jax.tree.map(lambda x: jnp.zeros((m,) + x.shape, x.dtype), empty) if r_chunks > 1 else None
        (_, _, acc), _ = jax.lax.scan(tick, (empty, ring, acc), jnp.arange(m * r_chunks + p - 1))
        return jax.tree.map(lambda x: x[None], acc)

    acc = _shard_map(body, segs, active, rest, batch, (), ("layers",))
    objective = jnp.sum(acc["objective"])
    return objective * scale, _aux_out(acc, program, m, setup.num_moe)


def pipeline_value_and_grad(graphdef, params: dict[str, Any], batch: dict[str, jax.Array], *, schedule: Schedule,
                            scale, top_k: int, aux_loss_coeff: float, z_loss_coeff: float, remat: RecomputePolicy | str,
                            balancing: policies.LoadBalancing | None = None):
    """``((objective * scale, aux), d(objective * scale)/d params)`` by the 1F1B schedule
    (interleaved when ``schedule.virtual > 1``): the arguments and the first two results are
    :func:`pipeline_loss`'s; the gradients are float32, shaped like ``params``.

    One ``lax.scan`` over ticks. At tick ``t`` stage ``s`` runs the forward of item
    ``w = t - s`` and the backward of item ``u = t - (R*P - 1) - (P - 1 - s)``: an item is one
    chunk of one micro-batch, taken in Megatron's order (groups of ``P`` micro-batches, chunk
    by chunk forward and in reverse backward). The forward keeps only the chunk's input, in a
    ``2*R*P - 1``-slot buffer; the backward recomputes the chunk from it under ``jax.vjp``
    (with the layers' own ``remat`` policy inside), takes the cotangent its successor sent the
    tick before (or, on the last chunk of the last stage, the head's), accumulates the weight
    gradients in float32 and sends the input cotangent back with one ``ppermute``.
    """
    stage_axes, setup, balancing, stacks, rest, segs, active = _prepare(
        graphdef, params, schedule, balancing, aux_loss_coeff, z_loss_coeff)
    p, r_chunks, program = schedule.stages, schedule.virtual, setup.program
    m = batch["input_ids"].shape[0]
    delay = r_chunks * p - 1          # ticks between an item's forward and backward on the last stage
    slots = 2 * r_chunks * p - 1      # inputs in flight on stage 0 (fewer further down)
    num_ticks = m * r_chunks + delay + p - 1

    def body(segs_1RS, active_1RS, rest, batch, scale):
        stage = jax.lax.axis_index(stage_axes)
        segs_RS = [jax.tree.map(lambda x: x[0], s) for s in segs_1RS]
        active_RS = [a[0] for a in active_1RS]
        model = _merge(graphdef, setup, rest)
        dtype = jax.tree.leaves(segs_RS)[0].dtype
        micro = lambda i: {k: jax.lax.dynamic_index_in_dim(v, i, keepdims=False) for k, v in batch.items()}
        at = lambda tree, i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)

        def item(i, backward):
            """(chunk, micro-batch, forward index) of forward/backward item ``i``."""
            i = jnp.clip(i, 0, m * r_chunks - 1)
            group, within = i // (p * r_chunks), i % (p * r_chunks)
            chunk = within // p
            if backward:
                chunk = r_chunks - 1 - chunk
            mb = group * p + within % p
            return chunk, mb, group * p * r_chunks + chunk * p + within % p

        def chunk_objective(states, rest, x_saved, x_embedded, mb, on, first, last, counts, micro_index):
            """The chunk's output and its part of the objective: on the last chunk of the last
            stage the micro-batch's weighted CE sum (its ``loss_weight`` already carries the
            step's normalisation), plus the chunk's router losses (/M, as without the pipeline)."""
            model = _merge(graphdef, setup, rest)
            x_in = jnp.where(first, x_embedded, x_saved)
            context = model.layer_context(mb["segment_ids"], mb["positions"])
            x_out, stats = _chunk_forward(setup.stack_graphs, program, states, on, x_in, context, remat)
            lm_objective, ce_sum, count = model.weighted_loss_sums(
                model.final_norm(x_out), mb["labels"], mb["loss_mask"] * last.astype(mb["loss_mask"].dtype),
                mb["loss_weight"] * last.astype(mb["loss_weight"].dtype))
            router_objective, sums, counts = _router_terms(program, stats, on, jnp.bool_(True), balancing, top_k, m,
                                                           counts, micro_index)
            objective = lm_objective + router_objective
            return (x_out, objective), (objective, lm_objective, ce_sum, count, sums, counts)

        def tick(carry, t):
            received, cotangent, inputs, grads, acc = carry
            # forward of item w: keep its input for the backward, pass its output on
            w = t - stage
            chunk, mb_index, _ = item(w, backward=False)
            mb = micro(mb_index)
            first = (stage == 0) & (chunk == 0)
            x_in = jnp.where(first, model.embed_tokens(mb["input_ids"]).astype(dtype), received)
            context = model.layer_context(mb["segment_ids"], mb["positions"])
            on = [at(a, chunk) for a in active_RS]
            x_out, _ = _chunk_forward(setup.stack_graphs, program, [at(s, chunk) for s in segs_RS], on,
                                      x_in, context, remat)
            inputs = jax.lax.dynamic_update_index_in_dim(inputs, x_in, jnp.clip(w, 0, None) % slots, 0)
            ring = r_chunks > 1
            forward = [(i, (i + 1) % p) for i in range(p if ring else p - 1)]
            backward = [((i + 1) % p, i) for i in range(p if ring else p - 1)]
            received = jax.lax.ppermute(x_out, stage_axes, forward)
            # One order of collectives on every device: the forward's (its TP/EP ones, then the
            # permute) before the backward's. XLA:CPU otherwise runs independent collectives in
            # whatever order its thread pool picks per device, and on a loaded machine devices
            # waiting in different rendezvous time out.
            received, inputs, cotangent, rest_b, segs_b = jax.lax.optimization_barrier(
                (received, inputs, cotangent, rest, segs_RS))
            # backward of item u, recomputed from its saved input
            u = t - delay - (p - 1 - stage)
            valid = (u >= 0) & (u < m * r_chunks)
            chunk, mb_index, w_u = item(u, backward=True)
            mb = micro(mb_index)
            first, last = (stage == 0) & (chunk == 0), (stage == p - 1) & (chunk == r_chunks - 1)
            on = [at(a, chunk) for a in active_RS]
            x_saved = jax.lax.dynamic_index_in_dim(inputs, w_u % slots, keepdims=False)
            x_embedded = _merge(graphdef, setup, rest_b).embed_tokens(mb["input_ids"]).astype(dtype)
            # global_aux_loss: the chunk's running counts over the micro-batches before this one
            # (a chunk's backward items come in micro-batch order).
            counts = [c[chunk] for c in acc["counts"]] if "counts" in acc else None
            f = functools.partial(chunk_objective, mb=mb, on=on, first=first, last=last, counts=counts,
                                  micro_index=mb_index)
            _, pullback, (objective, lm_objective, ce_sum, count, sums, counts) = jax.vjp(
                f, [at(s, chunk) for s in segs_b], rest_b, x_saved, x_embedded, has_aux=True)
            # Zero cotangents on idle ticks make every gradient of the tick exactly zero.
            ct_x = jnp.where(last | ~valid, jnp.zeros_like(cotangent), cotangent)
            g_states, g_rest, g_x, g_embedded = pullback((ct_x, scale * valid.astype(jnp.float32)))
            grads = ([jax.tree.map(lambda a, g: a.at[chunk].add(g.astype(jnp.float32)), acc_s, g_s)
                      for acc_s, g_s in zip(grads[0], g_states)],
                     jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads[1], g_rest))
            # The lookup's gradient goes straight into the accumulator's rows (a scatter-add of
            # B*T rows), not through a zero [V, D] buffer per tick as the lookup's transpose would.
            g_embed = grads[1]["embed"].at[mb["input_ids"]].add(g_embedded.astype(jnp.float32))
            grads = (grads[0], dict(grads[1], embed=g_embed))
            keep = valid.astype(jnp.float32)
            acc = dict(acc, ce_sum=acc["ce_sum"] + ce_sum * keep, loss_tokens=acc["loss_tokens"] + count * keep,
                       lm_objective=acc["lm_objective"] + lm_objective * keep,
                       objective=acc["objective"] + objective * keep)
            if sums:
                sums = jax.tree.map(lambda x: x * keep, sums)
                acc["moe"] = _add_sums(acc["moe"], sums, chunk)
            if counts is not None:
                acc["counts"] = [a.at[chunk].set(jnp.where(valid, c, a[chunk])) for a, c in zip(acc["counts"], counts)]
            cotangent = jax.lax.ppermute(g_x, stage_axes, backward)
            return (received, cotangent, inputs, grads, acc), None

        shape = jax.eval_shape(lambda: model.embed_tokens(batch["input_ids"][0]).astype(dtype))
        zeros_x = jnp.zeros(shape.shape, shape.dtype)
        f32_zeros = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)
        acc = _zero_acc(program, r_chunks, setup, balancing, ("objective", "ce_sum", "loss_tokens", "lm_objective"))
        carry = (zeros_x, zeros_x, jnp.zeros((slots,) + shape.shape, shape.dtype),
                 (f32_zeros(segs_RS), f32_zeros(rest)), acc)
        (_, _, _, (g_segs, g_rest), acc), _ = jax.lax.scan(tick, carry, jnp.arange(num_ticks))
        return jax.tree.map(lambda x: x[None], (g_segs, g_rest, acc))

    per_stage = ("layers",)
    g_segs, g_rest, acc = _shard_map(body, segs, active, rest, batch, scale, per_stage)
    aux = _aux_out(acc, program, m, setup.num_moe)
    # The objective is the sum of the terms the backward differentiated (weighted CE + router losses).
    objective = jnp.sum(acc["objective"])
    f32 = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), tree)
    transpose = jax.linear_transpose(lambda st: _to_segments(st, setup.stack_kinds, program, schedule), f32(stacks))
    (g_stacks,) = transpose(g_segs)
    grads = jax.tree.map(lambda x: jnp.sum(x, axis=0), g_rest)  # embedding on stage 0, head on P-1
    grads["layers"] = type(params["layers"])({k: g for k, g in enumerate(g_stacks)}) if isinstance(
        params["layers"], dict) else type(params["layers"])(g_stacks)
    return (objective * scale, aux), grads


def storage_axes(logical: dict[str, Any], stack_kinds, stages: int) -> dict[str, Any]:
    """The logical axes to store the weights with: a layer stack whose length the stages do not
    divide (a short run of a mixed dense/MoE model, or an uneven split's odd total) keeps its
    ``"layers"`` axis unsplit, i.e. every stage stores it whole and computes the layers it runs."""
    layers = dict(logical["layers"])
    for k, (_, n, _) in enumerate(stack_kinds):
        if n % stages:
            layers[k] = jax.tree.map(lambda names: tuple(None if a == "layers" else a for a in names), layers[k],
                                     is_leaf=lambda x: isinstance(x, tuple))
    return {**logical, "layers": layers}
