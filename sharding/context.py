"""The sequence order of context parallelism: Megatron's load-balanced ("zig-zag") layout.

Under ``--context-parallel-size N`` the sequence of every row is split over the ranks that
carry the context role. A causal mask makes a plain contiguous split unbalanced (the last rank's
queries see the whole sequence, the first rank's almost nothing), so Megatron cuts the sequence
into ``2N`` equal chunks and gives context rank ``r`` chunks ``r`` and ``2N-1-r``
(``megatron.core.utils.get_batch_on_this_cp_rank``): every rank then holds one early and one
late chunk and does the same attention work.

Here the whole batch is laid out in that order once, on the host (:func:`zigzag_order`
permutes the sequence axis), and the permuted sequence is split *contiguously* over the
context axes by the ordinary ``"act_seq"`` rule, so each rank receives exactly Megatron's two
chunks. Everything position-wise (embeddings, norms, MLP, MoE, the loss sums, the router's
per-document statistics keyed by segment id) does not care about the order; attention masks
causally by the original index of each token, which :func:`sequence_order` gives the model
for the active layout (the identity when the sequence is not split).

Against Megatron (megatron-core 0.16.1 ``get_batch_on_this_cp_rank`` /
``get_thd_batch_on_this_cp_rank``; Megatron-LM main's per-sequence and per-document balancing):

* a packed row is zig-zagged as one sequence and attention masks by segment id and original
  index, which is Megatron-LM's "per-sequence balancing" for inter-document masking. With
  ``cu_seqlens`` (THD) Megatron instead cuts *each document* into 2N chunks, padding every
  document to a multiple of 2N (``cu_seqlens_padded``) and Transformer Engine's
  ``thd_get_partitioned_indices`` picks the chunks. The attention output is the same; we add no
  padding, so no document has to be a multiple of 2N long, and the balance is per row;
* losses are sums over all tokens either way (Megatron all-reduces each CP rank's sums over the
  CP group). With ``--moe-expert-capacity-factor`` the tokens compete for capacity as the MoE
  block groups them ("act_tokens": under EP each data x context rank's own tokens, as
  Megatron's per-rank capacity), and ``--moe-token-drop-policy position`` ranks them in the
  layout's order, not the original one; dropless routing (the default) is order-free.

Nothing here imports ``mlir_train``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from sharding.manual import mesh_axes_of


def zigzag_order(seq_len: int, cp: int) -> np.ndarray:
    """Original index of each position of the load-balanced layout, ``[seq_len]`` int32.

    ``seq_len`` is cut into ``2 * cp`` chunks; the layout is, for ``r = 0 .. cp-1``, chunk ``r``
    followed by chunk ``2*cp-1-r``. Split contiguously into ``cp`` parts, part ``r`` is what
    Megatron's ``get_batch_on_this_cp_rank`` gives context rank ``r``. ``cp == 1`` is the identity.
    """
    if cp < 1:
        raise ValueError(f"context-parallel size must be positive, got {cp}")
    if cp == 1:
        return np.arange(seq_len, dtype=np.int32)
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x {cp} equal chunks "
                         f"(--seq-length must be divisible by 2 x --context-parallel-size)")
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * cp, seq_len // (2 * cp))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def to_zigzag(x: np.ndarray, cp: int, axis: int = -1) -> np.ndarray:
    """``x`` with its sequence ``axis`` in the load-balanced layout of :func:`zigzag_order`."""
    if cp == 1:
        return x
    return np.take(x, zigzag_order(x.shape[axis], cp), axis=axis)


def from_zigzag(x: np.ndarray, cp: int, axis: int = -1) -> np.ndarray:
    """The inverse of :func:`to_zigzag`: back to the original sequence order."""
    if cp == 1:
        return x
    return np.take(x, np.argsort(zigzag_order(x.shape[axis], cp)), axis=axis)


def context_parallel_size() -> int:
    """How many ranks the sequence (``"act_seq"``) is split over under the active rules and mesh."""
    return mesh_axes_of("act_seq")[1]


def sequence_order(seq_len: int) -> jnp.ndarray:
    """Original index ``[seq_len]`` of each sequence position as the active layout lays the
    batch out: :func:`zigzag_order` over the context ranks, the identity without them."""
    return jnp.asarray(zigzag_order(seq_len, context_parallel_size()))


def split_within_processes(mesh, axes: tuple[str, ...]) -> bool:
    """Whether every group of devices along mesh ``axes`` (a row's context ranks) lies in one
    process: then each process feeds whole rows and the split happens on its own devices."""
    if not axes:
        return True
    names = list(mesh.axis_names)
    devices = np.moveaxis(mesh.devices, [names.index(a) for a in axes], list(range(-len(axes), 0)))
    groups = devices.reshape(-1, int(np.prod([mesh.shape[a] for a in axes])))
    return all(len({d.process_index for d in group}) == 1 for group in groups)
