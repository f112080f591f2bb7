"""Matmul FLOPs of a compiled program, read from its optimized HLO text.

``compiled.cost_analysis()`` is None for deviceless XLA:GPU compiles and counts custom calls as
nothing, so this counts the matmuls themselves:

* ``dot`` instructions (top level or inside fusions, e.g. Triton GEMM fusions):
  2 x (output elements) x (contracted elements), from the operands' shapes;
* cuBLAS GEMM custom calls (``__cublas$gemm``, ``__cublas$lt$matmul``): the same from their
  operands and the ``dot_dimension_numbers`` of their backend config;
* the MoE block kernels of :mod:`mlir_train.model.moe.gpu` (``mosaic_gpu_v2`` custom calls
  whose ``op_name`` names the kernel): their static bound, 2 x R x K x N for R block rows,
  from the operand shapes. The kernels compute only the used blocks, so the work a step does
  is that bound times (used block rows / R), which depends on the routing: see
  :func:`MatmulFlops.kernel_flops_for_rows`. Other ``mosaic_gpu`` calls are listed, uncounted;
* tokamax's kernels (their ``op_name`` carries the op as JSON): the Mosaic-GPU / Triton ragged
  dots of ``--moe-gemm-backend tokamax`` as block kernels (:class:`KernelCall`), the Mosaic-GPU
  flash attention's forward and backward kernels by their tile loops (:class:`AttentionCall`;
  ``attention_flops`` with one document per row, :meth:`AttentionCall.flops` for packed rows);
* the Pallas FlashAttention kernels (``__gpu$xla.gpu.triton`` calls under ``mha_forward`` /
  ``mha_backward``, :func:`mlir_train.model.attention.flash_attention`): from q's shape
  ``[B, T, N, H]`` and the kernel's causal loop structure (key tiles up to the diagonal, the
  tiles read from the call's launch grid, since :func:`~mlir_train.model.attention.flash_block_sizes`
  picks them per GPU): the forward does
  2 matmuls per visited (query tile, key tile) pair, the backward 7 (the dK/dV loop
  recomputes the scores and dP, then dV and dK; the dQ loop recomputes both again, then dQ);
* our document-skipping Pallas-Triton attention (``docs_flash_{fwd,dq,dkv}_q<bq>_k<bk>``,
  :mod:`mlir_train.model.docs_flash`, ``--attention-kernel mlir``) by the tiles it visits
  (:class:`DocsFlashCall`; ``attention_flops`` with one document per row,
  :meth:`DocsFlashCall.flops` for packed rows' document starts).

Instructions inside a ``while`` body count as many times as the loop's ``known_trip_count``
(XLA's annotation, e.g. a layer ``scan``), nested loops multiplying; a loop without a known
trip count (a data-dependent ``fori_loop``) counts its body once and is listed in
``unknown_trip_count_loops``: a figure with such loops is not the work.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import numpy as np

_SHAPE = r"[a-z0-9]+\[[0-9,]*\]"
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_PARAMS = re.compile(r"(?:%?)([\w.\-]+):\s*(" + _SHAPE + r")")
_DIMS = re.compile(r"(lhs|rhs)_(contracting|batch)_dims=\{([0-9,]*)\}")


def _dims(shape: str) -> tuple[int, ...]:
    inner = shape[shape.index("[") + 1:shape.index("]")]
    return tuple(int(d) for d in inner.split(",") if d)


@dataclasses.dataclass
class KernelCall:
    name: str  # moe_block_matmul | moe_block_matmul_t | tokamax_ragged_dot (+ _t: the weight gradient)
    rows: int  # R: block rows of the buffer (the static bound's rows)
    flops_bound: float  # 2 R K N
    row_tile: int = 64  # rows per tile the kernel rounds each group up to (tokamax's Triton kernel: 128)

    def flops_for_rows(self, used_rows: float) -> float:
        return self.flops_bound * used_rows / self.rows


@dataclasses.dataclass
class MatmulFlops:
    dot_flops: float = 0.0  # dots and cuBLAS GEMMs (outside ``exclude_scope``)
    excluded_flops: float = 0.0  # dots and GEMMs whose op_name names ``exclude_scope``
    batched_dot_flops: float = 0.0  # the part with batch dimensions (expert-batched matmuls)
    kernels: list[KernelCall] = dataclasses.field(default_factory=list)
    attention_flops: float = 0.0  # flash attention kernels (tokamax's: with one document per row)
    attention_calls: list["AttentionCall"] = dataclasses.field(default_factory=list)  # tokamax's
    other_custom_calls: list[str] = dataclasses.field(default_factory=list)
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


def matmul_flops(hlo_text: str, exclude_scope: str | None = None) -> MatmulFlops:
    """Matmul FLOPs of ``hlo_text``; dots and GEMMs traced under ``jax.named_scope(exclude_scope)``
    (their ``op_name`` names it, forward and transposed) go to ``excluded_flops`` instead."""
    shapes: dict[str, tuple[int, ...]] = {}
    lines = hlo_text.splitlines()
    for line in lines:
        if "{" in line and "->" in line and "(" in line and "=" not in line.split("(")[0]:
            for name, shape in _PARAMS.findall(line.split("->")[0]):
                shapes[name] = _dims(shape)
        m = _INSTR.match(line)
        if m and re.match(_SHAPE, m.group(2).lstrip("(")):
            shapes[m.group(1)] = _dims(re.match(_SHAPE, m.group(2).lstrip("(")).group(0))
    multiplier = _computation_multipliers(lines)
    out = MatmulFlops()
    computation = None
    for line in lines:
        header = _HEADER.match(line) if not line.startswith(" ") else None
        if header:
            computation = header.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        times = multiplier.get(computation, 1)
        name, result, op, rest = m.groups()
        operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        if op == "while":
            out.while_loops += 1
            out.unknown_trip_count_loops += _trip_count(rest) is None
        elif op == "dot":
            dims = {(s, kind): [int(d) for d in v.split(",") if d] for s, kind, v in _DIMS.findall(rest)}
            lhs = shapes.get(operands[0]) if operands else None
            if lhs is None:
                continue
            contracted = math.prod(lhs[d] for d in dims.get(("lhs", "contracting"), []))
            flops = 2.0 * math.prod(shapes[name]) * contracted * times
            if _in_scope(rest, exclude_scope):
                out.excluded_flops += flops
                continue
            out.dot_flops += flops
            if dims.get(("lhs", "batch")):
                out.batched_dot_flops += flops
        elif op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            target = target.group(1) if target else ""
            if target.startswith("__cublas") and ("gemm" in target or "matmul" in target):
                flops, batched = _gemm_flops(rest, [shapes.get(o) for o in operands[:2]])
                flops *= times
                if _in_scope(rest, exclude_scope):
                    out.excluded_flops += flops
                    continue
                out.dot_flops += flops
                out.batched_dot_flops += flops if batched else 0.0
            elif target == "__gpu$xla.gpu.triton" and _flash_flops(rest) is not None:
                out.attention_flops += _flash_flops(rest) * times
            elif target == "__gpu$xla.gpu.triton" and (dc := _docs_flash_call(rest)) is not None:
                out.attention_calls.extend([dc] * times)
                out.attention_flops += dc.flops() * times
            elif (tk := _tokamax_call(rest, shapes.get(name), result)) is not None:
                if isinstance(tk, KernelCall):
                    out.kernels.extend([tk] * times)
                else:
                    out.attention_calls.extend([tk] * times)
                    out.attention_flops += tk.flops() * times
            elif target.startswith("mosaic_gpu"):
                kernel = _block_kernel(rest)
                if kernel is None:
                    out.other_custom_calls.append(name)
                else:
                    out.kernels.extend([kernel] * times)
    return out


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEES = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")


def _trip_count(rest: str) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
    return int(m.group(1)) if m else None


def _computation_multipliers(lines: list[str]) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation: 1 for the
    entry, a while body's caller's count times the loop's known trip count (1 if unknown), any
    other callee (fusions, calls, branches: each counted as if taken) its caller's count."""
    edges: dict[str, list[tuple[str, int]]] = {}
    entry, computation = None, None
    for line in lines:
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            computation = header.group(1)
            if line.startswith("ENTRY"):
                entry = computation
            continue
        m = _INSTR.match(line)
        if not m or computation is None:
            continue
        rest = m.group(4)
        trips = _trip_count(rest) if m.group(3) == "while" else None
        for kind, names in _CALLEES.findall(rest):
            for callee in re.findall(r"%?([\w.\-]+)", names):
                edges.setdefault(computation, []).append((callee, (trips or 1) if kind == "body" else 1))
    multiplier: dict[str, int] = {}

    def visit(name: str, times: int, depth: int = 0):
        if depth > 64:
            return
        multiplier[name] = multiplier.get(name, 0) + times
        for callee, factor in edges.get(name, []):
            visit(callee, times * factor, depth + 1)

    if entry is not None:
        visit(entry, 1)
    return multiplier


