"""What a compiled step does, read from its optimized HLO text (``compiled.as_text()``): the
planner's one HLO reader.

Per device (the text is the SPMD-partitioned program of one device), from one parse and one
traversal of the call graph (:func:`analyze`):

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
  replica group, or a collective-permute's source-target pairs; :func:`replica_groups` reads the
  explicit, iota and mesh forms) and by whether the schedule overlaps it: an async
  ``*-start``/``*-done`` pair (not ``is_sync``) with compute scheduled between the two in the
  scheduled program's order (``is_scheduled=true``: instruction order is the schedule), and
  whether that compute includes matmul work (a dot, a GEMM, a kernel).
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
import math
import re
from collections import Counter, defaultdict

from mlir_train.planner.hlo_kernels import (AttentionCall, DocsFlashCall, KernelCall, custom_call_target,
                                            read_custom_call)

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5,
}
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                    "collective-permute", "collective-broadcast", "send", "recv")

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    result_type: str
    operands: list[str]
    attrs: str


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
        """:attr:`collectives` with ragged all-to-alls at their traffic, not their buffers."""
        out = {k: {"count": c.count, "bytes": c.bytes} for k, c in self.collectives.items()}
        if "ragged-all-to-all" in out:
            out["ragged-all-to-all"]["bytes"] = self.ragged_traffic_bytes
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


def _split_top(s: str) -> list[str]:
    """Split at top-level commas (outside (), [], {})."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if cur and "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    # The result type runs up to the opcode: the first " opcode(" outside the type's brackets.
    depth, i = 0, 0
    while i < len(rest):
        ch = rest[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == " " and depth == 0:
            om = _OPCODE.match(rest, i)
            if om:
                break
        i += 1
    else:
        return None
    result_type, opcode = rest[:i].strip(), om.group(1)
    start = om.end()
    depth, j = 1, start
    while j < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[j], 0)
        j += 1
    operands = [o.split()[-1].lstrip("%") for o in _split_top(rest[start:j - 1]) if o]
    return Instruction(name, opcode, result_type, operands, rest[j:])


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Computations (name -> instructions) and the entry computation's name."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(1)
                comps[current] = []
                if line.lstrip().startswith("ENTRY"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _parse_instruction(line)
        if instr is not None:
            comps[current].append(instr)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(type_str)
            if dt in DTYPE_BYTES]


def _nbytes(arrays) -> int:
    return int(sum(DTYPE_BYTES[dt] * math.prod(shape) for dt, shape in arrays))


