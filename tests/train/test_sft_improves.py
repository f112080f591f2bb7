"""A short SFT on the bundled tasks measurably improves the model (the point of the trainer)."""

import difflib
import json
import os

import jax
import numpy as np
import pytest

from mlir_train.data import BatchLoader, build_datasets, default_data_config
from mlir_train.data.config import DEFAULT_DATA
from mlir_train.data.templates import ALPACA_PREAMBLE, ALPACA_PREAMBLE_INPUT
from mlir_train.model.generate import generate


def _prompt(rec):
    text = ALPACA_PREAMBLE_INPUT if rec["input"] else ALPACA_PREAMBLE
    text += f"### Instruction:\n{rec['instruction']}\n\n"
    if rec["input"]:
        text += f"### Input:\n{rec['input']}\n\n"
    return text + "### Response:\n"


def _answer_similarity(trainer, params, tokenizer, records):
    gens = generate(trainer.model(params), tokenizer, [_prompt(r) for r in records], max_new_tokens=24)
    return float(np.mean([difflib.SequenceMatcher(None, g.text.strip(), r["output"]).ratio()
                          for g, r in zip(gens, records)]))


def _valid_loss(trainer, valid, rows):
    loader = BatchLoader(valid, rows, seed=0)
    total = count = 0.0
    for _ in range(4):
        out = trainer.eval_step(trainer_params[0], trainer.shard_batch(next(loader), micro=False))
        total, count = total + float(out["ce_sum"]), count + float(out["loss_tokens"])
    return total / count


trainer_params = [None]


@pytest.mark.slow
def test_short_sft_lowers_eval_loss_and_improves_greedy_answers(tmp_path):
    from mlir_train.sft import main

    args = ["--model-name", "qwen3-moe-tiny", "--hf-tokenizer-path", default_data_config().tokenizer_path,
            "--data-path", DEFAULT_DATA, "--chat-template", "alpaca", "--packing-sft-data", "--split", "95,5,0",
            "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "80",
            "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "4", "--lr-decay-style", "cosine",
            "--adam-beta2", "0.95", "--weight-decay", "0.1", "--moe-aux-loss-coeff", "1e-2",
            "--eval-interval", "0", "--log-interval", "10", "--seed", "7",
            "--data-cache-path", str(tmp_path / "cache"), "--tensorboard-dir", str(tmp_path / "tb")]
    out = main(args)
    trainer, tokenizer = out.trainer, out.tokenizer
    data = build_datasets(default_data_config(seq_length=256, split="95,5,0", cache_path=str(tmp_path / "cache"), seed=7),
                          tokenizer)
    before = trainer.init_state(seed=7)["params"]  # the same init the run started from
    after = out.state["params"]
    rows = 8
    trainer_params[0] = before
    loss_before = _valid_loss(trainer, data.valid, rows)
    trainer_params[0] = after
    loss_after = _valid_loss(trainer, data.valid, rows)
    records = json.load(open(DEFAULT_DATA))[-32:]
    sim_before = _answer_similarity(trainer, before, tokenizer, records)
    sim_after = _answer_similarity(trainer, after, tokenizer, records)
    print(f"valid loss {loss_before:.3f} -> {loss_after:.3f}; answer similarity {sim_before:.3f} -> {sim_after:.3f}")
    assert loss_after < loss_before - 2.0
    # Measured on 2026-11-29 with the last 32 records: 0.104 -> 0.214, and 0.104 -> 0.201 after the
    # MoE's custom gradient changed float32 rounding (its gradients match autodiff to ~1e-6; 80
    # steps at lr 3e-3 amplify that into a different, equally trained run: valid loss 3.371 vs
    # 3.376). Greedy answers are that sensitive, so the bar is relative: half as similar again.
    assert sim_after > 1.5 * sim_before
