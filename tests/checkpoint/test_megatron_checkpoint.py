"""Megatron checkpoints (issue 18), against checkpoints and logits of real megatron-core.

``tests/mcore_cpu.py`` runs megatron-core 0.16.1 on CPU (gloo, several processes) to build a
tiny Qwen3-MoE ``GPTModel`` (hidden 64, 4 layers, 4 heads in 2 query groups, 8 experts, top-2,
vocabulary 1536 padded to 1600), save it in both formats and compute its own forward logits.
Once per session (about 30 s): TP2 x EP2 with expert-TP 1 over 2 ranks (ETP != TP; the legacy
files are ``mp_rank_00_000`` and ``mp_rank_01_001`` only, as Megatron-LM's writer-rank rule
leaves them). Marked slow: TP2 x PP2 x EP2 with two virtual pipeline chunks over 8 ranks
(about 2.5 min to write, 3 more to load back), a dense Qwen3 over TP2 x PP2 (4 ranks, 1.5 min),
ETP2 > TP1 (torch_dist, 4 ranks) and mixed dense/MoE layers (2 ranks).
"""

import os
import pickle
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import mcore_cpu  # noqa: E402

from mlir_train import convert, sft
from mlir_train.checkpoint import megatron as mc  # noqa: E402
from mlir_train.data.config import DEFAULT_DATA, DEFAULT_TOKENIZER  # noqa: E402
from mlir_train.data.tokenizer import load_tokenizer  # noqa: E402
from mlir_train.families.qwen3 import Qwen3  # noqa: E402
from mlir_train.model import ModelOptions  # noqa: E402

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")

VOCAB = 1536  # the bundled tokenizer's size, so sft can --load these checkpoints
SPEC = {"vocab": VOCAB, "divisible_by": 160}  # 1536 -> 1600 (x TP2 = 320, and at TP1)
TOL = 1e-4


def _saved(tmp_path_factory, name, layout, formats=("torch", "torch_dist"), **spec):
    """megatron-core's checkpoints + logits for ``layout``, written once per session (or kept in
    ``$MLIR_TRAIN_MCORE_CACHE/<name>`` across sessions when that is set, for local iteration)."""
    cache = os.environ.get("MLIR_TRAIN_MCORE_CACHE")
    out = os.path.join(cache, name) if cache else str(tmp_path_factory.mktemp(name))
    if not os.path.exists(os.path.join(out, "logits.npy")):
        mcore_cpu.run_job({"kind": "save", "layout": layout, "spec": SPEC | spec, "formats": list(formats)}, out)
    return out


@pytest.fixture(scope="session")
def mcore_small(tmp_path_factory):
    return _saved(tmp_path_factory, "mcore_tp2_ep2_etp1", {"tp": 2, "ep": 2, "etp": 1})


@pytest.fixture(scope="session")
def mcore_etp_over_tp(tmp_path_factory):
    return _saved(tmp_path_factory, "mcore_tp1_ep2_etp2", {"tp": 1, "ep": 2, "etp": 2}, formats=("torch_dist",))


@pytest.fixture(scope="session")
def mcore_mixed(tmp_path_factory):
    return _saved(tmp_path_factory, "mcore_mixed_tp2_ep2", {"tp": 2, "ep": 2}, moe_layer_freq=[0, 1, 1, 0])


@pytest.fixture(scope="session")
def mcore_dense(tmp_path_factory):
    return _saved(tmp_path_factory, "mcore_dense_tp2_pp2", {"tp": 2, "pp": 2}, experts=0)


@pytest.fixture(scope="session")
def mcore_big(tmp_path_factory):
    return _saved(tmp_path_factory, "mcore_tp2_pp2_ep2_vpp2", {"tp": 2, "pp": 2, "ep": 2, "vpp": 2})


def _abstract(cfg):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), options=ModelOptions(moe_impl="dense"))))
    return graphdef, nnx.to_pure_dict(state)


def _single_device(shapes):
    return jax.tree.map(lambda _: jax.sharding.make_single_device_sharding(jax.devices()[0]), shapes)


def _logits(graphdef, params, tokens):
    params = jax.tree.map(lambda x: jax.device_put(np.asarray(x), jax.devices()[0]), params)
    with jax.default_matmul_precision("highest"):
        return np.asarray(nnx.merge(graphdef, params)(jnp.asarray(tokens, jnp.int32)))


