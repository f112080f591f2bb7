"""What a compiled step does, read from its optimized HLO text (``compiled.as_text()``): the
planner's one HLO reader.

Per device (the text is the SPMD-partitioned program of one device), from one parse
(:mod:`mlir_train.planner.hlo_text`) and one traversal of the call graph (:func:`analyze`, here)
that multiplies what each instruction costs (:mod:`mlir_train.planner.hlo_cost`) by how often it
runs:

* the collectives by kind (all-reduce, all-gather, reduce-scatter, all-to-all,
  ragged-all-to-all, collective-permute, ...), how many run per step and their bytes;
* the FLOPs of every matrix multiply (:class:`MatmulFlops`): ``dot`` instructions (XLA:GPU keeps
  them inside its Triton GEMM fusions) and the custom calls whose work
  :mod:`mlir_train.planner.hlo_kernels` can read: cuBLAS GEMMs, the MoE block kernels (ours and
  tokamax's, at their static bound), the flash-attention kernels (Pallas mha, docs-flash,
  tokamax's).

:func:`matmul_flops` is the same traversal's FLOP breakdown, for callers that want only that.

Why parse text: ``cost_analysis()`` is None for a deviceless XLA:GPU executable, and on CPU it
counts every op, not just the matmuls Megatron's FLOP formula is about.

Counting rules (the one rule for loops and conditionals)
--------------------------------------------------------
* An instruction runs as often as its computation: a ``while`` body runs its
  ``known_trip_count`` times (XLA records it for ``lax.scan`` / ``fori_loop`` loops; where a
  loop rewrite dropped it, the count is read from the loop: a constant start, ``i < N`` with a
  constant ``N``, step 1), fusions, calls and async wrappers as often as their caller. A loop
  whose count cannot be read is counted once and reported (``Stats.unknown_loops``,
  ``MatmulFlops.unknown_trip_count_loops``): a figure with such loops is a lower bound.
* A ``conditional`` counts one branch: its costliest (FLOPs, then collective bytes; an upper
  bound: which branch runs is decided at run time), or with ``branch="min"`` its cheapest (e.g.
  the no-overflow path of a dropless dispatcher); ``Stats.conditionals`` says how many there were.
* Bytes of a collective are the larger of what it reads and what it writes per device (the
  full buffer for all-gather and reduce-scatter, as nccl-tests report sizes).
* Each collective is also tallied by its device groups (``Stats.collective_groups``: the first
  replica group, or a collective-permute's source-target pairs;
  :func:`~mlir_train.planner.hlo_text.replica_groups` reads the explicit, iota and mesh forms)
  and by whether the schedule overlaps it: an async ``*-start``/``*-done`` pair (not
  ``is_sync``) with compute scheduled between the two in the scheduled program's order
  (``is_scheduled=true``: instruction order is the schedule), and whether that compute includes
  matmul work (a dot, a GEMM, a kernel).
* HBM bytes (``Stats.hbm_bytes``, an estimate for the roofline): every top-level instruction
  that launches work (fusions, custom calls, copies, dots, collectives) reads its operands and
  writes its result once; what a fusion does inside stays on chip. Bookkeeping instructions
  (parameters, tuples, bitcasts, get-tuple-element, constants) move nothing.
* A dot's FLOPs: ``2 * prod(output dims) * prod(contracted dims)``. Custom calls whose FLOPs
  cannot be read from the HLO (cuDNN fused attention, other Mosaic/Triton kernels) are listed by
  target in ``Stats.uncounted_custom_calls``, never silently dropped.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

from mlir_train.planner.hlo_cost import (COLLECTIVE_KINDS, NO_TRAFFIC, FusionAccess, collective_bytes, dot_flops,
                                         fusion_access, is_kernel_call, launch_bytes, overlapped_starts,
                                         wraps_collective)
from mlir_train.planner.hlo_kernels import (AttentionCall, DocsFlashCall, KernelCall, custom_call_target,
                                            read_custom_call)
from mlir_train.planner.hlo_text import (Instruction, arrays_of, computations, in_scope, inferred_trip_count,
                                         known_trip_count, parse_module, replica_groups, source_target_pairs)


@dataclasses.dataclass
class Collective:
    count: int = 0          # executions per step
    bytes: int = 0          # summed over executions, per device


@dataclasses.dataclass
class MatmulFlops:
    """The FLOPs of one execution of the program, by kind (per device)."""
    dot_flops: float = 0.0  # dots and cuBLAS GEMMs (outside ``exclude_scope``)
    excluded_flops: float = 0.0  # dots and GEMMs whose op_name names ``exclude_scope``
    batched_dot_flops: float = 0.0  # the part with batch dimensions (expert-batched matmuls)
    kernels: list[KernelCall] = dataclasses.field(default_factory=list)  # one per execution
    attention_flops: float = 0.0  # flash attention kernels (tokamax's, docs-flash: one document per row)
    attention_calls: list[AttentionCall | DocsFlashCall] = dataclasses.field(default_factory=list)
    other_custom_calls: list[str] = dataclasses.field(default_factory=list)  # uncounted, by instruction
    while_loops: int = 0
    unknown_trip_count_loops: int = 0

    @property
    def total_flops(self) -> float:
        """Dots, GEMMs and attention kernels, with the block kernels at their static bound."""
        return self.dot_flops + self.attention_flops + self.kernel_flops_bound

    @property
    def kernel_flops_bound(self) -> float:
        return sum(k.flops_bound for k in self.kernels)

    def kernel_flops_for_rows(self, used_rows_by_buffer: dict[int, float]) -> float:
        """Kernel work when a buffer of R rows has ``used_rows_by_buffer[R]`` used block rows."""
        return sum(k.flops_for_rows(used_rows_by_buffer.get(k.rows, k.rows)) for k in self.kernels)


@dataclasses.dataclass(frozen=True)
class CollectiveGroup:
    """One kind of collective over one set of device groups, and how the schedule placed it."""
    kind: str
    group: tuple[int, ...]      # the first replica group (device ids); for a permute, the sources then targets
    pairs: tuple[tuple[int, int], ...] = ()  # a collective-permute's source-target pairs
    overlapped: bool = False    # compute scheduled between its start and done
    matmul_overlapped: bool = False  # ... and that compute includes matmul work


@dataclasses.dataclass
class Stats:
    collectives: dict[str, Collective]
    flops: MatmulFlops
    conditionals: int = 0
    unknown_loops: int = 0
    uncounted_custom_calls: dict[str, int] = dataclasses.field(default_factory=dict)
    collective_groups: dict[CollectiveGroup, Collective] = dataclasses.field(default_factory=dict)
    hbm_bytes: float = 0.0      # operands + results of every launched instruction, per step
    # What ragged all-to-alls carry at a balanced routing: per execution the smaller of the send
    # and receive buffers (the home rank's rows: all its routed rows go out in the dispatch and
    # come back in the combine), where ``collectives`` counts the larger, worst-case buffer.
    ragged_traffic_bytes: int = 0

    def traffic(self) -> dict[str, dict[str, int]]:
        """:attr:`collectives` with ragged all-to-alls at their traffic, not their buffers, and
        collective-permutes at what the busiest device sends: every device runs each permute,
        but only its pairs' sources send (a pipeline's forward permute is sent by every stage
        but the last, its backward one by every stage but the first), as Megatron's send/recv
        volumes count a device's sends."""
        out = {k: {"count": c.count, "bytes": c.bytes} for k, c in self.collectives.items()}
        if "ragged-all-to-all" in out:
            out["ragged-all-to-all"]["bytes"] = self.ragged_traffic_bytes
        if "collective-permute" in out:
            sent: dict[int, int] = {}
            for g, c in self.collective_groups.items():
                if g.kind == "collective-permute":
                    for source in {a for a, b in g.pairs if a != b}:
                        sent[source] = sent.get(source, 0) + c.bytes
            out["collective-permute"]["bytes"] = max(sent.values(), default=0)
        return out

    def overlap(self) -> dict[str, dict[str, int]]:
        """Per kind: executions and bytes in all, with compute between start and done, with matmul
        work between."""
        out: dict[str, dict[str, int]] = {}
        for g, c in self.collective_groups.items():
            row = out.setdefault(g.kind, dict(count=0, bytes=0, overlapped=0, overlapped_bytes=0,
                                              matmul_overlapped=0, matmul_overlapped_bytes=0))
            row["count"] += c.count
            row["bytes"] += c.bytes
            if g.overlapped:
                row["overlapped"] += c.count
                row["overlapped_bytes"] += c.bytes
            if g.matmul_overlapped:
                row["matmul_overlapped"] += c.count
                row["matmul_overlapped_bytes"] += c.bytes
        return dict(sorted(out.items()))

    @property
    def matmul_flops(self) -> float:
        """Every matmul FLOP of :attr:`flops`, the excluded scope's included."""
        return self.flops.total_flops + self.flops.excluded_flops

    def collective_bytes(self) -> int:
        return sum(c.bytes for c in self.collectives.values())


