"""Expert parallelism: all-to-all dispatch over the expert axis equals the single-device model.

Compiles are the cost on CPU, so each mesh compiles one program that returns the logits,
router stats and gradients together, and the dispatch-only checks use a lone MoE block.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from mlir_train.model import init_model, logical_axes
from mlir_train.model.moe import block as moe_lib
from sharding import Layout
from tests.helpers import B, COMPILER_OPTIONS, T, TINY_MOE, moe_block, moe_block_inputs, run_moe_block


MESHES = {
    "EP2xDP4": Layout(expert=2, num_devices=8),
    "EP4xTP2": Layout(expert=4, tensor=2, num_devices=8),
    "EP8": Layout(expert=8, num_devices=8),
    "TP2xEP2xDP2": Layout(tensor=2, expert=2, num_devices=8),
}


def _inputs():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, TINY_MOE.vocab_size, (B, T)), jnp.int32)
    # Two packed documents and some padding, so padding exclusion in the stats is exercised.
    seg = np.ones((B, T), np.int32)
    seg[0, 9:] = 2
    seg[1, 12:] = 0
    return ids, jnp.asarray(seg)


def _step(graphdef, ids, seg):
    def loss_fn(state):
        logits, stats = nnx.merge(graphdef, state)(ids, segment_ids=seg, return_router_stats=True)
        aux = jnp.sum(stats["probs_per_expert"] * stats["tokens_per_expert"]) / jnp.sum(stats["num_tokens"]) ** 2
        return jnp.mean(jax.nn.logsumexp(logits, -1)) + 0.1 * aux, (logits, stats)

    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


@pytest.fixture(scope="module")
def reference():
    model = init_model(TINY_MOE, moe_impl="padded")
    graphdef, state = nnx.split(model)
    ids, seg = _inputs()
    return model, graphdef, state, _step(graphdef, ids, seg).lower(state).compile(COMPILER_OPTIONS)(state)


@pytest.mark.parametrize("name", list(MESHES))
def test_expert_parallel_model_equals_one_device(name, reference):
    model, graphdef, state, ((ref_loss, (ref_logits, ref_stats)), ref_grads) = reference
    cfg = MESHES[name]
    mesh, rules = sharding.make_mesh(cfg), sharding.rules_for(cfg)
    ids, seg = _inputs()
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        state = jax.device_put(state, sharding.tree_shardings(logical_axes(model), rules, mesh))
        compiled = _step(graphdef, ids, seg).lower(state).compile(COMPILER_OPTIONS)
        (loss, (logits, stats)), grads = compiled(state)
    assert "all-to-all" in compiled.as_text()
    # Experts really are split: each device holds E / EP of them.
    gate = state["layers"][0]["mlp"]["gate_proj"][...]
    assert gate.addressable_shards[0].data.shape[1] == TINY_MOE.num_experts // cfg.expert

    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=1e-5)
    assert set(stats) == set(ref_stats)
    for key in ref_stats:  # global-batch router stats, not per-rank ones
        assert stats[key].shape == ref_stats[key].shape, key
        np.testing.assert_allclose(np.asarray(stats[key]), np.asarray(ref_stats[key]), rtol=1e-5, atol=1e-5, err_msg=key)
    assert float(stats["dropped_tokens"].sum()) == 0  # dropless by default
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_logical_axis_lookup():
    assert sharding.mesh_axes_of("exp") == ((), 1)  # no rules, no mesh: single-device paths
    cfg = MESHES["TP2xEP2xDP2"]
    with jax.set_mesh(sharding.make_mesh(cfg)), sharding.use_rules(sharding.rules_for(cfg)):
        assert sharding.mesh_axes_of("exp") == (("expert",), 2)
        assert sharding.mesh_axes_of("act_tokens") == (("data", "expert"), 4)
        assert sharding.mesh_axes_of("moe_mlp") == (("tensor",), 2)
    cfg = Layout(tensor=2, num_devices=8)
    with jax.set_mesh(sharding.make_mesh(cfg)), sharding.use_rules(sharding.rules_for(cfg)):
        assert sharding.mesh_axes_of("exp") == ((), 1)


# ----- the dispatch alone, on one MoE block -----------------------------------------------------


def test_capacity_is_per_rank_as_in_megatron():
    """With a capacity factor, each rank keeps at most C = ceil(cf * S_local * K / E) of *its own*
    tokens per expert (Megatron's drop is per rank too), so the EP run equals the single-device
    block applied to each rank's token chunk separately, and counts the same drops. Which
    assignments a rank drops (by probability or position) is the local padded path's rule,
    tested in test_model.py."""
    cfg = MESHES["TP2xEP2xDP2"]
    ranks = 4  # token chunks: data x expert
    block = moe_block(impl="padded", capacity_factor=0.5, drop_policy="probs")
    x, valid = moe_block_inputs()
    (_, (y, stats)), hlo = run_moe_block(block, x, valid, cfg)
    assert "all-to-all" in hlo

    s_local = B * T // ranks
    chunks = [
        run_moe_block(block, xc[None], vc[None])[0][1]
        for xc, vc in zip(x.reshape(ranks, s_local, -1), valid.reshape(ranks, s_local))
    ]
    ref_y = jnp.concatenate([c[0].reshape(s_local, -1) for c in chunks]).reshape(x.shape)
    ref_dropped = sum(float(c[1]["dropped_tokens"]) for c in chunks)
    assert ref_dropped > 0
    assert float(stats["dropped_tokens"]) == ref_dropped
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), atol=1e-5, rtol=1e-5)


def test_dropless_fallback_and_ragged_dispatch():
    """Padded dispatch with every token routed to the experts of rank 0 (the capacity guess
    overflows, the lax.cond takes the worst-case buffer), and the ragged_all_to_all dispatcher
    (run here through a dense emulation of ragged_all_to_all, which XLA:CPU lacks), both equal
    the dense reference, values and gradients."""
    cfg = MESHES["EP4xTP2"]
    x, valid = moe_block_inputs()

    skewed = moe_block(impl="padded")
    skewed.router[...] = jnp.zeros_like(skewed.router[...])  # ties: experts 0 and 1 for every token
    ref_skewed = moe_block(impl="dense")
    ref_skewed.router[...] = skewed.router[...]
    (_, (y, stats)), _ = run_moe_block(skewed, x, valid, cfg)
    (_, (ref_y, _)), _ = run_moe_block(ref_skewed, x, valid)
    assert float(stats["tokens_per_expert"][0]) == int(valid.sum())
    assert float(stats["dropped_tokens"]) == 0
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), atol=1e-5, rtol=1e-5)

    ragged = moe_block(impl="ragged", ragged_all_to_all=moe_lib.ragged_all_to_all_dense)
    ((_, (y, _)), grads), hlo = run_moe_block(ragged, x, valid, cfg, grads=True)
    ((_, (ref_y, _)), ref_grads), _ = run_moe_block(moe_block(impl="dense"), x, valid, grads=True)
    assert "all-to-all" in hlo
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)
