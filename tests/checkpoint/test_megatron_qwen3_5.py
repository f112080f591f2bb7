"""Qwen3.5 / Qwen3-Next checkpoints of Megatron-Bridge and Megatron-LM (megatron-core's
``GatedDeltaNet``, torch_dist: their ``--load`` format) against real megatron-core (issue 40 item 7).
LoongForge's own layout (its ``GatedDeltaNet`` with ``in_proj_qkvz`` / ``in_proj_ba``) is refused
by name.

``tests/mcore_qwen35.py`` builds megatron-core 0.16.1's ``GPTModel`` on CPU as Megatron-Bridge's
``Qwen3NextBridge`` configures it (``GatedDeltaNet`` layers with softmax attention every 4th,
the attention's output gate, zero-centred RMSNorms, a gated shared expert; TE's parameter names
through two CPU stand-ins): hidden 128 (qwen3-next-tiny's shape), 4 layers (a dense DeltaNet layer, two MoE DeltaNet layers,
an MoE attention layer), 2 key / 4 value DeltaNet heads, 8 experts top-2, vocabulary 1536 padded
to 1600. It saves with ``dist_checkpointing`` and runs megatron-core's own forward (its torch
chunked gated delta rule: FLA's Triton kernel does not run on CPU). Once per session: TP2 x EP2
with expert-TP 1 on 2 ranks, with Megatron-LM's ``args`` (as a Megatron-LM run writes them; about 45 s).
Its copy without ``args`` is what Megatron-Bridge writes (its config lives in its own run
config): the shape then comes from ``--model-name``. Marked slow: the TP1 checkpoint.
"""

import os
import shutil

import jax
import numpy as np
import pytest

from mlir_train import sft
from mlir_train.checkpoint import megatron as mc
from mlir_train.families.qwen3_5.config import MODELS
from tests.checkpoint.test_megatron_checkpoint import (
    _argv, _logits, _redo_dist, _single_device, assert_loads_sharded)

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")

from tests import mcore_qwen35  # noqa: E402

VOCAB = 1536
SPEC = {"vocab": VOCAB, "divisible_by": 160}
# fp32, logits up to 8.3: measured max |diff| 7.0e-5 (TP2 x EP2) and 1.4e-4 (TP1), median 3-4e-6; the
# two sides invert the chunks' UT systems by different algorithms (megatron-core row by row, ours by
# 2x2 block matmuls), so the rounding differs; a wrong layout moves logits by O(1)
TOL = 2e-4


def _saved(tmp_path_factory, name, layout, **job):
    cache = os.environ.get("MLIR_TRAIN_MCORE_CACHE")
    out = os.path.join(cache, name) if cache else str(tmp_path_factory.mktemp(name))
    if not os.path.exists(os.path.join(out, "logits.npy")):
        mcore_qwen35.run_job({"kind": "save", "layout": layout, "spec": SPEC, **job}, out)
    return out


@pytest.fixture(scope="session")
def megatron_lm(tmp_path_factory):
    """TP2 x EP2 (ETP1) with Megatron-LM's args."""
    return _saved(tmp_path_factory, "mcore_qwen35_tp2_ep2", {"tp": 2, "ep": 2, "etp": 1}, args=True)


@pytest.fixture(scope="session")
def bridge(megatron_lm, tmp_path_factory):
    """The same checkpoint without args, as Megatron-Bridge writes it (its config is its own run
    config, not Megatron-LM's argparse args)."""
    import torch

    out = str(tmp_path_factory.mktemp("bridge"))
    shutil.copytree(os.path.join(megatron_lm, "torch_dist"), os.path.join(out, "torch_dist"))
    common = os.path.join(out, "torch_dist", "iter_0000010", "common.pt")
    state = torch.load(common, weights_only=False)
    del state["args"]
    torch.save(state, common)
    return out


def _config():
    """The oracle's model as our config: qwen3-next-tiny (what --model-name names for a Bridge checkpoint)."""
    return MODELS["qwen3-next-tiny"].replace(vocab_size=VOCAB)


