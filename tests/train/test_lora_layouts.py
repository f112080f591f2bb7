"""LoRA trains exactly like one device in every layout, and only the adapters train.

One optimizer step of the tiny MoE (and dense) model with adapters on every target (attention,
dense MLP, per-expert or shared expert adapters), from the same seed on the same packed batch,
on one device and on a layout of the 8 fake CPU devices, compared as ``tests/train/test_layouts.py``
compares full training (:func:`tests.helpers.assert_step_matches`: loss, grad norm, the adapter
gradients read from Adam's first moment, the updated adapters). The adapters' B starts random
here (peft's and ours start at zero, which leaves A without gradient on the first step and
would make the comparison vacuous for A).

Also checked on every layout: the state's ``params`` and optimizer moments are the adapters
only, the frozen base comes back bit-identical, and Megatron's semantics hold with LoRA on:
clipping (the grad norm is above the clip, 1.0) and the LR schedule act on the adapters alone.

Default suite: TP2 x EP2 x SP with the distributed optimizer (MoE) and TP2 + SP (dense); the
other layouts (DP, EP x TP with shared expert adapters, FSDP, ETP, PP under 1F1B, interleaved 1F1B
and GPipe, context parallelism with TP + SP) are ``slow``.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from mlir_train.model import ModelOptions
from mlir_train.families import get_model_config
from mlir_train.config.policies import LoRAPolicy
from sharding.layout import Layout
from tests.helpers import MODELS, assert_step_matches, named_leaves, random_lora_b, train_one_step

PER_EXPERT = LoRAPolicy(dim=4, alpha=128)  # scaling 32: a grad norm above the clip (1.0)
SHARED = LoRAPolicy(dim=4, alpha=128, expert_adapters="shared")
DEEP = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=4)  # pipeline stages of 2 layers
CFGS = {"moe": MODELS["moe"], "dense": MODELS["dense"], "deep": DEEP}

# (model, policy, layout, the pipeline schedule's arguments: helpers.pipeline_schedule)
FAST = {
    "moe-TP2xEP2-SP-distopt": ("moe", PER_EXPERT, Layout(tensor=2, expert=2, sequence_parallel=True,
                                                          distributed_optimizer=True), {}),
}
SLOW = {
    "dense-TP2-SP": ("dense", PER_EXPERT, Layout(tensor=2, sequence_parallel=True), {}),
    "moe-DP8-shared": ("moe", SHARED, Layout(), {}),
    "moe-EP4xTP2-shared": ("moe", SHARED, Layout(tensor=2, expert=4), {}),
    "moe-FSDP8": ("moe", PER_EXPERT, Layout(fsdp=True), {}),
    "moe-TP1xEP2xETP2": ("moe", PER_EXPERT, Layout(expert=2, expert_tensor=2), {}),
    "deep-PP2xTP2-1f1b": ("deep", PER_EXPERT, Layout(pipeline=2, tensor=2), {}),
    "deep-PP2-interleaved": ("deep", PER_EXPERT, Layout(pipeline=2), {"virtual": 1}),
    "deep-PP2xEP2-gpipe": ("deep", PER_EXPERT, Layout(pipeline=2, expert=2), {"kind": "gpipe"}),
    "moe-CP2xTP2-SP": ("moe", PER_EXPERT, Layout(context=2, tensor=2, sequence_parallel=True), {}),
    "dense-CP2xTP2-SP": ("dense", PER_EXPERT, Layout(context=2, tensor=2, sequence_parallel=True), {}),
}


@functools.cache
def _run(model: str, policy: LoRAPolicy, layout: Layout | None, pipeline: tuple):
    return train_one_step(CFGS[model], layout, ModelOptions(lora=policy), init=random_lora_b, pipeline=dict(pipeline))


def _check(name: str, cases: dict):
    model, policy, layout, pipeline = cases[name]
    pipeline = tuple(sorted(pipeline.items()))
    ref = _run(model, policy, None, pipeline)
    got = _run(model, policy, layout, pipeline)
    assert_step_matches(got, ref, moe=model != "dense")
    # Only the adapters train: params and Adam's moments are adapter-shaped, the base is unchanged.
    names = [p for p, _ in named_leaves(got.params)]
    assert names and all(p.endswith(("/a", "/b")) and "lora" in p for p in names), names[:5]
    assert [p for p, _ in named_leaves(got.adam_mu)] == names
    for (path, a), (_, b) in zip(named_leaves(jax.device_get(got.state["base"])),
                                 named_leaves(jax.device_get(ref.state["base"]))):
        np.testing.assert_array_equal(a, b, err_msg=f"frozen base {path}")


@pytest.mark.parametrize("name", sorted(FAST))
def test_lora_step_matches_single_device(name):
    _check(name, FAST)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_lora_step_matches_single_device_slow(name):
    _check(name, SLOW)


def test_frozen_base_is_untouched_and_in_the_compute_dtype():
    """One bf16 step: the base is held in bfloat16 and comes back bit-identical; the adapters
    alone hold float32 master weights and moments."""
    res = train_one_step(MODELS["moe"], None, ModelOptions(lora=PER_EXPERT), step={"compute_dtype": "bfloat16"},
                         init=random_lora_b)
    state = jax.device_get(res.state)
    init = res.trainer.init_state(3)  # SEED: the base init_state gives, before the step
    base0 = jax.device_get(init["base"])
    for (path, a), (_, b) in zip(named_leaves(state["base"]), named_leaves(base0)):
        assert a.dtype == np.dtype("bfloat16") or path.endswith("expert_bias"), path
        np.testing.assert_array_equal(a, b, err_msg=path)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state["params"]))
    assert res.metrics["grad-norm"] > 0


@pytest.mark.parametrize("per_token", [False, True], ids=["per-micro-batch", "per-token"])
def test_megatron_semantics_unchanged(per_token):
    """With LoRA on: the loss is the base model's (B = 0 at the start) under either Megatron
    normalisation; the grad norm is the adapters' global L2 norm, clipped to 1.0 as Megatron
    clips; the update is Megatron's AdamW at the schedule's LR on the adapters alone."""
    from tests.helpers import BETA1, LR

    base = train_one_step(MODELS["moe"], None, per_token=per_token)
    lora = train_one_step(MODELS["moe"], None, ModelOptions(lora=PER_EXPERT), per_token=per_token)
    for key in ("lm loss", "load_balancing_loss", "loss tokens"):
        assert lora.metrics[key] == pytest.approx(base.metrics[key], rel=1e-6), key
    # B = 0: only the Bs have a gradient on the first step; A's is exactly zero.
    mu = dict(named_leaves(lora.adam_mu))
    assert all(not np.any(g) for p, g in mu.items() if p.endswith("/a"))
    g = {p: m / (1 - BETA1) for p, m in mu.items()}  # the clipped gradient (first step: mu = (1 - b1) g)
    norm = lora.metrics["grad-norm"]
    clipped_norm = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in g.values()))
    assert clipped_norm == pytest.approx(norm * min(1.0, 1.0 / (norm + 1e-6)), rel=1e-4)
    # first AdamW step: p - lr * (g / (|g| + eps) + wd * p), bias corrections cancelling
    for (path, p0), (_, p1) in zip(named_leaves(lora.init_params), named_leaves(lora.params)):
        want = p0 - LR * (g[path] / (np.abs(g[path]) + 1e-8) + 0.1 * p0)
        np.testing.assert_allclose(p1, want, rtol=0, atol=1e-3 * LR, err_msg=path)
