"""Build the SFT data cache ahead of training and print what preprocessing did.

    python -m mlir_train.preprocess --tokenizer-type HFTokenizer --hf-tokenizer-path DIR \\
        --data-path alpaca_data_en_52k.json --split 100,0,0 --chat-template alpaca \\
        --sft-num-preprocess-workers 8 --packing-sft-data --seq-length 2048 \\
        --data-cache-path CACHE

Takes exactly the flags of ``python -m mlir_train.sft`` (the training script's whole command line
can be passed; only the data and SFT flags matter), so both build and find the same cache.
Without --data-path / --hf-tokenizer-path / --seq-length it uses the bundled alpaca tasks and
tokenizer at 2048 tokens. Bad input prints one ``mlir-train: error:`` line and exits with status 2,
as every entry point does (:mod:`mlir_train.runtime.errors`).
"""

from __future__ import annotations

import sys
import time

from mlir_train.config import cli
from mlir_train.runtime import errors, platform_setup


def main(argv: list[str] | None = None) -> int:
    run_cfg = cli.parse(argv)
    platform_setup.configure_platform(cpu_devices=run_cfg.extras.cpu_devices)  # before jax starts
    from mlir_train.data import build_datasets
    from mlir_train.data.config import DEFAULT_DATA, DEFAULT_TOKENIZER, DataConfig

    d = run_cfg.data
    run_cfg = run_cfg.replace(data=dict(data_path=d.data_path or (DEFAULT_DATA,),
                                        hf_tokenizer_path=d.tokenizer_path or DEFAULT_TOKENIZER,
                                        seq_length=d.seq_length or 2048))
    cfg = DataConfig.from_flags(run_cfg.data, run_cfg.training.seed)
    start = time.perf_counter()
    try:
        data = build_datasets(cfg)
    except errors.user_errors() as e:
        return errors.report(e)
    print(data.summary())
    print(f"took {time.perf_counter() - start:.2f} s with {cfg.num_workers} worker(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