@dataclasses.dataclass
class _Tally:
    """What one execution of a computation does."""
    coll: dict[str, list[float]] = dataclasses.field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    dot: float = 0.0
    batched: float = 0.0
    excluded: float = 0.0
    attention: float = 0.0
    kernels: Counter = dataclasses.field(default_factory=Counter)          # KernelCall -> executions
    attention_calls: Counter = dataclasses.field(default_factory=Counter)  # AttentionCall | DocsFlashCall -> executions
    uncounted: Counter = dataclasses.field(default_factory=Counter)        # target -> executions
    groups: dict = dataclasses.field(default_factory=lambda: defaultdict(lambda: [0, 0]))  # CollectiveGroup -> [n, bytes]
    hbm: float = 0.0
    ragged: float = 0.0  # ragged all-to-all traffic (Stats.ragged_traffic_bytes)

    def add(self, other: _Tally, times: int, hbm: bool = True) -> None:
        self.ragged += other.ragged * times
        for k, (n, b) in other.coll.items():
            self.coll[k][0] += n * times
            self.coll[k][1] += b * times
        for k, (n, b) in other.groups.items():
            self.groups[k][0] += n * times
            self.groups[k][1] += b * times
        if hbm:
            self.hbm += other.hbm * times
        self.dot += other.dot * times
        self.batched += other.batched * times
        self.excluded += other.excluded * times
        self.attention += other.attention * times
        for mine, theirs in ((self.kernels, other.kernels), (self.attention_calls, other.attention_calls),
                             (self.uncounted, other.uncounted)):
            for k, n in theirs.items():
                mine[k] += n * times

    def cost(self) -> tuple[float, float]:
        """What picks a conditional's branch: FLOPs, then collective bytes."""
        kernels = sum(k.flops_bound * n for k, n in self.kernels.items())
        return self.dot + self.excluded + self.attention + kernels, sum(b for _, b in self.coll.values())


