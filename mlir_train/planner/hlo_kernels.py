"""What each kernel custom call of an optimized HLO computes: the recognisers that
:mod:`mlir_train.planner.hlo`'s one traversal asks about every ``custom-call`` it meets.

``compiled.cost_analysis()`` is None for deviceless XLA:GPU compiles and counts custom calls as
nothing, so the FLOPs of these calls are read from their operands, attributes and op names:

* cuBLAS GEMM custom calls (``__cublas$gemm``, ``__cublas$lt$matmul``): 2 x batch x M x N x K from
  their operands and the ``dot_dimension_numbers`` of their backend config;
* the MoE block kernels of :mod:`mlir_train.model.kernels.mosaic_moe` (``mosaic_gpu_v2`` custom calls
  whose ``op_name`` names the kernel): their static bound, 2 x R x K x N for R block rows,
  from the operand shapes. The kernels compute only the used blocks, so the work a step does
  is that bound times (used block rows / R), which depends on the routing: see
  :meth:`KernelCall.flops_for_rows`. Other ``mosaic_gpu`` calls are listed, uncounted;
* tokamax's kernels (their metadata carries the op as JSON: ``metadata_payload`` from tokamax 0.0.17,
  ``op_name`` in 0.0.12; :func:`_tokamax_json`): the Mosaic-GPU / Triton ragged
  dots of ``--moe-gemm-backend tokamax`` as block kernels (:class:`KernelCall`), the Mosaic-GPU
  flash attention's forward and backward kernels by their tile loops (:class:`AttentionCall`;
  one document per row, :meth:`AttentionCall.flops` for packed rows);
* the Pallas FlashAttention kernels (``__gpu$xla.gpu.triton`` calls under ``mha_forward`` /
  ``mha_backward``, :func:`mlir_train.model.attention.flash_attention`): from q's shape
  ``[B, T, N, H]`` and the kernel's causal loop structure (key tiles up to the diagonal, the
  tiles read from the call's launch grid, since :func:`~mlir_train.model.attention.flash_block_sizes`
  picks them per GPU): the forward does
  2 matmuls per visited (query tile, key tile) pair, the backward 7 (the dK/dV loop
  recomputes the scores and dP, then dV and dK; the dQ loop recomputes both again, then dQ);
* our document-skipping Pallas-Triton attention (``docs_flash_{fwd,dq,dkv,bwd}_q<bq>_k<bk>``,
  :mod:`mlir_train.model.kernels.docs_flash`, ``--attention-kernel mlir``) by the tiles it visits
  (:class:`DocsFlashCall`; one document per row, :meth:`DocsFlashCall.flops` for packed rows'
  document starts).

:func:`read_custom_call` is the one entry: a :class:`Read` (what the call counts as, per
execution) or None for a call whose FLOPs the HLO does not show.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import numpy as np

_SHAPE = r"[a-z0-9]+\[[0-9,]*\]"


def _dims(shape: str) -> tuple[int, ...]:
    inner = shape[shape.index("[") + 1:shape.index("]")]
    return tuple(int(d) for d in inner.split(",") if d)


@dataclasses.dataclass(frozen=True)
class KernelCall:
    name: str  # moe_block_matmul | moe_block_matmul_t | tokamax_ragged_dot (+ _t: the weight gradient)
    rows: int  # R: block rows of the buffer (the static bound's rows)
    flops_bound: float  # 2 R K N
    row_tile: int = 64  # rows per tile the kernel rounds each group up to (tokamax's Triton kernel: 128)

    def flops_for_rows(self, used_rows: float) -> float:
        return self.flops_bound * used_rows / self.rows


def _gemm_flops(rest: str, operand_shapes) -> tuple[float, bool]:
    """(2 x batch x M x N x K, has batch dimensions) of a cuBLAS GEMM call."""
    at = rest.find("backend_config=")
    if at < 0 or len(operand_shapes) < 2 or None in operand_shapes[:2]:
        return 0.0, False
    try:  # the config is JSON; whatever follows it on the line is not
        config = json.JSONDecoder().raw_decode(rest, at + len("backend_config="))[0]
        dnums = config["gemm_backend_config"]["dot_dimension_numbers"]
    except (ValueError, KeyError, TypeError):
        return 0.0, False
    lhs, rhs = operand_shapes[:2]
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


def _dkv_tile_pairs(t: int, tile_q: int, tile_k: int) -> int:
    """(query tile, key tile) pairs the Pallas backward's causal dK/dV loop visits: per key tile,
    the query tiles from the one holding its first key on (the same as
    :func:`_causal_tile_pairs` for square tiles)."""
    return sum(t // tile_q - (j * tile_k) // tile_q for j in range(t // tile_k))


def _flash_flops(rest: str) -> float | None:
    from mlir_train.model.attention import flash_backward_tiles, flash_block_sizes

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
    # (T / block_q, B, N) forward, whose tiles are square, and (B, N, T / block_kv_dkv) backward,
    # whose other tiles follow from that one and the head width (flash_backward_tiles).
    # As XLA prints it: "grid_x = 16 : i32, grid_y = 1 : i32, grid_z = 4 : i32".
    grid = re.search(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", rest)
    if grid is not None:
        tile = t // int(grid.group(1 if forward else 3))
        fwd, bwd = (tile, tile), flash_backward_tiles(tile, h)
    else:
        blocks = flash_block_sizes(t, head_dim=h)
        fwd = (blocks.block_q, blocks.block_k)
        bwd = (blocks.block_q_dkv, blocks.block_kv_dkv, blocks.block_q_dq, blocks.block_kv_dq)
    if forward:
        return 2 * 2.0 * b * n * h * _causal_tile_pairs(t, *fwd) * fwd[0] * fwd[1]
    q_dkv, kv_dkv, q_dq, kv_dq = bwd
    dkv = _dkv_tile_pairs(t, q_dkv, kv_dkv) * q_dkv * kv_dkv
    dq = _causal_tile_pairs(t, q_dq, kv_dq) * q_dq * kv_dq
    return 2.0 * b * n * h * (4 * dkv + 3 * dq)  # dK, dV: 4 matmuls a tile pair; dQ: 3


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
    (:mod:`mlir_train.model.kernels.docs_flash`, op_name ``docs_flash_{fwd,dq,dkv,bwd}_q<bq>_k<bk>``),
    with q's ``[B, T, N, H]``. Forward and dQ visit, per query tile, the key tiles from the tile's
    first document start to the causal diagonal (2 and 3 matmuls a tile pair); dK/dV, per key
    tile, the query tiles from the diagonal to the tile's last document end (4 matmuls), for each
    query head; the fused backward (``bwd``: dK, dV and dQ) the same tiles as dK/dV, 5 matmuls."""
    kind: str  # fwd | dq | dkv | bwd
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
        if self.kind in ("dkv", "bwd"):
            # a run's last index: the position before the next run's start
            nxt = np.append(np.nonzero(np.diff(start))[0], t - 1)  # last index of each run
            end = np.repeat(nxt, np.diff(np.concatenate([[-1], nxt])))
            return int(sum(int(end[j * tk:(j + 1) * tk].max()) // tq + 1 - (j * tk) // tq for j in range(t // tk)))
        return int(sum(-(-((i + 1) * tq) // tk) - int(start[i * tq:(i + 1) * tq].min()) // tk for i in range(t // tq)))

    def flops(self, k_start_T=None) -> float:
        matmuls = {"fwd": 2, "dq": 3, "dkv": 4, "bwd": 5}[self.kind]
        return matmuls * 2.0 * self.b * self.n * self.h * self.pairs(k_start_T) * self.tile_q * self.tile_k


def _docs_flash_call(rest: str) -> DocsFlashCall | None:
    op_name = re.search(r'op_name="([^"]*)"', rest)
    layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", rest)
    if op_name is None or layouts is None:
        return None
    kernel = re.search(r"(?:^|[/(])docs_flash_(fwd|dq|dkv|bwd)_q(\d+)_k(\d+)(?:[/)]|$)", op_name.group(1))
    if kernel is None:
        return None
    b, t, n, h = _dims(re.findall(_SHAPE, layouts.group(1))[0])
    return DocsFlashCall(kernel.group(1), b, t, n, h, int(kernel.group(2)), int(kernel.group(3)))


_TOKAMAX_KINDS = ("RaggedDot", "PallasMosaicGpuFlashAttention", "PallasMosaicGpuFlashAttentionVjp")


def _tokamax_ops(text: str) -> list[dict]:
    """Every ``tokamax:{...}`` JSON object in ``text`` (an attribute's value, quotes unescaped), in order."""
    ops, at = [], text.find("tokamax:{")
    while at >= 0:
        try:
            op, end = json.JSONDecoder().raw_decode(text, at + len("tokamax:"))
        except ValueError:
            end = at + len("tokamax:{")
        else:
            ops.append(op)
        at = text.find("tokamax:{", end)
    return ops


def _tokamax_json(rest: str):
    """The tokamax op a kernel call belongs to, from its metadata: tokamax >= 0.0.17 sets it as the
    ``xla_metadata_payload`` (``set_xla_metadata``), which optimized HLO prints as the metadata's
    ``metadata_payload="tokamax:{...}"`` (nested ops stacked outermost-first,
    ``tokamax:{A}/tokamax:{B}``: the innermost op whose kind is read here, the kernel's own); tokamax
    0.0.12 named a scope ``tokamax:{...}``, so the JSON is in ``op_name`` (the first one)."""
    payload = re.search(r'metadata_payload="((?:[^"\\]|\\.)*)"', rest)
    if payload is not None and "tokamax:{" in payload.group(1):
        ops = _tokamax_ops(payload.group(1).replace('\\"', '"'))
        known = [op for op in ops if str((op.get("op") or {}).get("__type", "")).endswith(_TOKAMAX_KINDS)]
        if known or ops:
            return (known or ops)[-1]
    op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', rest)
    if op_name is None or "tokamax:{" not in op_name.group(1):
        return None
    ops = _tokamax_ops(op_name.group(1).replace('\\"', '"'))
    return ops[0] if ops else None


# tokamax's Mosaic-GPU ragged-dot kernels by their own names (``pallas_mosaic_gpu_kernel_sm90`` /
# ``_sm100``): the forward form and the ragged-contracting (weight-gradient) form.
_TOKAMAX_RAGGED_NAMES = re.compile(r"(?:^|[/(])(ragged_dot|ragged_contracting_dim_dot)_sm\d+(?:[/)]|$)")


def _tokamax_ragged_dot_by_name(rest: str, result_shape) -> KernelCall | None:
    """A tokamax Mosaic-GPU ragged dot whose metadata lost the op's JSON, read from its kernel's
    name and operand shapes. tokamax 0.0.17's payload (``set_xla_metadata``) does not survive a
    ``shard_map`` in jax 0.12.1 (every kernel of the training step runs in one): its ``op_name``
    still ends in ``ragged_dot_sm90/mpmd_map`` or ``ragged_contracting_dim_dot_sm90/mpmd_map``.
    The row tile is then tokamax's default ``block_m`` (64; no config to read)."""
    op_name = re.search(r'op_name="([^"]*)"', rest)
    layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", rest)
    if op_name is None or layouts is None or result_shape is None:
        return None
    kernel = _TOKAMAX_RAGGED_NAMES.search(op_name.group(1))
    if kernel is None:
        return None
    matrices = [_dims(a) for a in re.findall(r"(?:bf16|f16|f32|f8e4m3fn|f8e5m2)\[[0-9,]*\]", layouts.group(1))]
    matrices = [m for m in matrices if len(m) == 2]
    if kernel.group(1) == "ragged_contracting_dim_dot" and len(result_shape) == 3:  # [R, K] x [R, N] -> [E, K, N]
        _, k, n = result_shape
        rows = [m[0] for m in matrices if m[1] == n]
        return KernelCall("tokamax_ragged_dot_t", rows[-1], 2.0 * rows[-1] * k * n) if rows else None
    if kernel.group(1) == "ragged_dot" and len(result_shape) == 2:  # [R, K] x [E, K, N] -> [R, N]
        r, n = result_shape
        ks = [m[1] for m in matrices if m[0] == r]
        return KernelCall("tokamax_ragged_dot", r, 2.0 * r * ks[0] * n) if ks else None
    return None


def _tokamax_call(rest: str, result_shape, result_text: str):
    """A tokamax kernel call (its metadata carries the op as JSON, :func:`_tokamax_json`) as a :class:`KernelCall` (ragged
    dot: 2 R K N over the ``R`` lhs rows, computed for the rows of the groups only, each rounded up
    to the kernel's ``block_m``) or an :class:`AttentionCall`; None for anything else."""
    op = _tokamax_json(rest)
    if op is None:
        return _tokamax_ragged_dot_by_name(rest, result_shape)
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


@dataclasses.dataclass(frozen=True)
class Read:
    """What one custom call counts as, per execution: ``kind`` is "gemm" (``flops``, ``batched``:
    with batch dimensions), "attention" (a Pallas mha kernel's ``flops``; 0 for its backward's
    preprocess kernel, which does no matmul), "attention_call"
    (``call``: an :class:`AttentionCall` or :class:`DocsFlashCall`, its ``flops()`` with one
    document per row) or "kernel" (``call``: a :class:`KernelCall`, counted at its static bound)."""
    kind: str
    flops: float = 0.0
    call: KernelCall | AttentionCall | DocsFlashCall | None = None
    batched: bool = False


def custom_call_target(attrs: str) -> str:
    m = re.search(r'custom_call_target="([^"]*)"', attrs)
    return m.group(1) if m else "?"


def read_custom_call(attrs: str, result_type: str, operand_shapes: list) -> Read | None:
    """What the custom call with these attributes (the instruction's text after its operands),
    result type and operand shapes (None where unknown) computes; None: a call whose FLOPs the HLO
    does not show (fused attention of cuDNN, other Mosaic/Triton kernels)."""
    target = custom_call_target(attrs)
    if target.startswith("__cublas") and ("gemm" in target or "matmul" in target):
        flops, batched = _gemm_flops(attrs, operand_shapes)
        return Read("gemm", flops, batched=batched)
    if target == "__gpu$xla.gpu.triton":
        if (flash := _flash_flops(attrs)) is not None:
            return Read("attention", flash)
        if (docs := _docs_flash_call(attrs)) is not None:
            return Read("attention_call", docs.flops(), docs)
        if re.search(r'op_name="[^"]*[/(]mha_preprocess_backward[/)]', attrs):  # delta = rowsum(o * do)
            return Read("attention", 0.0)
    result = re.match(_SHAPE, result_type.lstrip("("))
    if (tk := _tokamax_call(attrs, _dims(result.group(0)) if result else None, result_type)) is not None:
        if isinstance(tk, KernelCall):
            return Read("kernel", tk.flops_bound, tk)
        return Read("attention_call", tk.flops(), tk)
    if target.startswith("mosaic_gpu") and (kernel := _block_kernel(attrs)) is not None:
        return Read("kernel", kernel.flops_bound, kernel)
    return None
