"""LoRA through the CLI (``mlir_train.sft.main``): start on an HF base (carrying tensors no
parameter reads), save adapter-only checkpoints that record their base, resume exactly, export the
adapters in PEFT format, per expert by default (loaded by peft on the HF base: logits equal to our
merged ``--save-hf`` model's; merged by the plain LoRA formula W + (alpha/r) B A: our merged
export, whose model gives the same logits in transformers), or fused with ``--lora-export-format
fused``, and continue training from a PEFT directory. The merged export carries the base's extra
tensors, config fields and files."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from mlir_train import sft
from mlir_train.checkpoint.hf import save_pretrained
from mlir_train.families import get_model_config
from mlir_train.families import init_model
from mlir_train.model import ModelOptions
from mlir_train.checkpoint import peft as peft_dir
from mlir_train.checkpoint.hf_files import Files
from mlir_train.families.qwen3.params import TABLE
from tests.helpers import DEFAULT_DATA, DEFAULT_TOKENIZER, assert_carried, extras, make_source

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

LORA = ["--lora-dim", "4", "--lora-alpha", "16"]


def _argv(tmp_path, name, *extra):
    return ["--hf-tokenizer-path", DEFAULT_TOKENIZER, "--data-path", DEFAULT_DATA, "--split", "100,0,0",
            "--chat-template", "alpaca", "--packing-sft-data", "--seq-length", "64", "--global-batch-size", "8",
            "--micro-batch-size", "1", "--train-iters", "4", "--eval-interval", "0", "--lr", "1e-2",
            "--lr-warmup-iters", "1", "--log-interval", "1", "--data-cache-path", str(tmp_path / "cache"),
            "--tensorboard-dir", str(tmp_path / "tb" / name), "--no-kernel-self-check", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_run")
    cfg = get_model_config("qwen3-moe-tiny", num_layers=2)
    save_pretrained(init_model(cfg, seed=7), str(tmp / "plain"))
    base = make_source(str(tmp / "plain"), str(tmp / "base"))  # with an MTP head, a vision tower, ...
    first = sft.main(_argv(tmp, "first", "--load", base, *LORA, "--save", str(tmp / "ck"), "--save-interval", "2",
                           "--save-peft", str(tmp / "peft"), "--save-hf", str(tmp / "merged")))
    return tmp, base, first


def test_adapter_only_checkpoints_record_their_base(runs):
    tmp, base, first = runs
    meta = json.load(open(tmp / "ck" / "4" / "meta" / "metadata"))
    assert meta["lora"]["base"] == {"kind": "hf", "path": os.path.abspath(base), "seed": 1234}
    assert meta["lora"]["dim"] == 4 and meta["lora"]["alpha"] == 16.0
    params = first.state["params"]
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert names and all("lora" in n for n in names)
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(first.state["base"]))
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert adapter_bytes < base_bytes / 5
    # the frozen base is not in the checkpoint: its files are a fraction of the base's size
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp / "ck" / "4") for f in fs)
    assert size < base_bytes / 2


def test_resume_is_exact(runs):
    tmp, _, first = runs
    again = sft.main(_argv(tmp, "again", "--load", str(tmp / "ck"), "--ckpt-step", "2", *LORA))
    want = dict(first.history["lm loss"])
    got = dict(again.history["lm loss"])
    assert sorted(got) == [3, 4]
    for it in (3, 4):
        assert got[it] == pytest.approx(want[it], rel=1e-6, abs=0), it
    for a, b in zip(jax.tree.leaves(jax.device_get(again.state["params"])),
                    jax.tree.leaves(jax.device_get(first.state["params"]))):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_peft_export_equals_merged_save_hf(runs):
    tmp, base, _ = runs
    from transformers import AutoModelForCausalLM

    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 1000, (2, 16))).long()
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with_adapters = peft.PeftModel.from_pretrained(hf_base, str(tmp / "peft")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = with_adapters(ids).logits.numpy(), merged(ids).logits.numpy()
        with with_adapters.disable_adapter():
            plain = with_adapters(ids).logits.numpy()
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    assert np.abs(a - plain).max() > 1e-2  # training moved the adapters
    assert json.load(open(tmp / "peft" / "adapter_config.json"))["base_model_name_or_path"] == os.path.abspath(base)


def test_per_expert_export_merged_by_the_lora_formula_is_the_merged_export(runs):
    """Each adapted weight of the base plus (alpha/r) B A, in float64 from the files alone: our
    merged export's tensors, and in transformers the merged export's logits."""
    from safetensors.numpy import load_file, save_file
    from transformers import AutoModelForCausalLM

    tmp, base, _ = runs
    config = json.load(open(tmp / "peft" / "adapter_config.json"))
    scale = config["lora_alpha"] / config["r"]
    lora = load_file(str(tmp / "peft" / "adapter_model.safetensors"))
    source, merged = Files(base), Files(str(tmp / "merged"))
    formula = {n: source.read(n).astype(np.float64) for n in source.names() if n not in extras()}
    for key in (k for k in lora if k.endswith(".lora_A.weight")):
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        formula[f"{module}.weight"] += scale * (lora[key.replace("lora_A", "lora_B")].astype(np.float64) @ lora[key])
    assert set(formula) == set(merged.names()) - set(extras())
    weight_diff = max(np.abs(merged.read(n) - w).max() for n, w in formula.items())
    assert weight_diff < 1e-6, weight_diff
    os.makedirs(tmp / "formula")
    save_file({n: w.astype(np.float32) for n, w in formula.items()}, str(tmp / "formula" / "model.safetensors"))
    json.dump(json.load(open(tmp / "merged" / "config.json")), open(tmp / "formula" / "config.json", "w"))
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, 1000, (2, 16))).long()
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(str(tmp / "formula"), dtype=torch.float32).eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(str(tmp / "merged"), dtype=torch.float32).eval()(ids).logits
    logit_diff = (got - want).abs().max().item()
    print(f"formula vs merged export: weights {weight_diff:.3g}, logits {logit_diff:.3g}")
    assert logit_diff < 1e-4


def test_save_hf_after_lora_carries_the_base_extras(runs):
    tmp, base, _ = runs
    assert_carried(str(tmp / "merged"), base)


def test_continue_from_peft_directory(runs):
    """Reads the per-expert directory back (lr 0: the adapters it read are the ones it holds after a
    step) and writes the fused layout with --lora-export-format fused, which reads back the same."""
    tmp, base, first = runs
    more = sft.main(_argv(tmp, "more", "--load", str(tmp / "peft"), *LORA, "--train-iters", "1", "--lr", "0",
                          "--lr-warmup-iters", "0", "--save-peft", str(tmp / "fused"), "--lora-export-format", "fused"))
    want = jax.device_get(first.state["params"])
    for a, b in zip(jax.tree.leaves(jax.device_get(more.state["params"])), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    config = json.load(open(tmp / "fused" / "adapter_config.json"))
    assert config["target_parameters"] == ["gate_up_proj", "down_proj"]
    fused = peft_dir.load_adapters(str(tmp / "fused"), want, TABLE, more.trainer.stack_kinds,
                                   more.trainer.model_cfg.num_experts, policy=more.trainer.lora)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("extra,flag", [(["--save-peft", "p"], "--save-peft"),
                                        ([*LORA, "--lora-export-format", "fused"], "--lora-export-format fused"),
                                        ([*LORA, "--lora-dropout", "0.1"], "--lora-dropout 0.1"),
                                        ([*LORA, "--lora-target-modules", "router"], "--lora-target-modules router"),
                                        ([*LORA, "--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias")])
def test_lora_flags_are_refused_by_name(tmp_path, capsys, extra, flag):
    with pytest.raises(SystemExit) as e:
        sft.main(_argv(tmp_path, "x", *extra))
    assert e.value.code == 2
    assert f"error: {flag}" in capsys.readouterr().err
