"""The training loop of a built job (:func:`mlir_train.run.job.build_job`), and what it leaves.

One iteration: the next global batch, the compiled step, then the hooks in Megatron's order
(log, evaluate every ``--eval-interval``, save every ``--save-interval`` or when an exit
condition fires, stop). After the loop: the last evaluation, ``--save-hf``, and one line that
says how the run ended.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from mlir_train.checkpoint import sources
from mlir_train.runtime import log
from mlir_train.run.job import Job


@dataclasses.dataclass
class RunResult:
    """What a run leaves: the loss history (``{"lm loss": [(it, loss)], "valid": [...]}``),
    where its logs are, its final state and trainer, and why it stopped early (or None)."""

    history: dict[str, list]
    log_dir: str
    state: Any
    trainer: Any
    tokenizer: Any
    stopped: str | None = None


def train(job: Job) -> RunResult:
    """Run ``job``'s iterations from its starting iteration to ``--train-iters``."""
    t, h, trainer = job.cfg.training, job.hooks, job.trainer
    state, iteration, stopped = job.state, job.start_iteration, None

    def save(iteration: int) -> None:
        h.logger.flush()  # the NaN check must pass before this state is written
        h.timers.start("save-checkpoint")
        h.saver.save(iteration, state)
        h.timers.stop("save-checkpoint")

    log.info("compiling the training step ...")
    t0 = time.perf_counter()
    try:
        for iteration in range(job.start_iteration + 1, t.train_iters + 1):
            h.timers.start("data-wait")
            batch = trainer.global_batch(next(job.train_loader))
            h.timers.stop("data-wait")
            h.timers.start("step-dispatch")
            state, metrics = trainer.train_step(state, batch)
            h.timers.stop("step-dispatch")
            first = iteration == job.start_iteration + 1
            h.logger.step_done(iteration, metrics, first=first, started=t0)
            if first:
                log.info(f"first step (compile + run) took {time.perf_counter() - t0:.1f}s")
            if t.eval_interval and iteration % t.eval_interval == 0:
                h.logger.flush()
                h.evaluate(iteration, job.trainer.weights(state))
            stopped = h.stop.reason(iteration)
            if h.saver is not None and (h.saver.should_save(iteration) or stopped):
                save(iteration)
            if stopped:
                break
        h.logger.flush()
        if h.saver is not None:
            save(iteration)  # no-op if this iteration is already saved
            h.saver.close()
    finally:
        h.stop.close()
        if h.saver is not None:
            h.saver.release()  # the --save lock, however the loop ended
    return _finish(job, state, iteration, stopped)


def _finish(job: Job, state, iteration: int, stopped: str | None) -> RunResult:
    t, ck, h = job.cfg.training, job.cfg.checkpoint, job.hooks
    if not stopped and not (t.eval_interval and t.train_iters % t.eval_interval == 0):
        h.evaluate(t.train_iters, job.trainer.weights(state))
    if not stopped and ck.save_hf:
        sources.HFModel.write(ck.save_hf, job.trainer, state, carry_from=job.hf_origin)
        log.info(f"wrote the HF model to {ck.save_hf}" + (" (base + LoRA adapters merged)" if job.trainer.lora else ""))
    if not stopped and ck.save_peft:
        sources.PeftAdapters.write(ck.save_peft, job.trainer, state, base=job.lora_base,
                                   layout=ck.lora_export_format or "per-expert")
        log.info(f"wrote the LoRA adapters to {ck.save_peft} (HF PEFT format)")
    h.writer.close()
    history = h.logger.history
    if stopped:
        where = f"checkpoint of iteration {iteration} in {ck.save}" if h.saver else "nothing saved (no --save)"
        log.info(f"stopped by {stopped} after iteration {iteration}; {where}")
    elif not history["lm loss"]:
        log.info(f"nothing to train: the checkpoint is at iteration {job.start_iteration} >= --train-iters")
    else:
        first, last = history["lm loss"][0][1], history["lm loss"][-1][1]
        log.info(f"done. lm loss {first:.4f} -> {last:.4f} over {t.train_iters} iterations; "
                 f"logs and metrics.jsonl in {h.log_dir}")
    return RunResult(history, h.log_dir, state, job.trainer, job.tokenizer, stopped)
