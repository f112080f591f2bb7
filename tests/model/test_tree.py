"""The parameter-tree vocabulary (:mod:`mlir_train.model.tree`): a template or a mask cuts a
tree into its trained part and the frozen rest, and the two go back together unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from mlir_train.config.policies import LoRAPolicy
from mlir_train.families import build_model, get_model_config
from mlir_train.model import ModelOptions, tree
from mlir_train.model.lora import trained_part

WEIGHTS = {"embed": jnp.ones((4, 2)),
           "layers": {0: {"attn": {"q": jnp.ones((2, 2)), "q_lora": {"a": jnp.ones((2, 1)), "b": jnp.zeros((1, 2))}},
                          "mlp": {"up": jnp.ones((2, 3))}}},
           "head": jnp.ones((2, 4))}
ADAPTERS = {"layers": {0: {"attn": {"q_lora": {"a": None, "b": None}}}}}  # a template: keys only


def test_select_and_drop_cut_a_tree_in_two_and_merge_puts_it_back():
    trained, frozen = tree.select(WEIGHTS, ADAPTERS), tree.drop(WEIGHTS, ADAPTERS)
    assert trained == {"layers": {0: {"attn": {"q_lora": WEIGHTS["layers"][0]["attn"]["q_lora"]}}}}
    assert "q_lora" not in frozen["layers"][0]["attn"] and "mlp" in frozen["layers"][0]
    assert jax.tree.structure(tree.merge(frozen, trained)) == jax.tree.structure(WEIGHTS)
    assert tree.contains(WEIGHTS, ADAPTERS) and not tree.contains(frozen, ADAPTERS)
    assert tree.contains(WEIGHTS, {}) and tree.select(WEIGHTS, WEIGHTS) == WEIGHTS


def test_drop_removes_the_dicts_it_empties():
    assert tree.drop({"a": {"b": 1}, "c": 2}, {"a": {"b": None}}) == {"c": 2}


def test_template_functions_take_any_leaves():
    """Specs and logical-axis tuples are leaves (a ``jax.tree`` walk would open the tuples)."""
    axes = {"layers": {0: {"attn": {"q": ("embed", None), "q_lora": {"a": ("embed", None), "b": (None, "heads")}}}}}
    assert tree.select(axes, ADAPTERS)["layers"][0]["attn"]["q_lora"]["b"] == (None, "heads")
    specs = {"head": PartitionSpec(None, "tensor"), "layers": {0: {"attn": {"q_lora": {"a": PartitionSpec()}}}}}
    assert tree.drop(specs, ADAPTERS) == {"head": PartitionSpec(None, "tensor")}


def test_merge_prefers_the_second_trees_leaves():
    assert tree.merge({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}, "d": 4}) == {"a": {"b": 3, "c": 2}, "d": 4}


def test_split_returns_the_same_arrays_and_join_undoes_it():
    """1F1B keeps frozen weights out of its residuals by their ``id``: no copies."""
    where = tree.mask(WEIGHTS, ADAPTERS)
    assert where["layers"][0]["attn"]["q_lora"] == {"a": True, "b": True} and where["embed"] is False
    kept, rest = tree.split(WEIGHTS, where)
    assert kept["layers"][0]["attn"]["q_lora"]["a"] is WEIGHTS["layers"][0]["attn"]["q_lora"]["a"]
    assert rest["head"] is WEIGHTS["head"] and kept["head"] is None and rest["layers"][0]["attn"]["q_lora"]["a"] is None
    joined = tree.join(kept, rest)
    assert all(a is b for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(WEIGHTS)))
    assert tree.prune(kept) == tree.select(WEIGHTS, ADAPTERS)


def test_mask_of_no_template_keeps_everything():
    assert all(jax.tree.leaves(tree.mask(WEIGHTS, None)))
    kept, rest = tree.split(WEIGHTS, tree.mask(WEIGHTS, None))
    assert tree.prune(rest) == {} and jax.tree.structure(kept) == jax.tree.structure(WEIGHTS)


def test_a_lora_models_adapters_and_base_make_the_model():
    """On a real model: the adapters' template cuts its weights into the adapters (every A and B)
    and a base that is exactly the plain model's tree."""
    cfg = get_model_config("qwen3-moe-tiny", vocab_size=64, num_layers=2)
    model = build_model(cfg, ModelOptions(lora=LoRAPolicy(dim=2, alpha=4.0)), abstract=True)
    weights, adapters = nnx.to_pure_dict(nnx.state(model)), trained_part(model)
    plain = nnx.to_pure_dict(nnx.state(build_model(cfg, ModelOptions(), abstract=True)))
    assert jax.tree.structure(tree.drop(weights, adapters)) == jax.tree.structure(plain)
    assert {p[-1].key for p, _ in jax.tree.leaves_with_path(tree.select(weights, adapters))} == {"a", "b"}
    assert jax.tree.structure(tree.merge(tree.drop(weights, adapters), tree.select(weights, adapters))) == \
        jax.tree.structure(weights)
