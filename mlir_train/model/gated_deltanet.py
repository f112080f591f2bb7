"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5/3.6, packing-correct.

The math follows HF transformers' ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet`` and their
torch fallbacks ``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule`` and
``causal_conv1d_fn`` (identical in the qwen3_next, qwen3_5 and qwen3_5_moe modeling files of
transformers 5.24). Per value head, with the state ``S`` a ``[K, V]`` matrix in float32:

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - k_t^T exp(g_t) S_{t-1})^T,    o_t = S_t^T q_t

where q and k are L2-normalised (eps 1e-6 inside the rsqrt, in float32) and q is scaled by
1/sqrt(K), g = -exp(A_log) * softplus(a + dt_bias) <= 0 and beta = sigmoid(b).

:func:`recurrent_gated_delta_rule` runs that recurrence token by token (the test oracle).
:func:`chunk_gated_delta_rule` is the training form: the WY/UT transform turns each chunk of
``C`` tokens into a few matmuls and one unit-lower-triangular solve, and a ``lax.scan`` carries
the float32 state from chunk to chunk.

**Packing.** Both forms take ``segment_ids_BT`` (1, 2, ... per packed document, 0 for padding, as
the attention layers take them). A *run* is a maximal stretch of equal ids; the state restarts
at zero at the first token of every run, so a packed row gives exactly what its documents give
one by one. Chunks are not split at boundaries: inside a chunk every pairwise decay, the UT
system and the intra-chunk attention are masked to pairs of the same run, a token reads the
carried-in state only if its run is the run the previous chunk ended in, and the state leaving
a chunk collects only the chunk's last run (times the carried state when that run started
before the chunk). Padding positions output zeros. The causal conv restarts its window the same
way (:func:`causal_conv1d`).

The nnx token mixer built on these is :class:`mlir_train.model.linear_attention.GatedDeltaNet`.

**States** (for context parallelism, which will pass them between ranks): both forms take an
initial recurrent state and return the final one; the conv takes and returns its last ``W - 1``
inputs. An initial state belongs to the row's *first* run (the document that continues from the
previous rank); whoever passes it zeroes it when that row starts a new document.

Shape suffixes: B batch, T sequence, G key (and query) heads, H value heads (q and k heads are
repeated ``H // G`` times each, consecutively: value head ``h`` reads key head ``h // (H // G)``,
as HF's ``repeat_interleave``), K key head dim, V value head dim, C chunk length, N chunks,
W conv width, D hidden size. Nothing here names a mesh axis.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

L2NORM_EPS = 1e-6  # HF l2norm (= the FLA library's), fixed inside torch_*_gated_delta_rule


# ----------------------------------------------------------------------------------------------
# Elementwise pieces of the layer


def l2_normalize(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """HF/FLA ``l2norm``: ``x * rsqrt(sum(x^2) + eps)`` over the last axis, in float32 (the eps
    sits inside the rsqrt, added to the sum of squares, not to the norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def decay_and_beta(a_BTH: jax.Array, b_BTH: jax.Array, a_log_H: jax.Array, dt_bias_H: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The per-token, per-value-head log decay ``g`` (float32, <= 0) and write strength ``beta``.

    HF: ``g = -exp(A_log.float()) * softplus(a.float() + dt_bias)`` in float32 and
    ``beta = b.sigmoid()`` in the projection's dtype (rounded there before the kernel upcasts it).
    torch's softplus returns x above 20; ``jax.nn.softplus`` differs from that by under exp(-20).
    """
    g = -jnp.exp(a_log_H.astype(jnp.float32)) * jax.nn.softplus(a_BTH.astype(jnp.float32) + dt_bias_H.astype(jnp.float32))
    beta = jax.nn.sigmoid(b_BTH.astype(jnp.float32)).astype(b_BTH.dtype)
    return g, beta


def gated_rms_norm(x_BTHV: jax.Array, z_BTHV: jax.Array, weight_V: jax.Array, eps: float) -> jax.Array:
    """HF ``Qwen3NextRMSNormGated`` (same in Qwen3.5): RMS-normalise each head's output over V in
    float32, cast back, scale by ``weight`` (a plain scale initialised to ones, *not* the
    zero-centred ``1 + w`` of the family's other RMSNorms), then multiply by ``silu(z)`` in float32
    and cast back to the input dtype."""
    dt = x_BTHV.dtype
    x32 = x_BTHV.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scaled = weight_V.astype(dt) * x32.astype(dt)
    return (scaled.astype(jnp.float32) * jax.nn.silu(z_BTHV.astype(jnp.float32))).astype(dt)


# ----------------------------------------------------------------------------------------------
# Document runs


def document_runs(segment_ids_BT: jax.Array | None, batch: int, seq_len: int) -> jax.Array:
    """Index of the run each position belongs to: 0 for the row's first run, +1 at every change
    of segment id. Using runs rather than the ids themselves makes a document that reappears
    after padding (ids 1 1 0 0 1) a new document, so every mask below only needs equality."""
    if segment_ids_BT is None:
        return jnp.zeros((batch, seq_len), jnp.int32)
    changes = (segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), jnp.cumsum(changes, axis=1)], axis=1)


