"""Exports put in place whole (issue 48, checkpoint/whole.py): after a write the directory holds
exactly what that write made (an earlier export's shards and index are gone, so a loader that
filters weight files by the index reads the new model); a crash while writing leaves the earlier
export; a crash between the renames is repaired by the next export; a file of the user's in the
destination refuses the export, naming it, before a run trains, and is never deleted. No torch."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlir_train import families, sft
from mlir_train.checkpoint import whole
from mlir_train.checkpoint.hf import load_pretrained, save_pretrained
from mlir_train.runtime.errors import CheckpointError

TINY = families.get_model_config("qwen3-moe-tiny", num_layers=2, vocab_size=256, hidden_size=32,
                                 moe_intermediate_size=16, num_experts=4)


def _export(dst, seed, max_shard_bytes):
    model = families.init_model(TINY, seed=seed)
    whole.write(str(dst), "HF model", lambda d: save_pretrained(model, d, max_shard_bytes=max_shard_bytes))
    return model


def _listing(root):
    return sorted(os.path.relpath(os.path.join(h, n), root) for h, _, ns in os.walk(root) for n in ns)


def _served(root):
    """The weight files a serving engine reads: those the index names, else every .safetensors."""
    index = os.path.join(root, "model.safetensors.index.json")
    if os.path.exists(index):
        return sorted(set(json.load(open(index))["weight_map"].values()))
    return sorted(f for f in os.listdir(root) if f.endswith(".safetensors"))


def _same_weights(model, path):
    back = load_pretrained(str(path), dtype=jnp.float32)
    for a, b in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)), nnx.to_flat_state(nnx.state(back, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a[1].get_value()), np.asarray(b[1].get_value()))


def test_a_second_export_leaves_exactly_its_own_files(tmp_path):
    dst = tmp_path / "hf"
    _export(dst, seed=1, max_shard_bytes=16 * 1024)  # sharded, with an index
    first = _listing(dst)
    assert "model.safetensors.index.json" in first and len(_served(dst)) > 2
    model = _export(dst, seed=2, max_shard_bytes=1 << 30)  # one file, no index
    files = _listing(dst)
    assert files == sorted(["config.json", "model.safetensors", whole.MANIFEST]), files
    assert json.load(open(dst / whole.MANIFEST))["files"] == ["config.json", "model.safetensors"]
    assert _served(dst) == ["model.safetensors"]
    _same_weights(model, dst)
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing left beside it


def test_a_crash_while_writing_leaves_the_earlier_export(tmp_path):
    dst = tmp_path / "hf"
    model = _export(dst, seed=1, max_shard_bytes=16 * 1024)
    before = {f: (dst / f).read_bytes() for f in _listing(dst)}

    def dies(d):
        save_pretrained(families.init_model(TINY, seed=2), d, max_shard_bytes=1 << 30)
        raise KeyboardInterrupt  # interrupted after the files, before the swap

    with pytest.raises(KeyboardInterrupt):
        whole.write(str(dst), "HF model", dies)
    assert {f: (dst / f).read_bytes() for f in _listing(dst)} == before
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    _same_weights(model, dst)


def test_what_a_killed_export_left_is_repaired_by_the_next(tmp_path, capsys):
    dst = tmp_path / "hf"
    model = _export(dst, seed=1, max_shard_bytes=1 << 30)
    # killed between the renames: the earlier export set aside, the destination gone
    os.rename(dst, tmp_path / ".hf.replaced")
    # and an earlier kill mid-write left a staging directory
    os.makedirs(tmp_path / ".hf.partial")
    (tmp_path / ".hf.partial" / whole.WRITING).touch()
    (tmp_path / ".hf.partial" / "model-00001.safetensors").write_bytes(b"half")
    with pytest.raises(RuntimeError, match="disk full"):
        whole.write(str(dst), "HF model", lambda d: (_ for _ in ()).throw(RuntimeError(f"{d}: disk full")))
    out = capsys.readouterr().out
    assert "put back the earlier export" in out and "removed" in out and ".hf.partial" in out
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    _same_weights(model, dst)


def test_an_error_names_the_destination_not_the_staging_directory(tmp_path):
    dst = str(tmp_path / "hf")
    with pytest.raises(CheckpointError, match=rf"^{dst}: nope$"):
        whole.write(dst, "HF model", lambda d: (_ for _ in ()).throw(CheckpointError(f"{d}: nope")))


@pytest.mark.parametrize("foreign", ["notes.txt", "sub/model.safetensors"])
def test_files_of_the_users_refuse_the_export_and_stay(tmp_path, foreign):
    dst = tmp_path / "hf"
    _export(dst, seed=1, max_shard_bytes=1 << 30)  # our export, then a file of the user's beside it
    (dst / foreign).parent.mkdir(parents=True, exist_ok=True)
    (dst / foreign).write_text("mine")
    with pytest.raises(CheckpointError, match=rf"{dst}: it holds files .*\({foreign}; the export there did not write"):
        _export(dst, seed=2, max_shard_bytes=1 << 30)
    assert (dst / foreign).read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["hf"]
    plain = tmp_path / "plain"  # a directory no export of ours wrote
    plain.mkdir()
    (plain / "model.safetensors").write_bytes(b"theirs")
    assert "no export of ours wrote them" in whole.problem(str(plain))
    empty = tmp_path / "empty"
    empty.mkdir()
    _export(empty, seed=1, max_shard_bytes=1 << 30)  # an empty directory is taken
    assert whole.MANIFEST in os.listdir(empty)


def test_a_staging_directory_not_ours_is_left_alone(tmp_path):
    os.makedirs(tmp_path / ".hf.partial")
    (tmp_path / ".hf.partial" / "x").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not ours"):
        _export(tmp_path / "hf", seed=1, max_shard_bytes=1 << 30)
    assert (tmp_path / ".hf.partial" / "x").read_text() == "mine"


def _sft(*flags):
    with pytest.raises(SystemExit) as stop:
        sft.main(["--config", "demo", "--train-iters", "1", *flags])
    return stop.value.code


def test_sft_refuses_an_export_directory_holding_the_users_files_before_training(tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "data.jsonl").write_text("{}\n")
    assert _sft("--save-hf", str(dst)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--save-hf {dst}: it holds files" in err[0] and "data.jsonl" in err[0], err
    save = tmp_path / "ck"
    assert _sft("--save", str(save), "--save-peft", str(save / "peft"), "--lora-dim", "4") == 2
    err = capsys.readouterr().err
    assert "--save-peft" in err and "--save " in err and "must be apart" in err, err
    assert (dst / "data.jsonl").exists() and not save.exists()
