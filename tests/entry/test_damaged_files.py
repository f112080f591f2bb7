"""Every file kind we read, damaged every way a file gets damaged (issue 48): cut short (a download
or a disk that stopped), zero bytes, a corrupt header (its first bytes overwritten), and wrong
JSON (valid JSON of the wrong shape; a safetensors header that parses but is no tensor table).
Each is one ``error:`` line naming the file, exit status 2, no traceback; the run never trains
past it. The kinds: an HF model directory's safetensors, index and config.json; the tokenizer's
files; a PEFT adapter directory's two files; a checkpoint of ours (a step's files); Megatron
legacy ``torch`` rank files and tracker; data files; ``--config``, ``--chat-template-kwargs`` and
``--sft-dataset-config`` files. (Megatron ``torch_dist`` files: tests/checkpoint/test_megatron_checkpoint.py,
next to the megatron-core checkpoints it writes.)"""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

from mlir_train import convert, families
from mlir_train.checkpoint.hf import save_pretrained
from mlir_train.data.config import DEFAULT_DATA, DEFAULT_TOKENIZER
from tests.entry.test_input_errors import _check, _run_in_process

DAMAGES = ("truncated", "zero-bytes", "corrupt-header", "wrong-json")
TINY = families.get_model_config("qwen3-moe-tiny", num_layers=2, vocab_size=1600)


def damage(path: str, how: str) -> None:
    data = open(path, "rb").read()
    if how == "truncated":
        data = data[:len(data) // 2]
    elif how == "zero-bytes":
        data = b""
    elif how == "corrupt-header":
        data = b"\xff\xfe\x00\x01" * 4 + data[16:]
    elif path.endswith(".safetensors"):  # a header that parses, naming no tensor a reader can use
        header = b'{"__metadata__": [1, 2]}'
        data = struct.pack("<Q", len(header)) + header
    else:
        data = b"[1, 2, 3]" if not path.endswith((".yaml", ".yml")) else b"- 1\n- 2\n"
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """One valid file of every kind, and the flags that read each."""
    tmp = tmp_path_factory.mktemp("good")
    hf = str(tmp / "hf")
    save_pretrained(families.init_model(TINY, seed=0), hf, max_shard_bytes=200_000)  # sharded, with an index
    ours = str(tmp / "ours")
    assert convert.main([hf, ours]) == 0
    tok = str(tmp / "tok")
    shutil.copytree(DEFAULT_TOKENIZER, tok)
    data = str(tmp / "data.json")
    shutil.copy(DEFAULT_DATA, data)
    (tmp / "run.yaml").write_text("lr: 1.0e-3\nseed: 3\n")
    (tmp / "kwargs.json").write_text(json.dumps({"enable_thinking": False}))
    (tmp / "dataset_info.json").write_text(json.dumps({"tasks": {"file_name": data, "formatting": "alpaca"}}))
    found = {"hf": hf, "ours": ours, "tok": tok, "data": data, "run.yaml": str(tmp / "run.yaml"),
             "kwargs": str(tmp / "kwargs.json"), "dataset_info": str(tmp / "dataset_info.json"), "peft": None,
             "megatron": None}
    from flax import nnx

    from mlir_train.checkpoint.peft import save_adapters
    from mlir_train.config.policies import LoRAPolicy
    from mlir_train.model import ModelOptions
    from mlir_train.model.lora import LoRAParam

    model = families.build_model(TINY, ModelOptions(lora=LoRAPolicy(4)), abstract=True)
    shapes = nnx.to_pure_dict(nnx.state(model, LoRAParam))
    import jax

    found["peft"] = str(tmp / "peft")
    save_adapters(found["peft"], jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes), policy=LoRAPolicy(4),
                  table=families.family_of(TINY).hf_params(TINY), stack_kinds=model.stack_kinds,
                  num_experts=TINY.num_experts)
    try:
        import torch  # noqa: F401

        found["megatron"] = str(tmp / "megatron")
        assert convert.main([hf, found["megatron"], "--to", "megatron", "--tensor-model-parallel-size", "2"]) == 0
    except ImportError:
        pass
    return found


def _argv(tmp, *extra):
    return ["--model-name", "qwen3-moe-tiny", "--num-layers", "2", "--tokenizer-type", "HFTokenizer",
            "--hf-tokenizer-path", DEFAULT_TOKENIZER, "--data-path", DEFAULT_DATA, "--split", "100,0,0",
            "--chat-template", "alpaca", "--packing-sft-data", "--seq-length", "64", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--train-iters", "1", "--eval-interval", "0", "--lr", "1e-3",
            "--data-cache-path", os.path.join(tmp, "cache"), *extra]


def _cases(good):
    """(kind, the file damaged (relative to its copy), the flags reading the copy)."""
    hf_files = sorted(os.listdir(good["hf"]))
    shards = [f for f in hf_files if f.endswith(".safetensors")]
    step = next(n for n in sorted(os.listdir(good["ours"])) if n.isdigit())
    ours_files = sorted(os.path.relpath(os.path.join(d, f), good["ours"])
                        for d, _, fs in os.walk(os.path.join(good["ours"], step)) for f in fs
                        if f != "commit_success.txt")  # Orbax's commit mark: there or not, its bytes never read
    meg = []
    if good["megatron"]:
        meg = [("megatron", os.path.relpath(os.path.join(d, f), good["megatron"]), lambda p: ["--load", p])
               for d, _, fs in os.walk(good["megatron"]) for f in fs if f.endswith(".pt") or f.endswith(".txt")]
    load = lambda p: ["--load", p, "--model-name", "qwen3-moe-tiny", "--finetune"]
    return [
        *[("hf", f, load) for f in ["config.json", "model.safetensors.index.json", shards[0], shards[-1]]],
        *[("tok", f, lambda p, f=f: ["--hf-tokenizer-path", p] + (["--chat-template", "hf"] if "jinja" in f else []))
          for f in sorted(os.listdir(good["tok"]))],  # the template file is read where it is used
        *[("peft", f, lambda p, hf=good["hf"]: ["--load", p, "--pretrained-checkpoint", hf, "--lora-dim", "4"])
          for f in sorted(os.listdir(good["peft"]))],
        *[("ours", f, lambda p: ["--load", p]) for f in ours_files],
        *meg,
        ("data", "", lambda p: ["--data-path", p]),
        ("run.yaml", "", lambda p: ["--config", p]),
        ("kwargs", "", lambda p: ["--chat-template", "qwen3", "--chat-template-kwargs", p]),
        ("dataset_info", "", lambda p: ["--sft-dataset-config", p]),
    ]


@pytest.mark.parametrize("how", DAMAGES)
def test_every_damaged_file_is_one_line_naming_it(good, how, tmp_path, capsys):
    failures = []
    for i, (kind, rel, flags) in enumerate(_cases(good)):
        src = good[kind]
        copy = str(tmp_path / f"{i}-{os.path.basename(src)}")
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, copy)
        target = os.path.join(copy, rel) if rel else copy
        damage(target, how)
        code, err = _run_in_process(_argv(str(tmp_path), *flags(copy)), capsys)
        try:
            _check(f"{kind} {rel or os.path.basename(src)} {how}", code, err, os.path.basename(target))
        except AssertionError as e:
            lines = str(e).splitlines()
            failures.append(" | ".join(lines[:1] + lines[-3:-1] if code is None else lines[:1])[:900])
    assert not failures, f"{len(failures)} of {len(_cases(good))}:\n" + "\n".join(failures)