def _abstract(cfg):
    from flax import nnx

    from mlir_train.families.qwen3_5 import Qwen35
    from mlir_train.model import ModelOptions

    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen35(cfg, rngs=nnx.Rngs(0), options=ModelOptions(moe_impl="dense"))))
    return graphdef, nnx.to_pure_dict(state)


def _load(path, fallback=None, shardings=None):
    ckpt = mc.find(os.path.join(path, "torch_dist"))
    cfg = mc.model_config(ckpt, name="qwen3-next-tiny", vocab_size=VOCAB, fallback=fallback)
    graphdef, shapes = _abstract(cfg)
    return cfg, graphdef, mc.load_params(ckpt, cfg, shapes, shardings or _single_device(shapes))


def _reference(out_dir):
    return np.load(os.path.join(out_dir, "logits.npy"))[..., :VOCAB], np.load(os.path.join(out_dir, "tokens.npy"))


def test_megatron_lm_checkpoint_logits_equal_megatron_core(megatron_lm):
    """The shape from the args (the 3:1 DeltaNet/attention pattern, the dense first layer, partial
    RoPE, the shared expert), then our logits against megatron-core's forward of the checkpoint."""
    ref, tokens = _reference(megatron_lm)
    cfg, graphdef, params = _load(megatron_lm)
    assert cfg == _config().replace(layer_types=cfg.layer_types)
    assert cfg.mixers() == ("linear_attention",) * 3 + ("full_attention",) and cfg.hf_model_type == "qwen3_next"
    assert params["embed"].shape == (VOCAB, 128)
    diff = np.abs(_logits(graphdef, params, tokens) - ref).max()
    assert diff <= TOL, diff


def test_bridge_checkpoint_takes_its_shape_from_the_model_name(bridge, megatron_lm):
    """No args (Megatron-Bridge): the named model's shape, loaded into a TP2 x EP2 layout of 8
    devices shard by shard, equal to the unsharded load and to megatron-core's logits."""
    from sharding.layout import Layout

    ref, tokens = _reference(megatron_lm)
    with pytest.raises(mc.MegatronCheckpointError, match="stores no 'args'; give --model-name"):
        _load(bridge)
    cfg, graphdef, plain = _load(bridge, fallback=_config())
    assert np.abs(_logits(graphdef, plain, tokens) - ref).max() <= TOL
    assert_loads_sharded(mc.find(os.path.join(bridge, "torch_dist")), cfg, plain, Layout(tensor=2, expert=2))


def test_mismatched_checkpoints_name_the_tensor(bridge, tmp_path):
    """A model of other DeltaNet heads, a tensor gone, a tensor no parameter reads: each an
    error naming the checkpoint and the tensor."""
    import torch

    with pytest.raises(mc.MegatronCheckpointError, match=r"iter_0000010: layer 0 layers/0/linear_attn/\w+ "
                                                        r"\(from decoder\.layers\.0\.self_attention\.\S+\): .*does the model config"):
        jax.block_until_ready(_load(bridge, fallback=_config().replace(linear_key_head_dim=16))[2])
    src = os.path.join(bridge, "torch_dist")
    gone = "decoder.layers.1.self_attention.in_proj.weight.beta"
    _redo_dist(src, str(tmp_path / "gone" / "torch_dist"), lambda sd: {k: v for k, v in sd.items() if k != gone})
    with pytest.raises(mc.MegatronCheckpointError, match=rf"no tensor decoder\.layers\.self_attention\.in_proj\.weight\.beta "
                                                         r"\(layer 1\)"):
        jax.block_until_ready(_load(str(tmp_path / "gone"), fallback=_config())[2])
    extra = "decoder.layers.2.self_attention.conv1d.bias"
    _redo_dist(src, str(tmp_path / "extra" / "torch_dist"), lambda sd: sd | {extra: torch.zeros(256)})
    with pytest.raises(mc.MegatronCheckpointError, match=rf"{extra.replace('.', r'[.]')} \(256,\)"):
        _load(str(tmp_path / "extra"), fallback=_config())


