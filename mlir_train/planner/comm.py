"""What Megatron-LM moves per step and device for a layout: its analytic communication volumes,
the reference the compiled program's collectives are audited against (:func:`compare`).

For one training step of ``num_micro`` micro-batches of ``micro_batch`` rows of ``seq`` tokens
(bf16 activations, Megatron's defaults otherwise), on the device of the busiest pipeline stage,
every collective Megatron-core issues, with its bytes counted as :mod:`mlir_train.planner.hlo`
counts the compiled ones: the larger of what one device reads and writes (the full buffer of
an all-gather or reduce-scatter, as nccl-tests report sizes; a send's message for PP).

Per decoder layer and micro-batch, ``T = micro_batch * seq / CP`` tokens of the data replica,
``f`` forward passes (1, plus 1 for a layer full recompute reruns; selective recompute reruns
no collective), activations of ``a`` bytes:

* Attention and a dense MLP under TP > 1 (``ColumnParallelLinear`` then ``RowParallelLinear``,
  megatron/core/tensor_parallel/layers.py):
  with ``--sequence-parallel``, all-gather of the ``[T, h]`` input before the column linear and
  reduce-scatter of its output after the row linear (``f`` each), and in the backward the
  all-gather of the output gradient (row linear), the all-gather of the input again for the
  weight gradient and the reduce-scatter of the input gradient (column linear,
  ``LinearWithGradAccumulationAndAsyncCommunication.backward``): ``f + 2`` all-gathers and
  ``f + 1`` reduce-scatters of ``T h a`` bytes. Without SP: ``f`` forward all-reduces (row
  linear) and one backward all-reduce (column linear's input gradient).
* MoE layer (``MoEAlltoAllTokenDispatcher``, token_dispatcher.py): each rank routes its
  ``T / TP`` (sequence-parallel) tokens, ``R = T / TP * k`` rows. With EP > 1: the dispatch and
  the combine all-to-all of ``R h a`` bytes and the dispatch of the routing probabilities
  (``R`` float32), each forward and backward. With ETP > 1: the rows are all-gathered over the
  expert-tensor group after the dispatch (``R * ETP`` rows) and reduce-scattered before the
  combine, each forward and (as its transpose) backward. Megatron requires SP for MoE under
  TP > 1; without it the tokens are not split and ``R = T k``.
* The router's load-balancing statistics (``TopKRouter._apply_*aux_loss``, router.py, and
  ``get_tokens_per_expert_and_token_count``, moe_utils.py), per MoE layer and forward pass:
  ``aux_loss`` all-reduces the ``E`` expert counts (int64, the sum of a boolean routing map) over
  the TP x CP group, ``seq_aux_loss`` the ``mb x E`` per-sequence counts over the same group,
  ``global_aux_loss`` the ``E`` counts over TP x DP x CP. Only the types whose coefficient is not
  zero run (``balancing``; None: none counted).
* Embedding (first stage), TP > 1: its vocab-parallel output is reduce-scattered (SP) or
  all-reduced once forward; the backward all-gathers the gradient (SP). LM head (last stage):
  the column linear as above (all-gather forward; backward all-gather and reduce-scatter with
  SP, all-reduce without), and the vocab-parallel cross entropy's three all-reduces of ``T``
  float32 (max, target logit, sum of exponentials).
* Pipeline: a stage sends its ``[T / TP (SP), mb, h]`` output forward and its input gradient
  backward per micro-batch (``get_tensor_shapes`` in megatron/core/pipeline_parallel/schedules.py);
  counted as bytes sent by the device.

Per step, the gradients: Megatron keeps them in float32 (``main_grad``; for bf16 training
``--accumulate-allreduce-grads-in-fp32`` is set by megatron/training/arguments.py unless
``--grad-reduce-in-bf16``) and reduces them once per step over the data-parallel group
(``DP x CP`` for dense parameters, the expert-data group ``world / (ETP EP PP)`` for expert
ones): with ``--use-distributed-optimizer`` a reduce-scatter of the local gradient buffer and
an all-gather of the updated bf16 parameters, else an all-reduce. Under SP the parameters
every TP rank holds whole (norms, the router) have their gradients all-reduced over TP
(``finalize_model_grads``). Tied embeddings under PP all-reduce the embedding gradient between
the first and last stage.

Not counted (each under a KiB per step): scalar all-reduces (loss, token count, grad norm,
found-inf) and the logged aux losses' per-step reductions.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from mlir_train.config.models import ModelConfig

# The compiled kinds each Megatron kind is compared with (collective-permute: XLA's send/recv).
COMPILED_KINDS = {
    "all-reduce": ("all-reduce",),
    "all-gather": ("all-gather",),
    "reduce-scatter": ("reduce-scatter",),
    "all-to-all": ("all-to-all", "ragged-all-to-all"),
    "send/recv": ("collective-permute", "send", "recv"),
}


@dataclasses.dataclass(frozen=True)
class CommLayout:
    """The sizes Megatron's volumes depend on (``sharding.Layout`` has them all: :meth:`of`)."""
    num_devices: int
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    expert_tensor: int | None = None
    context: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False

    @classmethod
    def of(cls, layout, num_devices: int) -> "CommLayout":
        return cls(num_devices, layout.tensor, layout.pipeline, layout.expert, layout.expert_tensor, layout.context,
                   layout.sequence_parallel, layout.distributed_optimizer)

    @property
    def etp(self) -> int:
        return self.tensor if self.expert_tensor is None else self.expert_tensor

    @property
    def data(self) -> int:
        return self.num_devices // (self.tensor * self.context * self.pipeline)

    @property
    def expert_data(self) -> int:
        return self.num_devices // (self.etp * self.expert * self.pipeline)