def _attr_list(attrs: str, key: str) -> list[int]:
    m = re.search(key + r"=\{([0-9,]*)\}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(key + r"=\{([^}]*)\}", attrs)
    if m:
        return [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
    m = re.search(key + r"=%?([\w.\-]+)", attrs)
    return [m.group(1)] if m else []


def _trip_count(attrs: str) -> int | None:
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', attrs)
    return int(m.group(1)) if m else None


_CONSTANT = re.compile(r"constant\((-?\d+)\)")


def _int_constant(name: str, instrs: dict[str, Instruction], depth: int = 8) -> int | None:
    """The value of an integer scalar defined by ``constant(c)``, through copies and bitcasts."""
    ins = instrs.get(name)
    while ins is not None and depth:
        if ins.opcode == "constant":
            m = re.fullmatch(r"\s*(-?\d+)\s*", ins.operands[0]) if ins.operands else None
            return int(m.group(1)) if m else None
        if ins.opcode not in ("copy", "bitcast", "convert") or not ins.operands:
            return None
        ins, depth = instrs.get(ins.operands[0]), depth - 1
    return None


def _infer_trip_count(loop: Instruction, caller: str, comps: dict[str, list[Instruction]]) -> int | None:
    """Trip count of a ``while`` whose ``known_trip_count`` XLA dropped (it does after some loop
    rewrites): the induction variable ``i`` (``known_induction_variable``, else tuple element 0)
    starts at a constant ``c`` (the while's operand tuple) and the condition is ``i < N`` for a
    constant ``N`` (possibly inside a fusion); a step of 1 is assumed, as ``scan`` emits."""
    m = re.search(r'"known_induction_variable"\s*:\s*\{\s*"tuple_index"\s*:\s*"(\d+)"', loop.attrs)
    index = int(m.group(1)) if m else 0
    caller_instrs = {i.name: i for i in comps.get(caller, [])}
    init_tuple = caller_instrs.get(loop.operands[0]) if loop.operands else None
    if init_tuple is None or init_tuple.opcode != "tuple" or len(init_tuple.operands) <= index:
        return None
    start = _int_constant(init_tuple.operands[index], caller_instrs)
    conds = _called(loop.attrs, "condition")
    if start is None or not conds or conds[0] not in comps:
        return None
    cond = {i.name: i for i in comps[conds[0]]}
    root = comps[conds[0]][-1]
    scope = cond
    if root.opcode == "fusion":  # compare(param_j, constant N) inside, param_j = operand j of the fusion
        called = _called(root.attrs, "calls")
        if not called or called[0] not in comps:
            return None
        scope = {i.name: i for i in comps[called[0]]}
        fused_root = comps[called[0]][-1]
        operand_of_param = {i.name: root.operands[int(i.operands[0])] for i in comps[called[0]]
                            if i.opcode == "parameter" and i.operands and i.operands[0].isdigit()
                            and int(i.operands[0]) < len(root.operands)}
        root = fused_root
    if root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    bound = _int_constant(root.operands[1], scope)
    lhs = root.operands[0]
    if scope is not cond:
        lhs = operand_of_param.get(lhs)
    gte = cond.get(lhs) if lhs else None
    if bound is None or gte is None or gte.opcode != "get-tuple-element" or f"index={index}" not in gte.attrs:
        return None
    return max(0, bound - start)


def _dot_flops(instr: Instruction, types: dict[str, str]) -> tuple[float, bool]:
    """(FLOPs, has batch dimensions) of a ``dot``."""
    out = _arrays(instr.result_type)
    lhs = _arrays(types.get(instr.operands[0], "")) if instr.operands else []
    if not out or not lhs:
        return 0.0, False
    contracted = math.prod(lhs[0][1][d] for d in _attr_list(instr.attrs, "lhs_contracting_dims"))
    return 2.0 * math.prod(out[0][1]) * contracted, bool(_attr_list(instr.attrs, "lhs_batch_dims"))


def _in_scope(attrs: str, scope: str | None) -> bool:
    if scope is None:
        return False
    op_name = re.search(r'op_name="([^"]*)"', attrs)
    return op_name is not None and scope in op_name.group(1)


# Instructions that launch no work and move no bytes of their own.
_NO_TRAFFIC = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                         "add-dependency", "partition-id", "replica-id", "opt-barrier", "domain"})
# ... and those that are not compute for the overlap count (copies are data movement the
# scheduler may also hide, but not the compute a collective should overlap).
_NOT_COMPUTE = _NO_TRAFFIC | {"copy", "copy-start", "copy-done", "send", "send-done", "recv", "recv-done"}
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                          r"\s*\{([^}]*)\}")
# Custom calls that do matmul work: cuBLAS / cuDNN GEMMs and attention, Mosaic / Triton / Pallas kernels.
_KERNEL_TARGETS = ("cublas", "cudnn", "gemm", "mosaic", "triton", "pallas")


def _is_kernel_call(attrs: str) -> bool:
    target = custom_call_target(attrs).lower()
    return any(k in target for k in _KERNEL_TARGETS)


def replica_groups(attrs: str) -> list[list[int]] | None:
    """A collective's device groups from its attributes: explicit ``{{0,1},{2,3}}``, iota
    ``[G,S]<=[dims]T(perm)`` (iota over dims, transposed by perm, reshaped to G groups of S) or
    mesh ``mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}`` (one group per coordinate of the
    axes not named; the device at each mesh position is the iota ``device_ids`` flattened,
    row-major ids without it); None where it has none."""
    m = _IOTA_GROUPS.search(attrs)
    if m:
        import numpy as np
        g, size = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(g, size).tolist()
    m = _MESH_GROUPS.search(attrs)
    if m:
        import numpy as np
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, dims = [a for a, _ in axes], [int(d) for _, d in axes]
        over = {a.strip().strip("'") for a in m.group(4).split(",") if a.strip()}
        flat = np.arange(math.prod(dims))
        if m.group(2):
            order = np.arange(math.prod(dims)).reshape([int(d) for d in m.group(2).split(",")])
            if m.group(3):
                order = order.transpose([int(p) for p in m.group(3).split(",")])
            flat = order.reshape(-1)
        ids = flat.reshape(dims)
        keep = [i for i, n in enumerate(names) if n not in over]
        moved = np.moveaxis(ids, keep, list(range(len(keep)))) if keep else ids
        size = math.prod(d for n, d in zip(names, dims) if n in over)
        return moved.reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if m:
        return [[int(x) for x in grp.split(",") if x] for grp in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return None


def source_target_pairs(attrs: str) -> tuple[tuple[int, int], ...]:
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if not m:
        return ()
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1)))


