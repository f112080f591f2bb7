"""How attention runs: the packed-document causal mask, the XLA implementations
(:func:`masked_attention` of a ``[B, T, S]`` mask; :func:`blocked_attention`, the same by key
blocks from segment ids and original indices), context-parallel attention, and the GPU kernels'
wrappers (Pallas FlashAttention with its tiles, tokamax, our docs-flash), each in a region
manual over the axes XLA cannot split it along. :class:`mlir_train.model.layers.Attention`
picks one by its ``impl``.

Shape suffixes as in :mod:`mlir_train.model.layers`: B batch, T sequence, S key sequence,
N query heads, K kv heads, G query heads per kv head, H head dim; M = G * T rows of a kv group,
C keys of one block.
"""

from __future__ import annotations

import functools
import math
import typing

import jax
import jax.numpy as jnp

from mlir_train.model.kernels import docs_flash, tokamax_ops
from mlir_train.runtime.platform_setup import platform_name
from sharding import logical_shard_map, mesh_axes_of, varying_axes

# How attention runs: "xla" is masked_attention below (any platform; it computes the whole
# [T, S] score matrix, masked half included); "docs-flash" is our Pallas (Triton) kernel
# (mlir_train.model.kernels.docs_flash, --attention-kernel mlir), GPU only, whose forward and both
# backward passes skip the tiles outside a tile's documents; "flash" is the Pallas (Triton)
# FlashAttention kernel of jax.experimental.pallas.ops.gpu.attention (--attention-kernel pallas-mha),
# GPU only, on the jax versions that still ship it (removed in jax 0.12: pallas_mha_missing);
# "tokamax" is tokamax's Mosaic-GPU flash attention
# (mlir_train.model.kernels.tokamax_ops.tokamax_attention), GPU only, whose forward also skips the
# key blocks of the packed row's earlier documents. The GPU default is "docs-flash" on every
# supported jax: it is our code, so it exists in each of them (JAX's Pallas-Triton mha, the
# default before, is gone from 0.12.1; JAX's current Mosaic-GPU attention takes no segment ids, so
# it cannot keep packed documents apart), `check --code-paths gpu` certifies it interpreted (tokamax's
# kernels have no interpreter), and its compiled FLOPs (benchmarks/README.md) are within 0.1 % of
# the mha kernel's on one document per row and below Megatron's causal count on packed rows, where
# mha and tokamax are above it. tokamax's kernel also wants --seq-length a multiple of 128.
ATTENTION_IMPLS = ("xla", "flash", "tokamax", "docs-flash")
DEFAULT_ATTENTION_IMPL = {"cpu": "xla", "gpu": "docs-flash", "tpu": "xla"}
SEGMENT_ID_IMPLS = ("flash", "tokamax", "docs-flash")  # the kernels that take the segment ids, not a [B, T, S] mask


PALLAS_MHA_MODULE = "jax.experimental.pallas.ops.gpu.attention"


@functools.cache
def pallas_mha_missing() -> str | None:
    """None where this jax ships JAX's Pallas-Triton FlashAttention (``"flash"``,
    ``--attention-kernel pallas-mha``), else why not: deprecated in jax 0.11.2, removed in 0.12."""
    import importlib

    try:
        importlib.import_module(PALLAS_MHA_MODULE)
    except ImportError as e:
        return (f"--attention-kernel pallas-mha needs {PALLAS_MHA_MODULE}, which jax {jax.__version__} does not "
                f"ship (JAX removed it in 0.12: {e}); use --attention-kernel auto (our docs-flash kernel, the GPU "
                "default), mlir (the same), tokamax or xla")
    return None


def attention_mask(segment_ids_BT: jax.Array, order_T: jax.Array | None = None) -> jax.Array:
    """Causal mask restricted to equal segment ids: packed documents never see each other.

    ``order_T`` is the original index of each position (default ``0..T-1``), for a sequence laid
    out in another order (:func:`sharding.context.zigzag_order`). Padding (segment 0) attends
    only to padding, which keeps its softmax rows finite.
    """
    t = segment_ids_BT.shape[1]
    order_T = jnp.arange(t, dtype=jnp.int32) if order_T is None else order_T
    causal_TS = order_T[:, None] >= order_T[None, :]
    same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return causal_TS[None] & same_BTS


