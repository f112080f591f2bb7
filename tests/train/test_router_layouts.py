"""The router variants train exactly like one device under DP, EP x TP and PP, and the expert
bias is train state: moved by each step's load, split like the layers, saved and restored.

One variant carries everything new at once, to keep compiles few: sigmoid scores with
group-limited routing (4 groups, 2 per token, top-4) and the aux-loss-free expert bias, with
``seq_aux_loss`` on packed documents, ``global_aux_loss`` over the step's two micro-batches and
the z-loss. One optimizer step on ``tests/train/test_layouts.py``'s packed batch (1-3 documents per
row and a padded tail), compared with the one-device step as there: losses and grad norm rtol
1e-5, the gradients (Adam's first moment) within 1e-5 of each tensor's largest, and the updated
expert bias exactly (it moves by +-rate from integer counts, so any layout error flips a sign).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from mlir_train.model import ModelOptions
from mlir_train.config import policies
from mlir_train.checkpoint import orbax as checkpoint
from mlir_train.config.policies import RouterConfig
from mlir_train.train.optim import make_optimizer
from mlir_train.train.schedule import megatron_lr_schedule
from mlir_train.train.trainer import StepConfig, model_dims
from mlir_train.train.build import build_trainer
from sharding.mesh import make_mesh, validate
from sharding.layout import Layout
from tests.helpers import (COMPILER_OPTIONS, MICRO, MODELS, SEQ, SEED, adam_mu, named_leaves, packed_batch, pipeline_schedule,
                           sft_args)

ROUTER = RouterConfig(score_function="sigmoid", num_groups=4, group_topk=2, enable_expert_bias=True,
                      per_sequence_stats=True)
BALANCING = policies.LoadBalancing(coeffs=(("seq_aux_loss", 1e-2), ("global_aux_loss", 1e-2)), z_loss_coeff=1e-3)
RATE = 1e-2
LAYOUTS = {
    "DP8": Layout(),
    "EP4xTP2": Layout(tensor=2, expert=4),
    "PP2xEP2xDP2": Layout(pipeline=2, expert=2),  # the default 1F1B schedule
    "PP2xEP2xDP2-gpipe": Layout(pipeline=2, expert=2),
}
PIPELINE_SCHEDULE = {"PP2xEP2xDP2-gpipe": "gpipe"}  # else Megatron's default (1f1b)
# Pure DP is also inside PP2xEP2xDP2 (two data ranks); its own 8-rank run is the slow one.
SLOW = {"DP8", "PP2xEP2xDP2", "PP2xEP2xDP2-gpipe"}  # GPipe itself is tested in tests/train/test_pipeline.py
SINGLE = "1 device"


# Sinkhorn balancing (no aux loss; z-loss only), top-2.
SINKHORN = RouterConfig(sinkhorn=True)
SINKHORN_BALANCING = policies.LoadBalancing(z_loss_coeff=1e-3, sinkhorn=True)


def make_trainer(layout: str, router: RouterConfig = ROUTER, balancing: policies.LoadBalancing = BALANCING, top_k: int = 4):
    cfg = MODELS["moe"].replace(top_k=top_k)
    if layout == SINGLE:
        parallel = Layout(num_devices=1)
        mesh = make_mesh(parallel, devices=jax.devices()[:1])
    else:
        parallel = validate(LAYOUTS[layout], model_dims(cfg), seq_length=SEQ)
        mesh = make_mesh(parallel)
    schedule = megatron_lr_schedule(lr=1e-3, min_lr=1e-4, train_iters=10, lr_decay_style="cosine", lr_warmup_iters=0)
    optimizer = make_optimizer(lr_schedule=schedule, weight_decay=0.1, beta1=0.9, beta2=0.95, clip_grad=1.0)
    return build_trainer(cfg, StepConfig(num_micro_batches=MICRO, balancing=balancing, expert_bias_update_rate=RATE),
                         optimizer, parallel, mesh, options=ModelOptions(router=router),
                         schedule=pipeline_schedule(cfg, parallel, MICRO, PIPELINE_SCHEDULE.get(layout, "1f1b")))


@functools.cache
def run(layout: str, variant: str = "bias"):
    trainer = (make_trainer(layout) if variant == "bias" else
               make_trainer(layout, SINKHORN, SINKHORN_BALANCING, top_k=2))
    cfg = trainer.model_cfg
    state = trainer.init_state(SEED)
    batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in packed_batch(cfg.vocab_size).items()}
    compiled = trainer.lower_train_step(state, batch).compile(COMPILER_OPTIONS)
    state, metrics = compiled(state, batch)
    return trainer, state, jax.device_get(metrics)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
                                    for name in LAYOUTS])
def test_router_variants_match_single_device(layout):
    _, ref_state, ref = run(SINGLE)
    _, state, got = run(layout)
    for key in ("lm loss", "grad-norm", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss"):
        assert ref[key] > 0, key
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(got["tokens_per_expert"], ref["tokens_per_expert"])
    per_layer = [k for k in ref if k.endswith(" per layer")]
    assert len(per_layer) == 4, per_layer
    for name in per_layer:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, err_msg=name)
    params, ref_params = jax.device_get(state["params"]), jax.device_get(ref_state["params"])
    for (path, a), (_, b) in zip(named_leaves(adam_mu(state["opt_state"])), named_leaves(adam_mu(ref_state["opt_state"]))):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(np.abs(b).max(), 1e-30), err_msg=f"gradient {path}")
    bias, ref_bias = params["layers"][0]["mlp"]["expert_bias"], ref_params["layers"][0]["mlp"]["expert_bias"]
    np.testing.assert_array_equal(bias, ref_bias)


@pytest.mark.parametrize("layout", ["EP4xTP2", pytest.param("PP2xEP2xDP2", marks=pytest.mark.slow)])
def test_sinkhorn_matches_single_device_and_evaluates_without_balancing(layout):
    _, ref_state, ref = run(SINGLE, "sinkhorn")
    trainer, state, got = run(layout, "sinkhorn")
    for key in ("lm loss", "grad-norm", "z_loss"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(got["tokens_per_expert"], ref["tokens_per_expert"])
    for (path, a), (_, b) in zip(named_leaves(adam_mu(state["opt_state"])), named_leaves(adam_mu(ref_state["opt_state"]))):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(np.abs(b).max(), 1e-30), err_msg=f"gradient {path}")
    # Evaluation routes by the plain softmax top-k (Megatron's eval mode): the same eval loss as
    # a pre-softmax top-2 router on the same weights, and not the training routing.
    plain = make_trainer(layout, RouterConfig(pre_softmax=True), policies.LoadBalancing(z_loss_coeff=1e-3), top_k=2)
    batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in packed_batch(trainer.model_cfg.vocab_size).items()}
    got_eval = jax.device_get(trainer.eval_step(state["params"], batch))
    want_eval = jax.device_get(plain.eval_step(state["params"], batch))
    np.testing.assert_allclose(got_eval["ce_sum"], want_eval["ce_sum"], rtol=1e-6)
    assert trainer.eval_graphdef is not trainer.graphdef


def test_expert_bias_moves_against_the_load_and_is_checkpointed(tmp_path):
    trainer, state, metrics = run(SINGLE)
    load = np.asarray(metrics["tokens_per_expert"])  # [L, E], summed over the step's micro-batches
    bias = np.asarray(jax.device_get(state["params"])["layers"][0]["mlp"]["expert_bias"])
    mean = load.mean(axis=-1, keepdims=True)
    np.testing.assert_array_equal(bias, np.float32(RATE) * np.sign(mean - load).astype(np.float32))
    assert np.abs(bias).sum() > 0
    # No gradient reaches it: Adam's first moment of the bias is zero.
    mu = adam_mu(state["opt_state"])["layers"][0]["mlp"]["expert_bias"]
    assert not np.any(np.asarray(mu))
    # Saved with the weights, restored as it was.
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ck"), max_to_keep=1)
    assert mgr.save(1, state, {"model": trainer.model_cfg.as_dict()}, force=True)
    mgr.close()
    restored = checkpoint.CheckpointManager(str(tmp_path / "ck"), read_only=True).restore(
        {"params": trainer.abstract_state()["params"]})
    np.testing.assert_array_equal(np.asarray(restored["params"]["layers"][0]["mlp"]["expert_bias"]), bias)


def test_per_layer_logging_tags_are_megatrons():
    from mlir_train.train.metrics import router_scalars

    cfg = MODELS["moe"].replace(num_layers=3, mlp_only_layers=(0,))  # MoE layers 1 and 2
    m = {"load_balancing_loss": 0.02, "z_loss": 0.001, "dropped_tokens": 0.0, "ep_overflow_rows": 3.0,
         "load_balancing_loss per layer": np.array([1.5, 2.5]), "z_loss per layer": np.array([3.0, 4.0])}
    assert router_scalars(m, cfg) == {"load_balancing_loss": 0.02, "z_loss": 0.001, "dropped tokens": 0.0,
                                      "ep overflow rows": 3.0, "ep further rounds": 0.0}
    tags = router_scalars(m, cfg, per_layer=True)
    assert tags["moe/load_balancing_loss_layer_1"] == 1.5 and tags["moe/load_balancing_loss_layer_2"] == 2.5
    assert tags["moe/z_loss_layer_2"] == 4.0 and "moe/z_loss_layer_0" not in tags


@pytest.mark.slow  # ~100 s on 2 busy cores: data preprocessing and a bf16 step compile
def test_cli_router_flags_train_in_bf16_and_log_per_layer(tmp_path, capsys):
    """The Megatron flags end to end: a list of balancing types with one coefficient each, sigmoid
    group-limited routing with the expert bias, in bf16 (the bias stays float32) with the router in fp64, per-layer logs."""
    import json
    import os

    from mlir_train.sft import main

    flags = ["--train-iters", "2", "--eval-interval", "0", "--bf16", "--lr-warmup-iters", "0",
             "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "global_aux_loss",
             "--moe-aux-loss-coeff", "1e-2", "1e-3", "1e-2", "--moe-z-loss-coeff", "1e-3",
             "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             "--moe-router-bias-update-rate", "1e-2", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
             "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp64", "--moe-per-layer-logging"]
    args = sft_args(tmp_path, *flags)
    args[args.index("--eval-iters") + 1] = "0"  # no eval step to compile
    args[args.index("--moe-aux-loss-coeff"):args.index("--moe-aux-loss-coeff") + 2] = []  # the list replaces it
    out = main(args)
    text = capsys.readouterr().out
    assert "seq_load_balancing_loss:" in text and "global_load_balancing_loss:" in text
    records = [json.loads(line) for line in open(tmp_path / "tb" / "metrics.jsonl")]
    last = [r for r in records if "lm loss" in r][-1]
    for name in ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss"):
        assert np.isfinite(last[name]) and last[name] > 0, name
        assert {f"moe/{name}_layer_{i}" for i in range(2)} <= set(last), name
    bias = out.state["params"]["layers"][0]["mlp"]["expert_bias"]
    steps = np.asarray(bias) / 1e-2  # two updates of +-1e-2 each (0 on a tie with the mean)
    assert bias.dtype == np.float32 and np.any(steps != 0)
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-5)
    assert np.abs(steps).max() <= 2 + 1e-5
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


@pytest.mark.parametrize("flags,message", [
    (["--moe-router-load-balancing-type", "sinkhorn"], "takes no aux loss"),  # sft_args sets a coefficient
    (["--moe-router-enable-expert-bias"], "--moe-router-score-function sigmoid"),
    (["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], "one per type"),
    (["--moe-router-group-topk", "2"], "--moe-router-num-groups"),
])
def test_cli_refuses_router_settings_by_flag(tmp_path, capsys, flags, message):
    from mlir_train.sft import main

    with pytest.raises(SystemExit):
        main(sft_args(tmp_path, "--train-iters", "1", *flags))
    assert message in capsys.readouterr().err
