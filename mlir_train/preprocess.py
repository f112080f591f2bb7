"""Build the SFT data cache ahead of training and print what preprocessing did.

    python -m mlir_train.preprocess --tokenizer-type HFTokenizer --hf-tokenizer-path DIR \\
        --data-path alpaca_data_en_52k.json --split 100,0,0 --chat-template alpaca \\
        --sft-num-preprocess-workers 8 --packing-sft-data --seq-length 2048 \\
        --data-cache-path CACHE

Takes the Megatron/AIAK data and SFT flags (others are ignored with a note, so the training
script's whole flag list can be passed). Without --data-path / --hf-tokenizer-path it uses the
bundled alpaca tasks and tokenizer. Bad input prints one error line and exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
import time

from mlir_train.data import DataConfig, DataError, build_datasets
from mlir_train.data.config import DEFAULT_DATA, DEFAULT_TOKENIZER


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data (Megatron/AIAK flags)")
    group.add_argument("--data-path", nargs="+", default=[DEFAULT_DATA],
                       help="files, or a weighted blend 'w1 path1 w2 path2'")
    group.add_argument("--tokenizer-type", default="HFTokenizer")
    group.add_argument("--hf-tokenizer-path", default=DEFAULT_TOKENIZER)
    group.add_argument("--chat-template", default="alpaca", help="alpaca | qwen | chatml | hf")
    group.add_argument("--seq-length", type=int, default=2048)
    group.add_argument("--packing-sft-data", action="store_true")
    group.add_argument("--sft-num-preprocess-workers", type=int, default=1)
    group.add_argument("--data-cache-path", default=None,
                       help="default: $XDG_CACHE_HOME or ~/.cache, under mlir_train/sft_data")
    group.add_argument("--sft-dataset-config", default=None)
    group.add_argument("--split", default="100,0,0")
    group.add_argument("--train-on-prompt", action="store_true")
    group.add_argument("--sft-drop-long-samples", action="store_true",
                       help="drop samples longer than --seq-length instead of truncating them")
    group.add_argument("--sft-skip-bad-records", action="store_true")
    group.add_argument("--seed", type=int, default=1234)


def data_config_from_args(args: argparse.Namespace) -> DataConfig:
    return DataConfig(
        data_path=tuple(args.data_path), tokenizer_path=args.hf_tokenizer_path,
        tokenizer_type=args.tokenizer_type, chat_template=args.chat_template,
        seq_length=args.seq_length, packing=args.packing_sft_data,
        num_workers=args.sft_num_preprocess_workers, cache_path=args.data_cache_path,
        dataset_config=args.sft_dataset_config, split=args.split,
        train_on_prompt=args.train_on_prompt, drop_long=args.sft_drop_long_samples,
        skip_bad_records=args.sft_skip_bad_records, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlir_train.preprocess",
                                     description=__doc__.splitlines()[0])
    add_data_arguments(parser)
    args, ignored = parser.parse_known_args(argv)
    if ignored:
        print(f"note: ignoring flags preprocessing does not read: {' '.join(ignored)}",
              file=sys.stderr)
    cfg = data_config_from_args(args)
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