def _not_padding(segment_ids_BT: jax.Array | None) -> jax.Array | None:
    return None if segment_ids_BT is None else segment_ids_BT != 0


# ----------------------------------------------------------------------------------------------
# Causal depthwise conv


def causal_conv1d(x_BTE: jax.Array, w_WE: jax.Array, segment_ids_BT: jax.Array | None = None,
                  initial_state_BWE: jax.Array | None = None, *, activation: bool = True) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv of width W (HF ``causal_conv1d_fn``, no bias) and SiLU, restarting
    its window at every document boundary.

    ``y_t = silu(sum_i w[i] x_{t-W+1+i})`` over the inputs of ``t``'s own run only: earlier
    documents contribute zeros, as the zero left-padding of a document run alone does. ``E``
    may be any trailing shape (``[G, K]``, ``[H, V]``, or HF's flat ``2*G*K + H*V`` channels);
    ``w_WE`` is HF's ``conv1d.weight[:, 0, :]`` transposed (``w[W - 1]`` multiplies the current
    token).

    ``initial_state_BWE``: the ``W - 1`` inputs before the row (zeros by default), part of the
    row's first run. Returns ``(y_BTE, final_state_BWE)``, the last ``W - 1`` inputs of the
    extended row with those outside its last run zeroed, ready to pass on.

    Computed in float32 and cast back to ``x``'s dtype (HF runs the conv and SiLU in the weight's
    dtype; the two agree in float32).
    """
    b, t = x_BTE.shape[:2]
    trailing = x_BTE.shape[2:]
    width = w_WE.shape[0]
    if initial_state_BWE is None:
        initial_state_BWE = jnp.zeros((b, width - 1, *trailing), x_BTE.dtype)
    xx = jnp.concatenate([initial_state_BWE.astype(jnp.float32), x_BTE.astype(jnp.float32)], axis=1)
    run_BT = document_runs(segment_ids_BT, b, t)
    run_ext = jnp.concatenate([jnp.zeros((b, width - 1), jnp.int32), run_BT], axis=1)  # the prefix is run 0
    expand = (slice(None), slice(None)) + (None,) * len(trailing)
    w = w_WE.astype(jnp.float32)
    y = jnp.zeros((b, t, *trailing), jnp.float32)
    for i in range(width):
        same = (run_ext[:, i:i + t] == run_BT)[expand]
        y = y + jnp.where(same, xx[:, i:i + t], 0.0) * w[i]
    if activation:
        y = jax.nn.silu(y)
    final = jnp.where((run_ext[:, t:] == run_BT[:, -1:])[expand], xx[:, t:], 0.0)  # xx's last W - 1
    return y.astype(x_BTE.dtype), final.astype(x_BTE.dtype)


# ----------------------------------------------------------------------------------------------
# The gated delta rule


def _prepare(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, scale, normalize_qk):
    """float32; q/k repeated to the value heads (HF repeat_interleave), L2-normalised, q scaled."""
    h, g_heads = v_BTHV.shape[2], q_BTGK.shape[2]
    if h % g_heads or k_BTGK.shape[2] != g_heads:
        raise ValueError(f"value heads {h} must be a multiple of the q/k heads {q_BTGK.shape[2]}, {k_BTGK.shape[2]}")
    q, k = q_BTGK.astype(jnp.float32), k_BTGK.astype(jnp.float32)
    if h != g_heads:
        q, k = jnp.repeat(q, h // g_heads, axis=2), jnp.repeat(k, h // g_heads, axis=2)
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v_BTHV.astype(jnp.float32), g_BTH.astype(jnp.float32), beta_BTH.astype(jnp.float32)


def recurrent_gated_delta_rule(q_BTGK: jax.Array, k_BTGK: jax.Array, v_BTHV: jax.Array, g_BTH: jax.Array,
                               beta_BTH: jax.Array, segment_ids_BT: jax.Array | None = None,
                               initial_state_BHKV: jax.Array | None = None, *, scale: float | None = None,
                               normalize_qk: bool = True, precision=None) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token (HF ``torch_recurrent_gated_delta_rule``): the oracle
    for :func:`chunk_gated_delta_rule`. Returns ``(o_BTHV in q's dtype, final_state_BHKV float32)``.

    The state is zeroed before the first token of every run after the row's first (packing);
    ``initial_state_BHKV`` (default zeros) is the state the first run starts from. Padding
    (segment 0) positions output zeros.
    """
    out_dtype = q_BTGK.dtype
    b, t, h, vd = v_BTHV.shape
    q, k, v, g, beta = _prepare(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, scale, normalize_qk)
    kd = q.shape[-1]
    run_BT = document_runs(segment_ids_BT, b, t)
    s0 = jnp.zeros((b, h, kd, vd), jnp.float32) if initial_state_BHKV is None else initial_state_BHKV.astype(jnp.float32)

    def step(carry, xs):
        s_BHKV, prev_run_B = carry
        q_BHK, k_BHK, v_BHV, g_BH, beta_BH, run_B = xs
        s_BHKV = jnp.where((run_B == prev_run_B)[:, None, None, None], s_BHKV, 0.0)
        s_BHKV = s_BHKV * jnp.exp(g_BH)[..., None, None]
        kv_mem_BHV = jnp.einsum("bhk,bhkv->bhv", k_BHK, s_BHKV, precision=precision)
        delta_BHV = (v_BHV - kv_mem_BHV) * beta_BH[..., None]
        s_BHKV = s_BHKV + k_BHK[..., :, None] * delta_BHV[..., None, :]
        o_BHV = jnp.einsum("bhk,bhkv->bhv", q_BHK, s_BHKV, precision=precision)
        return (s_BHKV, run_B), o_BHV

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, run_BT))
    (s_final, _), o_TBHV = jax.lax.scan(step, (s0, jnp.zeros((b,), jnp.int32)), xs)
    o_BTHV = jnp.moveaxis(o_TBHV, 0, 1)
    valid = _not_padding(segment_ids_BT)
    if valid is not None:
        o_BTHV = jnp.where(valid[:, :, None, None], o_BTHV, 0.0)
    return o_BTHV.astype(out_dtype), s_final