def _scores(q_BKMH, k_BKSH, mask_BTS):
    """Scaled, masked scores ``[B, K, M, S]`` in float32 (Megatron's attention_softmax_in_fp32);
    ``M = G * T`` is the group's query heads and positions, one matmul row each."""
    b, kv, m, h = q_BKMH.shape
    t = mask_BTS.shape[1]
    # The 1/sqrt(H) scale is applied to q (an [M, H] tensor) by the caller, not to the scores.
    s_BKMS = jnp.einsum("bkmh,bksh->bkms", q_BKMH, k_BKSH, preferred_element_type=jnp.float32)
    s_BKGTS = s_BKMS.reshape(b, kv, m // t, t, -1)
    return jnp.where(mask_BTS[:, None, None], s_BKGTS, jnp.finfo(jnp.float32).min).reshape(s_BKMS.shape)


def _attention_fwd(q_BKMH, k_BKSH, v_BKSH, mask_BTS):
    s_BKMS = _scores(q_BKMH, k_BKSH, mask_BTS)
    m_BKM = jnp.max(s_BKMS, axis=-1)
    e_BKMS = jnp.exp(s_BKMS - m_BKM[..., None])
    z_BKM = jnp.sum(e_BKMS, axis=-1)
    # Normalise the [M, H] output rather than the [M, S] probabilities.
    o_BKMH = jnp.einsum("bkms,bksh->bkmh", e_BKMS.astype(v_BKSH.dtype), v_BKSH, preferred_element_type=jnp.float32)
    o_BKMH = (o_BKMH / z_BKM[..., None]).astype(v_BKSH.dtype)
    lse_BKM = m_BKM + jnp.log(z_BKM)
    return o_BKMH, (q_BKMH, k_BKSH, v_BKSH, mask_BTS, o_BKMH, lse_BKM)


def _attention_bwd(res, do_BKMH):
    q_BKMH, k_BKSH, v_BKSH, mask_BTS, o_BKMH, lse_BKM = res
    dt = q_BKMH.dtype
    # Recompute the probabilities from the saved log-sum-exp (as FlashAttention's backward).
    p_BKMS = jnp.exp(_scores(q_BKMH, k_BKSH, mask_BTS) - lse_BKM[..., None])
    dv_BKSH = jnp.einsum("bkms,bkmh->bksh", p_BKMS.astype(dt), do_BKMH, preferred_element_type=jnp.float32)
    dp_BKMS = jnp.einsum("bkmh,bksh->bkms", do_BKMH, v_BKSH, preferred_element_type=jnp.float32)
    # sum_s p * dp = sum_h o * do: the softmax Jacobian's row term without a [M, S] reduction.
    delta_BKM = jnp.sum(o_BKMH.astype(jnp.float32) * do_BKMH.astype(jnp.float32), axis=-1)
    ds_BKMS = (p_BKMS * (dp_BKMS - delta_BKM[..., None])).astype(dt)
    dq_BKMH = jnp.einsum("bkms,bksh->bkmh", ds_BKMS, k_BKSH, preferred_element_type=jnp.float32)
    dk_BKSH = jnp.einsum("bkms,bkmh->bksh", ds_BKMS, q_BKMH, preferred_element_type=jnp.float32)
    return dq_BKMH.astype(dt), dk_BKSH.astype(dt), dv_BKSH.astype(dt), None


@jax.custom_vjp
def _attention(q_BKMH, k_BKSH, v_BKSH, mask_BTS):
    return _attention_fwd(q_BKMH, k_BKSH, v_BKSH, mask_BTS)[0]


_attention.defvjp(_attention_fwd, _attention_bwd)


def _block_mask(seg_q_BT, seg_k_BC, order_q_T, order_k_C, k_BKCH):
    """``[B, T, C]``: same document and causal by original index (see :func:`attention_mask`).

    The ids pass an optimization barrier together with the block's keys: depending only on
    integer inputs, the mask would otherwise be split off by JAX's partial evaluation (under
    rematerialisation) into a separate loop that stacks every block's mask, broadcast to the
    scores' shape, as a residual."""
    seg_q_BT, seg_k_BC, order_q_T, order_k_C, _ = jax.lax.optimization_barrier(
        (seg_q_BT, seg_k_BC, order_q_T, order_k_C, k_BKCH))
    return (seg_q_BT[:, :, None] == seg_k_BC[:, None, :]) & (order_q_T[:, None] >= order_k_C[None, :])[None]


def _block_scores(q_BKMH, k_BKCH, mask_BTC):
    """Scores ``[B, K, G, T, C]`` of one key block and the mask broadcastable to them: kept
    as ``[B, 1, 1, T, C]`` so that XLA fuses it into the elementwise ops instead of
    materialising it per query head (or, hoisted out of the key loop, for every block)."""
    b, kv, m, _ = q_BKMH.shape
    t = mask_BTC.shape[1]
    s_BKMC = jnp.einsum("bkmh,bkch->bkmc", q_BKMH, k_BKCH, preferred_element_type=jnp.float32)
    return s_BKMC.reshape(b, kv, m // t, t, -1), mask_BTC[:, None, None]


def _key_blocks(x, block, axis):
    """``x`` with its key axis cut into blocks of ``block``, the block index leading (scan's xs)."""
    n = x.shape[axis] // block
    x = x.reshape(*x.shape[:axis], n, block, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _varying_like(x, *refs):
    """``x`` varying over every manual mesh axis one of ``refs`` varies over: a scan carry
    started from constants must vary as its updates do inside a manual region."""
    axes = set().union(*(varying_axes(r) for r in refs))
    return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def _blocked_fwd(block, q_BKMH, k_BKSH, v_BKSH, seg_q_BT, seg_k_BS, order_q_T, order_k_S):
    b, kv, m, h = q_BKMH.shape
    xs = (_key_blocks(k_BKSH, block, 2), _key_blocks(v_BKSH, block, 2), _key_blocks(seg_k_BS, block, 1),
          _key_blocks(order_k_S, block, 0))

    def step(carry, blk):
        m_BKM, z_BKM, o_BKMH = carry
        k_BKCH, v_BKCH, seg_k_BC, order_k_C = blk
        s_BKGTC, mask = _block_scores(q_BKMH, k_BKCH, _block_mask(seg_q_BT, seg_k_BC, order_q_T, order_k_C, k_BKCH))
        s_BKGTC = jnp.where(mask, s_BKGTC, jnp.finfo(jnp.float32).min)
        new_m = jnp.maximum(m_BKM, jnp.max(s_BKGTC, axis=-1).reshape(m_BKM.shape))
        e_BKGTC = jnp.where(mask, jnp.exp(s_BKGTC - new_m.reshape(s_BKGTC.shape[:-1])[..., None]), 0.0)
        rescale = jnp.exp(m_BKM - new_m)
        e_BKMC = e_BKGTC.reshape(b, kv, m, -1)
        o_BKMH = o_BKMH * rescale[..., None] + jnp.einsum(
            "bkmc,bkch->bkmh", e_BKMC.astype(v_BKCH.dtype), v_BKCH, preferred_element_type=jnp.float32)
        return (new_m, z_BKM * rescale + jnp.sum(e_BKMC, axis=-1), o_BKMH), None

    init = (jnp.full((b, kv, m), jnp.finfo(jnp.float32).min), jnp.zeros((b, kv, m)), jnp.zeros((b, kv, m, h)))
    init = _varying_like(init, q_BKMH, k_BKSH, v_BKSH, seg_q_BT, seg_k_BS, order_q_T, order_k_S)
    (m_BKM, z_BKM, o_BKMH), _ = jax.lax.scan(step, init, xs)
    o_BKMH = (o_BKMH / z_BKM[..., None]).astype(v_BKSH.dtype)
    lse_BKM = m_BKM + jnp.log(z_BKM)
    return o_BKMH, (q_BKMH, k_BKSH, v_BKSH, seg_q_BT, seg_k_BS, order_q_T, order_k_S, o_BKMH, lse_BKM)


def _blocked_bwd(block, res, do_BKMH):
    q_BKMH, k_BKSH, v_BKSH, seg_q_BT, seg_k_BS, order_q_T, order_k_S, o_BKMH, lse_BKM = res
    dt = q_BKMH.dtype
    delta_BKM = jnp.sum(o_BKMH.astype(jnp.float32) * do_BKMH.astype(jnp.float32), axis=-1)
    xs = (_key_blocks(k_BKSH, block, 2), _key_blocks(v_BKSH, block, 2), _key_blocks(seg_k_BS, block, 1),
          _key_blocks(order_k_S, block, 0))

    def step(dq_BKMH, blk):
        k_BKCH, v_BKCH, seg_k_BC, order_k_C = blk
        s_BKGTC, mask = _block_scores(q_BKMH, k_BKCH, _block_mask(seg_q_BT, seg_k_BC, order_q_T, order_k_C, k_BKCH))
        lse_BKGT1 = lse_BKM.reshape(s_BKGTC.shape[:-1])[..., None]
        p_BKMC = jnp.where(mask, jnp.exp(s_BKGTC - lse_BKGT1), 0.0).reshape(q_BKMH.shape[:3] + (-1,))
        dv_BKCH = jnp.einsum("bkmc,bkmh->bkch", p_BKMC.astype(dt), do_BKMH, preferred_element_type=jnp.float32)
        dp_BKMC = jnp.einsum("bkmh,bkch->bkmc", do_BKMH, v_BKCH, preferred_element_type=jnp.float32)
        ds_BKMC = (p_BKMC * (dp_BKMC - delta_BKM[..., None])).astype(dt)
        dq_BKMH = dq_BKMH + jnp.einsum("bkmc,bkch->bkmh", ds_BKMC, k_BKCH, preferred_element_type=jnp.float32)
        dk_BKCH = jnp.einsum("bkmc,bkmh->bkch", ds_BKMC, q_BKMH, preferred_element_type=jnp.float32)
        return dq_BKMH, (dk_BKCH.astype(dt), dv_BKCH.astype(dt))

    dq0 = _varying_like(jnp.zeros(q_BKMH.shape, jnp.float32), q_BKMH, k_BKSH, v_BKSH, seg_q_BT, seg_k_BS,
                        order_q_T, order_k_S, do_BKMH)
    dq_BKMH, (dk_NBKCH, dv_NBKCH) = jax.lax.scan(step, dq0, xs)
    unblock = lambda x: jnp.moveaxis(x, 0, 2).reshape(k_BKSH.shape)
    return dq_BKMH.astype(dt), unblock(dk_NBKCH), unblock(dv_NBKCH), None, None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked_attention(block, q_BKMH, k_BKSH, v_BKSH, seg_q_BT, seg_k_BS, order_q_T, order_k_S):
    return _blocked_fwd(block, q_BKMH, k_BKSH, v_BKSH, seg_q_BT, seg_k_BS, order_q_T, order_k_S)[0]


_blocked_attention.defvjp(_blocked_fwd, _blocked_bwd)

# Keys per block of blocked_attention: the [rows, block] float32 scores of one block are what
# it holds at a time (8k queries x 8 heads per kv group, 2 groups, at block 512: 512 MiB).
KEY_BLOCK = 512


def blocked_attention(q_BTKGH, k_BSKH, v_BSKH, seg_q_BT, seg_k_BS, order_q_T, order_k_S, *, block: int | None = None):
    """:func:`masked_attention` of the packed-document causal mask, built block by block from
    segment ids and original token indices (queries and keys may be different positions: under
    context parallelism a rank's queries against the whole row's keys), with the keys visited in
    blocks of ``block`` (default :data:`KEY_BLOCK`, or the whole row if it does not divide) by an
    online softmax, FlashAttention's recurrence in XLA ops. Neither pass materialises more than
    one block's ``[rows, block]`` scores; the backward recomputes them from the saved
    log-sum-exp. Every key block is computed, masked or not (the shapes are static)."""
    b, t, kv, g, h = q_BTKGH.shape
    s = k_BSKH.shape[1]
    block = block or KEY_BLOCK
    block = block if s % block == 0 else s
    q_BKMH = (q_BTKGH * (1.0 / math.sqrt(h))).astype(q_BTKGH.dtype).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)
    o_BKMH = _blocked_attention(block, q_BKMH, k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3),
                                seg_q_BT, seg_k_BS, order_q_T, order_k_S)
    return o_BKMH.reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4)