def _in_scope(rest: str, scope: str | None) -> bool:
    if scope is None:
        return False
    op_name = re.search(r'op_name="([^"]*)"', rest)
    return op_name is not None and scope in op_name.group(1)


def _gemm_flops(rest: str, operand_shapes) -> tuple[float, bool]:
    config = re.search(r"backend_config=(\{.*\})", rest)
    if config is None or None in operand_shapes:
        return 0.0, False
    try:
        dnums = json.loads(config.group(1))["gemm_backend_config"]["dot_dimension_numbers"]
    except (ValueError, KeyError):
        return 0.0, False
    lhs, rhs = operand_shapes
    lc = [int(d) for d in dnums.get("lhs_contracting_dimensions", [])]
    lb = [int(d) for d in dnums.get("lhs_batch_dimensions", [])]
    rc = [int(d) for d in dnums.get("rhs_contracting_dimensions", [])]
    rb = [int(d) for d in dnums.get("rhs_batch_dimensions", [])]
    batch = math.prod(lhs[d] for d in lb)
    m = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
    n = math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb)
    k = math.prod(lhs[d] for d in lc)
    return 2.0 * batch * m * n * k, bool(lb)


def _block_kernel(rest: str) -> KernelCall | None:
    op_name = re.search(r'op_name="([^"]*)"', rest)
    layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", rest)
    if op_name is None or layouts is None:
        return None
    shapes = [_dims(s) for s in re.findall(_SHAPE, layouts.group(1))]
    path = op_name.group(1).split("/")
    if "moe_block_matmul_t" in path:
        (k, r), (_, n) = shapes[2], shapes[3]  # lhs [K, R], rhs [R, N]
        return KernelCall("moe_block_matmul_t", r, 2.0 * r * k * n)
    if "moe_block_matmul" in path:
        (r, k), (_, _, n) = shapes[2], shapes[3]  # lhs [R, K], rhs [E, K, N]
        return KernelCall("moe_block_matmul", r, 2.0 * r * k * n)
    return None


