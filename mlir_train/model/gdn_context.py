"""The gated DeltaNet under context parallelism: the conv windows and the recurrent state pass
from one piece of the sequence to the next within a document, and restart across documents.

Under ``--context-parallel-size N`` a row arrives in Megatron's load-balanced order
(:mod:`sharding.context`): the sequence is cut into ``2N`` pieces and context rank ``r`` holds
pieces ``r`` and ``2N-1-r``. The recurrence runs in the original order, so a piece needs what
the piece before it (on another rank) leaves behind:

* **conv windows**: the last ``W - 1`` pre-conv inputs of q, k and v of the previous piece,
  zeroed outside that piece's last document run (what :func:`causal_conv1d` itself passes),
  and zeroed whole when this piece starts a new document (its first segment id differs from
  the previous piece's last). These need nothing from further back as long as a piece holds at
  least ``W - 1`` tokens, which :func:`check_pieces` demands (else refused, naming the flags);
* **the recurrent state** ``S`` ``[B, H, K, V]``: the delta rule is affine in its initial state,
  ``S_out = F S_in + S_zero`` with ``F`` ``[B, H, K, K]`` (the product of the piece's
  ``exp(g) (I - beta k k^T)`` over its last run; 0 when that run starts inside the piece) and
  ``S_zero`` the state from a zero start. One chunked pass per piece computes both at once (the
  value columns extended by ``K`` zero columns, started from ``[0 | I]``); the ``2N`` pieces'
  ``(F, S_zero)`` and boundary segment ids are all-gathered over the context ranks, every rank
  folds them in piece order (``2N`` small matmuls, a reset where a piece starts a new document),
  and runs its pieces' delta rule again from their true initial states.

So each rank computes the chunked rule twice over its own ``T / N`` tokens (once with ``K``
extra value columns) and the only collectives are the all-gathers of the ``[2N, B, H, K, K + V]``
states and the windows (their transposes, reduce-scatters, in the backward); nothing here holds
the whole sequence. The result is the one-device computation with the chunks cut at piece
boundaries as well (the same sums in a different float32 order).

Shape suffixes as in :mod:`mlir_train.model.gated_deltanet`; P: the 2 local pieces, c: a piece's length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlir_train.model.gated_deltanet import causal_conv1d, chunk_gated_delta_rule, document_runs
from sharding import logical_shard_map, mesh_axes_of

KEY = ("act_batch", "act_seq", "act_gdn_key_heads", None)
VALUE = ("act_batch", "act_seq", "act_gdn_heads", None)
HEADS = ("act_batch", "act_seq", "act_gdn_heads")


def check_pieces(seq_len: int, cp: int, conv_width: int) -> None:
    """A piece (``seq_len / (2 cp)`` tokens) must hold a whole conv window (``W - 1`` tokens):
    else a window would reach two pieces back. ValueError naming the flags."""
    if seq_len % (2 * cp) or seq_len // (2 * cp) < conv_width - 1:
        raise ValueError(
            f"--context-parallel-size {cp} with --seq-length {seq_len}: the gated DeltaNet passes its conv window "
            f"({conv_width - 1} tokens) between the sequence's {2 * cp} pieces, so each piece needs at least "
            f"{conv_width - 1} tokens (use a longer --seq-length or a smaller --context-parallel-size)")


def _pieces(x):
    """``[B, 2c, ...]`` -> ``[2, B, c, ...]``: this rank's two pieces."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, 2, t // 2, *x.shape[2:]), 1, 0)


def _unpieces(x):
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _global(x_P, axes, cp):
    """This rank's per-piece values ``[2, ...]`` -> every piece's in sequence order ``[2N, ...]``
    (piece ``i`` is rank ``i``'s first for ``i < N``, rank ``2N-1-i``'s second after)."""
    g = jax.lax.all_gather(x_P, axes, axis=0, tiled=False)  # [N, 2, ...]
    return jnp.concatenate([g[:, 0], g[::-1, 1]], axis=0)


def _tails(x_PBcE, runs_PBc, width):
    """Each piece's last ``W - 1`` inputs, zeroed outside its last document run."""
    tail = x_PBcE[:, :, -(width - 1):]
    keep = runs_PBc[:, :, -(width - 1):] == runs_PBc[:, :, -1:]
    return jnp.where(keep.reshape(keep.shape + (1,) * (tail.ndim - 3)), tail, jnp.zeros_like(tail))