def unit_lower_inverse(a_XCC: jax.Array, precision=None) -> jax.Array:
    """``(I + A)^-1`` for strictly lower-triangular ``A`` (``[..., C, C]``), exactly, by matmuls only.

    Recursive 2 x 2 block inversion (LAPACK ``trtri``'s scheme, FLA's ``solve_tril``):
    ``[[L11, 0], [L21, L22]]^-1 = [[L11^-1, 0], [-L22^-1 L21 L11^-1, L22^-1]]``, all the diagonal
    blocks of one size at once, from 1 x 1 (the unit diagonal) to ``C`` in ``log2(C)`` levels
    (``C`` is zero-padded to a power of two, which leaves the leading block's inverse unchanged).

    Not ``lax.linalg.triangular_solve``: on XLA:CPU that is jaxlib 0.10.2's LAPACK ``trsm`` FFI,
    whose batch loop (``ParallelBatchMap``) queues its pieces on XLA:CPU's intra-op pool and
    blocks a pool thread waiting for them; when as many solves run at once as the pool has
    threads (one per fake device, all in the same step), every thread waits and the step hangs.
    Matmuls are also what a GPU runs best on a 64 x 64 system.
    """
    c = a_XCC.shape[-1]
    p = 1 << max(0, (c - 1).bit_length())
    batch = a_XCC.shape[:-2]
    a = jnp.pad(a_XCC, [(0, 0)] * len(batch) + [(0, p - c)] * 2) if p != c else a_XCC
    inv = jnp.ones((*batch, p, 1, 1), a.dtype)  # the inverses of the diagonal blocks, [..., p / s, s, s]
    s = 1
    while s < p:
        m = p // (2 * s)
        diag = jnp.moveaxis(jnp.diagonal(a.reshape(*batch, m, 2 * s, m, 2 * s), axis1=-4, axis2=-2), -1, -3)
        pair = inv.reshape(*batch, m, 2, s, s)
        inv11, inv22 = pair[..., 0, :, :], pair[..., 1, :, :]
        inv21 = -jnp.matmul(jnp.matmul(inv22, diag[..., s:, :s], precision=precision), inv11, precision=precision)
        inv = jnp.concatenate([jnp.concatenate([inv11, jnp.zeros_like(inv11)], axis=-1),
                               jnp.concatenate([inv21, inv22], axis=-1)], axis=-2)
        s *= 2
    return inv.reshape(*batch, p, p)[..., :c, :c]


