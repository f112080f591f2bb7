"""Build the SFT data cache ahead of training and print what preprocessing did.

    python -m mlir_train.preprocess --tokenizer-type HFTokenizer --hf-tokenizer-path DIR \\
        --data-path alpaca_data_en_52k.json --split 100,0,0 --chat-template alpaca \\
        --sft-num-preprocess-workers 8 --packing-sft-data --seq-length 2048 \\
        --data-cache-path CACHE

Takes exactly the flags of ``python -m mlir_train.sft`` (the training script's whole command line
can be passed; only the data and SFT flags matter), so both build and find the same cache.
--data-path, --hf-tokenizer-path and --seq-length are required; ``--config demo`` (also what no
arguments mean) gives the demo's: the bundled alpaca tasks and tokenizer. The bundled files are
never used in place of a flag the user left out. Bad input prints one ``mlir-train: error:`` line
and exits with status 2, as every entry point does (:mod:`mlir_train.runtime.errors`).
"""

from __future__ import annotations

import sys
import time

from mlir_train.config import cli, demo, flags
from mlir_train.runtime import errors, platform_setup


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_cfg = cli.parse(argv or ["--config", demo.NAME])
    platform_setup.configure_platform(cpu_devices=run_cfg.extras.cpu_devices)  # before jax starts
    from mlir_train.data import build_datasets
    from mlir_train.data.config import DataConfig

    try:
        flags.require(run_cfg, ("--data-path", "--hf-tokenizer-path", "--seq-length"), entry="preprocess")
        cfg = DataConfig.from_flags(run_cfg.data, run_cfg.training.seed)
        start = time.perf_counter()
        data = build_datasets(cfg)
    except errors.user_errors() as e:
        return errors.report(e)
    print(data.summary())
    print(f"took {time.perf_counter() - start:.2f} s with {cfg.num_workers} worker(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
