"""Optimized HLO text as data: the parser the planner's HLO audit (:mod:`mlir_train.planner.hlo`)
reads a compiled program with, and the readers of the attributes it needs.

:func:`parse_module` turns ``compiled.as_text()`` into computations of :class:`Instruction`
(name, opcode, result type, operand names, the rest of the line as attribute text). The other
functions read one thing each from that text: the arrays of a type and their bytes
(:func:`arrays_of`, :func:`bytes_of`), the computations an attribute names
(:func:`computations`), a loop's trip count (:func:`known_trip_count`, else
:func:`inferred_trip_count` from the loop's own instructions), whether an instruction was traced
under a ``jax.named_scope`` (:func:`in_scope`), a collective's device groups
(:func:`replica_groups`, :func:`source_target_pairs`). Nothing here counts: what a step costs is
:mod:`mlir_train.planner.hlo_cost` (one instruction) and :mod:`mlir_train.planner.hlo` (how
often each runs).
"""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5,
}

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


def arrays_of(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(type_str)
            if dt in DTYPE_BYTES]


def bytes_of(arrays) -> int:
    return int(sum(DTYPE_BYTES[dt] * math.prod(shape) for dt, shape in arrays))


def int_list(attrs: str, key: str) -> list[int]:
    m = re.search(key + r"=\{([0-9,]*)\}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def computations(attrs: str, key: str) -> list[str]:
    m = re.search(key + r"=\{([^}]*)\}", attrs)
    if m:
        return [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
    m = re.search(key + r"=%?([\w.\-]+)", attrs)
    return [m.group(1)] if m else []


def known_trip_count(attrs: str) -> int | None:
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', attrs)
    return int(m.group(1)) if m else None


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


def inferred_trip_count(loop: Instruction, caller: str, comps: dict[str, list[Instruction]]) -> int | None:
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
    conds = computations(loop.attrs, "condition")
    if start is None or not conds or conds[0] not in comps:
        return None
    cond = {i.name: i for i in comps[conds[0]]}
    root = comps[conds[0]][-1]
    scope = cond
    if root.opcode == "fusion":  # compare(param_j, constant N) inside, param_j = operand j of the fusion
        called = computations(root.attrs, "calls")
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


def in_scope(attrs: str, scope: str | None) -> bool:
    """Whether an instruction's ``op_name`` names ``jax.named_scope(scope)`` (forward or transposed)."""
    if scope is None:
        return False
    op_name = re.search(r'op_name="([^"]*)"', attrs)
    return op_name is not None and scope in op_name.group(1)


# The iota and mesh forms of replica_groups (the explicit form is read in place).
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                          r"\s*\{([^}]*)\}")


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
