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


@dataclasses.dataclass
class Stats:
    collectives: dict[str, Collective]
    flops: MatmulFlops
    conditionals: int = 0
    unknown_loops: int = 0
    uncounted_custom_calls: dict[str, int] = dataclasses.field(default_factory=dict)

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

    def add(self, other: _Tally, times: int) -> None:
        for k, (n, b) in other.coll.items():
            self.coll[k][0] += n * times
            self.coll[k][1] += b * times
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

    def __init__(self, comps: dict[str, list[Instruction]], entry: str, branch: str, exclude_scope: str | None):
        if branch not in ("max", "min"):
            raise ValueError(f"branch={branch!r}: expected 'max' or 'min'")
        self.pick = max if branch == "max" else min
        self.exclude_scope = exclude_scope
        self.comps, self.entry = comps, entry
        self.types = {name: {i.name: i.result_type for i in instrs} for name, instrs in comps.items()}
        self.memo: dict[str, _Tally] = {}
        # Instructions met in the reachable computations, each once.
        self.loops, self.unknown_loops, self.conditionals, self.uncounted_names = 0, 0, 0, []

    def tally(self, comp: str) -> _Tally:
        if comp not in self.memo:
            t = _Tally()
            for ins in self.comps.get(comp, []):
                self._instruction(ins, comp, t)
            self.memo[comp] = t
        return self.memo[comp]

    def _instruction(self, ins: Instruction, comp: str, t: _Tally) -> None:
        op, types = ins.opcode, self.types[comp]
        base = op[:-6] if op.endswith("-start") else op
        if base in COLLECTIVE_KINDS and not op.endswith(("-done", "-update")):
            ins_bytes = _nbytes([a for o in ins.operands for a in _arrays(types.get(o, ""))])
            outs = _arrays(ins.result_type)
            if op.endswith("-start"):  # (operands..., outputs..., context scalars)
                outs = [a for a in outs[len(ins.operands):] if a[1]]
            t.coll[base][0] += 1
            t.coll[base][1] += max(ins_bytes, _nbytes(outs))
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
            tallies = [self.tally(b) for b in branches]
            if tallies:
                t.add(self.pick(tallies, key=_Tally.cost), 1)
        if op not in ("while", "conditional") and not op.endswith(("-done", "-update")):
            for called in _called(ins.attrs, "calls") + (_called(ins.attrs, "to_apply") if op == "call" else []):
                t.add(self.tally(called), 1)

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
            t.add(self.tally(body), 1 if n is None else n)


def analyze(text: str, *, branch: str = "max", exclude_scope: str | None = None) -> Stats:
    """Collectives and matmul FLOPs per device per step of an optimized HLO module's text.
    ``branch``: which branch of each ``conditional`` counts, the costliest ("max", an upper
    bound) or the cheapest ("min", e.g. the no-overflow path of a dropless dispatcher). Dots and
    GEMMs traced under ``jax.named_scope(exclude_scope)`` (their ``op_name`` names it, forward
    and transposed) go to ``flops.excluded_flops`` instead of ``flops.dot_flops``."""
    return _analyze(parse_module(text), branch, exclude_scope)


def _analyze(module: tuple[dict[str, list[Instruction]], str], branch: str = "max",
             exclude_scope: str | None = None) -> Stats:
    reader = _Reader(*module, branch, exclude_scope)
    t = reader.tally(reader.entry)
    flops = MatmulFlops(
        dot_flops=t.dot, excluded_flops=t.excluded, batched_dot_flops=t.batched,
        kernels=[k for k, n in t.kernels.items() for _ in range(int(n))], attention_flops=t.attention,
        attention_calls=[c for c, n in t.attention_calls.items() for _ in range(int(n))],
        other_custom_calls=reader.uncounted_names, while_loops=reader.loops,
        unknown_trip_count_loops=reader.unknown_loops)
    return Stats({k: Collective(int(n), int(b)) for k, (n, b) in sorted(t.coll.items())}, flops,
                 reader.conditionals, reader.unknown_loops, {k: int(n) for k, n in t.uncounted.items()})


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
    return CompiledStep(int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes), int(mem.alias_size_in_bytes),
                        int(mem.temp_size_in_bytes), int(peak) if peak else None, stats,
                        _analyze(module, "min") if stats.conditionals else stats)
