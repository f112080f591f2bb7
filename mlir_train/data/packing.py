"""Packing documents into fixed-length rows without splitting any document.

Best-fit decreasing: documents are placed longest first, each into the open row whose free space
it fills most tightly. On alpaca-like length distributions (many short documents, a tail of long
ones) this leaves only the last few rows partly empty, well above 95% fill at 2048 tokens.
"""

from __future__ import annotations

import bisect

import numpy as np


def pack_best_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Group documents (all ``<= capacity`` long) into rows of at most ``capacity`` tokens.

    Returns ``(row_offsets, row_docs)``: row ``r`` holds documents
    ``row_docs[row_offsets[r]:row_offsets[r + 1]]`` (indices into ``lengths``).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and int(lengths.max()) > capacity:
        raise ValueError(f"document of {int(lengths.max())} tokens exceeds the row ({capacity})")
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted; full rows leave the list
    for doc in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[doc])
        i = bisect.bisect_left(free, (length, -1))
        if i < len(free):
            space, row = free.pop(i)
            rows[row].append(doc)
        else:
            space, row = capacity, len(rows)
            rows.append([doc])
        if space - length > 0:
            bisect.insort(free, (space - length, row))
    return _offsets(rows)


def one_per_row(num_docs: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(num_docs + 1, dtype=np.int64), np.arange(num_docs, dtype=np.int64)


def _offsets(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    row_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    row_docs = np.fromiter((d for r in rows for d in r), dtype=np.int64, count=int(sizes.sum()))
    return row_offsets, row_docs
