"""Every input error is one sentence: a corpus of bad inputs of our own (flags, data files,
tokenizers, HF directories, our and Megatron checkpoints, ``--save`` targets), each run through
``sft.main`` in-process; each must exit 2 with exactly one ``error:`` line that names the input,
and no Python traceback. A few run through the real entry point in a subprocess too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import traceback

import pytest

from mlir_train import sft
from mlir_train.data.config import DEFAULT_DATA, DEFAULT_TOKENIZER


def _argv(tmp, *extra, data=DEFAULT_DATA, tokenizer=DEFAULT_TOKENIZER):
    """A tiny, valid run; ``extra`` makes it bad (a later flag wins over an earlier one)."""
    return ["--model-name", "qwen3-moe-tiny", "--num-layers", "2", "--tokenizer-type", "HFTokenizer",
            "--hf-tokenizer-path", tokenizer, "--data-path", data, "--split", "100,0,0", "--chat-template", "alpaca",
            "--packing-sft-data", "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--train-iters", "1", "--eval-interval", "0", "--lr", "1e-3", "--log-interval", "1",
            "--data-cache-path", os.path.join(tmp, "cache"), *extra]


def _hf_dir(root, name, config):
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(config if isinstance(config, str) else json.dumps(config))
    return path


QWEN3_MOE_TINY = {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}


def _megatron_dir(root, name, latest, rank_file: bytes | None):
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(latest)
    if rank_file is not None:
        rank = os.path.join(path, f"iter_{int(latest):07d}", "mp_rank_00")
        os.makedirs(rank)
        with open(os.path.join(rank, "model_optim_rng.pt"), "wb") as f:
            f.write(rank_file)
    return path


def _newcomer_cases(tmp, write, save_file):
    """Issue 36's classes: output paths, LoRA targets, kernel refusals, chat data, dataset configs."""
    def chat(name, *messages):
        return write(name, json.dumps({"messages": list(messages)}) + "\n")

    user, done = {"role": "user", "content": "q"}, {"role": "assistant", "content": "done"}
    call = {"type": "function", "function": {"name": "f", "arguments": "{city: Rome"}}
    return [
        # every output path checked at start-up, named by its flag (never a traceback after training)
        ("save-peft-under-file", ["--lora-dim", "4", "--save-peft", os.path.join(save_file, "p")], "--save-peft"),
        ("save-hf-under-file", ["--save-hf", os.path.join(save_file, "hf")], "--save-hf"),
        ("save-hf-is-file", ["--save-hf", save_file], "--save-hf"),
        ("tensorboard-under-file", ["--tensorboard-dir", os.path.join(save_file, "tb")], "--tensorboard-dir"),
        # LoRA targets of the family that no layer of this model has (all its MLPs are MoE)
        ("lora-no-layer", ["--lora-dim", "4", "--lora-target-modules", "mlp.linear_fc1"], "no layer of"),
        # refusals suggest choices that exist
        ("attention-gpu-kernel", ["--attention-kernel", "mlir"], "use --attention-kernel auto or --attention-kernel xla"),
        ("moe-gpu-kernel", ["--moe-gemm-backend", "mosaic"], "use --moe-gemm-backend auto or --moe-gemm-backend padded"),
        # chat data
        ("kwargs-missing-file", ["--chat-template", "qwen3", "--chat-template-kwargs", os.path.join(tmp, "kw.json")],
         "kw.json': no such file"),
        ("kwargs-bad-json-file", ["--chat-template", "qwen3", "--chat-template-kwargs", write("kw_bad.json", "{1")],
         "kw_bad.json: not a JSON object"),
        ("tool-args-not-json", ["--chat-template", "qwen3", "--data-path", chat(
            "tools.jsonl", user, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "ok"}, done)],
         "tools.jsonl:1"),
        ("thinking-only", ["--chat-template", "qwen3", "--data-path", chat(
            "think.jsonl", user, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\n"})],
         "think.jsonl:1"),
        ("dataset-config-file-name", ["--sft-dataset-config", write("dataset_info.json", json.dumps(
            {"alpaca_tasks": {"file_name": "missing.json", "formatting": "alpaca"}}))], "file_name 'missing.json'"),
        ("dataset-config-unknown-key", ["--sft-dataset-config", write("dataset_info2.json", json.dumps(
            {"alpaca_tasks": {"formatting": "alpaca", "ranking": True}}))], "['ranking']"),
        ("config-demo-typo", ["--config", "demoo"], "--config demo is the no-argument job"),
    ]


def _corpus(tmp):
    """(case id, argv, what the error line must name)."""
    os.makedirs(tmp, exist_ok=True)
    def write(name, text):
        path = os.path.join(tmp, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    llama = _hf_dir(tmp, "llama", dict(QWEN3_MOE_TINY, model_type="llama"))
    bad_json = _hf_dir(tmp, "badjson", '{"model_type": "qwen3_moe",')
    no_weights = _hf_dir(tmp, "noweights", QWEN3_MOE_TINY)
    os.makedirs(os.path.join(tmp, "badtok"), exist_ok=True)
    bad_tok = os.path.dirname(write(os.path.join("badtok", "tokenizer.json"), "not json"))
    deepspeed = os.path.join(tmp, "deepspeed", "global_step5")
    os.makedirs(deepspeed)
    with open(os.path.join(tmp, "deepspeed", "latest"), "w") as f:
        f.write("global_step5")
    with open(os.path.join(deepspeed, "mp_rank_00_model_states.pt"), "wb") as f:
        f.write(b"\0" * 16)
    save_file = write("a_file", "not a directory\n")
    return [
        # flags
        ("fp8", ["--fp8-format", "hybrid"], "--fp8-format"),
        ("fp8-recipe", ["--fp8-recipe", "delayed", "--fp8-param-gather"], "--fp8-recipe"),
        ("peer-fp8", ["--fp8-force-no-requant"], "--fp8-force-no-requant"),
        ("lora-dim", ["--lora-dim-typo", "8"], "--lora-dim-typo"),
        ("bad-float", ["--lr", "fast"], "--lr"),
        ("bad-split", ["--global-batch-size", "12"], "--global-batch-size"),
        ("tp3", ["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
        ("config-missing", ["--config", os.path.join(tmp, "nope.yaml")], "nope.yaml"),
        ("config-bad-yaml", ["--config", write("bad.yaml", "lr: [1,\n  seed: {\n")], "bad.yaml"),
        ("config-bad-key", ["--config", write("key.yaml", "fp8_format: hybrid\n")], "key.yaml"),
        ("model-name", ["--model-name", "qwen3-moe-tinyy"], "--model-name"),
        ("model-name-llama", ["--model-name", os.path.join(llama, "config.json")], "llama"),
        # data files
        ("data-missing", ["--data-path", os.path.join(tmp, "missing.json")], "missing.json"),
        ("data-bad-json", ["--data-path", write("bad.json", "[{\"instruction\": ")], "bad.json"),
        ("data-empty", ["--data-path", write("empty.jsonl", "")], "empty.jsonl"),
        ("data-no-fields", ["--data-path", write("odd.jsonl", '{"a": 1}\n{"b": 2}\n')], "odd.jsonl"),
        # tokenizers
        ("tokenizer-missing", ["--hf-tokenizer-path", os.path.join(tmp, "no-tokenizer")], "no-tokenizer"),
        ("tokenizer-bad", ["--hf-tokenizer-path", bad_tok], "badtok"),
        # HF directories
        ("hf-llama", ["--load", llama], "llama"),
        ("hf-bad-json", ["--load", bad_json], "badjson"),
        ("hf-no-weights", ["--load", no_weights], "noweights"),
        # Megatron and other checkpoints
        ("megatron-bad-latest", ["--load", _megatron_dir(tmp, "mg_latest", "abc", None)], "mg_latest"),
        ("megatron-missing-iter", ["--load", _megatron_dir(tmp, "mg_missing", "7", None)], "mg_missing"),
        ("megatron-garbage-shard", ["--load", _megatron_dir(tmp, "mg_garbage", "7", b"garbage")], "mg_garbage"),
        ("deepspeed", ["--load", os.path.join(tmp, "deepspeed")], "deepspeed"),
        ("missing-load-strict", ["--load", os.path.join(tmp, "void"), "--exit-on-missing-checkpoint"], "void"),
        ("ckpt-step-no-load", ["--ckpt-step", "3"], "--ckpt-step"),
        # --save targets
        ("save-is-file", ["--save", save_file, "--save-interval", "1"], "a_file"),
        ("save-under-file", ["--save", os.path.join(save_file, "ckpt"), "--save-interval", "1"], "a_file"),
        *_newcomer_cases(tmp, write, save_file),
    ]


def _run_in_process(argv, capsys):
    try:
        sft.main(argv)
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # an escaped exception is the failure this test is for
        return None, capsys.readouterr().err + traceback.format_exc()
    else:
        code = 0
    return code, capsys.readouterr().err


def _error_lines(err):
    return [line for line in err.splitlines() if "error:" in line]


def _check(case, code, err, names):
    assert code == 2, f"{case}: exit {code!r}, stderr:\n{err}"
    assert "Traceback" not in err, f"{case}: traceback:\n{err}"
    lines = _error_lines(err)
    assert len(lines) == 1, f"{case}: {len(lines)} error lines:\n{err}"
    assert names in lines[0], f"{case}: the error does not name {names!r}: {lines[0]}"


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("bad_inputs"))


def _check_all(tmp, cases, capsys):
    """Every case run in-process and checked; the failures reported together."""
    failures = []
    for case, extra, names in cases:
        code, err = _run_in_process(_argv(tmp, *extra), capsys)
        try:
            _check(case, code, err, names)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n\n".join(failures)


def test_every_bad_input_is_one_line_exit_2(corpus_dir, capsys):
    _check_all(corpus_dir, _corpus(corpus_dir), capsys)


@pytest.fixture(scope="module")
def our_checkpoint(tmp_path_factory):
    """One real checkpoint of ours (a one-iteration run), to damage."""
    tmp = str(tmp_path_factory.mktemp("ours"))
    save = os.path.join(tmp, "ckpt")
    sft.main(_argv(tmp, "--save", save, "--save-interval", "1"))
    return tmp, save


def _step_dirs(save):
    return sorted(n for n in os.listdir(save) if n.isdigit())


def test_bad_checkpoints_of_ours_are_one_line_exit_2(our_checkpoint, capsys, tmp_path):
    tmp, save = our_checkpoint
    step = _step_dirs(save)[-1]
    cases = [("ckpt-step-absent", ["--load", save, "--ckpt-step", "99"], "99"),
             ("load-step-mismatch", ["--load", os.path.join(save, step), "--ckpt-step", "99"], "99"),
             ("other-model", ["--load", save, "--num-layers", "4"], "num_layers")]
    damaged = str(tmp_path / "damaged")
    shutil.copytree(save, damaged)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(damaged, step)) for f in fs
                   if os.path.getsize(os.path.join(d, f)) > 64 and "manifest" not in f.lower())
    with open(files[-1], "r+b") as f:  # flip bytes in the biggest-named data file
        f.seek(32)
        f.write(b"\xff" * 16)
    cases.append(("corrupt", ["--load", damaged, "--ckpt-step", step], "damaged"))
    _check_all(tmp, cases, capsys)


def test_missing_required_flags_are_one_line_naming_them_all(capsys):
    """Flags without the demo's: every missing required flag in one line, and the demo to start from."""
    code, err = _run_in_process(["--lora-dim", "8", "--lr", "1e-3"], capsys)
    _check("missing-required", code, err, "missing --model-name --data-path --hf-tokenizer-path --seq-length "
                                          "--micro-batch-size --train-iters (required)")
    assert "python -m mlir_train.sft --config demo" in err


@pytest.mark.parametrize("case", ["fp8", "hf-llama", "data-missing"])
def test_the_real_entry_point_says_it_in_one_line(corpus_dir, case):
    """The same through ``python -m mlir_train.sft``: what a user's shell sees."""
    extra, names = next((x, n) for c, x, n in _corpus(os.path.join(corpus_dir, f"sub-{case}")) if c == case)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-m", "mlir_train.sft", *_argv(corpus_dir, *extra)],
                         capture_output=True, text=True, env=env, timeout=300)
    _check(case, run.returncode, run.stderr, names)