class _Reader:
    """One traversal of a parsed module (see the module's counting rules); each computation is
    tallied once (memoised) and scaled by its callers."""

    def __init__(self, comps: dict[str, list[Instruction]], entry: str, branch: str, exclude_scope: str | None,
                 min_scopes: tuple[str, ...] = ()):
        if branch not in ("max", "min", "balanced"):
            raise ValueError(f"branch={branch!r}: expected 'max', 'min' or 'balanced'")
        if branch == "balanced" and not min_scopes:
            raise ValueError("branch='balanced' needs min_scopes: the scopes whose conditionals count their cheapest branch")
        self.branch, self.min_scopes = branch, tuple(min_scopes)
        self.exclude_scope = exclude_scope
        self.comps, self.entry = comps, entry
        self.types = {name: {i.name: i.result_type for i in instrs} for name, instrs in comps.items()}
        self.memo: dict = {}  # computation (or (computation, its wrapper's overlap)) -> _Tally
        self._overlap: dict[str, tuple[bool, bool]] = {}  # the current computation's async starts
        # Inside an async fusion wrapping a collective (jax 0.12.1's Triton collective fusions):
        # the wrapper's (overlapped, with matmuls), which its collective takes; None elsewhere.
        self._wrapper: tuple[bool, bool] | None = None
        self._access: dict[str, tuple] = {}  # fused computation -> what it reads of its operands
        # Instructions met in the reachable computations, each once.
        self.loops, self.unknown_loops, self.conditionals, self.uncounted_names = 0, 0, 0, []

    def _pick(self, ins: Instruction):
        """How a conditional's branch is chosen: ``max``/``min`` everywhere, or under ``balanced``
        the cheapest branch of the conditionals traced under one of ``min_scopes`` (a dropless
        dispatcher's overflow rounds, which a balanced routing never enters) and the costliest of
        every other (e.g. work only one pipeline stage does: the busiest device's count)."""
        if self.branch == "balanced":
            return min if any(in_scope(ins.attrs, s) for s in self.min_scopes) else max
        return max if self.branch == "max" else min

    def tally(self, comp: str, wrapper: tuple[bool, bool] | None = None) -> _Tally:
        """What ``comp`` costs per execution; ``wrapper``: it is the fused computation of an
        async fusion wrapping a collective, scheduled with that (overlapped, with matmuls)."""
        key = comp if wrapper is None else (comp, wrapper)
        if key not in self.memo:
            t = _Tally()
            saved_wrapper, self._wrapper = self._wrapper, wrapper
            self._overlap = overlapped_starts(self.comps.get(comp, []), self._does_matmul, self.comps)
            try:
                for ins in self.comps.get(comp, []):
                    self._instruction(ins, comp, t)
            finally:
                self._wrapper = saved_wrapper
            self.memo[key] = t
        return self.memo[key]

    def _fusion_access(self, ins: Instruction) -> FusionAccess | None:
        """:func:`~mlir_train.planner.hlo_cost.fusion_access` of the computation a fusion calls,
        read once per computation; None for any other instruction."""
        called = computations(ins.attrs, "calls") if ins.opcode in ("fusion", "fusion-start") else []
        if not called or called[0] not in self.comps:
            return None
        if called[0] not in self._access:
            self._access[called[0]] = fusion_access(self.comps[called[0]], self.types[called[0]])
        return self._access[called[0]]

    def _does_matmul(self, ins: Instruction) -> bool:
        """Whether one execution of ``ins`` does matmul work (itself or what it calls)."""
        if ins.opcode == "dot":
            return True
        if ins.opcode == "custom-call":
            return is_kernel_call(ins.attrs)
        called = [c for key in ("calls", "body", "to_apply", "branch_computations")
                  for c in computations(ins.attrs, key)]
        saved = self._overlap
        try:
            return any(self.tally(c).cost()[0] > 0 for c in called if c in self.comps)
        finally:
            self._overlap = saved

    def _instruction(self, ins: Instruction, comp: str, t: _Tally) -> None:
        op, types = ins.opcode, self.types[comp]
        base = op[:-6] if op.endswith("-start") else op
        if op not in NO_TRAFFIC and not op.endswith(("-done", "-update")) and op not in ("while", "conditional", "call"):
            t.hbm += launch_bytes(ins, types, self._fusion_access(ins))
        if base in COLLECTIVE_KINDS and not op.endswith(("-done", "-update")):
            nbytes, ragged = collective_bytes(ins, types)
            t.ragged += ragged
            t.coll[base][0] += 1
            t.coll[base][1] += nbytes
            overlapped, matmul = self._overlap.get(ins.name, self._wrapper or (False, False))
            pairs = source_target_pairs(ins.attrs)
            groups = replica_groups(ins.attrs)
            first = tuple(sorted({d for p in pairs for d in p})) if pairs else (tuple(groups[0]) if groups else ())
            key = CollectiveGroup(base, first, pairs, overlapped, matmul)
            t.groups[key][0] += 1
            t.groups[key][1] += nbytes
        elif op == "dot":
            self._matmul(t, *dot_flops(ins, types), ins.attrs)
        elif op == "custom-call":
            self._custom_call(ins, types, t)
        elif op == "while":
            self._loop(ins, comp, t)
        elif op == "conditional":
            self.conditionals += 1
            branches = (computations(ins.attrs, "branch_computations") or computations(ins.attrs, "true_computation")
                        + computations(ins.attrs, "false_computation"))
            saved = self._overlap
            tallies = [self.tally(b) for b in branches]
            self._overlap = saved
            if tallies:
                t.add(self._pick(ins)(tallies, key=_Tally.cost), 1)
        if op not in ("while", "conditional") and not op.endswith(("-done", "-update")):
            # A fusion's inside stays on chip: its HBM traffic is the fusion's operands and result.
            callees = computations(ins.attrs, "calls") + (computations(ins.attrs, "to_apply") if op == "call" else [])
            wrapper = self._overlap.get(ins.name, (False, False)) if wraps_collective(ins, self.comps) else None
            for called in callees:
                saved = self._overlap
                t.add(self.tally(called, wrapper), 1, hbm=op in ("call", "async-start"))
                self._overlap = saved

    def _matmul(self, t: _Tally, flops: float, batched: bool, attrs: str) -> None:
        if in_scope(attrs, self.exclude_scope):
            t.excluded += flops
        else:
            t.dot += flops
            t.batched += flops if batched else 0.0

    def _custom_call(self, ins: Instruction, types: dict[str, str], t: _Tally) -> None:
        shapes = [arrays_of(types.get(o, "")) for o in ins.operands]
        read = read_custom_call(ins.attrs, ins.result_type, [a[0][1] if a else None for a in shapes])
        if read is None:
            t.uncounted[custom_call_target(ins.attrs)] += 1
            self.uncounted_names.append(ins.name)
        elif read.kind == "gemm":
            self._matmul(t, read.flops, read.batched, ins.attrs)
        elif read.kind == "attention":
            t.attention += read.flops
        elif read.kind == "attention_call":
            t.attention += read.flops
            t.attention_calls[read.call] += 1
        else:
            t.kernels[read.call] += 1

    def _loop(self, ins: Instruction, comp: str, t: _Tally) -> None:
        self.loops += 1
        n = known_trip_count(ins.attrs)
        if n is None:
            n = inferred_trip_count(ins, comp, self.comps)
        self.unknown_loops += n is None
        for body in computations(ins.attrs, "body"):
            saved = self._overlap
            t.add(self.tally(body), 1 if n is None else n)
            self._overlap = saved


