"""Our Pallas (Triton) causal GQA flash attention for packed documents (``--attention-kernel mlir``,
``attention_impl="docs-flash"``): forward and backward kernels that visit only the tiles a
tile's documents can see.

Inputs ``q [B, T, N, H]``, ``k, v [B, S, K, H]`` (S = T; ``G = N / K`` query heads share a kv head,
mapped in the block index maps: k/v are never repeated), ``segment_ids [B, T]``. The function is
:func:`~mlir_train.model.attention.masked_attention` of ``attention_mask(segment_ids)``: causal within
equal segment ids, padding (id 0) attending to padding.

In XLA, outside the kernels, each position's document start (the first index of its run of equal
ids) and document end (the last) are computed. Then

* forward and dQ, query tile ``i``: key tiles ``start[i * bq] // bk`` .. the causal end;
* dK/dV, key tile ``j``: query tiles from the causal start ``j * bk // bq`` to
  ``end[(j + 1) * bk - 1] // bq``, for each of the kv head's G query heads;

and within a visited tile the scores are masked exactly by segment id and causality. The skip
bounds assume each segment id is one contiguous run (as packing lays rows out; the same
assumption as tokamax's ``k_start``); the masking inside the tiles does not.

A ``custom_vjp`` keeps only the output and the (base-2) log-sum-exp; accumulation is float32;
bf16 and float32 inputs. ``interpret=True`` runs the kernels in Pallas' interpreter (CPU tests).
The kernels are named ``docs_flash_{fwd,dq,dkv,bwd}_q<bq>_k<bk>`` (the op_name
:mod:`mlir_train.planner.hlo_kernels` reads the tiles from).

The backward is by default one kernel (``bwd``, FlashAttention-2's): per key tile it forms dK and
dV as the dK/dV kernel does and adds each visited tile's ``dS K`` into a float32 dQ with atomic
adds, 5 matmuls a tile pair where the split dQ and dK/dV kernels (``Tiles(fused_dq=False)``) run
3 + 4, each recomputing the scores. The atomics' order varies run to run on a GPU (dQ's last
bits with it); the split kernels sum in a fixed order."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Query x key tiles of each kernel and their warps. 64x64 everywhere by default: on Hopper
    Triton issues wgmma (m64) for them; 4 warps (one warpgroup) hold the forward's and dQ's
    64 x H float32 accumulator, the dK/dV kernel's two accumulators want 8."""

    fwd_q: int = 64
    fwd_k: int = 64
    bwd_q: int = 64
    bwd_k: int = 64
    fwd_warps: int = 4
    dq_warps: int = 4
    dkv_warps: int = 8
    num_stages: int = 2
    dkv_q: int | None = None  # the dK/dV kernel's own query x key tiles; None: bwd_q x bwd_k
    dkv_k: int | None = None
    # The backward as one kernel (dK, dV and an atomic float32 dQ: 5 matmuls a tile pair), or
    # as the split dQ and dK/dV kernels (7, each recomputing the scores; dQ summed in registers,
    # in a fixed order: bit-reproducible run to run, where float32 atomics are not).
    fused_dq: bool = True
    # The fused backward's software-pipeline stages: at 2 its dK, dV and dQ tiles spilled (ptxas
    # for sm_90a: 356 bytes at H 128 on 64 x 64 tiles, 8 warps; 64 at H 256 on 16 x 64); at 1 it
    # holds 206 / 228 registers, no spill (tests/model/test_docs_flash.py reads it).
    fused_stages: int = 1

    @classmethod
    def for_head_dim(cls, head_dim: int) -> "Tiles":
        """The tiles for ``head_dim``: the defaults up to 128; for wider heads (Qwen3.5 / Qwen3-Next's
        256) twice the warps in the forward and dQ kernels (their 64 x 256 float32 accumulator is
        128 registers a thread over 4 warps: ptxas spilled 48 and 356 bytes), and a dK/dV loop that
        steps 16 query rows over its 64 keys (its two 64 x 256 accumulators spilled 1296 bytes at 64 x 64,
        580 at 32 x 64; at 16 x 64 none, and the dK/dV matmuls stay wgmma). Read from ptxas for an
        H200 by tests/planner/test_docs_flash_ptx.py."""
        if head_dim <= 128:
            return cls()
        return cls(fwd_warps=8, dq_warps=8, dkv_q=16, dkv_k=64)

    @property
    def dkv(self) -> tuple[int, int]:
        return (self.dkv_q or self.bwd_q, self.dkv_k or self.bwd_k)

    def fit(self, t: int) -> "Tiles":
        """The tiles shrunk (to gcd with ``t``) so that they divide ``t``."""
        g = lambda b: math.gcd(t, b)
        dkv_q, dkv_k = self.dkv
        return dataclasses.replace(self, fwd_q=g(self.fwd_q), fwd_k=g(self.fwd_k), bwd_q=g(self.bwd_q),
                                   bwd_k=g(self.bwd_k), dkv_q=g(dkv_q), dkv_k=g(dkv_k))


