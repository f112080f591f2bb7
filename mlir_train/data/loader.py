"""Deterministic, resumable batches; each process of a multi-host job reads only its rows.

Rows are visited in a fresh permutation each epoch, seeded by ``(seed, epoch)``. The row stream
runs across epoch boundaries (a global batch may end one epoch and start the next), so no row
is skipped and a split smaller than one batch still works. The state is ``(epoch, position)``
in that stream, so a restored loader yields exactly the batch that would have come next.
"""

from __future__ import annotations

import numpy as np

from mlir_train.data.dataset import SFTDataset
from mlir_train.data.records import DataError


class BatchLoader:
    def __init__(self, dataset: SFTDataset, global_batch_size: int, *, seed: int,
                 process_index: int = 0, process_count: int = 1):
        if dataset.num_rows == 0:
            raise DataError(f"{dataset.name} split has 0 rows; check --split and the data")
        if global_batch_size < 1 or global_batch_size % process_count:
            raise ValueError(f"global batch size {global_batch_size} must be a positive multiple "
                             f"of the process count {process_count}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process index {process_index} not in [0, {process_count})")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.process_index, self.process_count = process_index, process_count
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, None

    @property
    def rows_per_process(self) -> int:
        return self.global_batch_size // self.process_count

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order, self._order_epoch = rng.permutation(self.dataset.num_rows), epoch
        return self._order

    def next_global_rows(self) -> np.ndarray:
        """The row indices of the next global batch (all processes), advancing the state."""
        rows, needed = [], self.global_batch_size
        while needed:
            order = self._epoch_order(self.epoch)
            take = order[self.position:self.position + needed]
            rows.append(take)
            needed -= len(take)
            self.position += len(take)
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return np.concatenate(rows)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rows = self.next_global_rows()
        start = self.process_index * self.rows_per_process
        return self.dataset.rows(rows[start:start + self.rows_per_process])

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_rows": self.dataset.num_rows, "global_batch_size": self.global_batch_size}

    def restore(self, state: dict) -> None:
        if state["seed"] != self.seed or state.get("num_rows", self.dataset.num_rows) != \
                self.dataset.num_rows:
            raise DataError(f"loader state {state} does not match this loader (seed {self.seed}, "
                            f"{self.dataset.num_rows} rows): the data or seed changed since the "
                            f"checkpoint")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