def masked_attention(q_BTKGH, k_BSKH, v_BSKH, mask_BTS):
    """Grouped-query softmax attention ``softmax(q k^T / sqrt(H) | mask) v`` -> ``[B, T, K, G, H]``.

    Written with einsums (XLA partitions them over batch and heads like any einsum) in a
    matmul-friendly layout: heads ahead of positions, a kv group's G query heads stacked
    into the rows (``M = G * T``) of one ``[M, H] x [H, S]`` product. On XLA:CPU the
    ``btkgh,bskh->bkgts`` form of the same product is ~3-4x slower. A FlashAttention-style
    custom gradient keeps only the output and the per-row log-sum-exp and recomputes the
    probabilities in the backward, instead of autodiff keeping every layer's ``[B, K, G, T,
    S]`` float32 probabilities and making several more passes over them.
    """
    b, t, kv, g, h = q_BTKGH.shape
    q_BKMH = (q_BTKGH * (1.0 / math.sqrt(h))).astype(q_BTKGH.dtype).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)
    o_BKMH = _attention(q_BKMH, k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3), mask_BTS)
    return o_BKMH.reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4)


def context_parallel_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, order_T):
    """Attention with the sequence split over the context ranks: each rank's queries attend to
    every key of the row, so K, V and the keys' segment ids and original indices (``order_T``,
    :func:`sharding.context.sequence_order`) are all-gathered over the context axes inside a
    region manual over them (the gradients of K and V come back reduce-scattered: the
    transpose of the all-gather), and :func:`blocked_attention` masks each block of keys by
    document and original order. Batch and heads are manual too (left to XLA inside the region,
    the partitioner gathers the batch over the data ranks). When TP exceeds the kv heads (each
    rank holds every kv head, see ``sharding.mesh.kv_heads_replicated``) a rank's query heads all
    belong to one kv head, which it picks by its tensor rank.

    All-gather rather than a ring of K/V blocks: with GQA the K/V of a whole row are small
    (Qwen3-30B-A3B: 4 kv heads, 32k tokens, 2 x 32 MiB in bf16 per layer), one gather per layer,
    and the scores, which are what grows with the sequence, are held one key block at a time.
    ``benchmarks/README.md`` has the compiled figures."""
    seq_axes, _ = mesh_axes_of("act_seq")
    head_axes, tp = mesh_axes_of("act_heads")
    kv_split = mesh_axes_of("act_kv_heads")[1] > 1
    n, kv = q_BTNH.shape[2], k_BSKH.shape[2]
    q_names = ("act_batch", "act_seq", "act_heads", None)
    kv_names = ("act_batch", "act_seq", "act_kv_heads", None)

    def run(q_BTNH, k_BSKH, v_BSKH, seg_BT, order_T):
        gather = lambda a, axis: jax.lax.all_gather(a, seq_axes, axis=axis, tiled=True)
        k_BSKH, v_BSKH, seg_BS, order_S = gather(k_BSKH, 1), gather(v_BSKH, 1), gather(seg_BT, 1), gather(order_T, 0)
        b, t, n_local, h = q_BTNH.shape
        if tp > 1 and not kv_split:  # replicated kv heads: this rank's query heads share one
            first = jax.lax.axis_index(head_axes) * n_local // (n // kv)
            k_BSKH, v_BSKH = (jax.lax.dynamic_slice_in_dim(a, first, 1, axis=2) for a in (k_BSKH, v_BSKH))
        k_local = k_BSKH.shape[2]
        q_BTKGH = q_BTNH.reshape(b, t, k_local, n_local // k_local, h)
        o_BTKGH = blocked_attention(q_BTKGH, k_BSKH, v_BSKH, seg_BT, seg_BS, order_T, order_S)
        return o_BTKGH.reshape(b, t, n_local, h)

    in_names = (q_names, kv_names, kv_names, ("act_batch", "act_seq"), ("act_seq",))
    return logical_shard_map(run, in_names=in_names, out_names=q_names, manual=("act_seq", "act_batch", "act_heads"))(
        q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, order_T)


def _not_the_repeat(prim, *_, **__) -> bool:
    """A ``jax.checkpoint`` policy keeping every value but a repeat's (``jnp.repeat``: a
    broadcast and a reshape), which the backward recomputes from its input."""
    return prim.name not in ("broadcast_in_dim", "reshape")


def flash_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, *, interpret: bool = False,
                    compute_capability: str | None = None):
    """Causal GQA attention within packed documents (equal segment ids; padding, segment 0,
    attends to padding) with the Pallas FlashAttention kernel: the same function as
    :func:`masked_attention` of ``attention_mask(segment_ids_BT)``. The kernel wants as many
    kv heads as query heads, so each kv head is repeated for its G query heads (its gradient
    sums them back). XLA cannot split a kernel call, so it runs in a region manual over the
    batch and head axes; ``interpret`` runs the kernel in Pallas' interpreter (CPU tests).
    The tiles follow the GPU the program is built for (:func:`flash_block_sizes`):
    ``compute_capability`` ("9.0"), or by default that of the mesh's devices
    (:func:`target_compute_capability`)."""
    missing = pallas_mha_missing()
    if missing:
        raise ValueError(missing)
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    if mesh_axes_of("act_seq")[1] > 1:
        # The kernel masks causally from index 0 of one sequence shared by q and k; the
        # context-parallel layout needs the original token order (see context_parallel_attention).
        raise ValueError("the flash attention kernel does not run with the sequence split over context-parallel "
                         "ranks (--context-parallel-size > 1); build the model with attention_impl='xla'")
    n, h = q_BTNH.shape[2], q_BTNH.shape[3]
    g = n // k_BSKH.shape[2]
    t = q_BTNH.shape[1]
    if compute_capability is None:
        compute_capability = target_compute_capability()
    block = flash_block_sizes(t, compute_capability, head_dim=h)
    if block is None:
        raise ValueError(f"flash attention needs a sequence length (--seq-length) that is a multiple of 16, got {t}")
    num_warps = flash_num_warps(block, h)

    # The kernel takes one k/v head per query head: the GQA repeat is recomputed in the backward
    # (_not_the_repeat), so the kernel's residuals hold the K k/v heads, not N (the seed: 16 MiB
    # per layer and micro-batch on a device). Its output and row sums are kept: no kernel reruns.
    @functools.partial(jax.checkpoint, policy=_not_the_repeat)
    def run(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT):
        k_BSNH, v_BSNH = (jnp.repeat(a, g, axis=2) for a in (k_BSKH, v_BSKH))
        return pallas_attention.mha(
            q_BTNH, k_BSNH, v_BSNH, segment_ids_BT, sm_scale=1.0 / math.sqrt(h), causal=True,
            block_sizes=pallas_attention.BlockSizes(**block._asdict()), num_warps=num_warps, interpret=interpret,
        )

    if mesh_axes_of("act_batch")[1] == 1 and mesh_axes_of("act_heads")[1] == 1:
        return run(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)
    heads, kv = ("act_batch", None, "act_heads", None), ("act_batch", None, "act_kv_heads", None)
    # check_vma=False: the kernel's pallas_call declares its outputs without the manual axes'
    # variance (it takes q's plain shape), which a checked region refuses.
    return logical_shard_map(run, in_names=(heads, kv, kv, ("act_batch", None)), out_names=heads,
                             manual=("act_batch", "act_heads"), check_vma=False)(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)


