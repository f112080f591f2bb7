"""SFT preprocessing throughput: mlir_train's pipeline vs HF ``datasets.map(num_proc=N)``.

    python benchmarks/preprocess.py [--records 52000] [--workers N] [--tokenizer DIR]

Generates an alpaca-like file (the bundled task generator, 52k records by default), then in the
same run times, each from a cold cache:

- mlir_train ``build_datasets`` with 1 and N workers (read, alpaca template, tokenise, loss
  masks, pack into 2048-token rows, write the memory-mappable cache);
- the AIAK/LoongForge path: ``datasets.load_dataset("json")`` then ``.map(num_proc=N)`` rendering
  the same alpaca template and tokenising prompt and response into input_ids/labels (no packing).

Prints the seconds of each and the ratio datasets / mlir_train (> 1 means mlir_train is faster).
Needs the ``bench`` extra (``pip install datasets``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from make_assets import generate_records  # noqa: E402

from mlir_train.data import build_datasets, load_tokenizer  # noqa: E402
from mlir_train.data.config import DEFAULT_TOKENIZER, DataConfig  # noqa: E402
from mlir_train.data.templates import ALPACA_PREAMBLE, ALPACA_PREAMBLE_INPUT  # noqa: E402

IGNORE_INDEX = -100


def ours(path: str, tokenizer, workers: int, seq_length: int, work: str) -> float:
    cfg = DataConfig(data_path=(path,), tokenizer_path=tokenizer.name_or_path,
                     seq_length=seq_length, packing=True, num_workers=workers,
                     cache_path=tempfile.mkdtemp(dir=work))
    start = time.perf_counter()
    data = build_datasets(cfg, tokenizer)
    elapsed = time.perf_counter() - start
    assert not data.from_cache
    print(f"  mlir_train, {workers} worker(s): {elapsed:6.2f} s  ({data.stats.records_kept} docs, "
          f"{data.train.num_rows} rows, fill {100 * data.stats.fill_ratio():.1f}%)")
    return elapsed


def with_datasets(path: str, tokenizer, workers: int, seq_length: int, work: str) -> float:
    import datasets

    datasets.disable_progress_bars()
    eos = tokenizer.eos_token

    def tokenize(batch):
        input_ids, labels = [], []
        for instruction, query, response in zip(batch["instruction"], batch["input"],
                                                 batch["output"]):
            if query:
                prompt = (f"{ALPACA_PREAMBLE_INPUT}### Instruction:\n{instruction}\n\n"
                          f"### Input:\n{query}\n\n### Response:\n")
            else:
                prompt = f"{ALPACA_PREAMBLE}### Instruction:\n{instruction}\n\n### Response:\n"
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            response_ids = tokenizer(response + eos, add_special_tokens=False)["input_ids"]
            ids = (prompt_ids + response_ids)[:seq_length + 1]
            input_ids.append(ids)
            labels.append(([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:seq_length + 1])
        return {"input_ids": input_ids, "labels": labels}

    start = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=path, split="train",
                                    cache_dir=tempfile.mkdtemp(dir=work))
    dataset = dataset.map(tokenize, batched=True, num_proc=workers,
                          remove_columns=dataset.column_names)
    elapsed = time.perf_counter() - start
    print(f"  datasets.map(num_proc={workers}):  {elapsed:6.2f} s  ({len(dataset)} docs, "
          f"not packed)")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=52_000)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "alpaca_like.json")
        with open(path, "w") as f:
            json.dump(generate_records(args.records, seed=52), f)
        print(f"{args.records} alpaca-like records, tokenizer {args.tokenizer}, "
              f"{os.cpu_count()} CPUs")
        one = ours(path, tokenizer, 1, args.seq_length, work)
        many = ours(path, tokenizer, args.workers, args.seq_length, work)
        peer = with_datasets(path, tokenizer, args.workers, args.seq_length, work)
    print(f"ratio datasets.map(num_proc={args.workers}) / mlir_train({args.workers} workers): "
          f"{peer / many:.2f}x   (mlir_train 1 worker: {peer / one:.2f}x)")


if __name__ == "__main__":
    main()
