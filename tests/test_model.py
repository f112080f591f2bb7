"""Model-level properties: MoE paths agree, remat changes nothing, every param is annotated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from mlir_train.config import MODELS, ModelConfig, get_model_config
from mlir_train.model import Qwen3, init_model, logical_axes
from mlir_train.model.layers import apply_rope, rope_tables
from sharding.rules import LOGICAL_AXES

TINY = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=2)


def _tokens(b=2, t=32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, TINY.vocab_size, (b, t)), jnp.int32)


def _loss_and_grads(model: Qwen3, ids, segment_ids=None):
    graphdef, state = nnx.split(model)

    def loss_fn(state):
        m = nnx.merge(graphdef, state)
        logits, stats = m(ids, segment_ids=segment_ids, return_router_stats=True)
        return jnp.mean(jax.nn.logsumexp(logits, -1)) + 0.01 * jnp.sum(stats["probs_per_expert"] ** 2)

    return jax.jit(jax.value_and_grad(loss_fn))(state)


@pytest.mark.parametrize("impl", ["padded", "ragged"])
def test_fast_moe_paths_equal_reference(impl):
    ids = _tokens()
    seg = jnp.asarray(np.array([[1] * 20 + [2] * 8 + [0] * 4, [1] * 32]), jnp.int32)
    ref = _loss_and_grads(init_model(TINY, moe_impl="dense"), ids, seg)
    got = _loss_and_grads(init_model(TINY, moe_impl=impl), ids, seg)
    np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)


def test_padded_dropless_fallback_when_an_expert_overflows():
    # Route everything to one expert: the static capacity guess overflows, lax.cond must
    # take the C = S branch and still drop nothing.
    model = init_model(TINY, moe_impl="padded")
    ref = init_model(TINY, moe_impl="dense")
    for m in (model, ref):
        for stack in m.layers:
            # A zero router ties all experts; top_k then picks experts 0 and 1 for every token.
            stack.mlp.router[...] = jnp.zeros_like(stack.mlp.router[...])
    ids = _tokens(seed=1)
    out, stats = model(ids, return_router_stats=True)
    assert float(stats["tokens_per_expert"][0, 0]) == ids.size  # every token chose expert 0 (and 1)
    assert float(stats["dropped_tokens"].sum()) == 0
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(ids)), atol=1e-5)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_factor_drops_and_counts(policy):
    model = init_model(TINY, moe_impl="padded", capacity_factor=0.5, drop_policy=policy)
    _, stats = model(_tokens(), return_router_stats=True)
    k, e = TINY.top_k, TINY.num_experts
    capacity = int(np.ceil(0.5 * 64 * k / e))
    counts = np.asarray(stats["tokens_per_expert"])
    expected_drops = np.maximum(counts - capacity, 0).sum(-1)
    np.testing.assert_allclose(np.asarray(stats["dropped_tokens"]), expected_drops)
    assert expected_drops.sum() > 0


@pytest.mark.parametrize("remat", ["full", "selective"])
def test_remat_policies_do_not_change_gradients(remat):
    ids = _tokens(seed=2)
    ref = _loss_and_grads(init_model(TINY), ids)
    got = _loss_and_grads(init_model(TINY, remat=remat), ids)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


def test_every_param_has_known_logical_axes():
    for cfg in (TINY, get_model_config("qwen3-tiny", vocab_size=512)):
        model = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
        axes = logical_axes(model)
        shapes = nnx.state(model, nnx.Param)
        for names, var in zip(
            jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)),
            jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, nnx.Variable)),
        ):
            assert len(names) == len(var.shape), (names, var.shape)
            assert set(names) <= set(LOGICAL_AXES), names


def test_layers_are_scanned_not_unrolled():
    cfg = TINY.replace(num_layers=8)
    model = init_model(cfg)
    graphdef, state = nnx.split(model)
    hlo = jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids)).lower(state, _tokens()).as_text()
    # One scanned body: a while loop, and the attention einsum appears once, not 8 times.
    assert "while" in hlo
    assert hlo.count("bkgts") <= 2


def test_mixed_dense_and_moe_layers_follow_hf_rules():
    cfg = TINY.replace(num_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert cfg.layer_kinds() == (False, True, False, False, False, True)
    model = init_model(cfg)
    assert model.stack_kinds == ((0, 1, False), (1, 1, True), (2, 3, False), (5, 1, True))
    _, stats = model(_tokens(), return_router_stats=True)
    assert stats["tokens_per_expert"].shape == (2, TINY.num_experts)


def test_rope_linear_interpolation_matches_hf():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    hf_cfg = Qwen3Config(head_dim=16, hidden_size=64, num_attention_heads=4, rope_theta=1e6,
                         rope_scaling={"rope_type": "linear", "factor": 4.0})
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    assert cfg.rope_scaling_factor == 4.0 and cfg.rope_theta == 1e6
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 10, 16)).astype(np.float32)  # HF layout [B, N, T, H]
    pos = np.arange(10)[None]
    cos, sin = Qwen3RotaryEmbedding(hf_cfg)(torch.from_numpy(q), torch.from_numpy(pos))
    ref, _ = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q), cos, sin)
    c, s = rope_tables(jnp.asarray(pos), 16, cfg.rope_theta, cfg.rope_scaling_factor)
    ours = apply_rope(jnp.asarray(q.transpose(0, 2, 1, 3)), c, s)
    np.testing.assert_allclose(np.asarray(ours).transpose(0, 2, 1, 3), ref.numpy(), atol=1e-5)


def test_registry_has_release_values():
    moe = MODELS["qwen3-30b-a3b"]
    assert (moe.hidden_size, moe.num_layers, moe.num_heads, moe.num_kv_heads, moe.head_dim) == (2048, 48, 32, 4, 128)
    assert (moe.num_experts, moe.top_k, moe.moe_intermediate_size, moe.norm_topk_prob) == (128, 8, 768, True)
    assert round(moe.num_params() / 1e9, 1) == 30.5
    assert round(MODELS["qwen3-235b-a22b"].num_params() / 1e9) == 235
    assert MODELS["qwen3-0.6b"].tie_word_embeddings and not MODELS["qwen3-8b"].tie_word_embeddings
    assert all(c.vocab_size == 151936 for n, c in MODELS.items() if "tiny" not in n)
    assert get_model_config("qwen3-30b-a3b", num_layers=4, top_k=2).num_layers == 4
    with pytest.raises(ValueError, match="Did you mean 'qwen3-30b-a3b'"):
        get_model_config("qwen3-30b-a3")