def analyze(text: str, *, branch: str = "max", exclude_scope: str | None = None,
            min_scopes: tuple[str, ...] = ()) -> Stats:
    """Collectives and matmul FLOPs per device per step of an optimized HLO module's text.
    ``branch``: which branch of each ``conditional`` counts, the costliest ("max", an upper
    bound) or the cheapest ("min"), or ("balanced") the cheapest of those traced under one of
    ``min_scopes`` (e.g. the overflow rounds of a dropless dispatcher) and the costliest of the
    others. Dots and
    GEMMs traced under ``jax.named_scope(exclude_scope)`` (their ``op_name`` names it, forward
    and transposed) go to ``flops.excluded_flops`` instead of ``flops.dot_flops``."""
    return _analyze(parse_module(text), branch, exclude_scope, min_scopes)


def _analyze(module: tuple[dict[str, list[Instruction]], str], branch: str = "max",
             exclude_scope: str | None = None, min_scopes: tuple[str, ...] = ()) -> Stats:
    reader = _Reader(*module, branch, exclude_scope, min_scopes)
    t = reader.tally(reader.entry)
    flops = MatmulFlops(
        dot_flops=t.dot, excluded_flops=t.excluded, batched_dot_flops=t.batched,
        kernels=[k for k, n in t.kernels.items() for _ in range(int(n))], attention_flops=t.attention,
        attention_calls=[c for c, n in t.attention_calls.items() for _ in range(int(n))],
        other_custom_calls=reader.uncounted_names, while_loops=reader.loops,
        unknown_trip_count_loops=reader.unknown_loops)
    return Stats({k: Collective(int(n), int(b)) for k, (n, b) in sorted(t.coll.items())}, flops,
                 reader.conditionals, reader.unknown_loops, {k: int(n) for k, n in t.uncounted.items()},
                 {k: Collective(int(n), int(b)) for k, (n, b) in t.groups.items()}, float(t.hbm), int(t.ragged))


