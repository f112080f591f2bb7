"""How Megatron's tensor-parallel ranks hold a tensor, both ways: a global tensor from the
ranks' pieces (:func:`assemble`) and one rank's piece of it (:func:`piece`), by the split rule
the family's parameter table gives each tensor (:data:`mlir_train.families.table.SPLITS`). The
routed experts' tensors split the same way over the expert-tensor-parallel ranks."""

from __future__ import annotations

import numpy as np

from mlir_train.families.table import COLUMN, GLU, REPLICATED, ROW, VOCAB


def assemble(pieces: list[np.ndarray], split: str) -> np.ndarray:
    """The global tensor of the ranks' ``pieces`` (rank order); one piece for a replicated one."""
    if split in (COLUMN, VOCAB):
        return np.concatenate(pieces, axis=0)
    if split == ROW:
        return np.concatenate(pieces, axis=1)
    if split == GLU:  # each rank: its block of the gate rows, then its block of the up rows
        halves = [np.split(w, 2, axis=0) for w in pieces]
        return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=0)
    if split == REPLICATED:
        return pieces[0]
    raise ValueError(f"unknown split {split!r}")


def piece(w: np.ndarray, split: str, rank: int, ranks: int) -> np.ndarray:
    """Rank ``rank``'s piece of the global ``w`` over ``ranks`` ranks."""
    if split in (COLUMN, VOCAB):
        return np.split(w, ranks, axis=0)[rank]
    if split == ROW:
        return np.split(w, ranks, axis=1)[rank]
    if split == GLU:
        gate, up = np.split(w, 2, axis=0)
        return np.concatenate([np.split(gate, ranks)[rank], np.split(up, ranks)[rank]])
    if split == REPLICATED:
        return w
    raise ValueError(f"unknown split {split!r}")


def pieces_of(split: str, ranks: int) -> range:
    """The ranks whose pieces make the global tensor (one for a replicated tensor)."""
    return range(1 if split == REPLICATED else ranks)
