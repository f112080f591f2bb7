"""megatron-core itself as the oracle for what we re-implement of Megatron's formulas.

megatron-core 0.16.1 (PyPI) runs here on CPU in this one process (a one-rank gloo group, the
shims of ``tests/mcore_cpu.py``), and is compared on the same inputs with:

* the LR and weight-decay schedule (``OptimizerParamScheduler``, built as Megatron-LM's
  ``training.get_optimizer_param_scheduler`` builds it) for the seed script's flags over 5000
  iterations and for every other decay style;
* the MoE switch load-balancing loss and router z-loss: the functions
  (``switch_load_balancing_loss_func``, ``z_loss_func``) and the ``TopKRouter``'s own losses,
  values and router-weight gradients, on the same routing (with padding tokens);
* a few optimizer steps of a tiny Qwen3-MoE ``GPTModel`` driven by megatron-core's own
  micro-batch schedule, DDP gradient finalisation, optimizer (Adam with the seed's betas, eps,
  weight decay and clipping) and scheduler, against our trainer from the same weights: the
  loss and grad norm of every iteration within 1e-4 relative, under Megatron's default loss
  normalisation and under ``--calculate-per-token-loss``.

Timing (2 shared cores): importing megatron-core takes ~30 s of the module's time.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mcore_cpu  # skips the module without torch / megatron-core
from mlir_train import cli, losses
from mlir_train.config import get_model_config
from mlir_train.optim import optimizer_from_args
from mlir_train.schedule import schedule_from_args

torch = mcore_cpu.torch


@pytest.fixture(scope="module", autouse=True)
def megatron_on_cpu():
    mcore_cpu.initialize(seed=0)
    with mcore_cpu.CudaToCpu():
        yield


# ----- LR and weight-decay schedule -----------------------------------------------------------

SEED_TRAINING_FLAGS = [  # the seed script's TRAINING_ARGS that shape the schedule
    "--lr", "1.0e-5", "--min-lr", "1.0e-6", "--lr-decay-style", "cosine", "--lr-decay-iters", "5000",
    "--lr-warmup-fraction", "0.002", "--train-iters", "50", "--weight-decay", "0.1", "--global-batch-size", "128",
    "--micro-batch-size", "1", "--seq-length", "2048",
]


class _ParamGroups:
    """The optimizer the scheduler writes its rates into: one default param group."""

    def __init__(self):
        self.param_groups = [{"default_config": True}]


def _megatron_scheduler(args):
    """``OptimizerParamScheduler`` as Megatron-LM's ``get_optimizer_param_scheduler`` builds it
    for iteration-based training (steps counted in samples); Megatron's defaults for the
    weight-decay increment (``--start/--end-weight-decay`` = ``--weight-decay``, constant)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.global_batch_size
    decay_steps = (args.lr_decay_iters or args.train_iters) * gbs
    warmup_steps = (args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None
                    else args.lr_warmup_iters * gbs)
    wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs
    opt = _ParamGroups()
    sched = OptimizerParamScheduler(
        opt, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
        wsd_decay_steps=wsd, lr_wsd_decay_style=args.lr_wsd_decay_style)
    return sched, opt.param_groups[0]


def _compare_schedules(argv, iterations):
    args, _ = cli.parse_args(argv)
    ours = schedule_from_args(args)
    sched, group = _megatron_scheduler(args)
    want = []
    for _ in range(iterations + 1):  # the rate of update i is set after i successful steps
        want.append(group["lr"])
        assert group["weight_decay"] == args.weight_decay
        sched.step(increment=args.global_batch_size)
    want = np.asarray(want)
    python = np.asarray([ours.lr_at(i) for i in range(iterations + 1)])
    traced = np.asarray(jax.jit(jax.vmap(ours))(jnp.arange(iterations + 1)))
    np.testing.assert_allclose(python, want, rtol=1e-12, atol=0)
    np.testing.assert_allclose(traced, want, rtol=2e-6, atol=0)  # what optax applies, float32
    return args, want


def test_seed_schedule_equals_megatrons_over_5000_iterations():
    args, want = _compare_schedules(SEED_TRAINING_FLAGS, 5000)
    assert want[0] == 0.0 and want[10] == pytest.approx(1e-5) and want[5000] == pytest.approx(1e-6)
    # and the optimizer built from these flags applies that schedule with Megatron's constant
    # weight decay (Megatron's get_wd with --weight-decay-incr-style constant)
    opt = optimizer_from_args(args, schedule_from_args(args))
    params = {"w": jnp.ones((2, 2))}
    state = opt.init(params)
    grads = {"w": jnp.zeros((2, 2))}
    for i in range(12):  # zero gradients: each update is the decoupled decay -lr_i * wd * w
        updates, state = opt.update(grads, state, params)
        np.testing.assert_allclose(np.asarray(updates["w"]), -want[i] * 0.1, rtol=1e-5, atol=1e-14)


OTHER_STYLES = {
    "linear-warmup-iters": ["--lr-decay-style", "linear", "--lr-warmup-iters", "7", "--lr-warmup-init", "1e-6"],
    "constant": ["--lr-decay-style", "constant", "--lr-warmup-iters", "3"],
    "inverse-square-root": ["--lr-decay-style", "inverse-square-root", "--lr-warmup-iters", "5"],
    "inverse-square-root-no-warmup": ["--lr-decay-style", "inverse-square-root"],
    **{f"WSD-{s}": ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "30", "--lr-wsd-decay-style", s,
                    "--lr-warmup-fraction", "0.05"]
       for s in ("exponential", "linear", "cosine", "minus_sqrt")},
}


