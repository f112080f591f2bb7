"""What a compiled step does, read from its optimized HLO text (``compiled.as_text()``).

Per device (the text is the SPMD-partitioned program of one device):

* :func:`collectives`: every collective by kind (all-reduce, all-gather, reduce-scatter,
  all-to-all, ragged-all-to-all, collective-permute, ...), how many run per step and their bytes;
* :func:`matmul_flops`: the FLOPs of every matrix multiply: ``dot`` instructions (XLA:GPU keeps
  them inside its Triton GEMM fusions) and cuBLAS GEMM custom calls.

Why parse text: ``cost_analysis()`` is None for a deviceless XLA:GPU executable, and on CPU it
counts every op, not just the matmuls Megatron's FLOP formula is about.

Counting rules
--------------
* An instruction runs as often as its computation: a ``while`` body runs its
  ``known_trip_count`` times (XLA records it for ``lax.scan`` / ``fori_loop`` loops; where a
  loop rewrite dropped it, the count is read from the loop: a constant start, ``i < N`` with a
  constant ``N``, step 1), fusions, calls and async wrappers as often as their caller. A loop
  whose count cannot be read is counted once and reported in ``Stats.unknown_loops``.
* A ``conditional`` counts its costliest branch (an upper bound: which branch runs is decided at
  run time; ``branch="min"`` counts the cheapest instead); ``Stats.conditionals`` says how many
  there were.
* Bytes of a collective are the larger of what it reads and what it writes per device (the
  full buffer for all-gather and reduce-scatter, as nccl-tests report sizes).
* A dot's FLOPs: ``2 * prod(output dims) * prod(contracted dims)``. Custom calls whose FLOPs
  cannot be read from the HLO (fused attention, Mosaic/Triton kernels) are listed by target in
  ``Stats.uncounted_custom_calls``; callers may pass ``custom_call_flops`` to count them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict
from typing import Callable

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5,
}
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                    "collective-permute", "collective-broadcast", "send", "recv")
GEMM_CUSTOM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")

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
class Stats:
    collectives: dict[str, Collective]
    matmul_flops: float
    conditionals: int = 0
    unknown_loops: int = 0
    uncounted_custom_calls: dict[str, int] = dataclasses.field(default_factory=dict)

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
    scope, arg = cond, None
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


def _dot_flops(instr: Instruction, types: dict[str, str]) -> float:
    out = _arrays(instr.result_type)
    lhs = _arrays(types.get(instr.operands[0], "")) if instr.operands else []
    if not out or not lhs:
        return 0.0
    contracted = math.prod(lhs[0][1][d] for d in _attr_list(instr.attrs, "lhs_contracting_dims"))
    return 2.0 * math.prod(out[0][1]) * contracted


def _gemm_custom_call_flops(instr: Instruction, types: dict[str, str]) -> float:
    m = re.search(r"backend_config=(\{.*\})\s*$", instr.attrs) or re.search(r"backend_config=(\{.*\})", instr.attrs)
    lhs = _arrays(types.get(instr.operands[0], "")) if instr.operands else []
    out = _arrays(instr.result_type)
    if not m or not lhs or not out:
        return 0.0
    try:
        cfg = json.loads(m.group(1))
    except json.JSONDecodeError:
        return 0.0
    dims = cfg.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    contracted = math.prod(lhs[0][1][int(d)] for d in dims.get("lhs_contracting_dimensions", []))
    return 2.0 * math.prod(out[0][1]) * contracted


def _custom_call_target(attrs: str) -> str:
    m = re.search(r'custom_call_target="([^"]*)"', attrs)
    return m.group(1) if m else "?"


def analyze(text: str, custom_call_flops: dict[str, Callable[[Instruction, dict[str, str]], float]] | None = None,
            *, branch: str = "max") -> Stats:
    """Collectives and matmul FLOPs per device per step of an optimized HLO module's text.
    ``branch``: which branch of each ``conditional`` counts, the costliest ("max", an upper
    bound) or the cheapest ("min", e.g. the no-overflow path of a dropless dispatcher)."""
    if branch not in ("max", "min"):
        raise ValueError(f"branch={branch!r}: expected 'max' or 'min'")
    pick = max if branch == "max" else min
    comps, entry = parse_module(text)
    types = {name: {i.name: i.result_type for i in instrs} for name, instrs in comps.items()}
    extra = dict(custom_call_flops or {})
    memo: dict[str, tuple[dict[str, list[float]], float, int, int, dict[str, int]]] = {}

    def visit(comp: str):
        """(collectives kind -> [count, bytes], flops, conditionals, unknown loops, uncounted)
        of one execution of ``comp``."""
        if comp in memo:
            return memo[comp]
        coll: dict[str, list[float]] = defaultdict(lambda: [0, 0])
        flops, conds, unknown = 0.0, 0, 0
        uncounted: dict[str, int] = defaultdict(int)

        def add(sub, times: float):
            nonlocal flops, conds, unknown
            c, f, nc, nu, un = sub
            for k, (n, b) in c.items():
                coll[k][0] += n * times
                coll[k][1] += b * times
            flops += f * times
            conds += nc
            unknown += nu
            for k, n in un.items():
                uncounted[k] += int(n * times)

        for ins in comps.get(comp, []):
            op = ins.opcode
            base = op[:-6] if op.endswith("-start") else op
            if base in COLLECTIVE_KINDS and not op.endswith(("-done", "-update")):
                ins_bytes = _nbytes([a for o in ins.operands for a in _arrays(types[comp].get(o, ""))])
                outs = _arrays(ins.result_type)
                if op.endswith("-start"):  # (operands..., outputs..., context scalars)
                    outs = [a for a in outs[len(ins.operands):] if a[1]]
                coll[base][0] += 1
                coll[base][1] += max(ins_bytes, _nbytes(outs))
            elif op == "dot":
                flops += _dot_flops(ins, types[comp])
            elif op == "custom-call":
                target = _custom_call_target(ins.attrs)
                if target in GEMM_CUSTOM_CALLS:
                    flops += _gemm_custom_call_flops(ins, types[comp])
                elif target in extra:
                    flops += extra[target](ins, types[comp])
                else:
                    uncounted[target] += 1
            if op == "while":
                n = _trip_count(ins.attrs)
                if n is None:
                    n = _infer_trip_count(ins, comp, comps)
                unknown += n is None
                for body in _called(ins.attrs, "body"):
                    add(visit(body), n or 1)
            elif op == "conditional":
                conds += 1
                branches = (_called(ins.attrs, "branch_computations")
                            or _called(ins.attrs, "true_computation") + _called(ins.attrs, "false_computation"))
                results = [visit(b) for b in branches]
                if results:
                    add(pick(results, key=lambda r: (r[1], sum(b for _, b in r[0].values()))), 1)
            elif not op.endswith(("-done", "-update")):
                for called in _called(ins.attrs, "calls"):
                    add(visit(called), 1)
        memo[comp] = (dict(coll), flops, conds, unknown, dict(uncounted))
        return memo[comp]

    coll, flops, conds, unknown, uncounted = visit(entry)
    return Stats({k: Collective(int(n), int(b)) for k, (n, b) in sorted(coll.items())}, flops, conds, unknown,
                 dict(uncounted))


def collectives(text: str) -> dict[str, Collective]:
    return analyze(text).collectives


def matmul_flops(text: str) -> float:
    return analyze(text).matmul_flops


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


def audit_compiled(compiled, custom_call_flops=None) -> CompiledStep:
    """:class:`CompiledStep` of a ``jax.stages.Compiled`` (``jit(f).lower(...).compile()``)."""
    mem = compiled.memory_analysis()
    if mem is None:
        raise ValueError("this executable has no memory analysis")
    peak = getattr(mem, "peak_memory_in_bytes", None)
    text = compiled.as_text()
    stats = analyze(text, custom_call_flops)
    return CompiledStep(int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes), int(mem.alias_size_in_bytes),
                        int(mem.temp_size_in_bytes), int(peak) if peak else None, stats,
                        analyze(text, custom_call_flops, branch="min") if stats.conditionals else stats)