def test_args_of_other_models_are_refused_by_name():
    """Args the family cannot build are refused naming the flag (Qwen3's mapping refuses the
    DeltaNet args the same way)."""
    from mlir_train import families
    from mlir_train.runtime.errors import CheckpointError

    args = vars(mcore_qwen35.megatron_args(mcore_qwen35.SPEC_FIELDS, mcore_qwen35.Layout(), 1))
    build = lambda a: families.from_megatron(a, name="x", vocab_size=VOCAB, has_tensor=lambda t, n: True)
    assert build(args).linear_num_value_heads == 4
    with pytest.raises(CheckpointError, match="multi-token-prediction"):
        build(args | {"mtp_num_layers": 1})
    with pytest.raises(CheckpointError, match="apply_layernorm_1p"):
        build(args | {"apply_layernorm_1p": False})
    with pytest.raises(CheckpointError, match="as qwen3_5: attention_output_gate is off"):
        build(args | {"attention_output_gate": False})
    # Qwen3's mapping refuses DeltaNet layers even where nothing else differs
    with pytest.raises(CheckpointError, match=r"as qwen3: experimental_attention_variant='gated_delta_net' \(gated "):
        build(args | {"rotary_percent": 1.0, "moe_shared_expert_intermediate_size": None, "attention_output_gate": False})