@pytest.mark.parametrize("style", list(OTHER_STYLES))
def test_other_decay_styles_equal_megatrons(style):
    argv = ["--lr", "3e-4", "--min-lr", "3e-5", "--train-iters", "100", "--lr-decay-iters", "80",
            "--weight-decay", "0.01", "--global-batch-size", "16", *OTHER_STYLES[style]]
    _compare_schedules(argv, 120)  # past --lr-decay-iters too


# ----- MoE aux loss and z-loss ---------------------------------------------------------------

E, K, H, SEQ, ROWS = 8, 2, 32, 12, 3


def _routing_inputs():
    rng = np.random.default_rng(0)
    x_BTD = rng.standard_normal((ROWS, SEQ, H)).astype(np.float32)
    w_DE = (0.3 * rng.standard_normal((H, E))).astype(np.float32)
    valid_BT = np.ones((ROWS, SEQ), bool)
    valid_BT[0, -4:] = False  # padding (segment id 0)
    valid_BT[2, -1:] = False
    return x_BTD, w_DE, valid_BT


def _our_router_losses(x_BTD, w_DE, valid_BT, aux_coeff, z_coeff):
    """Our MoE block's routing statistics -> coeff * aux loss + coeff * z-loss, and the router
    gradient of that sum."""
    from flax import nnx

    from mlir_train.model.moe import MoE

    cfg = get_model_config("qwen3-moe-tiny", hidden_size=H, num_experts=E, top_k=K)
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(MoE(cfg, nnx.Rngs(0), out_std=0.02))
    state = nnx.to_pure_dict(state)

    def total(w):
        block = nnx.merge(graphdef, {**state, "router": w})
        _, _, stats = block.route(jnp.asarray(x_BTD).reshape(-1, H), jnp.asarray(valid_BT).reshape(-1))
        aux, z = losses.switch_aux_loss_per_layer(stats, K), losses.z_loss_per_layer(stats)
        return aux_coeff * aux + z_coeff * z, (aux, z)

    (_, (aux, z)), grad = jax.value_and_grad(total, has_aux=True)(jnp.asarray(w_DE))
    return float(aux), float(z), np.asarray(grad)


def test_aux_and_z_loss_functions_equal_megatrons():
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func, z_loss_func

    x_BTD, w_DE, valid_BT = _routing_inputs()
    aux, z, _ = _our_router_losses(x_BTD, w_DE, valid_BT, 1.0, 1.0)
    valid = torch.from_numpy(valid_BT.reshape(-1))
    logits = torch.from_numpy(x_BTD.reshape(-1, H) @ w_DE)[valid]  # padding excluded, as ours does
    scores = torch.softmax(logits, dim=-1)
    routing = torch.zeros_like(scores).scatter(1, torch.topk(scores, K, dim=1).indices, 1.0)
    want_aux = switch_load_balancing_loss_func(scores, routing.sum(0), logits.shape[0], K, E, moe_aux_loss_coeff=1.0)
    want_z = z_loss_func(logits, 1.0)
    np.testing.assert_allclose(aux, float(want_aux), rtol=1e-5)
    np.testing.assert_allclose(z, float(want_z), rtol=1e-5)


def test_topk_router_losses_and_gradients_equal_megatrons():
    """The router module end to end: Megatron's TopKRouter (softmax after top-k, aux_loss
    balancing, z-loss, a padding mask) logs the same per-layer losses we log and gives the
    router weight the same gradient from them."""
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        clear_aux_losses_tracker,
        get_default_pg_collection,
        get_moe_layer_wise_logging_tracker,
    )
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    aux_coeff, z_coeff = 1e-2, 1e-3
    x_BTD, w_DE, valid_BT = _routing_inputs()
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
        moe_aux_loss_coeff=aux_coeff, moe_z_loss_coeff=z_coeff, moe_router_load_balancing_type="aux_loss",
        moe_router_pre_softmax=False, moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
        add_bias_linear=False, params_dtype=torch.float32)
    router = TopKRouter(config, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    router.train()
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w_DE.T.copy()))
    clear_aux_losses_tracker()
    x = torch.from_numpy(x_BTD.transpose(1, 0, 2).copy())  # Megatron's [seq, batch, hidden]
    padding = torch.from_numpy(~valid_BT.T.copy())  # True = padding, as its loss functions read it
    probs, _ = router(x, padding_mask=padding)
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    (probs * 0).sum().backward()  # only the attached aux / z-loss gradients reach the weight
    tracker = get_moe_layer_wise_logging_tracker()
    want_aux = float(tracker["load_balancing_loss"]["values"][0])
    want_z = float(tracker["z_loss"]["values"][0])
    aux, z, grad = _our_router_losses(x_BTD, w_DE, valid_BT, aux_coeff, z_coeff)
    np.testing.assert_allclose(aux, want_aux, rtol=1e-5)
    np.testing.assert_allclose(z, want_z, rtol=1e-5)
    want_grad = router.weight.grad.numpy().T
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-5 * np.abs(want_grad).max())
    assert np.abs(want_grad).max() > 0