def _causal_tile_pairs(t: int, tile_q: int, tile_k: int) -> int:
    """(query tile, key tile) pairs a causal loop visits: key tiles up to each query tile's end."""
    return sum(-(-((i + 1) * tile_q) // tile_k) for i in range(t // tile_q))


def _flash_flops(rest: str) -> float | None:
    from mlir_train.model.attention import flash_block_sizes

    op_name = re.search(r'op_name="([^"]*)"', rest)
    layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", rest)
    if op_name is None or layouts is None:
        return None
    path = op_name.group(1)
    forward = re.search(r"(^|[/(])mha_forward([/)]|$)", path) is not None
    if not forward and re.search(r"(^|[/(])mha_backward([/)]|$)", path) is None:
        return None
    b, t, n, h = _dims(re.findall(_SHAPE, layouts.group(1))[0])
    # The tiles depend on the target GPU (flash_block_sizes): read them from the launch grid,
    # (T / block_q, B, N) forward and (B, N, T / block_kv) backward, whose tiles are square.
    grid = re.search(r"grid_x = (\d+)\D+grid_y = (\d+)\D+grid_z = (\d+)", rest)
    if grid is not None:
        tile = t // int(grid.group(1 if forward else 3))
        tiles = (tile, tile)
    else:
        blocks = flash_block_sizes(t)
        tiles = (blocks.block_q, blocks.block_k) if forward else (blocks.block_q_dkv, blocks.block_kv_dkv)
    pairs = _causal_tile_pairs(t, *tiles) * tiles[0] * tiles[1]
    if forward:
        return 2 * 2.0 * b * n * h * pairs
    return 2.0 * b * n * h * 7 * pairs  # dK, dV: 4 matmuls a tile pair; dQ: 3, on the same tiles


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One of tokamax's Mosaic-GPU flash attention kernels (sm90), from its op_name's JSON: the
    forward ("fwd"), or the backward's dQ ("dq") or dK/dV ("dkv") kernel, with q's ``[B, T, N, H]``
    and the kernel's tiles. The forward visits, per query tile, the key tiles from the tile's lowest
    document start (``Mask.k_start``) to the causal diagonal; tokamax 0.0.12's backward kernels
    mask by the document starts but visit every causal tile."""
    kind: str
    b: int
    t: int
    n: int
    h: int
    tile_q: int   # query rows per tile (two warpgroups' blocks)
    tile_k: int   # key rows per tile
    k_start: bool

    def flops(self, k_start_T=None) -> float:
        """The work for the document starts ``k_start_T`` (each position's first visible key; None:
        one document per row)."""
        t, tq, tk = self.t, self.tile_q, self.tile_k
        if self.kind == "dkv":  # per key tile, the query tiles from the diagonal on: 4 matmuls
            pairs = sum(-(-t // tq) - (j * tk) // tq for j in range(-(-t // tk)))
            return 4 * 2.0 * self.b * self.n * self.h * pairs * tq * tk
        pairs = 0
        for i in range(-(-t // tq)):
            ub = -(-min(t, (i + 1) * tq) // tk)
            lb = 0
            if self.kind == "fwd" and self.k_start and k_start_T is not None:
                lb = int(min(k_start_T[i * tq:(i + 1) * tq])) // tk
            pairs += ub - lb
        return (2 if self.kind == "fwd" else 3) * 2.0 * self.b * self.n * self.h * pairs * tq * tk


@dataclasses.dataclass(frozen=True)
class DocsFlashCall:
    """One of our document-skipping Pallas-Triton attention kernels
    (:mod:`mlir_train.model.docs_flash`, op_name ``docs_flash_{fwd,dq,dkv}_q<bq>_k<bk>``), with q's
    ``[B, T, N, H]``. Forward and dQ visit, per query tile, the key tiles from the tile's first
    document start to the causal diagonal (2 and 3 matmuls a tile pair); dK/dV, per key tile, the
    query tiles from the diagonal to the tile's last document end (4 matmuls), for each query head."""
    kind: str  # fwd | dq | dkv
    b: int
    t: int
    n: int
    h: int
    tile_q: int
    tile_k: int

    def pairs(self, k_start_T=None) -> int:
        """(query tile, key tile) pairs visited for the document starts ``k_start_T`` (each
        position's first index of its run of equal segment ids; None: one document per row)."""
        t, tq, tk = self.t, self.tile_q, self.tile_k
        start = np.zeros(t, np.int64) if k_start_T is None else np.asarray(k_start_T, np.int64)
        if self.kind == "dkv":
            # a run's last index: the position before the next run's start
            nxt = np.append(np.nonzero(np.diff(start))[0], t - 1)  # last index of each run
            end = np.repeat(nxt, np.diff(np.concatenate([[-1], nxt])))
            return int(sum(int(end[j * tk:(j + 1) * tk].max()) // tq + 1 - (j * tk) // tq for j in range(t // tk)))
        return int(sum(-(-((i + 1) * tq) // tk) - int(start[i * tq:(i + 1) * tq].min()) // tk for i in range(t // tq)))

    def flops(self, k_start_T=None) -> float:
        matmuls = {"fwd": 2, "dq": 3, "dkv": 4}[self.kind]
        return matmuls * 2.0 * self.b * self.n * self.h * self.pairs(k_start_T) * self.tile_q * self.tile_k


def _docs_flash_call(rest: str) -> DocsFlashCall | None:
    op_name = re.search(r'op_name="([^"]*)"', rest)
    layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", rest)
    if op_name is None or layouts is None:
        return None
    kernel = re.search(r"(?:^|[/(])docs_flash_(fwd|dq|dkv)_q(\d+)_k(\d+)(?:[/)]|$)", op_name.group(1))
    if kernel is None:
        return None
    b, t, n, h = _dims(re.findall(_SHAPE, layouts.group(1))[0])
    return DocsFlashCall(kernel.group(1), b, t, n, h, int(kernel.group(2)), int(kernel.group(3)))


def _tokamax_json(rest: str):
    op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', rest)
    if op_name is None or "tokamax:{" not in op_name.group(1):
        return None
    text = op_name.group(1).replace('\\"', '"')
    try:
        return json.JSONDecoder().raw_decode(text[text.index("tokamax:{") + len("tokamax:"):])[0]
    except ValueError:
        return None


def _tokamax_call(rest: str, result_shape, result_text: str):
    """A tokamax kernel call (its op_name carries the op as JSON) as a :class:`KernelCall` (ragged
    dot: 2 R K N over the ``R`` lhs rows, computed for the rows of the groups only, each rounded up
    to the kernel's ``block_m``) or an :class:`AttentionCall`; None for anything else."""
    op = _tokamax_json(rest)
    if op is None:
        return None
    kind = op.get("op", {}).get("__type", "")
    config = op.get("op", {}).get("config") or {}
    args = op.get("arguments", {})
    if kind.endswith("RaggedDot"):
        lhs = _dims(args["lhs"]) if isinstance(args.get("lhs"), str) else None
        if lhs is None or result_shape is None:
            return None
        tile = int(config.get("block_m", 64))
        if len(result_shape) == 3:  # ragged contracting: [R, K] x [R, N] -> [E, K, N]
            _, k, n = result_shape
            return KernelCall("tokamax_ragged_dot_t", lhs[0], 2.0 * lhs[0] * k * n, tile)
        r, n = result_shape
        return KernelCall("tokamax_ragged_dot", r, 2.0 * r * lhs[1] * n, tile)
    if kind.endswith("PallasMosaicGpuFlashAttention") or kind.endswith("PallasMosaicGpuFlashAttentionVjp"):
        b, t, n, h = _dims(args["q"])
        k_start = bool((args.get("mask") or {}).get("k_start"))
        if kind.endswith("Vjp"):
            wgs = int(config.get("compute_wgs", 2))
            if result_text.count("[") >= 2:  # (dk, dv)
                return AttentionCall("dkv", b, t, n, h, int(config["block_q_dkv"]), wgs * int(config["block_kv_dkv"]),
                                     k_start)
            return AttentionCall("dq", b, t, n, h, wgs * int(config["block_q_dq"]), int(config["block_kv_dq"]), k_start)
        return AttentionCall("fwd", b, t, n, h, 2 * int(config["block_q"]), int(config["block_kv"]), k_start)
    return None


def custom_call_counters() -> dict:
    """This module's kernel counters in :func:`mlir_train.planner.hlo.analyze`'s
    ``custom_call_flops`` form (target -> f(instruction, types)): the flash-attention Triton
    kernels by their causal tile pairs, tokamax's flash attention with one document per row, the
    MoE block kernels (ours and tokamax's) at their static bound (every block of the buffer: the
    planner's upper bound, no routing assumed)."""
    def flash(ins, types):
        docs = _docs_flash_call(ins.attrs)
        return docs.flops() if docs is not None else (_flash_flops(ins.attrs) or 0.0)

    def block(ins, types):
        result = re.match(_SHAPE, ins.result_type.lstrip("("))
        tk = _tokamax_call(ins.attrs, _dims(result.group(0)) if result else None, ins.result_type)
        if tk is not None:  # tokamax: ragged dots at their static bound, attention with one document per row
            return tk.flops_bound if isinstance(tk, KernelCall) else tk.flops()
        kernel = _block_kernel(ins.attrs)
        return 0.0 if kernel is None else kernel.flops_bound

    return {"__gpu$xla.gpu.triton": flash, "mosaic_gpu": block, "mosaic_gpu_v2": block}