def kernel_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, *, implementation: str = "mosaic_gpu"):
    """:func:`~mlir_train.model.kernels.tokamax_ops.tokamax_attention` (``--attention-kernel
    tokamax``) in a region manual over the batch and head axes, as :func:`flash_attention`."""
    if mesh_axes_of("act_seq")[1] > 1:
        raise ValueError("--attention-kernel tokamax does not run with the sequence split over context-parallel "
                         "ranks (--context-parallel-size > 1); use --attention-kernel xla")
    if q_BTNH.shape[1] % 128:
        raise ValueError(f"--attention-kernel tokamax needs a sequence length (--seq-length) that is a multiple of "
                         f"128 (its forward reduces the document starts per 128 queries), got {q_BTNH.shape[1]}; "
                         "use --attention-kernel mlir or xla")
    group = q_BTNH.shape[2] // k_BSKH.shape[2]

    def run(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT):
        k_BSKH, v_BSKH = rank_kv_heads(k_BSKH, v_BSKH, q_BTNH.shape[2], group)
        return tokamax_ops.tokamax_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, implementation=implementation)

    if mesh_axes_of("act_batch")[1] == 1 and mesh_axes_of("act_heads")[1] == 1:
        return run(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)
    heads, kv = ("act_batch", None, "act_heads", None), ("act_batch", None, "act_kv_heads", None)
    return logical_shard_map(run, in_names=(heads, kv, kv, ("act_batch", None)), out_names=heads,
                             manual=("act_batch", "act_heads"), check_vma=False)(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)