def test_sft_loads_a_bridge_checkpoint_or_says_what_is_wrong(bridge, megatron_lm, tmp_path, capsys):
    """``sft --load`` of the Bridge checkpoint with ``--model-name`` (the tokenizer's 1559 tokens
    pad to the checkpoint's 1600 rows; logits compared on its 1536 real ones); a model of
    another shape is one ``mlir-train: error:`` line naming the checkpoint and the tensor."""
    ref, tokens = _reference(megatron_lm)
    argv = _argv(tmp_path, "--tensor-model-parallel-size", "1", "--load", os.path.join(bridge, "torch_dist"),
                 "--train-iters", "0", "--lr-decay-iters", "10", "--finetune", "--model-name", "qwen3-next-tiny")
    out = sft.main(argv)
    graphdef, _ = _abstract(out.trainer.model_cfg)
    assert np.abs(_logits(graphdef, out.state["params"], tokens)[..., :VOCAB] - ref).max() <= TOL
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        sft.main(argv + ["--ffn-hidden-size", "128"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1].startswith("mlir-train: error:") and "iter_0000010: layer 0 " in err[-1] \
        and "(from decoder.layers.0.mlp.linear_fc" in err[-1], err


def test_legacy_torch_format_is_refused_by_name(tmp_path):
    """Megatron-LM's legacy files hold each TP rank's fused DeltaNet ``in_proj``: refused, naming
    the format and what to save instead, before any tensor is read."""
    import torch

    rank = tmp_path / "iter_0000010" / "mp_rank_00"
    rank.mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    args = mcore_qwen35.megatron_args(mcore_qwen35.SPEC_FIELDS | SPEC, mcore_qwen35.Layout(), 1)
    torch.save({"args": args, "iteration": 10, "checkpoint_version": 3.0, "model": {}}, rank / "model_optim_rng.pt")
    ckpt = mc.find(str(tmp_path))
    cfg = mc.model_config(ckpt, name="qwen3-next-tiny", vocab_size=VOCAB)
    _, shapes = _abstract(cfg)
    with pytest.raises(mc.MegatronCheckpointError, match=r"iteration 10\): the torch format is not read for qwen3_5 "
                                                         r"models \(qwen3-next-tiny\), only torch_dist; re-save it "
                                                         r"with --ckpt-format torch_dist"):
        mc.load_params(ckpt, cfg, shapes, _single_device(shapes))


def test_convert_to_hf_gives_transformers_megatron_cores_logits(bridge, megatron_lm, tmp_path, capsys):
    """``convert --model-name`` of the Bridge checkpoint (no args) to HF: transformers'
    ``Qwen3NextForCausalLM`` (its torch gated delta rule) gives megatron-core's logits, so each
    tensor landed where HF's layout (Megatron-Bridge's mapping, run backwards) puts it. The flag
    is refused for a source that brings its own config."""
    import torch
    from transformers import AutoModelForCausalLM

    from mlir_train import convert

    ref, tokens = _reference(megatron_lm)
    out = str(tmp_path / "hf")
    assert convert.main([os.path.join(bridge, "torch_dist"), out, "--model-name", "qwen3-next-tiny",
                         "--vocab-size", str(VOCAB)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3NextForCausalLM"
    with torch.no_grad():
        logits = hf(torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(logits - ref).max() <= TOL
    capsys.readouterr()
    assert convert.main([out, str(tmp_path / "back"), "--model-name", "qwen3-next-tiny"]) == 2
    assert "--model-name qwen3-next-tiny: SRC " in capsys.readouterr().err


def test_loongforge_gated_deltanet_layout_is_refused_by_name(bridge, tmp_path):
    """LoongForge's Qwen3-Next / Qwen3.5 models use their own GatedDeltaNet (HF's fused
    ``in_proj_qkvz`` / ``in_proj_ba``, replicated over TP, a plain ``out_norm``), not
    megatron-core's: such a tensor stops the load naming it and what to do."""
    import torch

    def loongforge(sd):
        sd = {k: v for k, v in sd.items() if "layers.0.self_attention.in_proj.weight." not in k}
        return sd | {"decoder.layers.0.self_attention.in_proj_qkvz.weight": torch.zeros(384, 128),
                     "decoder.layers.0.self_attention.in_proj_ba.weight": torch.zeros(8, 128)}

    _redo_dist(os.path.join(bridge, "torch_dist"), str(tmp_path / "lf" / "torch_dist"), loongforge)
    with pytest.raises(mc.MegatronCheckpointError, match=r"tensor decoder\.layers\.0\.self_attention\.in_proj_ba\.weight: "
                                                         r"LoongForge's own GatedDeltaNet layout .* tools/convert_checkpoint"):
        _load(str(tmp_path / "lf"), fallback=_config())


@pytest.mark.slow
def test_tp1_checkpoint(tmp_path_factory):
    out = _saved(tmp_path_factory, "mcore_qwen35_tp1", {"tp": 1}, args=True)
    ref, tokens = _reference(out)
    _, graphdef, params = _load(out)
    assert np.abs(_logits(graphdef, params, tokens) - ref).max() <= TOL


@pytest.mark.slow
def test_qwen3_5_moe_checkpoint_and_its_hf_export(tmp_path_factory, tmp_path):
    """Qwen3.5-MoE's shape (every layer MoE, no dense MLP; qwen3.5-moe-tiny) from Megatron-LM's
    args: megatron-core's logits here, and through ``convert`` in transformers'
    ``Qwen3_5MoeForCausalLM`` (Qwen3.5's split DeltaNet projections)."""
    import torch
    from transformers import AutoModelForCausalLM

    from mlir_train import convert

    out = _saved(tmp_path_factory, "mcore_qwen35moe_tp2_ep2", {"tp": 2, "ep": 2, "etp": 1}, args=True,
                 spec=SPEC | {"moe_layer_freq": 1})
    ref, tokens = _reference(out)
    ckpt = mc.find(os.path.join(out, "torch_dist"))
    cfg = mc.model_config(ckpt, name="qwen3.5-moe-tiny", vocab_size=VOCAB)
    assert cfg == MODELS["qwen3.5-moe-tiny"].replace(vocab_size=VOCAB, layer_types=cfg.layer_types,
                                                    intermediate_size=cfg.intermediate_size)
    graphdef, shapes = _abstract(cfg)
    params = mc.load_params(ckpt, cfg, shapes, _single_device(shapes))
    ours = np.abs(_logits(graphdef, params, tokens) - ref)
    assert convert.main([os.path.join(out, "torch_dist"), str(tmp_path / "hf"), "--model-name", "qwen3.5-moe-tiny",
                         "--vocab-size", str(VOCAB)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3_5MoeForCausalLM"
    with torch.no_grad():
        theirs = np.abs(hf(torch.as_tensor(tokens)).logits.numpy() - ref)
    # Measured: max 8.4e-4 (ours) and 5.9e-4 (transformers) at the same two positions of one row,
    # median 3e-6 for both: a spot where fp32 rounding grows in all three implementations alike,
    # not a layout error (which moves every logit by O(1)).
    assert max(ours.max(), theirs.max()) <= 1e-3 and max(np.median(ours), np.median(theirs)) <= 1e-5
