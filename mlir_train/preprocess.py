"""Build the SFT data cache ahead of training and print what preprocessing did.

    python -m mlir_train.preprocess --tokenizer-type HFTokenizer --hf-tokenizer-path DIR \\
        --data-path alpaca_data_en_52k.json --split 100,0,0 --chat-template alpaca \\
        --sft-num-preprocess-workers 8 --packing-sft-data --seq-length 2048 \\
        --data-cache-path CACHE

Takes exactly the flags of ``python -m mlir_train.sft`` (the training script's whole command line
can be passed; only the data and SFT flags matter), so both build and find the same cache.
Without --data-path / --hf-tokenizer-path / --seq-length it uses the bundled alpaca tasks and
tokenizer at 2048 tokens. Bad input prints one error line and exits with status 1.
"""

from __future__ import annotations

import sys
import time

from mlir_train import cli
from mlir_train.data import DataError, build_datasets
from mlir_train.data.config import DEFAULT_DATA, DEFAULT_TOKENIZER


def main(argv: list[str] | None = None) -> int:
    args, _ = cli.parse_args(argv)
    args.data_path = args.data_path or [DEFAULT_DATA]
    args.hf_tokenizer_path = args.hf_tokenizer_path or DEFAULT_TOKENIZER
    args.seq_length = args.seq_length or 2048
    cfg = cli.data_config(args)
    start = time.perf_counter()
    try:
        data = build_datasets(cfg)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(data.summary())
    print(f"took {time.perf_counter() - start:.2f} s with {cfg.num_workers} worker(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
