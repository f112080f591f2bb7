"""Model flags held against the checkpoint ``--load`` brings (issue 48, checkpoint/agree.py): for
every kind of checkpoint (HF, ours, Megatron, a PEFT directory on its ``--pretrained-checkpoint``
base), a flag that describes another model stops the run in one line naming the flag, its value
and the checkpoint's, before anything is built; flags that agree, another name for the same
network, and the flags a fresh model alone uses pass (the latter said)."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx

from mlir_train import convert, families, sft
from mlir_train.checkpoint.hf import save_pretrained
from mlir_train.checkpoint.peft import save_adapters
from mlir_train.config.policies import LoRAPolicy
from mlir_train.model import ModelOptions
from mlir_train.model.lora import LoRAParam

TINY = families.get_model_config("qwen3-moe-tiny")  # the demo's model: --config demo names it


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """{kind: the --load flags of a checkpoint of TINY in that format}."""
    tmp = tmp_path_factory.mktemp("loads")
    hf = str(tmp / "hf")
    save_pretrained(families.init_model(TINY, seed=0), hf)
    ours = str(tmp / "ours")
    assert convert.main([hf, ours]) == 0
    policy = LoRAPolicy(4)
    shapes = nnx.to_pure_dict(nnx.state(families.build_model(TINY, ModelOptions(lora=policy), abstract=True),
                                        LoRAParam))
    model = families.build_model(TINY, ModelOptions(lora=policy), abstract=True)
    peft_dir = str(tmp / "peft")
    save_adapters(peft_dir, jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes), policy=policy,
                  table=families.family_of(TINY).hf_params(TINY), stack_kinds=model.stack_kinds,
                  num_experts=TINY.num_experts)
    found = {"hf": ["--load", hf], "ours": ["--load", ours],
             "peft": ["--load", peft_dir, "--pretrained-checkpoint", hf, "--lora-dim", "4"]}
    try:
        import torch  # noqa: F401  (Megatron files are torch pickles)

        megatron = str(tmp / "megatron")
        assert convert.main([hf, megatron, "--to", "megatron"]) == 0
        found["megatron"] = ["--load", megatron, "--finetune"]
    except ImportError:
        pass
    return found


def _run(load, *flags):
    """``sft --config demo`` up to where the model is known (--train-iters 0 trains nothing)."""
    with pytest.raises(SystemExit) as stop:
        sft.main(["--config", "demo", "--train-iters", "0", *load, *flags])
    return stop.value.code


CONTRADICTIONS = [  # (flags, what the one error line says)
    (["--model-name", "qwen3-tiny"], "--model-name qwen3-tiny is not the model of the checkpoint"),
    (["--model-name", "qwen3.5-moe-tiny"], "family qwen3_5 against qwen3"),
    (["--num-layers", "2"], "--num-layers 2 contradicts the checkpoint .*, whose num_layers is 4"),
    (["--hidden-size", "64"], "--hidden-size 64 contradicts .*, whose hidden_size is 128"),
    (["--kv-channels", "16"], "--kv-channels 16 contradicts .*, whose head_dim is 32"),
    (["--moe-ffn-hidden-size", "32"], "--moe-ffn-hidden-size 32 contradicts .*, whose moe_intermediate_size is 64"),
    (["--moe-router-topk", "4"], "--moe-router-topk 4 contradicts .*, whose top_k is 2"),
    (["--num-query-groups", "4"], "--num-query-groups 4 contradicts .*, whose num_kv_heads is 2"),
    (["--norm-epsilon", "1e-5"], "--norm-epsilon 1e-05 contradicts .*, whose rms_norm_eps is 1e-06"),
    (["--rotary-base", "10000"], "--rotary-base 10000 contradicts .*, whose rope_theta is 1000000.0.*--finetune"),
    (["--vocab-size", "4096"], "--vocab-size 4096 but the checkpoint .* has 2048 embedding rows"),
]


@pytest.mark.parametrize("kind", ["hf", "ours", "megatron", "peft"])
def test_a_contradicting_flag_stops_the_run_in_one_line(loads, kind, capsys):
    if kind not in loads:
        pytest.skip("Megatron checkpoints are torch pickles: the default lane writes one")
    cases = CONTRADICTIONS if kind == "hf" else CONTRADICTIONS[:3] + CONTRADICTIONS[5:6]
    for flags, says in cases:
        if kind == "megatron" and flags[0] == "--rotary-base":
            continue  # --finetune (a Megatron checkpoint past iteration 0) lets RoPE move
        assert _run(loads[kind], *flags) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and __import__("re").search(says, err[0]), (flags, err)


def test_agreeing_flags_and_fresh_model_flags_pass(loads, capsys):
    """The flags of the checkpoint's own model pass; --max-position-embeddings and
    --init-method-std (what only a fresh model takes) pass and are said; under --finetune
    --rotary-base moves RoPE, said."""
    ok = ["--num-layers", "4", "--hidden-size", "128", "--moe-ffn-hidden-size", "64", "--moe-router-topk", "2",
          "--max-position-embeddings", "2048", "--init-method-std", "0.006"]
    result = sft.main(["--config", "demo", "--train-iters", "0", "--lr-decay-iters", "10", *loads["hf"], *ok,
                       "--rotary-base", "500000",
                       "--finetune"])
    out = capsys.readouterr().out
    assert "--max-position-embeddings 2048 is for a fresh model" in out and "keeps its own 4096" in out
    assert "--init-method-std 0.006 is for a fresh model" in out
    assert "WARNING: --rotary-base 500000 replaces" in out and "1000000.0" in out
    cfg = result.trainer.model_cfg
    assert (cfg.max_position_embeddings, cfg.init_std, cfg.rope_theta) == (4096, TINY.init_std, 500000.0)


@pytest.mark.parametrize("name", sorted(families.known_models()))
def test_every_release_names_the_network_its_config_json_holds(name):
    """``--model-name X --load <X's HF directory>`` passes: the config.json we write for X (as the
    release's, vision-language outer config included) reads back as the same network."""
    cfg = families.get_model_config(name)
    back = families.from_hf_config(families.family_of(cfg).to_hf(cfg))
    assert back.structure() == cfg.structure()


def test_a_megatron_checkpoint_unpads_to_vocab_size(loads, capsys):
    """--vocab-size: Megatron pads from it, so its checkpoint is unpadded to it."""
    if "megatron" not in loads:
        pytest.skip("Megatron checkpoints are torch pickles: the default lane writes one")
    result = sft.main(["--config", "demo", "--train-iters", "0", "--lr-decay-iters", "10", *loads["megatron"],
                       "--vocab-size", "2000"])
    assert result.trainer.model_cfg.vocab_size == 2000