def chunk_gated_delta_rule(q_BTGK: jax.Array, k_BTGK: jax.Array, v_BTHV: jax.Array, g_BTH: jax.Array,
                           beta_BTH: jax.Array, segment_ids_BT: jax.Array | None = None,
                           initial_state_BHKV: jax.Array | None = None, *, chunk_size: int = 64,
                           scale: float | None = None, normalize_qk: bool = True,
                           precision=None, unroll: int | bool = 1) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in chunks of ``chunk_size`` (HF ``torch_chunk_gated_delta_rule``, FLA's
    ``chunk_gated_delta_rule``), packing-correct. Same arguments and results as
    :func:`recurrent_gated_delta_rule`; ``T`` need not be a multiple of the chunk.

    Within a chunk, with ``same_ij`` "i and j in the same run", ``G_i`` the log decay summed
    over ``i``'s run from its first token in the chunk up to ``i``, and ``carry_i`` "i's run is
    the one the state arrived in" (for the first chunk: the row's first run, which starts from
    the initial state):

        A     = strict_lower(beta_i k_i.k_j exp(G_i - G_j) same_ij)           the UT system
        u, w  = (I + A)^-1 [beta v,  beta k exp(G) carry]                     one triangular solve
        P     = lower(q_i.k_j exp(G_i - G_j) same_ij)                         intra-chunk attention
        delta = u - w S                                                       the delta-rule update
        o     = (q exp(G) carry) S + P delta
        S'    = exp(G_C) carry_C S + sum_j [j in the last run] exp(G_C - G_j) k_j delta_j^T

    Everything but the last three lines is computed for all chunks at once; the scan over chunks
    carries only ``S`` ``[B, H, K, V]`` in float32. Every exponent is ``<= 0`` (masked pairs are
    set to ``-inf`` *before* the exp), so nothing overflows and no masked branch feeds a NaN into
    the gradient. The tail is padded with g = beta = k = v = 0 in the last run, which leaves the
    state exactly as the last real token left it (as HF's padding does).

    ``unroll`` goes to the chunk scan (``True`` unrolls it fully, which also makes XLA's cost
    analysis count every chunk rather than the loop body once). ``precision`` goes to every
    matmul (None: JAX's default, which XLA:GPU may run as TF32).
    """
    out_dtype = q_BTGK.dtype
    b, t, h, vd = v_BTHV.shape
    q, k, v, g, beta = _prepare(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, scale, normalize_qk)
    kd = q.shape[-1]
    n = max(1, -(-t // chunk_size))
    chunks, run_BNC = _in_chunks((q, k, v, g, beta), document_runs(segment_ids_BT, b, t), n, chunk_size)
    xs = _chunk_terms(*chunks, run_BNC, precision)
    s0 = jnp.zeros((b, h, kd, vd), jnp.float32) if initial_state_BHKV is None else initial_state_BHKV.astype(jnp.float32)
    s_final, o_NBHCV = _scan_chunks(s0, xs, precision, unroll)
    o_BNCHV = jnp.moveaxis(o_NBHCV, (0, 1, 2), (1, 0, 3))
    o_BTHV = o_BNCHV.reshape(b, n * chunk_size, h, vd)[:, :t]
    valid = _not_padding(segment_ids_BT)
    if valid is not None:
        o_BTHV = jnp.where(valid[:, :, None, None], o_BTHV, 0.0)
    return o_BTHV.astype(out_dtype), s_final


def _in_chunks(tensors, run_BT: jax.Array, n: int, c: int):
    """``[B, T, H, ...]`` tensors padded to ``n`` chunks of ``c`` (zeros in the last run) as
    ``[B, H, N, C, ...]``, and the runs ``[B, N, C]``."""
    b, t = run_BT.shape
    pad = n * c - t
    if pad:
        tensors = [jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in tensors]
        run_BT = jnp.pad(run_BT, [(0, 0), (0, pad)], mode="edge")

    def chunked(x_BT_):  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x_BT_.reshape(b, n, c, *x_BT_.shape[2:])
        return jnp.moveaxis(x, 3, 1) if x.ndim > 3 else x

    return [chunked(x) for x in tensors], run_BT.reshape(b, n, c)


def _chunk_terms(q_BHNCK, k_BHNCK, v_BHNCV, g_BHNC, beta_BHNC, run_BNC, precision) -> tuple[jax.Array, ...]:
    """Every chunk's terms of :func:`chunk_gated_delta_rule` at once (all but its last three
    lines), chunk axis first for the scan: ``u, w, qread, attn, kwrite, keep``."""
    b, n, c = run_BNC.shape
    vd = v_BHNCV.shape[-1]
    prev_run_BN = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), run_BNC[:, :-1, -1]], axis=1)
    carry_BNC = run_BNC == prev_run_BN[:, :, None]
    causal_same_BNCC = (run_BNC[:, :, :, None] == run_BNC[:, :, None, :]) & jnp.tril(jnp.ones((c, c), bool))
    strict_CC = jnp.tril(jnp.ones((c, c), bool), -1)

    # The cumulative decay from the start of each token's run within the chunk (a masked sum, not
    # a cumsum minus an offset: that would cancel other documents' decays only up to rounding, and
    # leave them a rounding-sized gradient from this one).
    cum_BHNC = jnp.einsum("bnij,bhnj->bhni", causal_same_BNCC.astype(jnp.float32), g_BHNC,
                          precision=jax.lax.Precision.HIGHEST)
    diff_BHNCC = cum_BHNC[..., :, None] - cum_BHNC[..., None, :]
    decay_BHNCC = jnp.exp(jnp.where(causal_same_BNCC[:, None], diff_BHNCC, -jnp.inf))

    kk_BHNCC = jnp.einsum("bhnik,bhnjk->bhnij", k_BHNCK, k_BHNCK, precision=precision)
    a_BHNCC = jnp.where(strict_CC, kk_BHNCC * decay_BHNCC, 0.0) * beta_BHNC[..., :, None]
    attn_BHNCC = jnp.einsum("bhnik,bhnjk->bhnij", q_BHNCK, k_BHNCK, precision=precision) * decay_BHNCC

    read_BHNC = jnp.exp(cum_BHNC) * carry_BNC[:, None]  # how much of the carried-in state each token sees
    rhs = jnp.concatenate([v_BHNCV * beta_BHNC[..., None], k_BHNCK * (beta_BHNC * read_BHNC)[..., None]], axis=-1)
    solved = jnp.einsum("bhnij,bhnjx->bhnix", unit_lower_inverse(a_BHNCC, precision), rhs, precision=precision)
    u_BHNCV, w_BHNCK = solved[..., :vd], solved[..., vd:]
    qread_BHNCK = q_BHNCK * read_BHNC[..., None]

    last_BHN = cum_BHNC[..., -1]
    in_last_BNC = run_BNC == run_BNC[:, :, -1:]
    kwrite_BHNCK = k_BHNCK * jnp.exp(jnp.where(in_last_BNC[:, None], last_BHN[..., None] - cum_BHNC, -jnp.inf))[..., None]
    keep_BHN = jnp.exp(last_BHN) * carry_BNC[:, None, :, -1]

    return tuple(jnp.moveaxis(x, 2, 0) for x in (u_BHNCV, w_BHNCK, qread_BHNCK, attn_BHNCC, kwrite_BHNCK, keep_BHN))


def _scan_chunks(s0_BHKV: jax.Array, xs, precision, unroll):
    """The scan over chunks: the state through each, and each chunk's output."""

    def step(s_BHKV, xs):
        u, w, qread, attn, kwrite, keep = xs
        delta_BHCV = u - jnp.einsum("bhck,bhkv->bhcv", w, s_BHKV, precision=precision)
        o_BHCV = (jnp.einsum("bhck,bhkv->bhcv", qread, s_BHKV, precision=precision)
                  + jnp.einsum("bhij,bhjv->bhiv", attn, delta_BHCV, precision=precision))
        s_BHKV = keep[..., None, None] * s_BHKV + jnp.einsum("bhck,bhcv->bhkv", kwrite, delta_BHCV, precision=precision)
        return s_BHKV, o_BHCV

    return jax.lax.scan(step, s0_BHKV, xs, unroll=unroll)


# ----------------------------------------------------------------------------------------------
# FLOPs


def _inverse_flops(chunk_size: int) -> int:
    """Matmul FLOPs of :func:`unit_lower_inverse` for one ``C x C`` system: level ``s`` does
    ``P / 2s`` pairs of ``[s, s] x [s, s]`` products, ``2 P s^2``; summed over ``s = 1 .. P / 2``,
    ``2 P (P^2 - 1) / 3`` (``P``: ``C`` rounded up to a power of two)."""
    p = 1 << max(0, (chunk_size - 1).bit_length())
    return 2 * p * (p * p - 1) // 3


def chunk_flops_per_token(num_value_heads: int, key_dim: int, value_dim: int, chunk_size: int = 64) -> int:
    """Forward matmul FLOPs per token of :func:`chunk_gated_delta_rule` (multiply-add = 2), all
    value heads, for a sequence that fills its chunks (:func:`chunk_flops` counts the padded tail).

    Per chunk of ``C`` tokens and per value head (``K``, ``V`` the head dims):

    * ``k k^T`` and ``q k^T`` over the chunk, ``[C, K] x [K, C]`` each:           2 * 2 C^2 K
    * the UT system's inverse ``(I + A)^-1`` (:func:`unit_lower_inverse`):          2 C (C^2 - 1) / 3
    * that inverse times ``[beta v, beta k exp(G)]``, ``[C, C] x [C, V + K]``:       2 C^2 (V + K)
    * ``w S`` and ``(q exp(G)) S``, ``[C, K] x [K, V]`` each:                       2 * 2 C K V
    * ``P delta``, ``[C, C] x [C, V]``:                                             2 C^2 V
    * the state update ``kwrite^T delta``, ``[K, C] x [C, V]``:                     2 C K V

    Divided by ``C``: ``6 K V + 4 C K + 2 C V + 2 C (K + V) + 2 (C^2 - 1) / 3`` per token per head
    (for a power-of-two ``C``; otherwise the inverse is that of the next power of two, and this
    rounds down). The sequence-length-free ``6 K V`` is the recurrence's own work; the ``C`` terms
    are what chunking pays to turn it into matmuls. At Qwen3.5/Qwen3-Next sizes (K = V = 128,
    C = 64, H = 32): 182,954 per head, 1.40x the ``8 K V`` that Megatron counts for the core
    (:func:`megatron_flops_per_token`); forward substitution (LAPACK's ``trsm``) would do the solve
    in ``C (C - 1)(K + V)`` instead of ``2 C^2 (K + V) + 2 C (C^2 - 1) / 3``, 1.25x, but see
    :func:`unit_lower_inverse` for why it is not used. The backward runs each matmul twice more,
    so a training step is about 3x this, as Megatron's factor 3 assumes. Elementwise work (decays,
    masks, the l2 norm) is not counted.

    Sharing ``q k^T`` and ``k k^T`` across the ``H // G`` value heads of a key head (the decays
    differ per value head, the products do not) would save ``4 C K (1 - G/H)`` per token per head;
    this implementation repeats q and k as HF does.
    """
    return _chunk_flops_per_head(key_dim, value_dim, chunk_size) * num_value_heads // chunk_size


def _chunk_flops_per_head(k: int, v: int, c: int) -> int:
    """One chunk, one value head: the terms listed in :func:`chunk_flops_per_token`, times ``C``."""
    return c * (6 * k * v + 4 * c * k + 2 * c * v + 2 * c * (k + v)) + _inverse_flops(c)


def chunk_flops(batch: int, seq_len: int, num_value_heads: int, key_dim: int, value_dim: int, chunk_size: int = 64) -> int:
    """Forward matmul FLOPs of one :func:`chunk_gated_delta_rule` call, the padded tail included."""
    chunks = max(1, math.ceil(seq_len / chunk_size))
    return batch * chunks * num_value_heads * _chunk_flops_per_head(key_dim, value_dim, chunk_size)


def megatron_flops_per_token(hidden: int, num_key_heads: int, num_value_heads: int, key_dim: int, value_dim: int,
                             conv_width: int = 4) -> int:
    """Forward FLOPs per token of one gated-DeltaNet layer as Megatron-LM counts them
    (``megatron/training/training.py``, ``num_floating_point_operations``, the
    ``experimental_attention_variant == "gated_delta_net"`` term; the hybrid-model branch's
    ``gdn_layer_flops`` is the same), multiply-add = 2, before the factor 3 for the backward:

        2 * ( D (2 G K + 2 H V + 2 H)     in_proj: q, k, v, z, b, a
            + W (2 G K + H V)             the depthwise conv
            + 4 H V^2                     the core: "KK^T, VK^T, S(a(I-bKK^T)), and SQ"
            + D H V )                     out_proj

    Megatron's core term assumes ``K == V`` (it writes ``V^2``); it is the recurrent form's
    ``8 K V`` per head, not the chunked algorithm's (:func:`chunk_flops_per_token`). MFU compares
    this count with the peak, as Megatron's TFLOP/s/GPU does.
    """
    d, g, h, k, v, w = hidden, num_key_heads, num_value_heads, key_dim, value_dim, conv_width
    return 2 * (d * (2 * g * k + 2 * h * v + 2 * h) + w * (2 * g * k + h * v) + 4 * h * v * v + d * h * v)


# ----------------------------------------------------------------------------------------------
# Qwen3-Next's fused projections


def split_qwen3_next_projections(in_proj_qkvz, in_proj_ba, num_key_heads: int, num_value_heads: int,
                                 key_dim: int, value_dim: int):
    """Qwen3-Next's fused ``in_proj_qkvz`` ``[G*(2K + 2RV), D]`` and ``in_proj_ba`` ``[2H, D]``
    (torch ``[out, in]`` weights, R = H // G) into Qwen3.5's ``in_proj_qkv`` ``[2GK + HV, D]``,
    ``in_proj_z`` ``[HV, D]``, ``in_proj_b``, ``in_proj_a`` ``[H, D]``: a pure row permutation.

    The fused rows are grouped by key head: for key head ``g``, ``q_g (K), k_g (K), v (R V),
    z (R V)``, and ``b (R), a (R)`` (HF ``fix_query_key_value_ordering``, Megatron's layout,
    which keeps a key head's value heads on its tensor rank). Value head ``g R + r`` is the
    ``r``-th of key head ``g``'s. Works on numpy and jax arrays.
    """
    g, h, k, v = num_key_heads, num_value_heads, key_dim, value_dim
    r = h // g
    d = in_proj_qkvz.shape[-1]
    qkvz = in_proj_qkvz.reshape(g, 2 * k + 2 * r * v, d)
    q, kk = qkvz[:, :k], qkvz[:, k:2 * k]
    vv, z = qkvz[:, 2 * k:2 * k + r * v], qkvz[:, 2 * k + r * v:]
    ba = in_proj_ba.reshape(g, 2 * r, d)
    qkv = _concat([q.reshape(g * k, d), kk.reshape(g * k, d), vv.reshape(h * v, d)])
    return qkv, z.reshape(h * v, d), ba[:, :r].reshape(h, d), ba[:, r:].reshape(h, d)


def fuse_qwen3_next_projections(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, num_key_heads: int,
                                num_value_heads: int, key_dim: int, value_dim: int):
    """The inverse of :func:`split_qwen3_next_projections` (for writing Qwen3-Next checkpoints)."""
    g, h, k, v = num_key_heads, num_value_heads, key_dim, value_dim
    r = h // g
    d = in_proj_qkv.shape[-1]
    q = in_proj_qkv[:g * k].reshape(g, k, d)
    kk = in_proj_qkv[g * k:2 * g * k].reshape(g, k, d)
    vv = in_proj_qkv[2 * g * k:].reshape(g, r * v, d)
    z = in_proj_z.reshape(g, r * v, d)
    qkvz = _concat([q, kk, vv, z], axis=1).reshape(g * (2 * k + 2 * r * v), d)
    ba = _concat([in_proj_b.reshape(g, r, d), in_proj_a.reshape(g, r, d)], axis=1).reshape(2 * h, d)
    return qkvz, ba


def _concat(parts, axis=0):
    """numpy stays numpy (an importer streams host arrays; nothing lands on a device)."""
    xp = jnp if any(isinstance(p, jax.Array) for p in parts) else np
    return xp.concatenate(parts, axis=axis)
