"""Exports carry what the model did not train (checkpoint/carry.py): an HF source directory with
tensors no parameter reads (an MTP head, a vision tower, an unknown counter, in bf16 / f16 / int64)
loads, naming and counting them, and its HF exports (``save_pretrained(carry_from=...)``, and
``--save-hf`` after full fine-tuning through the CLI; after LoRA in tests/train/test_lora_run.py)
hold them byte for byte, with the source's config.json fields, generation config and tokenizer
files. Plus the raw safetensors reader and writer that copy them."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlir_train import families, sft
from mlir_train.checkpoint.hf import load_pretrained, save_pretrained
from mlir_train.checkpoint.hf_files import Files, _header, write_raw
from mlir_train.families.qwen3.params import TABLE
from tests.helpers import DEFAULT_DATA, DEFAULT_TOKENIZER, assert_carried, extras, make_source

TINY = families.get_model_config("qwen3-moe-tiny", num_layers=2, vocab_size=1600, hidden_size=64,
                                 moe_intermediate_size=32, num_experts=4)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("carry")
    save_pretrained(families.init_model(TINY, seed=3), str(tmp / "plain"))
    return make_source(str(tmp / "plain"), str(tmp / "source"))


def test_raw_files_round_trip(tmp_path):
    file = str(tmp_path / "x.safetensors")
    write_raw(file, extras(), {"format": "pt"})
    from safetensors.numpy import load_file

    assert load_file(file)["unknown.step_counter"].tolist() == [42]  # the safetensors library reads it
    header, start = _header(file)
    assert start % 8 == 0 and header["__metadata__"] == {"format": "pt"}


def test_load_reads_past_extras_and_export_carries_them(source, tmp_path, capsys):
    model = load_pretrained(source, dtype=jnp.float32)
    out = capsys.readouterr().out
    assert "WARNING" in out and "3 tensors of no parameter of the qwen3 model (model.visual.patch_embed.proj.weight, " \
                                "mtp.layers.0.fc.weight, unknown.step_counter)" in out
    export = str(tmp_path / "export")
    save_pretrained(model, export, carry_from=source)
    out = capsys.readouterr().out
    assert f"copied byte for byte from {source}" in out and "copied chat_template.jinja, generation_config.json, " \
                                                            "tokenizer_config.json" in out
    assert_carried(export, source)
    back = load_pretrained(export, dtype=jnp.float32)  # the export reads back: the same weights
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(back, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_declared_patterns_are_counted_not_warned(source, monkeypatch, capsys):
    table = dataclasses.replace(TABLE, carried=("mtp.*", "model.visual.*"))
    monkeypatch.setitem(families.FAMILIES, "qwen3", dataclasses.replace(families.FAMILIES["qwen3"], params=table))
    load_pretrained(source, dtype=jnp.float32)
    out = capsys.readouterr().out
    assert "2 tensors the model does not use (mtp.*: 1, model.visual.*: 1) read past" in out
    assert "WARNING" in out and "1 tensors of no parameter of the qwen3 model (unknown.step_counter)" in out


def test_export_into_its_own_source_is_refused(source, tmp_path):
    from mlir_train.runtime.errors import CheckpointError

    copy = shutil.copytree(source, tmp_path / "copy")
    with pytest.raises(CheckpointError, match="is the HF directory the model was read from"):
        save_pretrained(load_pretrained(str(copy), dtype=jnp.float32), str(copy), carry_from=str(copy))


def test_save_hf_after_full_fine_tuning_carries_them(source, tmp_path):
    export = str(tmp_path / "sft-export")
    sft.main(["--hf-tokenizer-path", DEFAULT_TOKENIZER, "--data-path", DEFAULT_DATA, "--split", "100,0,0",
              "--chat-template", "alpaca", "--packing-sft-data", "--seq-length", "64", "--global-batch-size", "8",
              "--micro-batch-size", "1", "--train-iters", "1", "--eval-interval", "0", "--lr", "1e-3",
              "--log-interval", "1", "--data-cache-path", str(tmp_path / "cache"), "--tensorboard-dir",
              str(tmp_path / "tb"), "--no-kernel-self-check", "--load", source, "--save-hf", export])
    assert_carried(export, source)
    before, after = Files(source), Files(export)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(before.read(name), after.read(name))  # it trained
