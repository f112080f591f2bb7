"""Megatron training semantics of the compiled step and the CLI loop."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlir_train.model import flops
from mlir_train.model import losses
from mlir_train.config.policies import LoadBalancing
from mlir_train.families import get_model_config
from mlir_train.train.optim import LossScaler, make_optimizer
from mlir_train.train.schedule import megatron_lr_schedule
from mlir_train.train.trainer import StepConfig
from mlir_train.train.build import build_trainer
from sharding.mesh import make_mesh
from sharding.layout import Layout
from tests.helpers import sft_args

CFG = get_model_config("qwen3-moe-tiny", vocab_size=256, num_layers=2, hidden_size=64, intermediate_size=128)
SEQ = 32


def _one_device_trainer(num_micro, cfg=CFG, loss_scaler=None, compute_dtype="float32", lr=1e-3, aux=1e-2,
                        per_token=False, micro_batch_size=1, lm_loss_report="objective"):
    parallel = Layout(num_devices=1)
    mesh = make_mesh(parallel, devices=jax.devices()[:1])
    opt = make_optimizer(lr_schedule=megatron_lr_schedule(lr=lr, train_iters=10), weight_decay=0.1, clip_grad=1.0)
    step_cfg = StepConfig(num_micro_batches=num_micro, balancing=LoadBalancing.from_flags("aux_loss", aux, z_loss_coeff=aux / 10),
                          compute_dtype=compute_dtype,
                          per_token_loss=per_token, micro_batch_size=micro_batch_size, lm_loss_report=lm_loss_report)
    return build_trainer(cfg, step_cfg, opt, parallel, mesh, loss_scaler=loss_scaler)


def _batch(rows=8, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (rows, SEQ)).astype(np.int32)
    seg = np.ones_like(ids)
    seg[:, SEQ // 2:] = 2
    seg[0, -5:] = 0  # padding
    pos = np.concatenate([np.arange(SEQ // 2), np.arange(SEQ - SEQ // 2)])[None].repeat(rows, 0).astype(np.int32)
    # Very uneven loss-token counts per row: row r has about 3 * r loss tokens.
    mask = np.zeros_like(ids, np.float32)
    for r in range(rows):
        mask[r, : 3 * r + 1] = 1.0
    mask[seg == 0] = 0
    return dict(input_ids=ids, labels=np.roll(ids, -1, 1), loss_mask=mask, segment_ids=seg, positions=pos)


def _micro(batch, num_micro):
    return {k: v.reshape(num_micro, v.shape[0] // num_micro, *v.shape[1:]) for k, v in batch.items()}


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def step_results():
    """One step with GBS 8 as 8 micro-batches of 1, and as 1 micro-batch of 8, with
    ``--calculate-per-token-loss`` (the normalisation over the whole global batch).

    Router losses are off: they are formed from per-micro-batch statistics (in Megatron too), so
    only the LM loss and its gradients are invariant to how the batch is split.
    """
    out = {}
    batch = _batch()
    for num_micro in (8, 1):
        trainer = _one_device_trainer(num_micro, aux=0.0, per_token=True)
        state = trainer.init_state(seed=0)
        new_state, metrics = trainer.train_step(state, trainer.shard_batch(_micro(batch, num_micro)))
        out[num_micro] = (trainer, jax.device_get(new_state), jax.device_get(metrics))
    return out


def test_gradient_accumulation_equals_one_big_batch(step_results):
    _, s8, m8 = step_results[8]
    _, s1, m1 = step_results[1]
    np.testing.assert_allclose(m8["lm loss"], m1["lm loss"], rtol=1e-6)
    np.testing.assert_allclose(m8["grad-norm"], m1["grad-norm"], rtol=1e-5)
    # Adam's moments hold the (clipped) gradients themselves: they must agree tightly.
    for a, b in zip(_leaves(s8["opt_state"]), _leaves(s1["opt_state"])):
        np.testing.assert_allclose(a, b, atol=1e-8, rtol=1e-4)
    # Adam's first update is about lr * g / |g|, so a weight whose gradient is ~1e-9 can move by
    # a visible fraction of lr on rounding noise; bound that by a small fraction of lr = 1e-3.
    for a, b in zip(_leaves(s8["params"]), _leaves(s1["params"])):
        np.testing.assert_allclose(a, b, atol=5e-5)


def test_loss_is_normalised_over_all_loss_tokens_of_the_global_batch(step_results):
    trainer, _, metrics = step_results[8]
    batch = _batch()
    model = trainer.model(trainer.init_state(seed=0)["params"])
    logits = model(jnp.asarray(batch["input_ids"]), segment_ids=jnp.asarray(batch["segment_ids"]),
                   positions=jnp.asarray(batch["positions"]))
    total, count = losses.cross_entropy_sum(logits, jnp.asarray(batch["labels"]), jnp.asarray(batch["loss_mask"]))
    per_row_mean = np.mean([
        float(losses.cross_entropy_sum(logits[r:r + 1], jnp.asarray(batch["labels"][r:r + 1]),
                                       jnp.asarray(batch["loss_mask"][r:r + 1]))[0]) / batch["loss_mask"][r].sum()
        for r in range(8)
    ])
    np.testing.assert_allclose(metrics["lm loss"], float(total / count), rtol=1e-5)
    assert abs(float(metrics["lm loss"]) - per_row_mean) > 1e-3  # the mean of micro means would differ
    assert metrics["loss tokens"] == batch["loss_mask"].sum()


def _reference_objective(trainer, params, batch, group_rows: int | None) -> tuple[float, float]:
    """The LM objective written out by hand on the unsplit batch, and the L2 norm of its
    gradient: the mean over groups of ``group_rows`` rows of (group CE sum / group loss
    tokens), or, with ``group_rows=None``, the global CE sum / global loss tokens."""
    from flax import nnx

    def objective(p):
        model = nnx.merge(trainer.graphdef, p)
        logits = model(jnp.asarray(batch["input_ids"]), segment_ids=jnp.asarray(batch["segment_ids"]),
                       positions=jnp.asarray(batch["positions"]))
        labels, mask = jnp.asarray(batch["labels"]), jnp.asarray(batch["loss_mask"])
        if group_rows is None:
            total, count = losses.cross_entropy_sum(logits, labels, mask)
            return total / count
        rows = range(0, logits.shape[0], group_rows)
        parts = [losses.cross_entropy_sum(logits[r:r + group_rows], labels[r:r + group_rows], mask[r:r + group_rows])
                 for r in rows]
        return sum(t / jnp.maximum(c, 1.0) for t, c in parts) / len(parts)

    value, grads = jax.jit(jax.value_and_grad(objective))(params)
    return float(value), float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))


@pytest.mark.parametrize("micro_batch_size,num_micro,report", [
    (1, 2, "objective"), pytest.param(2, 2, "objective", marks=pytest.mark.slow),
    pytest.param(4, 1, "token-mean", marks=pytest.mark.slow)])
def test_default_loss_is_megatrons_mean_of_micro_batch_means(micro_batch_size, num_micro, report):
    """Without --calculate-per-token-loss every data-parallel micro-batch (``--micro-batch-size``
    rows) is normalised by its own loss tokens and the micro-batches are averaged, however the
    global batch is cut into accumulation steps: the step's gradient is that of the hand-written
    mean of group means, and the logged ``lm loss`` is that mean (AIAK's SFT report), or the
    global token mean as Megatron-LM reports it (``--training-phase pretrain``)."""
    batch = _batch()
    trainer = _one_device_trainer(num_micro, aux=0.0, micro_batch_size=micro_batch_size, lm_loss_report=report)
    state = trainer.init_state(seed=0)
    params = jax.device_get(state["params"])
    _, metrics = trainer.train_step(state, trainer.shard_batch(_micro(batch, num_micro)))
    value, norm = _reference_objective(trainer, params, batch, micro_batch_size)
    token_mean, per_token_norm = _reference_objective(trainer, params, batch, None)
    np.testing.assert_allclose(float(metrics["grad-norm"]), norm, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["lm loss"]), value if report == "objective" else token_mean, rtol=1e-5)
    # the rows' very uneven token counts make the two normalisations differ
    assert abs(norm - per_token_norm) > 1e-2 * norm and abs(value - token_mean) > 1e-4  # CE ~ log(V) at init


def test_loss_token_weights():
    mask = np.zeros((2, 4, 3), np.float32)
    mask[0, 0, :2] = 1  # micro 0: rows 0-1 hold 2 tokens, rows 2-3 hold 3
    mask[0, 3, :] = 1
    mask[1, 1, :1] = 1  # micro 1: rows 0-1 hold 1 token, rows 2-3 none (weight 0, no division by 0)
    w = np.asarray(losses.loss_token_weights(jnp.asarray(mask), micro_batch_size=2, per_token=False))
    np.testing.assert_allclose(w[0, 0, :2], 1 / 2 / 4)
    np.testing.assert_allclose(w[0, 3], 1 / 3 / 4)
    np.testing.assert_allclose(w[1, 1, 0], 1 / 1 / 4)
    assert w.sum() == pytest.approx(3 / 4) and np.all(w[mask == 0] == 0)
    w = np.asarray(losses.loss_token_weights(jnp.asarray(mask), micro_batch_size=2, per_token=True))
    np.testing.assert_allclose(w, mask / mask.sum())
    with pytest.raises(ValueError, match="--micro-batch-size 3"):
        losses.loss_token_weights(jnp.asarray(mask), micro_batch_size=3, per_token=False)


def test_the_trainer_takes_what_the_run_resolved():
    """The pipeline schedule, the router (its balancing groups: the data-parallel micro-batch) and
    the load balancing are resolved once, from the flags, and handed down as they are."""
    from mlir_train import families
    from mlir_train.config import cli
    from mlir_train.train.build import build_trainer, resolve

    cfg = cli.parse(["--model-name", "qwen3-moe-tiny", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                     "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "32",
                     "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--lr", "1e-3", "--train-iters", "1"])
    run = resolve(cfg, families.from_flags(cfg.model, 256), num_devices=2, platform="cpu")
    assert run.options.router.balancing_rows == 2 and run.step.balancing.z_loss_coeff == 1e-3
    trainer = run.trainer()
    assert trainer.schedule is run.schedule and trainer.step.schedule is run.schedule
    assert trainer.options.router is run.options.router and trainer.step_cfg is run.step
    # Callers without flags: the one builder fills in what they leave out.
    parallel = Layout(pipeline=2, num_devices=2)
    plain = build_trainer(run.model, StepConfig(num_micro_batches=4, micro_batch_size=3), layout=parallel,
                          mesh=make_mesh(parallel, devices=jax.devices()[:2]))
    assert plain.schedule.kind == "1f1b" and plain.schedule.stages == 2 and plain.options.router.balancing_rows == 3


def test_fp16_overflow_skips_the_step_and_backs_off():
    scaler = LossScaler(initial_scale=2.0**100, hysteresis=1)  # scaled loss overflows fp16
    trainer = _one_device_trainer(1, loss_scaler=scaler, compute_dtype="float16")
    state = trainer.init_state(seed=0)
    before = _leaves(state["params"])
    state, metrics = trainer.train_step(state, trainer.shard_batch(_micro(_batch(), 1)))
    assert int(metrics["skipped"]) == 1
    for a, b in zip(before, _leaves(state["params"])):
        np.testing.assert_array_equal(a, b)
    assert float(state["loss_scale"].scale) == 2.0**99


def test_bf16_keeps_float32_master_weights():
    trainer = _one_device_trainer(1, compute_dtype="bfloat16")
    state = trainer.init_state(seed=0)
    state, metrics = trainer.train_step(state, trainer.shard_batch(_micro(_batch(), 1)))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state["params"]))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0)
    assert np.isfinite(float(metrics["lm loss"]))


def test_flops_formula_against_xla_cost_analysis():
    """Our Megatron-formula FLOPs vs XLA's count for a dense model (MoE padding would skew XLA's).

    XLA also counts elementwise work (norms, softmax, optimizer), so it is allowed to be a little
    above the formula, never below it by more than the attention-halving Megatron applies.
    """
    # One layer and one micro-batch: XLA's cost analysis counts a while-loop body once, not per
    # trip, so scanned layers and micro-batches would be under-counted by their trip counts.
    cfg = get_model_config("qwen3-tiny", vocab_size=512, num_layers=1, hidden_size=256, intermediate_size=1024,
                           num_heads=4, num_kv_heads=2, head_dim=64)
    rows, seq = 4, 128
    trainer = _one_device_trainer(1, cfg=cfg)
    state = trainer.abstract_state()
    batch = {k: jax.ShapeDtypeStruct((1, rows, seq), jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=trainer.batch_sharding) for k in _batch()}
    compiled = trainer.lower_train_step(state, batch).compile()
    cost = compiled.cost_analysis()
    xla_flops = float((cost[0] if isinstance(cost, list) else cost)["flops"])
    ours = flops.num_floating_point_operations(cfg, seq, rows)
    ratio = xla_flops / ours
    assert 0.95 < ratio < 1.5, ratio


def test_cli_run_loss_falls_and_writes_tensorboard_and_metrics(tmp_path, capsys):
    from mlir_train.sft import main

    out = main(sft_args(tmp_path, "--train-iters", "12", "--eval-interval", "12", "--log-timers-to-tensorboard",
                         "--distributed-backend", "nccl"))
    text = capsys.readouterr().out
    assert "ignoring flags that mean nothing under JAX/XLA: --distributed-backend" in text
    assert "lm loss:" in text and "grad norm:" in text and "validation loss at iteration 12" in text
    losses_ = [l for _, l in out.history["lm loss"]]
    assert np.mean(losses_[-3:]) < losses_[0] - 1.0
    records = [json.loads(l) for l in open(tmp_path / "tb" / "metrics.jsonl")]
    assert [r["iteration"] for r in records if "lm loss" in r] == list(range(1, 13))
    for key in ("lm loss", "learning-rate", "grad-norm", "load_balancing_loss", "iteration-time", "expert-load",
                "timers/data-wait"):
        assert key in records[-2] or key in records[-1], key
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


@pytest.mark.slow  # ~22 s cold; bf16 through the CLI is also in test_router_layouts' CLI test
def test_cli_bf16_with_expert_parallelism_runs(tmp_path):
    """Regression: XLA:CPU's all-reduce-promotion pass used to abort bf16 EP steps (sft.py skips it)."""
    from mlir_train.sft import main

    out = main(sft_args(tmp_path, "--train-iters", "2", "--eval-interval", "0", "--bf16", "--lr-warmup-iters", "0",
                         "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"))
    assert all(np.isfinite(l) for _, l in out.history["lm loss"])


def test_cli_nan_check_names_the_iteration(tmp_path, capsys):
    """A non-finite loss stops the run with status 1 (a failed run, not bad input) and one error line."""
    from mlir_train.sft import main

    with pytest.raises(SystemExit) as stop:
        main(sft_args(tmp_path, "--train-iters", "6", "--eval-interval", "0", "--lr", "1e30",
                       "--lr-warmup-iters", "0", "--clip-grad", "0"))
    assert stop.value.code == 1
    assert re.search(r"mlir-train: error: iteration \d+: lm loss .* not finite", capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "ckpt")


def test_cli_rejects_bad_batch_split(tmp_path, capsys):
    from mlir_train.sft import main

    with pytest.raises(SystemExit):
        main(sft_args(tmp_path, "--train-iters", "2", "--global-batch-size", "12"))
    assert "--global-batch-size" in capsys.readouterr().err
