"""``--config demo``: the job ``python -m mlir_train.sft`` runs with no arguments, as flags.

A small end-to-end SFT of ``qwen3-moe-tiny`` on the bundled alpaca-format tasks and tokenizer
(``mlir_train/assets``), on 8 fake CPU devices in a TP2 x EP2 x DP4 layout. Flags after
``--config demo`` change it as they change a config file (``--config demo --lora-dim 8`` is a
LoRA run of it). Its learning rate keeps the loss falling without a spike: at 3e-3 (warm-up 4)
the loss bounced at iteration 11 (5.76 -> 6.85, grad norm 175) on every layout, one device
included, so no parallelism bug; at 2e-3 the bounce moved to iteration 13 (7.35, grad norm 29);
at 1e-3 with 8 warm-up iterations no grad norm passes 4.2 (the small rise at iteration 22 is a
harder batch, seen at every rate). The warm-up is a fraction (0.2 of 40 = 8 iterations) so that
``--config demo --train-iters 5`` runs as it says (a warm-up in iterations would outlast it).

This module imports nothing of jax or of the data layer (the config layer is below both); the
bundled files' paths are defined here and re-exported by :mod:`mlir_train.data.config`.
"""

from __future__ import annotations

import os

NAME = "demo"  # --config demo
ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
DEFAULT_DATA = os.path.join(ASSETS, "alpaca_tasks.json")
DEFAULT_TOKENIZER = os.path.join(ASSETS, "tokenizer")

FLAGS = [
    "--model-name", "qwen3-moe-tiny",
    "--tokenizer-type", "HFTokenizer", "--hf-tokenizer-path", DEFAULT_TOKENIZER,
    "--data-path", DEFAULT_DATA, "--split", "98,2,0",
    "--chat-template", "alpaca", "--packing-sft-data", "--sft-num-preprocess-workers", "2",
    "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "16",
    "--train-iters", "40", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-fraction", "0.2",
    "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
    "--moe-aux-loss-coeff", "1e-2",
    "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
    "--eval-interval", "20", "--eval-iters", "4", "--log-interval", "1",
]

# What the no-argument run says first: what it is and how to change it.
INTRO = ("no arguments: running --config demo, a small SFT of qwen3-moe-tiny on the bundled alpaca tasks "
         "(8 fake CPU devices, about a minute).\n"
         "    change it by adding flags, e.g.  python -m mlir_train.sft --config demo --lora-dim 8 "
         "(LoRA)  or  --train-iters 100;  python -m mlir_train.sft --help lists them all.")
