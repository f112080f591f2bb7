"""Evaluation as Megatron runs it: each of ``--eval-iters`` iterations is one global batch of
the valid split in the training step's micro-batches, forward only (pipelined under PP); at
most one pass over the split per evaluation."""

from __future__ import annotations

import math

from mlir_train.data import BatchLoader


class Evaluator:
    """The loop's evaluation hook: ``evaluator(iteration, params)`` -> validation loss (or None
    when the valid split is empty), reported through ``logger.validation``."""

    def __init__(self, trainer, valid, *, global_batch_size: int, eval_iters: int, seed: int, split: str,
                 process_index: int, process_count: int, logger, timers):
        self.trainer, self.valid, self.gbs, self.eval_iters = trainer, valid, global_batch_size, eval_iters
        self.seed, self.split, self.pid, self.nproc = seed, split, process_index, process_count
        self.logger, self.timers = logger, timers

    def __call__(self, iteration: int, params) -> float | None:
        if self.valid is None:
            print(f" validation at iteration {iteration}: the valid split is empty (--split {self.split}); skipped")
            return None
        self.timers.start("eval")
        loader = BatchLoader(self.valid, self.gbs, seed=self.seed, process_index=self.pid, process_count=self.nproc)
        total, count = 0.0, 0.0
        for _ in range(min(self.eval_iters, max(1, math.ceil(self.valid.num_rows / self.gbs)))):
            out = self.trainer.eval_step(params, self.trainer.global_batch(next(loader)))
            total, count = total + float(out["ce_sum"]), count + float(out["loss_tokens"])
        loss = total / max(count, 1.0)
        self.timers.stop("eval")
        self.logger.validation(iteration, loss)
        return loss