def _load(path, vocab=VOCAB, shardings=None):
    ckpt = mc.find(path)
    cfg = mc.model_config(ckpt, name="mcore", vocab_size=vocab)
    graphdef, shapes = _abstract(cfg)
    params = mc.load_params(ckpt, cfg, shapes, shardings or _single_device(shapes))
    return ckpt, cfg, graphdef, params


def _megatron_logits(out_dir):
    return np.load(os.path.join(out_dir, "logits.npy"))[..., :VOCAB], np.load(os.path.join(out_dir, "tokens.npy"))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_loads_megatron_checkpoint_with_megatron_logits(mcore_small, fmt):
    ref, tokens = _megatron_logits(mcore_small)
    ckpt, cfg, graphdef, params = _load(os.path.join(mcore_small, fmt))
    assert (ckpt.format, ckpt.iteration, ckpt.release) == (fmt, 10, False)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_experts,
            cfg.moe_intermediate_size, cfg.top_k, cfg.norm_topk_prob) == (64, 4, 4, 2, 16, 8, 32, 2, True)
    # the padded vocabulary (1600 rows) is cut back to the model's 1536
    assert params["embed"].shape == (VOCAB, 64) and params["lm_head"].shape == (64, VOCAB)
    assert mc.padded_vocab(ckpt) == 1600
    assert mc.find(ckpt.directory).directory == ckpt.directory  # the iter_0000010 directory itself works too
    ours = _logits(graphdef, params, tokens)
    assert np.abs(ours - ref).max() <= TOL, np.abs(ours - ref).max()


def test_loads_into_a_sharded_layout(mcore_small):
    """Into a PP2 x TP2 x EP2 (distributed optimizer) layout of 8 devices, each device's shard
    read by its own callback: equal to the unsharded load, in the run's shardings."""
    from sharding.layout import Layout

    ckpt, cfg, graphdef, plain = _load(os.path.join(mcore_small, "torch_dist"))
    assert_loads_sharded(ckpt, cfg, plain, Layout(tensor=2, expert=2, pipeline=2, distributed_optimizer=True))


def assert_loads_sharded(ckpt, cfg, plain, layout):
    """``ckpt`` loaded into ``layout``'s shardings (a trainer's) equals ``plain`` (its unsharded
    load), each leaf in the run's sharding."""
    import optax

    from mlir_train.train.build import build_trainer
    from mlir_train.train.trainer import StepConfig, model_dims
    from sharding.mesh import make_mesh, validate

    parallel = validate(layout, model_dims(cfg))
    trainer = build_trainer(cfg, StepConfig(), optax.identity(), parallel, make_mesh(parallel))
    sharded = mc.load_params(ckpt, cfg, trainer.param_shapes, trainer.master_shardings)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(sharded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(trainer.master_shardings)):
        assert got.sharding == want


def test_convert_round_trip_hf_and_back_to_megatron(mcore_small, tmp_path):
    """Megatron (torch_dist) -> HF, whose transformers logits are megatron-core's; HF ->
    Megatron legacy in another layout (TP1 x EP2), which megatron-core itself loads
    (strict) with identical logits."""
    ref, tokens = _megatron_logits(mcore_small)
    hf_dir, back = str(tmp_path / "hf"), str(tmp_path / "megatron")
    assert convert.main([os.path.join(mcore_small, "torch_dist"), hf_dir, "--vocab-size", str(VOCAB)]) == 0
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(hf_logits - ref).max() <= TOL

    assert convert.main([hf_dir, back, "--to", "megatron", "--tensor-model-parallel-size", "1",
                         "--expert-model-parallel-size", "2", "--make-vocab-size-divisible-by", "160"]) == 0
    assert sorted(os.listdir(os.path.join(back, "release"))) == ["checksums.json", "mp_rank_00_000", "mp_rank_00_001"]
    ckpt = mc.find(back)
    assert ckpt.release and ckpt.args["padded_vocab_size"] == 1600 and ckpt.args["vocab_size"] == VOCAB
    mcore_cpu.run_job({"kind": "load", "layout": {"tp": 1, "ep": 2}, "spec": SPEC, "checkpoint": back},
                      str(tmp_path / "reload"))
    again, _ = _megatron_logits(str(tmp_path / "reload"))
    assert np.abs(again - ref).max() <= TOL
    # and our own format in between: Megatron legacy -> mlir-train checkpoint -> HF
    ours = str(tmp_path / "ours")
    assert convert.main([os.path.join(mcore_small, "torch"), ours, "--to", "mlir-train", "--vocab-size", str(VOCAB)]) == 0
    assert convert.main([ours, str(tmp_path / "hf2")]) == 0
    hf2 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert np.abs(hf2(torch.as_tensor(tokens)).logits.numpy() - ref).max() <= TOL


