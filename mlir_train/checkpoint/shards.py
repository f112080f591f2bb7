"""The one shard reader: ``jax.make_array_from_callback`` callbacks that read only the shard asked for.

Both readers of foreign checkpoints, HF safetensors (:mod:`mlir_train.checkpoint.hf`) and
Megatron's torch / torch_dist files (:mod:`mlir_train.checkpoint.megatron.load`), build each
parameter of our model with ``jax.make_array_from_callback`` in the run's own shardings, so no
host holds the whole model. The callback gets the index of one device's shard. A parameter
stacked over layers (``[L, ...]``) or over layers and experts (``[L, E, ...]``) is read one
layer (one expert) at a time, only those in that index, through the format's ``read(l, e)``;
the last few are kept, since the shards of the same layer on other devices ask for it again. A
global parameter (embedding, final norm, LM head) is read whole, once.

What each format keeps for itself is how it opens its files (safetensors handles by tensor name;
torch pickles by rank, memory-mapped; DCP region reads) and how its tensors map to ours: those
share nothing but this callback shape.

No jax here: the callbacks take and return numpy arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

Callback = Callable[[tuple[slice, ...]], np.ndarray]


def full_index(index, ndim: int) -> tuple[slice, ...]:
    """``index`` (a shard's slices, possibly fewer than ``ndim``) with the trailing axes whole."""
    return tuple(index) + (slice(None),) * (ndim - len(index))


def whole_callback(read: Callable[[], np.ndarray], dtype) -> Callback:
    """A callback over a parameter ``read()`` returns whole (read on the first call only)."""
    whole = functools.cache(read)
    return lambda index: np.asarray(whole()[index], dtype=dtype)


def stacked_callback(shape: tuple[int, ...], read: Callable[[int, int | None], np.ndarray], dtype, *,
                     experts: bool, cache: int) -> Callback:
    """A callback over a parameter of ``shape`` stacked over layers (and, with ``experts``, over
    experts on the second axis). ``read(l, e)`` gives layer ``l``'s array without the stacked axes
    (``e`` is None without ``experts``); the last ``cache`` distinct ``(l, e)`` read are kept."""
    one = functools.lru_cache(maxsize=cache)(read)

    def callback(index) -> np.ndarray:
        index = full_index(index, len(shape))
        layers = range(*index[0].indices(shape[0]))
        if not experts:
            return np.stack([one(l, None)[index[1:]] for l in layers]).astype(dtype)
        chosen = range(*index[1].indices(shape[1]))
        return np.stack([np.stack([one(l, e)[index[2:]] for e in chosen]) for l in layers]).astype(dtype)

    return callback
