"""What one execution of one instruction of an optimized HLO program costs, per device: the
FLOPs of a ``dot``, the bytes of a collective, the HBM bytes of a launch, and which async
collectives the schedule overlaps with compute.

:mod:`mlir_train.planner.hlo` multiplies these by how often each instruction runs (its one
traversal: loop trip counts, conditional branches, callers); the rules are in its docstring.
Custom calls are read by :mod:`mlir_train.planner.hlo_kernels`, the text by
:mod:`mlir_train.planner.hlo_text`.
"""

from __future__ import annotations

import math
from collections import defaultdict

from mlir_train.planner.hlo_kernels import custom_call_target
from mlir_train.planner.hlo_text import Instruction, arrays_of, bytes_of, computations, int_list

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                    "collective-permute", "collective-broadcast", "send", "recv")
# Instructions that launch no work and move no bytes of their own.
NO_TRAFFIC = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                        "add-dependency", "partition-id", "replica-id", "opt-barrier", "domain"})
# ... and those that are not compute for the overlap count (copies are data movement the
# scheduler may also hide, but not the compute a collective should overlap).
_NOT_COMPUTE = NO_TRAFFIC | {"copy", "copy-start", "copy-done", "send", "send-done", "recv", "recv-done"}
# Custom calls that do matmul work: cuBLAS / cuDNN GEMMs and attention, Mosaic / Triton / Pallas kernels.
_KERNEL_TARGETS = ("cublas", "cudnn", "gemm", "mosaic", "triton", "pallas")

# What a fused computation reads of its operands: parameter index -> bytes read where the
# fusion only slices that parameter, and (parameter, update bytes) when its root is a
# dynamic-update-slice into a parameter (else None).
FusionAccess = tuple[dict[int, int], tuple[int, int] | None]


def dot_flops(instr: Instruction, types: dict[str, str]) -> tuple[float, bool]:
    """(FLOPs, has batch dimensions) of a ``dot``."""
    out = arrays_of(instr.result_type)
    lhs = arrays_of(types.get(instr.operands[0], "")) if instr.operands else []
    if not out or not lhs:
        return 0.0, False
    contracted = math.prod(lhs[0][1][d] for d in int_list(instr.attrs, "lhs_contracting_dims"))
    return 2.0 * math.prod(out[0][1]) * contracted, bool(int_list(instr.attrs, "lhs_batch_dims"))


def is_kernel_call(attrs: str) -> bool:
    """Whether a custom call does matmul work (a GEMM, attention, a Mosaic / Triton / Pallas kernel)."""
    target = custom_call_target(attrs).lower()
    return any(k in target for k in _KERNEL_TARGETS)


def collective_bytes(ins: Instruction, types: dict[str, str]) -> tuple[int, int]:
    """(bytes, ragged traffic) of one execution of a collective (or its ``-start``): bytes the
    larger of what it reads and what it writes; ragged traffic, for a ragged all-to-all, the
    smaller of its send and receive buffers (what a balanced routing carries), else 0."""
    ins_bytes = bytes_of([a for o in ins.operands for a in arrays_of(types.get(o, ""))])
    outs = arrays_of(ins.result_type)
    if ins.opcode.endswith("-start"):  # (operands..., outputs..., context scalars)
        outs = [a for a in outs[len(ins.operands):] if a[1]]
    ragged = 0
    if ins.opcode.removesuffix("-start") == "ragged-all-to-all":
        first = arrays_of(types.get(ins.operands[0], "")) if ins.operands else []
        ragged = min(bytes_of(first), bytes_of(outs[:1]))
    return max(ins_bytes, bytes_of(outs)), ragged