def _rename_legacy(src, dst, rename):
    """A copy of a legacy checkpoint with every rank file's model keys passed through ``rename``
    (dict -> dict), to check the TE / grouped-GEMM spellings of the same weights."""
    import torch

    shutil.copytree(src, dst)
    for root, _, files in os.walk(dst):
        for f in files:
            if f == "model_optim_rng.pt":
                sd = torch.load(os.path.join(root, f), weights_only=False)
                sd["model"] = rename(sd["model"])
                torch.save(sd, os.path.join(root, f))


def _te_names(model):
    out = {}
    for k, v in model.items():
        k2 = k.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        k2 = k2.replace("mlp.experts.local_experts.", "mlp.experts.LE.")
        if ".LE." in k2:  # TEGroupedMLP: linear_fc1.weight<j>
            head, rest = k2.split(".LE.")
            j, tail = rest.split(".", 1)
            k2 = f"{head}.{tail}{j}" if tail.endswith("weight") else f"{head}.{tail}"
        out[k2] = v
    return out


def _grouped_names(model):
    """Legacy GroupedMLP: weight1 [D, L*2F_r], weight2 [L*F_r, D] per layer."""
    import re

    import torch

    out, experts = {}, {}
    for k, v in model.items():
        m = re.match(r"(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.(\d+)\.linear_fc([12])\.(weight|_extra_state)", k)
        if m:
            if m.group(4) == "weight":
                experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = v
            continue
        out[k] = v
    for (prefix, which), ws in experts.items():
        ws = [ws[j] for j in sorted(ws)]
        # GroupedMLP views weight1 as [L, D, 2F_r] and weight2 as [L, F_r, D] (raw reshapes)
        out[f"{prefix}.weight{which}"] = (torch.stack([w.t() for w in ws]).reshape(ws[0].shape[1], -1)
                                          if which == "1" else torch.cat([w.t() for w in ws], dim=0))
    return out


@pytest.mark.parametrize("spelling", ["te", "grouped"])
def test_te_and_grouped_gemm_names(mcore_small, tmp_path, spelling):
    ref, tokens = _megatron_logits(mcore_small)
    dst = str(tmp_path / spelling)
    _rename_legacy(os.path.join(mcore_small, "torch"), dst, _te_names if spelling == "te" else _grouped_names)
    _, _, graphdef, params = _load(dst)
    assert np.abs(_logits(graphdef, params, tokens) - ref).max() <= TOL


def test_unknown_tensors_and_missing_layers_are_errors(mcore_small, tmp_path):
    import torch

    def add_shared(model):
        return model | {"decoder.layers.0.mlp.shared_experts.linear_fc1.weight": torch.zeros(8, 64)}

    dst = str(tmp_path / "shared")
    _rename_legacy(os.path.join(mcore_small, "torch"), dst, add_shared)
    with pytest.raises(mc.MegatronCheckpointError, match=r"shared_experts\.linear_fc1\.weight .* no counterpart"):
        _load(dst)
    dst = str(tmp_path / "pre_mcore")
    _rename_legacy(os.path.join(mcore_small, "torch"), dst, lambda m: {"language_model": {"encoder": m}})
    with pytest.raises(mc.MegatronCheckpointError, match="pre-megatron-core"):
        _load(dst)
    dst = str(tmp_path / "short")
    _rename_legacy(os.path.join(mcore_small, "torch"), dst,
                   lambda m: {k: v for k, v in m.items() if not k.startswith("decoder.layers.1.self_attention.linear_qkv.")})
    with pytest.raises(mc.MegatronCheckpointError, match=r"missing decoder\.layers\.1\.self_attention\.linear_qkv\.weight"):
        _, _, graphdef, params = _load(dst)
        jax.block_until_ready(params)