def docs_flash_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, *, interpret: bool = False):
    """:func:`mlir_train.model.kernels.docs_flash.docs_flash_attention` (``--attention-kernel mlir``: our
    Pallas-Triton kernel that skips other documents' tiles, forward and backward; GQA mapped in
    its index maps) in a region manual over the batch and head axes, as :func:`flash_attention`."""
    if mesh_axes_of("act_seq")[1] > 1:
        raise ValueError("--attention-kernel mlir does not run with the sequence split over context-parallel "
                         "ranks (--context-parallel-size > 1); use --attention-kernel xla")
    if q_BTNH.shape[1] % 16:
        raise ValueError(f"--attention-kernel mlir needs a sequence length (--seq-length) that is a multiple of 16, "
                         f"got {q_BTNH.shape[1]}")

    group = q_BTNH.shape[2] // k_BSKH.shape[2]

    def run(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT):
        k_BSKH, v_BSKH = rank_kv_heads(k_BSKH, v_BSKH, q_BTNH.shape[2], group)
        return docs_flash.docs_flash_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, interpret=interpret)

    if mesh_axes_of("act_batch")[1] == 1 and mesh_axes_of("act_heads")[1] == 1:
        return run(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)
    heads, kv = ("act_batch", None, "act_heads", None), ("act_batch", None, "act_kv_heads", None)
    return logical_shard_map(run, in_names=(heads, kv, kv, ("act_batch", None)), out_names=heads,
                             manual=("act_batch", "act_heads"), check_vma=False)(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)


