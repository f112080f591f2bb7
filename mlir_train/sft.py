"""``python -m mlir_train.sft``: supervised fine-tuning with a Megatron/AIAK command line.

Reads top to bottom: flags -> the job (:func:`mlir_train.run.job.build_job`: the starting
point, the model, the trainer, the data, the state and the loop's hooks) -> the loop
(:func:`mlir_train.run.loop.train`) -> one typed result (:class:`~mlir_train.run.loop.RunResult`).
Any error the user can act on ends the run with one line and exit status 2. With no arguments it
runs ``--config demo`` (:mod:`mlir_train.config.demo`): it fine-tunes ``qwen3-moe-tiny`` on the
bundled alpaca-format tasks and tokenizer on 8 fake CPU devices and shows the loss falling; flags
after ``--config demo`` change that job.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from mlir_train.config import cli, demo
from mlir_train.config.flags import RunConfig, require
from mlir_train.runtime import distributed, log, platform_setup
from mlir_train.runtime.errors import exit_on_user_error

if TYPE_CHECKING:
    from mlir_train.run.loop import RunResult

DEFAULT_ARGV = ["--config", demo.NAME]  # the no-argument job (mlir_train.config.demo)


def main(argv: list[str] | None = None) -> RunResult:
    launched = time.perf_counter()  # --exit-duration-in-mins counts from here, as Megatron's from its start
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        log.info(demo.INTRO)
    cfg = cli.parse(argv or DEFAULT_ARGV)
    if cfg.ignored_flags:
        log.info(f"ignoring flags that mean nothing under JAX/XLA: {' '.join(cfg.ignored_flags)}")
    with exit_on_user_error():
        require(cfg)
        platform_setup.configure_platform(cpu_devices=cfg.extras.cpu_devices,
                                          callback_threads=cfg.extras.code_paths == "gpu")
        processes = distributed.initialize_from_env(cpu_devices=cfg.extras.cpu_devices)  # before any device use
        try:
            return _train(cfg, launched)
        finally:
            distributed.shutdown(processes)


def _train(cfg: RunConfig, launched: float) -> RunResult:
    import jax

    from mlir_train.run import loop
    from mlir_train.run.job import build_job

    if jax.process_index() != 0:
        sys.stdout = open(os.devnull, "w")  # console lines from process 0 only, as Megatron's rank 0
    log.info(platform_setup.current().describe())
    if cfg.extras.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cfg.extras.compilation_cache_dir)
    job = build_job(cfg, launched)
    return loop.train(job)


if __name__ == "__main__":
    main()