def document_bounds(segment_ids_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(start_BT, end_BT)``: the first and last index of each position's run of equal ids."""
    t = segment_ids_BT.shape[1]
    index_T = jnp.arange(t, dtype=jnp.int32)
    change_BT = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
    first_BT = jnp.concatenate([jnp.ones_like(segment_ids_BT[:, :1], bool), change_BT], axis=1)
    last_BT = jnp.concatenate([change_BT, jnp.ones_like(segment_ids_BT[:, :1], bool)], axis=1)
    start_BT = lax.cummax(jnp.where(first_BT, index_T, 0), axis=1)
    end_BT = lax.cummin(jnp.where(last_BT, index_T, t - 1), axis=1, reverse=True)
    return start_BT.astype(jnp.int32), end_BT.astype(jnp.int32)


def _scores(q, k, q_seg, k_seg, q_pos, k_pos, scale):
    """Masked base-2 scores ``[bq, bk]`` in float32."""
    s = plgpu.dot(q, k.T) * (scale * LOG2E)
    mask = (q_seg[:, None] == k_seg[None, :]) & (q_pos[:, None] >= k_pos[None, :])
    return jnp.where(mask, s, MASK_VALUE)


def _fwd_kernel(q_ref, k_ref, v_ref, seg_ref, start_ref, o_ref, lse_ref, *, scale, bq, bk):
    i = pl.program_id(0)
    q = q_ref[...]
    q_pos = i * bq + jnp.arange(bq)
    q_seg = seg_ref[pl.ds(i * bq, bq)]
    lo = lax.div(jnp.min(start_ref[pl.ds(i * bq, bq)]), bk)
    hi = lax.div((i + 1) * bq + bk - 1, bk)

    def body(kt, carry):
        o, m, l = carry
        ks = pl.ds(kt * bk, bk)
        s = _scores(q, k_ref[ks, :], q_seg, seg_ref[ks], q_pos, kt * bk + jnp.arange(bk), scale)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp2(m - m_next)
        p = jnp.exp2(s - m_next[:, None])
        l = correction * l + jnp.sum(p, axis=1)
        v = v_ref[ks, :]
        o = correction[:, None] * o + plgpu.dot(p.astype(v.dtype), v)
        return o, m_next, l

    h = q.shape[-1]
    init = (jnp.zeros((bq, h), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
    o, m, l = lax.fori_loop(lo, hi, body, init)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, start_ref, dq_ref, *, scale, bq, bk):
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = i * bq + jnp.arange(bq)
    q_seg = seg_ref[pl.ds(i * bq, bq)]
    lo = lax.div(jnp.min(start_ref[pl.ds(i * bq, bq)]), bk)
    hi = lax.div((i + 1) * bq + bk - 1, bk)

    def body(kt, dq):
        ks = pl.ds(kt * bk, bk)
        k, v = k_ref[ks, :], v_ref[ks, :]
        p = jnp.exp2(_scores(q, k, q_seg, seg_ref[ks], q_pos, kt * bk + jnp.arange(bk), scale) - lse[:, None])
        ds = p * (plgpu.dot(do, v.T) - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, end_ref, *out_refs, scale, bq, bk, groups,
                fused: bool = False):
    """dK and dV of one key tile. ``fused`` (FlashAttention-2's backward): also each visited
    tile's ``dS K`` added (an atomic float32 add) into the float32 dQ rows it belongs to, so the
    backward runs 5 matmuls a tile pair, not the split kernels' 3 + 4; ``out_refs`` is then the
    zeroed accumulator's input (aliased), dK, dV and the accumulator (every key tile's program
    adds into it)."""
    dk_ref, dv_ref = out_refs[1:3] if fused else out_refs
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    k_pos = j * bk + jnp.arange(bk)
    k_seg = seg_ref[pl.ds(j * bk, bk)]
    lo = lax.div(j * bk, bq)
    hi = lax.div(jnp.max(end_ref[pl.ds(j * bk, bk)]), bq) + 1

    def group(g, carry):
        def body(qt, carry):
            dk, dv = carry
            qs = pl.ds(qt * bq, bq)
            q, do = q_ref[qs, g, :], do_ref[qs, g, :]
            lse, delta = lse_ref[g, qs], delta_ref[g, qs]
            p = jnp.exp2(_scores(q, k, seg_ref[qs], k_seg, qt * bq + jnp.arange(bq), k_pos, scale) - lse[:, None])
            dv = dv + plgpu.dot(p.astype(do.dtype).T, do)
            ds = (p * (plgpu.dot(do, v.T) - delta[:, None])).astype(q.dtype)
            dk = dk + plgpu.dot(ds.T, q)
            if fused:
                plgpu.atomic_add(out_refs[3], (qs, g, slice(None)), plgpu.dot(ds, k) * scale)
            return dk, dv

        return lax.fori_loop(lo, hi, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, groups, group, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(warps, stages):
    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _forward(q, k, v, seg, start, tiles: Tiles, interpret: bool):
    b, t, n, h = q.shape
    kv = k.shape[2]
    g = n // kv
    bq, bk = tiles.fwd_q, tiles.fwd_k
    scale = 1.0 / math.sqrt(h)
    row = pl.BlockSpec((None, t), lambda i, bi, ni: (bi, 0))
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, bq=bq, bk=bk),
        grid=(t // bq, b, n),
        in_specs=[pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0)),
                  pl.BlockSpec((None, t, None, h), lambda i, bi, ni: (bi, 0, ni // g, 0)),
                  pl.BlockSpec((None, t, None, h), lambda i, bi, ni: (bi, 0, ni // g, 0)),
                  row, row],
        out_specs=[pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, bi, ni: (bi, ni, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        compiler_params=_params(tiles.fwd_warps, tiles.num_stages),
        interpret=interpret,
        name=f"docs_flash_fwd_q{bq}_k{bk}",
    )(q, k, v, seg, start)
    return o, lse


def _backward(q, k, v, seg, start, end, o, lse, do, tiles: Tiles, interpret: bool):
    b, t, n, h = q.shape
    kv = k.shape[2]
    g = n // kv
    scale = 1.0 / math.sqrt(h)
    delta = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
    row = pl.BlockSpec((None, t), lambda i, bi, hi: (bi, 0))
    if tiles.fused_dq:
        dk, dv, dq = _dkv_call(q, k, v, seg, end, lse, do, delta, tiles, interpret, fused=True)
        return dq.astype(q.dtype), dk, dv
    bq, bk = tiles.bwd_q, tiles.bwd_k
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, bq=bq, bk=bk),
        grid=(t // bq, b, n),
        in_specs=[pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0)),
                  pl.BlockSpec((None, t, None, h), lambda i, bi, ni: (bi, 0, ni // g, 0)),
                  pl.BlockSpec((None, t, None, h), lambda i, bi, ni: (bi, 0, ni // g, 0)),
                  pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0)),
                  pl.BlockSpec((None, None, bq), lambda i, bi, ni: (bi, ni, i)),
                  pl.BlockSpec((None, None, bq), lambda i, bi, ni: (bi, ni, i)),
                  row, row],
        out_specs=pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(tiles.dq_warps, tiles.num_stages),
        interpret=interpret,
        name=f"docs_flash_dq_q{bq}_k{bk}",
    )(q, k, v, do, lse, delta, seg, start)
    dk, dv = _dkv_call(q, k, v, seg, end, lse, do, delta, tiles, interpret, fused=False)
    return dq, dk, dv


def _dkv_call(q, k, v, seg, end, lse, do, delta, tiles: Tiles, interpret: bool, fused: bool):
    """The dK/dV kernel over every key tile: ``(dk, dv)``, or fused ``(dk, dv, dq)`` with dQ
    accumulated in float32 into a zeroed buffer the call aliases."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    g = n // kv
    bq, bk = tiles.dkv
    row = pl.BlockSpec((None, t), lambda j, bi, ki: (bi, 0))
    heads = pl.BlockSpec((None, t, g, h), lambda j, bi, ki: (bi, 0, ki, 0))
    key_tile = pl.BlockSpec((None, bk, None, h), lambda j, bi, ki: (bi, j, ki, 0))
    per_head = pl.BlockSpec((None, g, t), lambda j, bi, ki: (bi, ki, 0))
    extra_in, extra_out = ([heads], [heads]) if fused else ([], [])
    return pl.pallas_call(
        functools.partial(_dkv_kernel, scale=1.0 / math.sqrt(h), bq=bq, bk=bk, groups=g, fused=fused),
        grid=(t // bk, b, kv),
        in_specs=[heads, key_tile, key_tile, heads, per_head, per_head, row, row] + extra_in,
        out_specs=[key_tile, key_tile] + extra_out,
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
                  + ([jax.ShapeDtypeStruct(q.shape, jnp.float32)] if fused else []),
        input_output_aliases={8: 2} if fused else {},
        compiler_params=_params(tiles.dkv_warps, tiles.fused_stages if fused else tiles.num_stages),
        interpret=interpret,
        name=f"docs_flash_{'bwd' if fused else 'dkv'}_q{bq}_k{bk}",
    )(q, k, v, do, lse, delta, seg, end, *([jnp.zeros(q.shape, jnp.float32)] if fused else []))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, seg, tiles, interpret):
    start, _ = document_bounds(seg)
    return _forward(q, k, v, seg, start, tiles, interpret)[0]


def _attention_fwd(q, k, v, seg, tiles, interpret):
    start, _ = document_bounds(seg)
    o, lse = _forward(q, k, v, seg, start, tiles, interpret)
    return o, (q, k, v, seg, o, lse)


def _attention_bwd(tiles, interpret, res, do):
    q, k, v, seg, o, lse = res
    start, end = document_bounds(seg)
    dq, dk, dv = _backward(q, k, v, seg, start, end, o, lse, do, tiles, interpret)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def docs_flash_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, *, tiles: Tiles | None = None,
                         interpret: bool = False):
    """Causal GQA attention within packed documents, skipping other documents' tiles (see the
    module docstring); the same function as ``masked_attention(q.reshape(B, T, K, G, H), k, v,
    attention_mask(segment_ids))`` for contiguous documents."""
    b, t, n, h = q_BTNH.shape
    if k_BSKH.shape[1] != t or n % k_BSKH.shape[2]:
        raise ValueError(f"docs-flash attention wants S == T and N a multiple of K: q {q_BTNH.shape}, k {k_BSKH.shape}")
    if h & (h - 1):
        raise ValueError(f"docs-flash attention wants a power-of-two head dim, got {h}")
    tiles = (tiles or Tiles.for_head_dim(h)).fit(t)
    if min(tiles.fwd_q, tiles.fwd_k, tiles.bwd_q, tiles.bwd_k, *tiles.dkv) < 16:
        raise ValueError(f"docs-flash attention needs a sequence length (--seq-length) that is a multiple of 16, "
                         f"got {t}")
    return _attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT.astype(jnp.int32), tiles, interpret)