def _redo_dist(src, dst, edit):
    """A copy of a torch_dist checkpoint with its tensors passed through ``edit`` (dict -> dict),
    written back as a plain torch DCP (what our reader reads of Megatron's)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    shutil.copytree(src, dst)
    it, flat = os.path.join(dst, "iter_0000010"), os.path.join(dst, "flat.pt")
    dcp_to_torch_save(it, flat)
    torch.save(edit(torch.load(flat, weights_only=False)), flat)
    for f in os.listdir(it):
        if f.endswith(".distcp") or f == ".metadata":
            os.remove(os.path.join(it, f))
    torch_save_to_dcp(flat, it)
    os.remove(flat)


def test_torch_dist_planted_and_missing_tensors_are_named(mcore_small, tmp_path):
    """Completeness in torch_dist: a tensor no parameter reads (a shared expert's), and a stacked
    tensor a parameter needs that is gone, are each named."""
    import torch

    src = os.path.join(mcore_small, "torch_dist")
    _redo_dist(src, str(tmp_path / "extra"),
               lambda sd: sd | {"decoder.layers.mlp.shared_experts.linear_fc1.weight": torch.zeros(4, 8, 64)})
    with pytest.raises(mc.MegatronCheckpointError, match=r"tensor decoder\.layers\.mlp\.shared_experts\.linear_fc1\.weight "
                                                         r"\(4, 8, 64\) .*has no counterpart in the model"):
        _load(str(tmp_path / "extra"))
    _redo_dist(src, str(tmp_path / "gone"),
               lambda sd: {k: v for k, v in sd.items() if k != "decoder.layers.self_attention.q_layernorm.weight"})
    with pytest.raises(mc.MegatronCheckpointError, match=r"no tensor decoder\.layers\.self_attention\.q_layernorm\.weight"):
        _, _, _, params = _load(str(tmp_path / "gone"))
        jax.block_until_ready(params)


def test_reads_megatron_pickles_without_megatron(mcore_small, tmp_path, monkeypatch):
    """Some checkpoints pickle Megatron classes (``MCoreMetadata`` into ``.metadata``, enums in
    ``args``): they unpickle as stubs, with Megatron not importable at all."""
    import torch
    from megatron.core.dist_checkpointing.strategies.torch import MCoreMetadata
    from megatron.core.enums import ModelType

    dst = str(tmp_path / "dist")
    shutil.copytree(os.path.join(mcore_small, "torch_dist"), dst)
    it = os.path.join(dst, "iter_0000010")
    with open(os.path.join(it, ".metadata"), "rb") as f:
        md = pickle.load(f)
    md.mcore_data = {"x": MCoreMetadata()}
    with open(os.path.join(it, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    common = torch.load(os.path.join(it, "common.pt"), weights_only=False)
    common["args"].model_type = ModelType.encoder_or_decoder
    torch.save(common, os.path.join(it, "common.pt"))
    ref, tokens = _megatron_logits(mcore_small)
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)  # any import of it now fails
    ckpt, _, graphdef, params = _load(dst)
    assert "stub" in repr(ckpt.args["model_type"])
    assert np.abs(_logits(graphdef, params, tokens) - ref).max() <= TOL


# ----- the trainer's --load ------------------------------------------------------------------------
def _argv(tmp_path, *extra):
    return ["--hf-tokenizer-path", DEFAULT_TOKENIZER, "--data-path", DEFAULT_DATA, "--split", "100,0,0",
            "--chat-template", "alpaca", "--packing-sft-data", "--seq-length", "64", "--global-batch-size", "8",
            "--micro-batch-size", "1", "--eval-interval", "0", "--lr", "1e-4", "--log-interval", "1",
            "--data-cache-path", str(tmp_path / "data"), "--tensorboard-dir", str(tmp_path / "tb"),
            "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", *extra]


def _tp1(tmp_path, *extra):
    """:func:`_argv` at TP1 (a later flag replaces an earlier one)."""
    return _argv(tmp_path, "--tensor-model-parallel-size", "1", *extra)


def test_sft_loads_megatron_checkpoint(mcore_small, tmp_path, capsys):
    """--load of a Megatron directory: the shape from its args, the vocabulary the tokenizer's
    (the bundled one's 1559 tokens, which pad to the checkpoint's 1600; its rows past the
    checkpoint's 1536 real ones are Megatron's padding, so the logits are compared on those 1536;
    TP1 because 1559 rows do not split over two ranks, which a run refuses naming the flag), Megatron's iteration continued (here 10 =
    --train-iters: nothing left to train, the loaded state comes back) or, with --finetune,
    restarted at 0; --model-name or an override that disagrees with the checkpoint stops the
    run. (Training from loaded weights is the same step as after an HF load: not re-run here.)"""
    ref, tokens = _megatron_logits(mcore_small)
    out = sft.main(_tp1(tmp_path, "--load", os.path.join(mcore_small, "torch"), "--train-iters", "10"))
    printed = capsys.readouterr().out
    assert "loading weights from Megatron torch checkpoint" in printed and "iteration 10" in printed
    assert "continuing Megatron's iteration count from 10" in printed and "nothing to train" in printed
    trainer = out.trainer
    assert trainer.model_cfg.vocab_size == len(load_tokenizer(DEFAULT_TOKENIZER)) and trainer.model_cfg.hidden_size == 64
    graphdef, _ = _abstract(trainer.model_cfg)
    assert np.abs(_logits(graphdef, out.state["params"], tokens)[..., :VOCAB] - ref).max() <= TOL

    fine = sft.main(_tp1(tmp_path, "--load", os.path.join(mcore_small, "torch_dist"), "--train-iters", "0",
                          "--lr-decay-iters", "10", "--finetune"))
    assert int(fine.state["iteration"]) == 0 and "at iteration 0 >= --train-iters" in capsys.readouterr().out
    assert np.abs(_logits(graphdef, fine.state["params"], tokens)[..., :VOCAB] - ref).max() <= TOL

    with pytest.raises(SystemExit):
        sft.main(_tp1(tmp_path, "--load", os.path.join(mcore_small, "torch"), "--train-iters", "1",
                       "--model-name", "qwen3-moe-tiny"))
    err = capsys.readouterr().err
    assert "--model-name qwen3-moe-tiny is not the model of the checkpoint Megatron torch checkpoint" in err
    assert "hidden_size 128 against 64" in err
    with pytest.raises(SystemExit):  # an override alone, without --model-name
        sft.main(_tp1(tmp_path, "--load", os.path.join(mcore_small, "torch"), "--train-iters", "1",
                       "--num-layers", "2"))
    err = capsys.readouterr().err
    assert "--num-layers 2 contradicts the checkpoint Megatron torch checkpoint" in err and "num_layers is" in err


def _fails(tmp_path, capsys, load):
    with pytest.raises(SystemExit) as exc:
        sft.main(_tp1(tmp_path, "--load", load, "--train-iters", "1"))
    assert exc.value.code != 0
    return capsys.readouterr().err


def test_unreadable_load_directories_are_errors(tmp_path, capsys):
    deepspeed = tmp_path / "deepspeed"
    (deepspeed / "global_step10").mkdir(parents=True)
    (deepspeed / "latest").write_text("global_step10")
    (deepspeed / "global_step10" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert "a DeepSpeed checkpoint" in _fails(tmp_path, capsys, str(deepspeed))

    zarr = tmp_path / "zarr"
    (zarr / "iter_0000005").mkdir(parents=True)
    (zarr / "latest_checkpointed_iteration.txt").write_text("5")
    (zarr / "iter_0000005" / "metadata.json").write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    err = _fails(tmp_path, capsys, str(zarr))
    assert "sharded backend zarr version 1" in err and "unsupported version" in err

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("hello")
    assert "no checkpoint we can read (it holds notes.txt)" in _fails(tmp_path, capsys, str(other))

    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    assert "no config.json: an incomplete HF directory" in _fails(tmp_path, capsys, str(weights))

    bad_tracker = tmp_path / "tracker"
    bad_tracker.mkdir()
    (bad_tracker / "latest_checkpointed_iteration.txt").write_text("latest")
    assert "holds 'latest', expected an iteration number or 'release'" in _fails(tmp_path, capsys, str(bad_tracker))

    assert mc.identify(str(tmp_path / "missing")) is None
    (tmp_path / "empty").mkdir()
    assert mc.identify(str(tmp_path / "empty")) is None
    (tmp_path / "interrupted" / "3.orbax-checkpoint-tmp-1").mkdir(parents=True)
    assert mc.identify(str(tmp_path / "interrupted")) is None  # a first save killed mid-write: no checkpoint yet


def test_damaged_torch_dist_files_are_one_line_naming_them(mcore_small, tmp_path, capsys):
    """Issue 48's matrix for megatron-core's ``torch_dist`` files (the other kinds:
    tests/entry/test_damaged_files.py): each file of the iteration directory cut short, emptied,
    its first bytes overwritten or (JSON) valid JSON of the wrong shape is one line naming it."""
    from tests.entry.test_damaged_files import DAMAGES, damage
    from tests.entry.test_input_errors import _run_in_process

    src = os.path.join(mcore_small, "torch_dist")
    it = next(n for n in os.listdir(src) if n.startswith("iter_"))
    failures = []
    for name in sorted(os.listdir(os.path.join(src, it))):
        for how in DAMAGES:
            copy = tmp_path / f"{name}-{how}"
            shutil.copytree(src, copy)
            damage(str(copy / it / name), how)
            code, err = _run_in_process(_tp1(tmp_path, "--load", str(copy), "--train-iters", "1"), capsys)
            lines = [line for line in err.splitlines() if "error:" in line]
            if code != 2 or len(lines) != 1 or name not in lines[0] or "Traceback" in err:
                failures.append(f"{name} {how}: exit {code}, {lines or err[-300:]}")
    assert not failures, "\n".join(failures)


# ----- 8 ranks: TP2 x PP2 x EP2 with a virtual pipeline -------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_tp2_pp2_ep2_virtual_pipeline(mcore_big, fmt):
    ref, tokens = _megatron_logits(mcore_big)
    path = os.path.join(mcore_big, fmt)
    if fmt == "torch":
        assert len(os.listdir(os.path.join(path, "iter_0000010"))) == 8  # mp_rank_TT_PPP_EEE
    ckpt, _, graphdef, params = _load(path)
    assert np.abs(_logits(graphdef, params, tokens) - ref).max() <= TOL


@pytest.mark.slow
def test_tp2_pp2_ep2_round_trip_through_megatron(mcore_big, tmp_path):
    """Ours -> Megatron legacy TP2 x PP2 x EP2, loaded by megatron-core on 8 ranks: its logits."""
    ref, _ = _megatron_logits(mcore_big)
    ours = str(tmp_path / "ours")
    assert convert.main([os.path.join(mcore_big, "torch_dist"), ours, "--to", "mlir-train",
                         "--vocab-size", str(VOCAB)]) == 0
    back = str(tmp_path / "megatron")
    assert convert.main([ours, back, "--to", "megatron", "--tensor-model-parallel-size", "2",
                         "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                         "--make-vocab-size-divisible-by", "160", "--iteration", "7"]) == 0
    assert sorted(os.listdir(os.path.join(back, "iter_0000007")))[0] == "checksums.json"
    assert len(os.listdir(os.path.join(back, "iter_0000007"))) == 1 + 8  # and mp_rank_TT_PPP_EEE
    mcore_cpu.run_job({"kind": "load", "layout": {"tp": 2, "pp": 2, "ep": 2}, "spec": SPEC, "checkpoint": back},
                      str(tmp_path / "reload"))
    again, _ = _megatron_logits(str(tmp_path / "reload"))
    assert np.abs(again - ref).max() <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_dense_qwen3_tp2_pp2(mcore_dense, fmt):
    """A dense Qwen3 (SwiGLU MLP, fc1 = gate|up per TP rank) over TP2 x PP2 (4 ranks)."""
    ref, tokens = _megatron_logits(mcore_dense)
    _, cfg, graphdef, params = _load(os.path.join(mcore_dense, fmt))
    assert not cfg.is_moe and cfg.intermediate_size == 96
    assert np.abs(_logits(graphdef, params, tokens) - ref).max() <= TOL


def test_resume_notes_say_once_what_cannot_be_taken(mcore_small):
    import dataclasses

    ckpt = dataclasses.replace(mc.find(os.path.join(mcore_small, "torch")), has_optimizer=True, has_rng=True)
    notes = mc.resume_notes(ckpt, finetune=False, load_optim=True, load_rng=True)
    assert len(notes) == 2 and "from 10" in notes[0] and "optimizer state" in notes[0] and "RNG" in notes[1]
    assert mc.resume_notes(ckpt, finetune=True, load_optim=False, load_rng=False) == []
    notes = mc.resume_notes(dataclasses.replace(ckpt, iteration=0, release=True), finetune=False, load_optim=True,
                            load_rng=False)
    assert notes == ["Megatron's optimizer state cannot be taken (optax state differs from Megatron's); it starts fresh"]


@pytest.mark.slow
def test_expert_tensor_parallel_above_tp_torch_dist(mcore_etp_over_tp):
    """TP1 x EP2 x ETP2 (4 ranks; torch_dist only: the legacy format cannot name ETP > TP files)."""
    ref, tokens = _megatron_logits(mcore_etp_over_tp)
    ckpt, _, graphdef, params = _load(os.path.join(mcore_etp_over_tp, "torch_dist"))
    assert ckpt.args["expert_tensor_parallel_size"] == 2 and ckpt.args["tensor_model_parallel_size"] == 1
    assert np.abs(_logits(graphdef, params, tokens) - ref).max() <= TOL


def test_legacy_writer_refuses_etp_above_tp(tmp_path):
    from mlir_train.families import get_model_config
    from sharding.layout import Layout

    cfg = get_model_config("qwen3-moe-tiny")
    with pytest.raises(mc.MegatronCheckpointError, match="must divide --tensor-model-parallel-size 1"):
        mc.save_legacy(None, None, cfg, str(tmp_path), Layout(tensor=1, expert=2, expert_tensor=2))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_mixed_dense_and_moe_layers(mcore_mixed, fmt):
    """--moe-layer-freq [0,1,1,0]: dense layers 0 and 3 around MoE layers 1-2 (TP2 x EP2); in
    torch_dist such heterogeneous blocks are stored one tensor per layer, not stacked."""
    ref, tokens = _megatron_logits(mcore_mixed)
    _, cfg, graphdef, params = _load(os.path.join(mcore_mixed, fmt))
    assert cfg.mlp_only_layers == (0, 3) and cfg.moe_layers() == (False, True, True, False)
    assert np.abs(_logits(graphdef, params, tokens) - ref).max() <= TOL


class _RunsCode:
    """What a hostile checkpoint pickles in its args: unpickling calls os.system(...)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(mcore_small, tmp_path, capsys, fmt):
    """A model_optim_rng.pt (or torch_dist common.pt) whose args reduce to os.system: convert and
    sft --load refuse it in one line naming the file and the global, and the command never runs."""
    import torch

    marker = tmp_path / "ran"
    dst = str(tmp_path / fmt)
    shutil.copytree(os.path.join(mcore_small, fmt), dst)
    target = next(os.path.join(root, f) for root, _, files in os.walk(dst) for f in files
                  if f in ("model_optim_rng.pt", "common.pt"))
    sd = torch.load(target, weights_only=False)
    sd["args"].hostile = _RunsCode(f"touch {marker}")
    torch.save(sd, target)
    assert convert.main([dst, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and target in err[0] and ("posix.system" in err[0] or "os.system" in err[0]), err
    assert "never" in err[0] and not marker.exists()
    with pytest.raises(SystemExit) as exc:
        sft.main(_argv(tmp_path, "--load", dst, "--train-iters", "1"))
    assert exc.value.code == 2 and not marker.exists()
    assert "system, which reading a Megatron checkpoint never loads" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_stub_unpickler_refuses_code_and_keeps_data():
    """The unpickler alone: containers, numpy arrays, Namespace and torch dtypes come back as data;
    Megatron's classes and torch functions as inert stubs; builtins.eval / os.system refused."""
    import argparse

    import torch

    from mlir_train.checkpoint.megatron import read

    def load(obj):
        return read._unpickler_for("x.pt")(__import__("io").BytesIO(pickle.dumps(obj))).load()

    ns = argparse.Namespace(a=1, dtype=torch.bfloat16, arr=np.arange(3, dtype=np.float32), act=torch.nn.functional.gelu)
    got = load({"args": ns, "s": {1, 2}})
    assert got["args"].a == 1 and got["args"].dtype is torch.bfloat16 and got["s"] == {1, 2}
    np.testing.assert_array_equal(got["args"].arr, np.arange(3, dtype=np.float32))
    assert "stub" in repr(got["args"].act)
    for hostile in (_RunsCode("true"),):
        with pytest.raises(read.UnsafePickleError, match=r"x\.pt: its pickle names (posix|os)\.system"):
            load({"args": hostile})

    class Evil:
        def __reduce__(self):
            return (eval, ("1 + 1",))

    with pytest.raises(read.UnsafePickleError, match="builtins.eval"):
        load(Evil())
