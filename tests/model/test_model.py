"""Model-level properties: MoE paths agree, remat changes nothing, every param is annotated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs torch (HF reference models); the default lane has it")
from flax import nnx

from mlir_train.config.models import ModelConfig
from mlir_train.families import from_hf_config, get_model_config
from mlir_train.families.qwen3 import MODELS
from mlir_train.families import init_model
from mlir_train.families.qwen3 import Qwen3
from mlir_train.model import ModelOptions, logical_axes
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


@pytest.mark.parametrize("impl", ["padded", "padded-loop", "ragged"])
def test_fast_moe_paths_equal_reference(impl):
    # "padded-loop": the dropless block loop, which larger expert matmuls take.
    extra = {"moe_block_loop": True} if impl == "padded-loop" else {}
    ids = _tokens()
    seg = jnp.asarray(np.array([[1] * 20 + [2] * 8 + [0] * 4, [1] * 32]), jnp.int32)
    ref = _loss_and_grads(init_model(TINY, options=ModelOptions(moe_impl="dense")), ids, seg)
    got = _loss_and_grads(init_model(TINY, options=ModelOptions(moe_impl=impl.split("-")[0], **extra)), ids, seg)
    np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)


def test_padded_dropless_on_a_few_tokens_equals_reference():
    # Decoding-sized inputs take the [E, S, D] buffer instead of the blocked layout.
    ids = _tokens(b=1, t=3)
    ref = _loss_and_grads(init_model(TINY, options=ModelOptions(moe_impl="dense")), ids)
    got = _loss_and_grads(init_model(TINY, options=ModelOptions(moe_impl="padded")), ids)
    np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)


def test_padded_dropless_survives_the_most_unbalanced_routing():
    # Route every token to the same two experts: the blocked layout's static block count
    # must still hold them all (nothing dropped) and give the reference's output.
    model = init_model(TINY, options=ModelOptions(moe_impl="padded"))
    ref = init_model(TINY, options=ModelOptions(moe_impl="dense"))
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
    model = init_model(TINY, options=ModelOptions(moe_impl="padded", capacity_factor=0.5, drop_policy=policy))
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
    got = _loss_and_grads(init_model(TINY, options=ModelOptions(remat=remat)), ids)
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
    assert cfg.moe_layers() == (False, True, False, False, False, True)
    model = init_model(cfg)
    assert [(s.layers, s.moe) for s in model.stack_kinds] == [((0, 2, 3, 4), False), ((1, 5), True)]  # one stack per kind
    _, stats = model(_tokens(), return_router_stats=True)
    assert stats["tokens_per_expert"].shape == (2, TINY.num_experts)


def test_rope_linear_interpolation_matches_hf():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    hf_cfg = Qwen3Config(head_dim=16, hidden_size=64, num_attention_heads=4, rope_theta=1e6,
                         rope_scaling={"rope_type": "linear", "factor": 4.0})
    cfg = from_hf_config(hf_cfg.to_dict())
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


def _plain_attention(q_BTKGH, k_BSKH, v_BSKH, mask_BTS):
    """Autodiff reference: the textbook masked softmax attention."""
    s = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
    s = jnp.where(mask_BTS[:, None, None], s / np.sqrt(q_BTKGH.shape[-1]), jnp.finfo(jnp.float32).min)
    return jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(s, axis=-1).astype(v_BSKH.dtype), v_BSKH)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 3e-2)])
def test_attention_custom_gradient_equals_autodiff(dtype, tol):
    from mlir_train.model.attention import attention_mask, masked_attention

    rng = np.random.default_rng(0)
    b, t, k, g, h = 2, 24, 2, 3, 16
    q, do = (jnp.asarray(rng.normal(size=(b, t, k, g, h)), dtype) for _ in range(2))
    kk, v = (jnp.asarray(rng.normal(size=(b, t, k, h)), dtype) for _ in range(2))
    # Two packed documents and padding in row 0: the mask is causal within segments.
    mask = attention_mask(jnp.asarray([[1] * 14 + [2] * 6 + [0] * 4, [1] * 24], jnp.int32))

    def run(fn):
        out, vjp = jax.vjp(lambda q, kk, v: fn(q, kk, v, mask), q, kk, v)
        return (out,) + vjp(do)

    for got, want in zip(run(masked_attention), run(_plain_attention)):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


def test_fused_linear_cross_entropy_equals_autodiff():
    from mlir_train.model import losses

    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(2, 7, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 50)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 50, (2, 7)), jnp.int32)
    mask = jnp.asarray(rng.integers(0, 2, (2, 7)), jnp.float32)

    def fused(h, w):
        total, count = losses.linear_cross_entropy_sum(h, w, labels, mask)
        return 0.3 * total, count

    def plain(h, w):
        total, count = losses.cross_entropy_sum(jnp.einsum("btd,dv->btv", h, w), labels, mask)
        return 0.3 * total, count

    (got, got_n), got_g = jax.value_and_grad(fused, argnums=(0, 1), has_aux=True)(h, w)
    (want, want_n), want_g = jax.value_and_grad(plain, argnums=(0, 1), has_aux=True)(h, w)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert float(got_n) == float(want_n) == float(mask.sum())
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tokens,experts,top_k", [(64, 8, 2), (4096, 16, 4), (10, 64, 8)])
def test_blocked_moe_block_count_bounds_any_routing(tokens, experts, top_k):
    from mlir_train.model.moe.block import block_layout

    a = tokens * top_k
    b, n_blocks = block_layout(a, experts)
    assert 8 <= b <= 128 and b & (b - 1) == 0
    # The worst case for block padding: as many experts as possible hold one row each,
    # the rest go to one expert.
    for sizes in ([a - (experts - 1)] + [1] * (experts - 1), [a // experts] * experts):
        sizes[0] += a - sum(sizes)
        assert sum(-(-n // b) for n in sizes) <= n_blocks