class FlashTiles(typing.NamedTuple):
    """The Pallas mha kernel's tiles, by the fields of its ``BlockSizes``."""

    block_q: int
    block_k: int
    block_q_dkv: int
    block_kv_dkv: int
    block_q_dq: int
    block_kv_dq: int


def rank_kv_heads(k_BSKH, v_BSKH, n_local: int, group: int):
    """Inside a region manual over the heads: the kv heads of this rank's ``n_local`` query heads
    (``group`` query heads a kv head). Where TP exceeds the kv heads each rank holds every kv head
    (``sharding.mesh.kv_heads_replicated``) and its query heads all belong to one, picked by its
    tensor rank; otherwise the rank's kv heads are already its own."""
    if k_BSKH.shape[2] * group == n_local:
        return k_BSKH, v_BSKH
    head_axes, tp = mesh_axes_of("act_heads")
    assert tp > 1 and n_local <= group and group % n_local == 0, (k_BSKH.shape, n_local, group, tp)
    first = jax.lax.axis_index(head_axes) * n_local // group
    return tuple(jax.lax.dynamic_slice_in_dim(a, first, 1, axis=2) for a in (k_BSKH, v_BSKH))


HOPPER_BACKWARD_TILE = 64
# The dK/dV loop's query step for heads wider than 128: on Hopper its two 64 x head_dim float32
# accumulators (dK, dV) take 128 of a thread's 255 registers over 8 warps at width 256, and
# 64-row query steps spill (ptxas: 812 + 816 bytes of spill stores + loads a thread), 32-row ones
# 316 + 332; 16-row steps do not.
WIDE_HEAD_DKV_QUERY_TILE = 16