def _previous(global_N, my_pieces, continues_P):
    """For each of this rank's pieces, the previous piece's value (zeros for piece 0 and where
    the piece starts a new document)."""
    prev = jnp.stack([global_N[jnp.maximum(i - 1, 0)] for i in my_pieces])
    keep = continues_P.reshape(continues_P.shape + (1,) * (prev.ndim - continues_P.ndim))
    return jnp.where(keep, prev, jnp.zeros_like(prev))


def _fold_states(f_NBHKK, s0_NBHKV, continues_NB):
    """The state each piece starts from: ``S_in(i+1) = [continues] (F_i S_in(i) + S_zero_i)``."""
    s, starts = jnp.zeros_like(s0_NBHKV[0]), []
    for i in range(s0_NBHKV.shape[0]):
        s = jnp.where(continues_NB[i][:, None, None, None], s, 0.0)
        starts.append(s)
        s = jnp.einsum("bhkj,bhjv->bhkv", f_NBHKK[i], s) + s0_NBHKV[i]
    return jnp.stack(starts)


def context_parallel_core(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, conv_weights, chunk_size: int):
    """Conv and delta rule of :class:`~mlir_train.model.linear_attention.GatedDeltaNet` over the
    load-balanced sequence split on the context ranks: ``(q, k, v)`` are the pre-conv
    projections, ``conv_weights`` the three ``[W, ...]`` conv weights; returns ``o_BTHV`` in the
    same order and split."""
    seq_axes, cp = mesh_axes_of("act_seq")
    check_pieces(q_BTGK.shape[1], cp, conv_weights[0].shape[0])
    conv_names = ((None, "act_gdn_key_heads", None), (None, "act_gdn_key_heads", None), (None, "act_gdn_heads", None))

    def run(q, k, v, g, beta, seg, weights):
        r = jax.lax.axis_index(seq_axes)
        mine = (r, 2 * cp - 1 - r)
        xs = [_pieces(a) for a in (q, k, v, g, beta, seg)]
        seg_PBc = xs[5]
        runs = jnp.stack([document_runs(s, *s.shape) for s in seg_PBc])
        first, last = _global(seg_PBc[:, :, 0], seq_axes, cp), _global(seg_PBc[:, :, -1], seq_axes, cp)
        continues_NB = jnp.concatenate([jnp.zeros_like(first[:1], bool), first[1:] == last[:-1]])
        continues_P = jnp.stack([continues_NB[i] for i in mine])
        conv = []
        for x, w in zip(xs[:3], weights):
            prev = _previous(_global(_tails(x, runs, w.shape[0]), seq_axes, cp), mine, continues_P)
            conv.append(jnp.stack([causal_conv1d(x[p], w, seg_PBc[p], prev[p])[0] for p in range(2)]))
        qc, kc, vc = conv
        kd, vd = qc.shape[-1], vc.shape[-1]
        rule = lambda p, v_, s: chunk_gated_delta_rule(qc[p], kc[p], v_, xs[3][p], xs[4][p], seg_PBc[p], s,
                                                       chunk_size=chunk_size)
        # (F | S_zero) of each piece in one pass: value columns [0 | v] started from [I | 0].
        b, _, h = vc.shape[1:4]
        eye = jnp.broadcast_to(jnp.eye(kd, dtype=jnp.float32), (b, h, kd, kd))
        start = jnp.concatenate([eye, jnp.zeros((b, h, kd, vd), jnp.float32)], axis=-1)
        maps = jnp.stack([rule(p, jnp.concatenate([jnp.zeros(vc.shape[1:-1] + (kd,), vc.dtype), vc[p]], -1),
                               start)[1] for p in range(2)])
        maps_N = _global(maps, seq_axes, cp)
        s_in = _fold_states(maps_N[..., :kd], maps_N[..., kd:], continues_NB)
        o = jnp.stack([rule(p, vc[p], s_in[i])[0] for p, i in enumerate(mine)])
        return _unpieces(o)

    return logical_shard_map(
        run, in_names=(KEY, KEY, VALUE, HEADS, HEADS, ("act_batch", "act_seq"), conv_names), out_names=VALUE,
        manual=("act_seq", "act_batch", "act_gdn_heads", "act_gdn_key_heads"),
        # The fold starts from constants ([I | 0], zeros) that a vma-checked scan would need cast
        # to varying one by one; unchecked, the weights' cotangents are summed over the ranks all the same.
        check_vma=False,
    )(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, conv_weights)