@dataclasses.dataclass(frozen=True)
class Volume:
    """One of Megatron's collectives, per device per step."""
    kind: str        # all-reduce | all-gather | reduce-scatter | all-to-all | send/recv
    purpose: str     # e.g. "attention SP all-gather", "expert grads reduce-scatter (distopt)"
    group: str       # tp | etp | ep | dp | edp | pp
    group_size: int
    count: int       # executions per step
    bytes: int       # summed over the executions


def _param_counts(cfg: ModelConfig, layers: range, lay: CommLayout, first: bool, last: bool) -> dict[str, float]:
    """Per device of a stage holding ``layers``: parameters split over TP (``dense``), held whole
    by every TP rank (``replicated``: norms, router), and routed-expert parameters."""
    h, d = cfg.hidden_size, cfg.head_dim
    tp = lay.tensor
    dense = replicated = expert = 0.0
    for i in layers:
        dense += (h * d * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * d * h) / tp
        replicated += 2 * h + 2 * d
        if cfg.layer_is_moe(i):
            replicated += h * cfg.num_experts
            expert += cfg.num_experts / lay.expert * 3 * h * cfg.moe_intermediate_size / lay.etp
        else:
            dense += 3 * h * cfg.intermediate_size / tp
    if first:
        dense += cfg.vocab_size * h / tp
    if last:
        replicated += h
        if not cfg.tie_word_embeddings or not first:
            dense += cfg.vocab_size * h / tp
    return dict(dense=dense, replicated=replicated, expert=expert)