def _overlapped_starts(instrs: list[Instruction], does_matmul) -> dict[str, tuple[bool, bool]]:
    """For every async collective start of one scheduled computation: (compute is scheduled
    between it and its done, that compute includes matmul work). A start marked ``is_sync``
    runs synchronously: never overlapped."""
    starts: dict[str, int] = {}
    out: dict[str, tuple[bool, bool]] = {}
    for i, ins in enumerate(instrs):
        if ins.opcode.endswith("-start") and ins.opcode[:-6] in COLLECTIVE_KINDS:
            starts[ins.name] = i
        elif ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in starts:
            s = starts.pop(ins.operands[0])
            start = instrs[s]
            if '"is_sync":true' in start.attrs:
                out[start.name] = (False, False)
                continue
            between = [x for x in instrs[s + 1:i] if x.opcode not in _NOT_COMPUTE
                       and not x.opcode.endswith(("-start", "-done", "-update"))]
            out[start.name] = (bool(between), any(does_matmul(x) for x in between))
    return out



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
        self.memo: dict[str, _Tally] = {}
        self._overlap: dict[str, tuple[bool, bool]] = {}  # the current computation's async starts
        self._access: dict[str, tuple] = {}  # fused computation -> what it reads of its operands
        # Instructions met in the reachable computations, each once.
        self.loops, self.unknown_loops, self.conditionals, self.uncounted_names = 0, 0, 0, []

    def _pick(self, ins: Instruction):
        """How a conditional's branch is chosen: ``max``/``min`` everywhere, or under ``balanced``
        the cheapest branch of the conditionals traced under one of ``min_scopes`` (a dropless
        dispatcher's overflow rounds, which a balanced routing never enters) and the costliest of
        every other (e.g. work only one pipeline stage does: the busiest device's count)."""
        if self.branch == "balanced":
            return min if any(_in_scope(ins.attrs, s) for s in self.min_scopes) else max
        return max if self.branch == "max" else min

    def tally(self, comp: str) -> _Tally:
        if comp not in self.memo:
            t = _Tally()
            self._overlap = _overlapped_starts(self.comps.get(comp, []), self._does_matmul)
            for ins in self.comps.get(comp, []):
                self._instruction(ins, comp, t)
            self.memo[comp] = t
        return self.memo[comp]

    def _launch_bytes(self, ins: Instruction, types: dict[str, str]) -> float:
        """HBM bytes one launch of ``ins`` moves: its operands and result, except that an
        operand a fusion only slices (dynamic-slice, slice, gather inside) counts the slices,
        and an in-place dynamic-update-slice root writes (and reads) only its update."""
        operands = [_nbytes(_arrays(types.get(o, ""))) for o in ins.operands]
        results = _arrays(ins.result_type)
        if ins.opcode.endswith("-start") and len(results) > len(ins.operands):  # (operands..., outputs...)
            results = results[len(ins.operands):]
        result = _nbytes(results)
        called = _called(ins.attrs, "calls") if ins.opcode == "fusion" else []
        if called and called[0] in self.comps:
            sliced, update_root = self._fusion_access(called[0])
            for i, b in sliced.items():
                if i < len(operands):
                    operands[i] = min(operands[i], b)
            if update_root is not None:
                param, update = update_root
                if param < len(operands):
                    operands[param] = 0
                result = min(result, update)
        return float(sum(operands) + result)

    def _fusion_access(self, comp: str):
        """(parameter index -> bytes read where the fusion only slices it, (parameter, update
        bytes) when the root is a dynamic-update-slice into a parameter)."""
        if comp in self._access:
            return self._access[comp]
        instrs = self.comps[comp]
        types = self.types[comp]
        params = {i.name: int(i.operands[0]) for i in instrs
                  if i.opcode == "parameter" and i.operands and i.operands[0].isdigit()}
        users: dict[str, list[Instruction]] = defaultdict(list)
        for i in instrs:
            for o in i.operands:
                users[o].append(i)
        sliced = {}
        for name, idx in params.items():
            aliases, frontier = {name}, [name]
            while frontier:  # the parameter seen through bitcasts
                for u in users.get(frontier.pop(), []):
                    if u.opcode == "bitcast":
                        aliases.add(u.name)
                        frontier.append(u.name)
            us = [u for a in aliases for u in users.get(a, []) if u.opcode != "bitcast"]
            if us and all(u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] in aliases for u in us):
                sliced[idx] = sum(_nbytes(_arrays(u.result_type)) for u in us)
        root, update_root = instrs[-1] if instrs else None, None
        while root is not None and root.opcode == "bitcast" and root.operands:
            root = {i.name: i for i in instrs}.get(root.operands[0])
        if root is not None and root.opcode == "dynamic-update-slice" and root.operands and root.operands[0] in params:
            update_root = (params[root.operands[0]], _nbytes(_arrays(types.get(root.operands[1], ""))))
        self._access[comp] = (sliced, update_root)
        return self._access[comp]

    def _does_matmul(self, ins: Instruction) -> bool:
        """Whether one execution of ``ins`` does matmul work (itself or what it calls)."""
        if ins.opcode == "dot":
            return True
        if ins.opcode == "custom-call":
            return _is_kernel_call(ins.attrs)
        called = _called(ins.attrs, "calls") + _called(ins.attrs, "body") + _called(ins.attrs, "to_apply") \
            + _called(ins.attrs, "branch_computations")
        saved = self._overlap
        try:
            return any(self.tally(c).cost()[0] > 0 for c in called if c in self.comps)
        finally:
            self._overlap = saved

    def _instruction(self, ins: Instruction, comp: str, t: _Tally) -> None:
        op, types = ins.opcode, self.types[comp]
        base = op[:-6] if op.endswith("-start") else op
        if op not in _NO_TRAFFIC and not op.endswith(("-done", "-update")) and op not in ("while", "conditional", "call"):
            t.hbm += self._launch_bytes(ins, types)
        if base in COLLECTIVE_KINDS and not op.endswith(("-done", "-update")):
            ins_bytes = _nbytes([a for o in ins.operands for a in _arrays(types.get(o, ""))])
            outs = _arrays(ins.result_type)
            if op.endswith("-start"):  # (operands..., outputs..., context scalars)
                outs = [a for a in outs[len(ins.operands):] if a[1]]
            nbytes = max(ins_bytes, _nbytes(outs))
            if base == "ragged-all-to-all":
                first = _arrays(types.get(ins.operands[0], "")) if ins.operands else []
                t.ragged += min(_nbytes(first), _nbytes(outs[:1]))
            t.coll[base][0] += 1
            t.coll[base][1] += nbytes
            overlapped, matmul = self._overlap.get(ins.name, (False, False))
            pairs = source_target_pairs(ins.attrs)
            groups = replica_groups(ins.attrs)
            first = tuple(sorted({d for p in pairs for d in p})) if pairs else (tuple(groups[0]) if groups else ())
            key = CollectiveGroup(base, first, pairs, overlapped, matmul)
            t.groups[key][0] += 1
            t.groups[key][1] += nbytes
        elif op == "dot":
            self._matmul(t, *_dot_flops(ins, types), ins.attrs)
        elif op == "custom-call":
            self._custom_call(ins, types, t)
        elif op == "while":
            self._loop(ins, comp, t)
        elif op == "conditional":
            self.conditionals += 1
            branches = (_called(ins.attrs, "branch_computations")
                        or _called(ins.attrs, "true_computation") + _called(ins.attrs, "false_computation"))
            saved = self._overlap
            tallies = [self.tally(b) for b in branches]
            self._overlap = saved
            if tallies:
                t.add(self._pick(ins)(tallies, key=_Tally.cost), 1)
        if op not in ("while", "conditional") and not op.endswith(("-done", "-update")):
            # A fusion's inside stays on chip: its HBM traffic is the fusion's operands and result.
            for called in _called(ins.attrs, "calls") + (_called(ins.attrs, "to_apply") if op == "call" else []):
                saved = self._overlap
                t.add(self.tally(called), 1, hbm=op in ("call", "async-start"))
                self._overlap = saved

    def _matmul(self, t: _Tally, flops: float, batched: bool, attrs: str) -> None:
        if _in_scope(attrs, self.exclude_scope):
            t.excluded += flops
        else:
            t.dot += flops
            t.batched += flops if batched else 0.0

    def _custom_call(self, ins: Instruction, types: dict[str, str], t: _Tally) -> None:
        shapes = [_arrays(types.get(o, "")) for o in ins.operands]
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
        n = _trip_count(ins.attrs)
        if n is None:
            n = _infer_trip_count(ins, comp, self.comps)
        self.unknown_loops += n is None
        for body in _called(ins.attrs, "body"):
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