def flash_block_sizes(t: int, compute_capability: str | None = None, head_dim: int = 128):
    """The kernel's tiles for sequence length ``t``: 128-row forward tiles (64 for heads wider
    than 128), smaller when ``t`` is short; None if ``t`` is not a multiple of 16. Backward
    tiles: on Hopper (compute capability 9.x) 64x64 where they divide ``t``, which Triton compiles
    to wgmma (with 8 warps, no spills, checked by tests/planner/test_gpu_kernels_ptx.py);
    elsewhere, and for short sequences, the kernel's default 32x32, which compiles to pre-Hopper
    ``mma.sync``. Heads wider than 128 step the dK/dV loop 16 query rows at a time
    (:func:`flash_backward_tiles`); :func:`flash_num_warps` gives the warps.

    The forward kernel keeps its query tile and two pipeline stages of key and value tiles in
    shared memory, ``2 (bq + 4 bk) head_dim`` bytes in bf16: at 128 x 128 and head_dim 256
    (Qwen3.5 / Qwen3-Next attention) 320 KiB, over Hopper's 227 KiB per block, and XLA:GPU
    refuses the program ("Shared memory size limit exceeded: requested 328192, available:
    232448"); 64 x 64 needs 160 KiB. The tiles are a :class:`FlashTiles` (the kernel's ``BlockSizes``
    fields), so the planner prices them on a jax that no longer ships the kernel."""
    if t % 16:
        return None
    fwd = math.gcd(t, 128 if head_dim <= 128 else 64)
    hopper = compute_capability is not None and compute_capability.split(".")[0] == "9"
    bwd = HOPPER_BACKWARD_TILE if hopper and t % HOPPER_BACKWARD_TILE == 0 else math.gcd(t, 32)
    q_dkv, kv_dkv, q_dq, kv_dq = flash_backward_tiles(bwd, head_dim)
    return FlashTiles(block_q=fwd, block_k=fwd, block_q_dkv=q_dkv, block_kv_dkv=kv_dkv, block_q_dq=q_dq,
                      block_kv_dq=kv_dq)


