"""One parameter table per family, and the one completeness check over every format.

The table: every parameter of every model shape (dense, MoE, mixed, tied, LoRA adapters, the
expert bias) has a row, every fused tensor's parts are all there, every codec's split undoes its
join. The formats (HF, PEFT, Megatron legacy and torch_dist, ours): a file with a tensor no
parameter reads (planted), or without one a parameter needs (removed), is a one-line error naming
it; a save whose table gives a parameter no place names it too.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlir_train import families
from mlir_train.checkpoint import complete
from mlir_train.config.models import LayerKind
from mlir_train.config.policies import LoRAPolicy, RouterConfig
from mlir_train.families.qwen3.params import TABLE
from mlir_train.families.table import GateUp, Linear, QueryGroups, Same
from mlir_train.model import ModelOptions
from mlir_train.model.lora import LoRAParam
from mlir_train.runtime.errors import CheckpointError

TINY = families.get_model_config("qwen3-moe-tiny", num_layers=3, vocab_size=256, mlp_only_layers=(0,))


def _flat(cfg, options=ModelOptions()):
    model = families.build_model(cfg, options, abstract=True)
    return model, dict(nnx.to_flat_state(nnx.state(model)))


# ----- the table ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [TINY, families.get_model_config("qwen3-tiny", num_layers=2, vocab_size=256),
                                 TINY.replace(tie_word_embeddings=True)], ids=["mixed-moe", "dense-tied", "moe-tied"])
def test_every_parameter_has_a_row(cfg):
    options = ModelOptions(router=RouterConfig(score_function="sigmoid", enable_expert_bias=True))
    model, flat = _flat(cfg, options)
    bound = TABLE.bind(flat, model.stack_kinds)
    assert {b.path for b in bound} == set(flat)
    assert any(b.row.state for b in bound) == cfg.is_moe  # the expert bias: training state, no HF tensor
    # every fused tensor of every row has all its parts, in each format
    for kind in (LayerKind(moe=False), LayerKind(moe=True), None):
        for row in TABLE.layer_rows(kind):
            for ext in row.hf + ((row.megatron,) if row.megatron else ()):
                fmt = "hf" if ext in row.hf else "megatron"
                assert len(TABLE.parts(row, ext, kind, fmt)) == ext.codec.parts


def test_a_parameter_without_a_row_is_named():
    model, flat = _flat(TINY)
    flat[("layers", 1, "mlp", "shared_expert")] = flat[("layers", 1, "mlp", "router")]
    with pytest.raises(CheckpointError, match=r"parameter layers/1/mlp/shared_expert of the model has no row in the "
                                              "qwen3 parameter table"):
        TABLE.bind(flat, model.stack_kinds)


def test_lora_adapters_are_the_rows_lora_targets():
    policy = LoRAPolicy(4, targets=("linear_qkv", "*experts*"))
    model, flat = _flat(TINY, ModelOptions(lora=policy))
    adapters = {p[2:-1] for p in flat if p[-1] in ("a", "b")}
    assert adapters == {("attn", "q_lora"), ("attn", "k_lora"), ("attn", "v_lora"), ("mlp", "fc1_lora"),
                        ("mlp", "fc2_lora")}
    assert {p[1] for p in flat if p[-2:-1] == ("fc1_lora",)} == {1}  # the experts of the MoE stack only


@pytest.mark.parametrize("codec,shapes", [
    (Same(), [(5, 3)]), (Linear(), [(6, 4)]), (Linear(2), [(2, 3, 4)]), (GateUp(), [(4, 3), (4, 3)]),
    (QueryGroups(), [(8, 4, 2), (8, 2, 2), (8, 2, 2)])])
def test_codecs_split_what_they_join(codec, shapes):
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=s) for s in shapes]
    for got, want in zip(codec.split(codec.join(parts), shapes), parts):
        np.testing.assert_array_equal(got, want)


def test_one_line_messages():
    with pytest.raises(CheckpointError, match=r"^f: missing tensor b \(2,\) \(and 1 more\); fix it$"):
        complete.check("f", missing={"b": "(2,)", "c": ""}, unread={"a": ""}, hint="; fix it")
    with pytest.raises(CheckpointError, match=r"^f: tensor a has no counterpart in the model: nothing reads it$"):
        complete.check("f", unread=["a"])
    complete.check("f")


# ----- HF --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from mlir_train.checkpoint.hf import save_pretrained

    path = str(tmp_path_factory.mktemp("hf") / "model")
    save_pretrained(families.init_model(TINY, seed=1), path)
    return path


def _edited(src: str, dst, edit) -> str:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), dst / "config.json")
    return str(dst)


def test_hf_planted_and_missing_tensors_are_named(hf_dir, tmp_path):
    """A planted tensor spelled as the table's own (an expert the config does not have) is an
    error; one of no row's spelling is carried (checkpoint/carry.py, tests/checkpoint/test_carry.py)."""
    from mlir_train.checkpoint.hf import load_pretrained

    extra = _edited(hf_dir, tmp_path / "extra",
                    lambda t: t.update({"model.layers.1.mlp.experts.8.up_proj.weight": np.zeros((64, 128), np.float32)}))
    with pytest.raises(CheckpointError, match=r"extra: tensor model\.layers\.1\.mlp\.experts\.8\.up_proj\.weight "
                                              r"\(64, 128\) has no counterpart in the model"):
        load_pretrained(extra, dtype=jnp.float32)
    gone = _edited(hf_dir, tmp_path / "gone", lambda t: t.pop("model.layers.0.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"gone: missing tensor model\.layers\.0\.mlp\.down_proj\.weight"):
        load_pretrained(gone, dtype=jnp.float32)


def _without_row(monkeypatch, path: tuple, **changes):
    """The qwen3 family with its ``path`` row(s) changed (e.g. no HF tensor)."""
    rows = tuple(dataclasses.replace(r, **changes) if r.path == path else r for r in TABLE.rows)
    family = dataclasses.replace(families.FAMILIES["qwen3"], params=dataclasses.replace(TABLE, rows=rows))
    monkeypatch.setitem(families.FAMILIES, "qwen3", family)


def test_hf_save_names_an_unwritten_parameter(monkeypatch, tmp_path):
    from mlir_train.checkpoint.hf import save_pretrained

    model = families.init_model(TINY, seed=1)
    _without_row(monkeypatch, ("attn", "k_norm", "scale"), hf=())
    with pytest.raises(CheckpointError, match=r"parameter layers/0/attn/k_norm/scale has no place in the format"):
        save_pretrained(model, str(tmp_path / "out"))


def test_megatron_save_names_an_unwritten_parameter(monkeypatch, tmp_path):
    from mlir_train.checkpoint import megatron as mc
    from sharding.layout import Layout

    params = jax.device_get(nnx.to_pure_dict(nnx.state(families.init_model(TINY, seed=1))))
    _without_row(monkeypatch, ("attn", "k_norm", "scale"), megatron=None)
    with pytest.raises(mc.MegatronCheckpointError, match=r"parameter layers/0/attn/k_norm/scale has no place in the "
                                                         r"format \(its table row names no Megatron tensor\)"):
        mc.save_params(params, TINY, str(tmp_path / "out"), Layout())


# ----- PEFT ------------------------------------------------------------------------------------------
def test_peft_planted_and_missing_tensors_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    from mlir_train.checkpoint import peft

    policy = LoRAPolicy(4)
    model, _ = _flat(TINY, ModelOptions(lora=policy))
    like = jax.tree.map(lambda x: np.ones(x.shape, np.float32), nnx.to_pure_dict(nnx.state(model, LoRAParam)))
    out = str(tmp_path / "adapter")
    peft.save_adapters(out, like, policy=policy, table=TABLE, stack_kinds=model.stack_kinds, num_experts=8)
    weights = os.path.join(out, peft.WEIGHTS_NAME)
    tensors = load_file(weights)
    extra = "base_model.model.model.layers.1.mlp.shared_expert.up_proj.lora_A.weight"
    save_file(tensors | {extra: np.zeros((4, 128), np.float32)}, weights)
    with pytest.raises(CheckpointError, match=r"tensor base_model\.model\.model\.layers\.1\.mlp\.shared_expert\.up_proj"
                                              r"\.lora_A\.weight has no counterpart in the model"):
        peft.load_adapters(out, like, TABLE, model.stack_kinds, 8, policy)
    gone = "base_model.model.model.layers.2.self_attn.o_proj.lora_B.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, weights)
    with pytest.raises(CheckpointError, match=rf"missing tensor {gone.replace('.', '[.]')}; the adapter does not match"):
        peft.load_adapters(out, like, TABLE, model.stack_kinds, 8, policy)


# ----- ours --------------------------------------------------------------------------------------------
def test_ours_planted_and_missing_arrays_are_named(tmp_path):
    from mlir_train.checkpoint import orbax
    from mlir_train.train.build import build_trainer

    trainer = build_trainer(TINY)
    params = jax.device_get(trainer.init_state(0)["params"])
    for name, tree, message in (
            ("extra", params | {"mtp_head": np.zeros((4,), np.float32)}, r"tensor mtp_head \(4,\) has no counterpart"),
            ("gone", {k: v for k, v in params.items() if k != "final_norm"}, r"missing tensor final_norm/scale")):
        mgr = orbax.CheckpointManager(str(tmp_path / name), async_save=False)
        mgr.save(3, {"params": tree}, {"model": TINY.as_dict()}, force=True)
        mgr.close()
        with pytest.raises(CheckpointError, match=message):
            orbax.load_state(str(tmp_path / name), trainer)