def stage_layers(num_layers: int, pipeline: int, first: int | None = None, last: int | None = None) -> list[range]:
    """Megatron's decoder layers per stage (``--decoder-first/last-pipeline-num-layers``)."""
    if pipeline == 1:
        return [range(num_layers)]
    sizes = [None] * pipeline
    rest, middle = num_layers, pipeline
    if first is not None:
        sizes[0], rest, middle = first, rest - first, middle - 1
    if last is not None:
        sizes[-1], rest, middle = last, rest - last, middle - 1
    if middle and rest % middle:
        raise ValueError(f"{rest} layers do not split evenly over {middle} pipeline stages")
    sizes = [s if s is not None else rest // max(middle, 1) for s in sizes]
    out, start = [], 0
    for s in sizes:
        out.append(range(start, start + s))
        start += s
    return out


class _Tally:
    """Megatron's collectives summed by (kind, purpose, group, group size), in the order first met."""

    def __init__(self):
        self.acc: dict[tuple[str, str, str, int], list[float]] = defaultdict(lambda: [0, 0.0])

    def add(self, kind: str, purpose: str, group: str, size: int, count: float, nbytes: float) -> None:
        if size > 1 and count > 0:
            a = self.acc[(kind, purpose, group, size)]
            a[0] += count
            a[1] += count * nbytes

    def volumes(self) -> list[Volume]:
        return [Volume(k, p, g, s, int(round(c)), int(round(b))) for (k, p, g, s), (c, b) in self.acc.items()]


def megatron_stage_volumes(cfg: ModelConfig, lay: CommLayout, *, seq: int, micro_batch: int, num_micro: int,
                           stage: int = 0, recompute_fraction: float = 0.0, act_bytes: int = 2, grad_bytes: int = 4,
                           param_bytes: int = 2, probs_bytes: int = 4, layers: list[range] | None = None,
                           balancing=None) -> list[Volume]:
    """Megatron's collectives for one device of pipeline stage ``stage`` (see the module
    docstring). ``recompute_fraction``: the share of the stage's layers whose forward full
    recompute reruns (``RecomputePolicy.recomputed_fraction``). ``balancing``: the run's
    ``mlir_train.config.policies.LoadBalancing`` (its aux losses' count reductions), or None."""
    layers = layers or stage_layers(cfg.num_layers, lay.pipeline)
    mine, pp = layers[stage], lay.pipeline
    first, last = stage == 0, stage == pp - 1
    tp, sp = lay.tensor, lay.sequence_parallel and lay.tensor > 1
    tokens = micro_batch * seq // lay.context                   # T, the data replica's tokens per micro-batch
    local = tokens // tp if (sp or cfg.is_moe and tp > 1) else tokens   # what one rank routes / sends
    act = tokens * cfg.hidden_size * act_bytes                 # one [T, h] activation buffer
    m = num_micro
    tally = _Tally()
    _decoder_layer_volumes(tally, cfg, lay, mine, m, recompute_fraction, sp, local * cfg.top_k, act,
                           cfg.hidden_size * act_bytes, probs_bytes)
    if balancing is not None and cfg.is_moe:
        _router_statistics_volumes(tally, cfg, lay, mine, m, recompute_fraction, micro_batch, balancing)
    if tp > 1:
        _embedding_and_head_volumes(tally, tp, sp, first, last, m, act, tokens)
    if pp > 1:
        msg = local * cfg.hidden_size * act_bytes if sp else act
        sends = (m if not last else 0) + (m if not first else 0)
        tally.add("send/recv", "pipeline activations and gradients", "pp", pp, sends, msg)
    _gradient_volumes(tally, cfg, lay, mine, first, last, sp, grad_bytes, param_bytes)
    return tally.volumes()


def _decoder_layer_volumes(tally: _Tally, cfg: ModelConfig, lay: CommLayout, mine: range, m: int,
                           recompute_fraction: float, sp: bool, rows: int, act: int, row_bytes: int,
                           probs_bytes: int) -> None:
    """Per micro-batch, the decoder layers ``mine``: the TP blocks' gathers and reductions
    (attention in every layer, the dense MLPs) and the MoE layers' token exchange of ``rows``
    routed rows of ``row_bytes`` per rank; a full recompute reruns its share of the forward ones."""
    tp, etp, ep = lay.tensor, lay.etp, lay.expert
    n_layers = len(mine)
    n_moe = sum(cfg.layer_is_moe(i) for i in mine)
    n_tp_blocks = n_layers + (n_layers - n_moe)            # attention in every layer, dense MLPs
    # Forward executions of those blocks (full recompute reruns its share of them), backward ones.
    f_blocks = m * (n_tp_blocks + recompute_fraction * n_tp_blocks)  # forward executions of TP blocks
    b_blocks = m * n_tp_blocks
    if sp:
        tally.add("all-gather", "TP blocks (attention, dense MLP): SP all-gather", "tp", tp, f_blocks + 2 * b_blocks,
                  act)
        tally.add("reduce-scatter", "TP blocks (attention, dense MLP): SP reduce-scatter", "tp", tp,
                  f_blocks + b_blocks, act)
    else:
        tally.add("all-reduce", "TP blocks (attention, dense MLP): all-reduce", "tp", tp, f_blocks + b_blocks, act)
    if n_moe:
        f_moe = m * (n_moe + recompute_fraction * n_moe)
        b_moe = m * n_moe
        tally.add("all-to-all", "MoE dispatch + combine all-to-all (top-k rows)", "ep", ep, 2 * (f_moe + b_moe),
                  rows * row_bytes)
        tally.add("all-to-all", "MoE routing probabilities all-to-all", "ep", ep, f_moe + b_moe, rows * probs_bytes)
        gathered = rows * etp  # balanced routing: R rows arrive per rank, R * ETP after the gather
        tally.add("all-gather", "MoE ETP all-gather of dispatched rows", "etp", etp, f_moe + b_moe,
                  gathered * row_bytes)
        tally.add("reduce-scatter", "MoE ETP reduce-scatter of expert outputs", "etp", etp, f_moe + b_moe,
                  gathered * row_bytes)


def _router_statistics_volumes(tally: _Tally, cfg: ModelConfig, lay: CommLayout, mine: range, m: int,
                               recompute_fraction: float, micro_batch: int, balancing) -> None:
    """Per MoE layer and forward pass (a full recompute reruns its share): the expert counts each
    aux loss all-reduces (int64, 8 bytes each; see the module docstring)."""
    n_moe = sum(cfg.layer_is_moe(i) for i in mine)
    f_moe = m * (n_moe + recompute_fraction * n_moe)
    tp_cp, counts = lay.tensor * lay.context, cfg.num_experts * 8
    group = "tp+cp" if lay.context > 1 else "tp"
    if balancing.coeff("aux_loss") > 0:
        tally.add("all-reduce", "router aux_loss expert counts", group, tp_cp, f_moe, counts)
    if balancing.coeff("seq_aux_loss") > 0:
        tally.add("all-reduce", "router seq_aux_loss per-sequence expert counts", group, tp_cp, f_moe,
                  micro_batch * counts)
    if balancing.coeff("global_aux_loss") > 0:
        tally.add("all-reduce", "router global_aux_loss expert counts", group + "+dp", tp_cp * lay.data, f_moe, counts)


def _embedding_and_head_volumes(tally: _Tally, tp: int, sp: bool, first: bool, last: bool, m: int, act: int,
                                tokens: int) -> None:
    """Per micro-batch under TP > 1: the vocab-parallel embedding (first stage), the LM head's
    column linear and the vocab-parallel cross entropy (last stage)."""
    if first:
        if sp:
            tally.add("reduce-scatter", "embedding SP reduce-scatter", "tp", tp, m, act)
            tally.add("all-gather", "embedding SP all-gather (backward)", "tp", tp, m, act)
        else:
            tally.add("all-reduce", "embedding all-reduce", "tp", tp, m, act)
    if last:
        if sp:
            # forward, backward regather (megatron-core's LinearWithGradAccumulationAndAsyncCommunication:
            # the vocab-split output gradient is used as it is, not gathered)
            tally.add("all-gather", "LM head SP all-gather", "tp", tp, 2 * m, act)
            tally.add("reduce-scatter", "LM head SP reduce-scatter (backward)", "tp", tp, m, act)
        else:
            tally.add("all-reduce", "LM head input-gradient all-reduce", "tp", tp, m, act)
        tally.add("all-reduce", "vocab-parallel cross entropy (max, target, sum-exp)", "tp", tp, 3 * m, tokens * 4)


def _gradient_volumes(tally: _Tally, cfg: ModelConfig, lay: CommLayout, mine: range, first: bool, last: bool,
                      sp: bool, grad_bytes: int, param_bytes: int) -> None:
    """Once per step: the gradients (and, with the distributed optimizer, the parameters) over
    the data-parallel groups, the SP-replicated ones over TP, the tied embedding's between the
    first and last stage."""
    tp, pp = lay.tensor, lay.pipeline
    params = _param_counts(cfg, mine, lay, first, last)
    dense_params = params["dense"] + params["replicated"]
    for name, n, group, size in (("dense", dense_params, "dp", lay.data * lay.context),
                                 ("expert", params["expert"], "edp", lay.expert_data)):
        if not n:
            continue
        if lay.distributed_optimizer:
            tally.add("reduce-scatter", f"{name} grads reduce-scatter (distributed optimizer, fp32)", group, size, 1,
                      n * grad_bytes)
            tally.add("all-gather", f"{name} params all-gather (distributed optimizer, bf16)", group, size, 1,
                      n * param_bytes)
        else:
            tally.add("all-reduce", f"{name} grads all-reduce (fp32)", group, size, 1, n * grad_bytes)
    if sp:
        tally.add("all-reduce", "SP-replicated grads (norms, router) all-reduce over TP", "tp", tp, 1,
                  params["replicated"] * grad_bytes)
    if cfg.tie_word_embeddings and pp > 1 and (first or last):
        tally.add("all-reduce", "tied embedding grads between first and last stage", "pp", 2, 1,
                  cfg.vocab_size * cfg.hidden_size / tp * grad_bytes)


def megatron_volumes(cfg: ModelConfig, lay: CommLayout, **kw) -> tuple[int, list[Volume]]:
    """(the busiest stage, its :func:`megatron_stage_volumes`): the stage moving the most bytes."""
    stages = [megatron_stage_volumes(cfg, lay, stage=s, **kw) for s in range(lay.pipeline)]
    best = max(range(len(stages)), key=lambda s: sum(v.bytes for v in stages[s]))
    return best, stages[best]


def by_kind(volumes: list[Volume]) -> dict[str, int]:
    out: dict[str, int] = {k: 0 for k in COMPILED_KINDS}
    for v in volumes:
        out[v.kind] += v.bytes
    return out


@dataclasses.dataclass(frozen=True)
class KindComparison:
    kind: str
    compiled_bytes: int
    megatron_bytes: int

    @property
    def ratio(self) -> float | None:
        return self.compiled_bytes / self.megatron_bytes if self.megatron_bytes else None


def compare(compiled: dict[str, dict[str, int]], volumes: list[Volume]) -> list[KindComparison]:
    """Per Megatron kind: compiled bytes (``Plan.collectives``: kind -> {"count", "bytes"}, the
    XLA kinds of :data:`COMPILED_KINDS` summed) against Megatron's."""
    mega = by_kind(volumes)
    out = []
    for kind, xla_kinds in COMPILED_KINDS.items():
        got = sum(compiled.get(k, {}).get("bytes", 0) for k in xla_kinds)
        if got or mega[kind]:
            out.append(KindComparison(kind, int(got), int(mega[kind])))
    return out


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**27 else f"{n / 2**20:.1f} MiB"


def format_volumes(volumes: list[Volume]) -> list[str]:
    return [f"{v.kind:<15s} {v.purpose:<62s} {v.group}{v.group_size:<3d} {v.count:6d}x {gib(v.bytes):>11s}"
            for v in sorted(volumes, key=lambda v: (v.kind, -v.bytes)) if v.bytes]


def total(volumes: list[Volume]) -> int:
    return int(math.fsum(v.bytes for v in volumes))


def group_axes(group: tuple[int, ...], mesh_shape: dict[str, int]) -> str:
    """The mesh axes a device group spans ("tensor", "data+expert", ...): device id ``i`` sits at
    ``i``'s row-major coordinates in the mesh (the device order of a mesh-sharded program)."""
    if len(group) <= 1:
        return "-"
    names, dims = list(mesh_shape), list(mesh_shape.values())

    def coords(i):
        out = []
        for d in reversed(dims):
            out.append(i % d)
            i //= d
        return out[::-1]

    cs = [coords(i) for i in group if i < math.prod(dims)]
    axes = [n for j, n in enumerate(names) if len({c[j] for c in cs}) > 1]
    return "+".join(axes) if axes else "?"


def balanced_kernel_rows(rows: int, *, expert_ranks: int, num_experts: int, top_k: int, block: int,
                         row_tile: int | None = None, buffer_factor: float | None = None) -> float:
    """Rows a block kernel over a receive buffer of ``rows`` rows computes at an exactly balanced
    routing. The buffer holds one round of the exchange plus a block per local expert for the
    round-ups: ``C + L b`` rows for ``L = E / EP`` local experts, ``C`` the smaller of the worst
    routing's ``EP S min(K, L)`` rows and ``--moe-ep-buffer-factor`` F times the ``S K`` a balanced
    routing sends (``exchange.exchange_capacity``; None: F >= the worst case, the buffer before
    the factor existed), ``S`` tokens per rank. A balanced routing brings ``S K`` rows, ``S K / L``
    per local expert, each rounded up to whole blocks (of ``max(b, row_tile)``)."""
    local = num_experts // expert_ranks
    worst_per_sk = expert_ranks * min(top_k, local) / top_k  # the worst routing's rows per S K
    per_sk = worst_per_sk if buffer_factor is None else min(buffer_factor, worst_per_sk)
    tokens_x_k = (rows - local * block) / per_sk
    tile = max(block, row_tile or block)
    per_expert = math.ceil(tokens_x_k / local / tile) * tile
    return float(min(rows, local * per_expert))