def flash_backward_tiles(tile: int, head_dim: int) -> tuple[int, int, int, int]:
    """The backward kernel's ``(block_q_dkv, block_kv_dkv, block_q_dq, block_kv_dq)`` for its
    key tile ``tile`` (the launch grid's, T / tile programs): square, but for heads wider than 128
    the dK/dV loop steps :data:`WIDE_HEAD_DKV_QUERY_TILE` query rows (at Hopper's 64 its dK and
    dV matmuls stay 64-row wgmma, the two 16-row score matmuls become ``mma.sync``; JAX's kernel
    needs ``block_q_dq == block_kv_dkv``, so the dQ loop keeps ``tile`` x ``tile``)."""
    if head_dim > 128 and tile > WIDE_HEAD_DKV_QUERY_TILE:
        return WIDE_HEAD_DKV_QUERY_TILE, tile, tile, tile
    return tile, tile, tile, tile


def flash_num_warps(block, head_dim: int) -> int | None:
    """Warps for the kernel's tiles ``block``; None: the kernel's own choice (4 for backward
    tiles under 128 x 128). Hopper's 64-row backward tiles need 8 (2 warpgroups) to
    hold their accumulators without spilling, and so do the 32-row ones of heads wider than 128
    (a ``head_dim``-wide dK and dV each); checked by tests/planner/test_gpu_kernels_ptx.py."""
    if block.block_kv_dkv == HOPPER_BACKWARD_TILE or (head_dim > 128 and block.block_kv_dkv == 32):
        return 8
    return None


def target_compute_capability() -> str | None:
    """The CUDA compute capability of the devices the program being traced is for: those of
    the concrete mesh set with ``jax.set_mesh`` (the trainer and the deviceless compiles set
    one; it is visible inside ``jit`` and ``shard_map``), else the default backend's; None for
    devices that are not NVIDIA GPUs."""
    devices = []
    try:
        from jax._src.mesh import get_concrete_mesh  # no public spelling works inside jit

        mesh = get_concrete_mesh()
        if mesh is not None and not mesh.empty:
            devices = list(mesh.devices.flat)
    except (ImportError, AttributeError):
        pass
    device = devices[0] if devices else jax.devices()[0]
    return getattr(device, "compute_capability", None) if platform_name(device) == "gpu" else None
