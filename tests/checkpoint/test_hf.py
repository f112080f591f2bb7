"""Parity with the reference nobody here wrote: transformers' Qwen3 / Qwen3-MoE in PyTorch.

A tiny random HF model is saved to a temp dir, loaded through ``load_pretrained`` in float32,
and its logits, LM loss and aux loss compared with HF's; then exported back and reloaded by
transformers. No golden files: the reference is computed in the test.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs torch (HF reference models); the default lane has it")
from flax import nnx
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from mlir_train.model import ModelOptions
from mlir_train.model import losses
from mlir_train.checkpoint.hf import CheckpointError, load_pretrained, save_pretrained
from sharding.rules import DATA_PARALLEL
from tests.helpers import perturb_torch

VOCAB = 256
TOL = 1e-4


def _moe_config(**kw) -> Qwen3MoeConfig:
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False, router_aux_loss_coef=0.01,
        max_position_embeddings=512,
    )
    base.update(kw)
    return Qwen3MoeConfig(**base)


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    torch.manual_seed(0)
    # Layer 0 is a dense MLP (mlp_only_layers): the importer must mix dense and MoE stacks.
    model = Qwen3MoeForCausalLM(_moe_config(mlp_only_layers=[0])).eval()
    perturb_torch(model, 1)
    path = str(tmp_path_factory.mktemp("hf_moe"))
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def hf_dense(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_theta=1e6, max_position_embeddings=512,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    perturb_torch(model, 2)
    path = str(tmp_path_factory.mktemp("hf_dense"))
    model.save_pretrained(path)
    return model, path


def _ids(batch=2, seq=24, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, seq)).astype(np.int32)


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.float().numpy()


@pytest.mark.parametrize("fixture", ["hf_moe", "hf_dense"])
def test_logits_match_hf(fixture, request):
    hf_model, path = request.getfixturevalue(fixture)
    ours = load_pretrained(path, dtype=jnp.float32)
    ids = _ids()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), _hf_logits(hf_model, ids), atol=TOL, rtol=0)


def test_lm_loss_and_aux_loss_match_hf(hf_moe):
    hf_model, path = hf_moe
    ours = load_pretrained(path, dtype=jnp.float32)
    ids = _ids(seed=3)
    with torch.no_grad():
        out = hf_model(torch.from_numpy(ids).long(), labels=torch.from_numpy(ids).long(), output_router_logits=True)
    logits, stats = ours(jnp.asarray(ids), return_router_stats=True)
    # HF shifts inside: position t predicts token t+1; the last position has no label.
    labels = np.concatenate([ids[:, 1:], np.zeros_like(ids[:, :1])], axis=1)
    mask = np.ones_like(ids, np.float32)
    mask[:, -1] = 0
    total, count = losses.cross_entropy_sum(logits, jnp.asarray(labels), jnp.asarray(mask))
    lm_loss = float(total / count)
    aux = float(losses.hf_aux_loss(stats))
    assert abs(aux - float(out.aux_loss)) < 1e-5
    # HF's `loss` already includes router_aux_loss_coef * aux_loss.
    assert abs(lm_loss + 0.01 * aux - float(out.loss)) < 1e-5
    # Two MoE layers (layer 0 is dense), each routing every token to top_k=2 experts.
    assert stats["tokens_per_expert"].shape == (2, 4)
    np.testing.assert_allclose(np.asarray(stats["tokens_per_expert"].sum(-1)), [2 * ids.size] * 2)


def test_megatron_aux_loss_is_one_when_balanced():
    stats = {
        "tokens_per_expert": jnp.full((1, 4), 2 * 8 / 4.0),  # 8 tokens, top-2, uniform
        "probs_per_expert": jnp.full((1, 4), 8 / 4.0),
        "num_tokens": jnp.array([8.0]),
    }
    np.testing.assert_allclose(np.asarray(losses.switch_aux_loss(stats, top_k=2)), [1.0], rtol=1e-6)


def test_packed_row_equals_documents_alone(hf_moe):
    _, path = hf_moe
    ours = load_pretrained(path, dtype=jnp.float32)
    a, b = _ids(1, 10, seed=5), _ids(1, 14, seed=6)
    packed = np.concatenate([a, b], axis=1)
    segment_ids = np.array([[1] * 10 + [2] * 14], np.int32)
    positions = np.array([list(range(10)) + list(range(14))], np.int32)
    out = np.asarray(ours(jnp.asarray(packed), segment_ids=jnp.asarray(segment_ids), positions=jnp.asarray(positions)))
    np.testing.assert_allclose(out[:, :10], np.asarray(ours(jnp.asarray(a))), atol=TOL, rtol=0)
    np.testing.assert_allclose(out[:, 10:], np.asarray(ours(jnp.asarray(b))), atol=TOL, rtol=0)


@pytest.mark.parametrize("fixture", ["hf_moe", "hf_dense"])
def test_save_pretrained_roundtrip_through_transformers(fixture, request, tmp_path):
    hf_model, path = request.getfixturevalue(fixture)
    ours = load_pretrained(path, dtype=jnp.float32)
    out_dir = str(tmp_path / "export")
    save_pretrained(ours, out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    ids = _ids(seed=7)
    ref = _hf_logits(hf_model, ids)
    np.testing.assert_allclose(_hf_logits(reloaded, ids), ref, atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), ref, atol=TOL, rtol=0)


def test_save_pretrained_shards_with_index(hf_moe, tmp_path):
    _, path = hf_moe
    ours = load_pretrained(path, dtype=jnp.float32)
    out_dir = str(tmp_path / "sharded")
    save_pretrained(ours, out_dir, dtype=jnp.bfloat16, max_shard_bytes=64 * 1024)
    index = json.load(open(os.path.join(out_dir, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    again = load_pretrained(out_dir, dtype=jnp.bfloat16)
    # Logits in bf16 can flip a near-tied top-k choice, so compare the weights exactly instead:
    # every reloaded tensor is the original rounded to bf16.
    before = nnx.to_flat_state(nnx.state(ours, nnx.Param))
    after = dict(nnx.to_flat_state(nnx.state(again, nnx.Param)))
    for path, var in before:
        got = after[path].get_value()
        assert got.dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(var.get_value().astype(jnp.bfloat16)), err_msg=str(path))


def test_reads_transformers5_fused_expert_layout(hf_moe, tmp_path):
    hf_model, path = hf_moe
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    # model.state_dict() holds transformers 5's in-memory fused layout.
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, str(fused_dir / "model.safetensors"))
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(str(fused_dir / "model.safetensors"))
    (fused_dir / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    ours = load_pretrained(str(fused_dir), dtype=jnp.float32)
    ids = _ids(seed=9)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), _hf_logits(hf_model, ids), atol=TOL, rtol=0)


def test_sharded_load_onto_mesh(hf_moe):
    hf_model, path = hf_moe
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rules = tuple((k, v) for k, v in DATA_PARALLEL if k != "vocab") + (("vocab", "data"),)
    ours = load_pretrained(path, dtype=jnp.float32, mesh=mesh, rules=rules)
    emb = ours.embed[...]
    assert emb.sharding.spec[0] == "data"
    assert emb.addressable_shards[0].data.shape == (VOCAB // 8, 64)
    ids = _ids(seed=10)
    with jax.set_mesh(mesh):
        out = np.asarray(ours(jnp.asarray(ids)))
    np.testing.assert_allclose(out, _hf_logits(hf_model, ids), atol=TOL, rtol=0)


def test_load_onto_pipeline_mesh_keeps_short_stacks_whole(hf_moe):
    """Under PP2 the dense layer-0 stack (1 layer) cannot split over the stages: it loads whole
    on each, the 2-layer MoE stack splits, and the model computes the same logits."""
    from sharding.mesh import make_mesh
    from sharding.layout import Layout
    from sharding.rules import rules_for

    hf_model, path = hf_moe
    parallel = Layout(pipeline=2, num_devices=8)
    mesh = make_mesh(parallel)
    ours = load_pretrained(path, dtype=jnp.float32, mesh=mesh, rules=rules_for(parallel))
    assert "stage" not in jax.tree.leaves(ours.layers[0].attn.q_proj[...].sharding.spec, is_leaf=lambda x: x is None)
    assert ours.layers[1].attn.q_proj[...].sharding.spec[0] == "stage"
    ids = _ids(seed=11)
    with jax.set_mesh(mesh):
        out = np.asarray(ours(jnp.asarray(ids)))
    np.testing.assert_allclose(out, _hf_logits(hf_model, ids), atol=TOL, rtol=0)


def _copy_with(src: str, dst, edit) -> str:
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    return str(dst)


def test_missing_tensor_is_named(hf_moe, tmp_path):
    _, path = hf_moe
    bad = _copy_with(path, tmp_path / "missing", lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight \(expected shape \(32, 64\)\)"):
        load_pretrained(bad, dtype=jnp.float32)


def test_misshaped_tensor_is_named(hf_moe, tmp_path):
    _, path = hf_moe

    def edit(t):
        t["model.layers.1.self_attn.q_proj.weight"] = t["model.layers.1.self_attn.q_proj.weight"][:, :60].contiguous()

    bad = _copy_with(path, tmp_path / "misshaped", edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight has shape \(64, 60\), expected \(64, 64\)"):
        load_pretrained(bad, dtype=jnp.float32)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_pretrained(str(tmp_path / "nope"))


def test_expert_bias_starts_at_zero_and_is_not_exported(hf_moe, tmp_path, capsys):
    """--moe-router-enable-expert-bias on an HF model: the bias (no HF tensor) starts at zero, and
    save_pretrained warns that a non-zero bias cannot be written (the HF model routes without it)."""
    from mlir_train.config.policies import RouterConfig

    hf, path = hf_moe
    model = load_pretrained(path, dtype=jnp.float32, options=ModelOptions(
        router=RouterConfig(score_function="sigmoid", enable_expert_bias=True)))
    stack = model.layers[1]  # layer 0 is dense
    assert stack.mlp.expert_bias[...].shape == (2, 4) and not np.any(np.asarray(stack.mlp.expert_bias[...]))
    stack.mlp.expert_bias[...] = jnp.full((2, 4), 0.01)
    save_pretrained(model, str(tmp_path / "out"))
    assert "expert bias" in capsys.readouterr().out
    reloaded = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "out"))  # no unexpected tensor
    np.testing.assert_array_equal(reloaded.model.layers[1].mlp.gate.weight.detach().numpy(),
                                  hf.model.layers[1].mlp.gate.weight.detach().numpy())