def matmul_flops(text: str, exclude_scope: str | None = None) -> MatmulFlops:
    """:attr:`Stats.flops` of :func:`analyze` (costliest branches): the FLOPs by kind."""
    return analyze(text, exclude_scope=exclude_scope).flops


def collectives(text: str) -> dict[str, Collective]:
    return analyze(text).collectives


def format_collectives(colls: dict[str, Collective]) -> str:
    if not colls:
        return "none"
    return ", ".join(f"{k} {c.count}x {c.bytes / 2**30:.2f} GiB" if c.bytes >= 2**27 else
                     f"{k} {c.count}x {c.bytes / 2**20:.1f} MiB" for k, c in colls.items())


@dataclasses.dataclass
class CompiledStep:
    """Per-device figures of one compiled executable: its memory analysis and HLO audit."""
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int | None         # the compiler's own peak, where its memory analysis has one
    stats: Stats                   # costliest branch of each conditional (an upper bound)
    stats_cheapest: Stats          # cheapest branch of each (the same as ``stats`` without conditionals)
    # A balanced routing on the busiest device: the overflow rounds' no-overflow branch, the
    # costliest branch of every other conditional (``branch="balanced"``).
    stats_balanced: Stats | None = None

    @property
    def needed_bytes(self) -> int:
        """Device memory the step needs: the compiler's peak, else arguments + outputs not
        aliased to (donated) arguments + temporaries."""
        if self.peak_bytes:
            return self.peak_bytes
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def audit_compiled(compiled) -> CompiledStep:
    """:class:`CompiledStep` of a ``jax.stages.Compiled`` (``jit(f).lower(...).compile()``)."""
    mem = compiled.memory_analysis()
    if mem is None:
        raise ValueError("this executable has no memory analysis")
    peak = getattr(mem, "peak_memory_in_bytes", None)
    module = parse_module(compiled.as_text())
    stats = _analyze(module)
    if not stats.conditionals:
        cheapest = balanced = stats
    else:
        from mlir_train.model.moe.dispatch import OVERFLOW_SCOPE  # the scope of the overflow rounds' conditionals

        cheapest, balanced = _analyze(module, "min"), _analyze(module, "balanced", min_scopes=(OVERFLOW_SCOPE,))
    return CompiledStep(int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes), int(mem.alias_size_in_bytes),
                        int(mem.temp_size_in_bytes), int(peak) if peak else None, stats, cheapest, balanced)