def wraps_collective(ins: Instruction, comps: dict[str, list[Instruction]]) -> bool:
    """Whether ``ins`` is an async fusion (``fusion-start``) whose fused computation holds a
    collective: newer XLA:GPU (jax 0.12.1) emits small all-reduces as Triton collective fusions
    (``kind=kCustom``, ``"kind":"__triton_collective"``), a ``fusion-start`` / ``fusion-done``
    pair around a synchronous ``all-reduce`` where jax 0.10.2 had ``all-reduce-start`` /
    ``-done``."""
    if ins.opcode != "fusion-start":
        return False
    return any(i.opcode.removesuffix("-start") in COLLECTIVE_KINDS
               for c in computations(ins.attrs, "calls") for i in comps.get(c, []))


def overlapped_starts(instrs: list[Instruction], does_matmul,
                      comps: dict[str, list[Instruction]] | None = None) -> dict[str, tuple[bool, bool]]:
    """For every async collective start of one scheduled computation: (compute is scheduled
    between it and its done, that compute includes matmul work). A start marked ``is_sync``
    runs synchronously: never overlapped. An async fusion wrapping a collective
    (:func:`wraps_collective`; ``comps``, the module's computations, to look inside) is such a
    start too, and is no compute for another's overlap; any other async fusion
    (``fusion-start``, e.g. jax 0.12.1's dynamic-slice fusions) is compute, as the plain fusion
    it was in jax 0.10.2."""
    comps = comps or {}
    starts: dict[str, int] = {}
    out: dict[str, tuple[bool, bool]] = {}
    wrappers = {ins.name for ins in instrs if wraps_collective(ins, comps)}
    for i, ins in enumerate(instrs):
        if (ins.opcode.endswith("-start") and ins.opcode[:-6] in COLLECTIVE_KINDS) or ins.name in wrappers:
            starts[ins.name] = i
        elif ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in starts:
            s = starts.pop(ins.operands[0])
            start = instrs[s]
            if '"is_sync":true' in start.attrs:
                out[start.name] = (False, False)
                continue
            between = [x for x in instrs[s + 1:i] if x.opcode not in _NOT_COMPUTE and x.name not in wrappers
                       and (x.opcode == "fusion-start" or not x.opcode.endswith(("-start", "-done", "-update")))]
            out[start.name] = (bool(between), any(does_matmul(x) for x in between))
    return out


def launch_bytes(ins: Instruction, types: dict[str, str], access: FusionAccess | None) -> float:
    """HBM bytes one launch of ``ins`` moves: its operands and result, except that an
    operand a fusion only slices (dynamic-slice, slice, gather inside) counts the slices,
    and an in-place dynamic-update-slice root writes (and reads) only its update. ``access``:
    :func:`fusion_access` of the computation a fusion calls, None for other instructions."""
    operands = [bytes_of(arrays_of(types.get(o, ""))) for o in ins.operands]
    results = arrays_of(ins.result_type)
    if ins.opcode.endswith("-start") and len(results) > len(ins.operands):  # (operands..., outputs...)
        results = results[len(ins.operands):]
    result = bytes_of(results)
    if access is not None:
        sliced, update_root = access
        for i, b in sliced.items():
            if i < len(operands):
                operands[i] = min(operands[i], b)
        if update_root is not None:
            param, update = update_root
            if param < len(operands):
                operands[param] = 0
            result = min(result, update)
    return float(sum(operands) + result)


def fusion_access(instrs: list[Instruction], types: dict[str, str]) -> FusionAccess:
    """What the fused computation ``instrs`` reads of its operands (:data:`FusionAccess`)."""
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
            sliced[idx] = sum(bytes_of(arrays_of(u.result_type)) for u in us)
    root, update_root = instrs[-1] if instrs else None, None
    while root is not None and root.opcode == "bitcast" and root.operands:
        root = {i.name: i for i in instrs}.get(root.operands[0])
    if root is not None and root.opcode == "dynamic-update-slice" and root.operands and root.operands[0] in params:
        update_root = (params[root.operands[0]], bytes_of(arrays_of(types.get(root.operands[1], ""))))
    return sliced, update_root
