"""The LR schedule equals Megatron-LM's OptimizerParamScheduler at every iteration."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mlir_train.config import cli
from mlir_train.train.schedule import LRSchedule, megatron_lr_schedule
from mlir_train.train import build


class MegatronScheduler:
    """A direct re-statement of Megatron's stateful scheduler (written for this test): built
    the way training.py builds it for iteration-based runs, counting samples, advanced by
    ``global_batch_size`` after every successful step."""

    def __init__(self, lr, min_lr, train_iters, decay_iters, gbs, style, warmup_iters=0,
                 warmup_fraction=None, init_lr=0.0, wsd_iters=None, wsd_style=None):
        self.max_lr, self.min_lr, self.init_lr, self.style, self.wsd_style = lr, min_lr, init_lr, style, wsd_style
        self.decay = (decay_iters or train_iters) * gbs
        self.warmup = warmup_fraction * self.decay if warmup_fraction is not None else warmup_iters * gbs
        self.wsd = None if wsd_iters is None else wsd_iters * gbs
        self.gbs, self.num_steps = gbs, 0

    def step(self):
        self.num_steps += self.gbs

    def get_lr(self):
        n = self.num_steps
        if self.warmup > 0 and n <= self.warmup:
            return self.init_lr + (self.max_lr - self.init_lr) * float(n) / float(self.warmup)
        if self.style == "constant":
            return self.max_lr
        if n > self.decay:
            return self.min_lr
        if self.style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * max(self.warmup, 1) ** 0.5 / max(n, 1) ** 0.5)
        r = float(n - self.warmup) / float(self.decay - self.warmup)
        delta = self.max_lr - self.min_lr
        if self.style == "linear":
            c = 1.0 - r
        elif self.style == "cosine":
            c = 0.5 * (math.cos(math.pi * r) + 1.0)
        else:
            start = self.decay - self.wsd
            if n <= start:
                c = 1.0
            else:
                w = float(n - start) / float(self.wsd)
                c = {
                    "linear": lambda: 1.0 - w,
                    "cosine": lambda: 0.5 * (math.cos(math.pi * w) + 1.0),
                    "exponential": lambda: 2.0 * math.pow(0.5, w) - 1.0,
                    "minus_sqrt": lambda: 1.0 - math.sqrt(w),
                }[self.wsd_style]()
        return self.min_lr + c * delta


CASES = [
    dict(style="constant", warmup_iters=7),
    dict(style="linear", warmup_iters=7),
    dict(style="linear", warmup_iters=0),
    dict(style="cosine", warmup_fraction=0.1),
    dict(style="cosine", warmup_fraction=0.015),  # 1.5 iterations of warmup
    dict(style="cosine", warmup_iters=5, init_lr=1e-4),
    dict(style="inverse-square-root", warmup_iters=9),
    dict(style="inverse-square-root", warmup_iters=0),
    dict(style="WSD", warmup_iters=5, wsd_iters=30, wsd_style="exponential"),
    dict(style="WSD", warmup_iters=5, wsd_iters=30, wsd_style="linear"),
    dict(style="WSD", warmup_fraction=0.05, wsd_iters=25, wsd_style="cosine"),
    dict(style="WSD", warmup_iters=0, wsd_iters=40, wsd_style="minus_sqrt"),
]


def _ours(case, lr, min_lr, train_iters, decay_iters, gbs):
    return megatron_lr_schedule(
        lr=lr, min_lr=min_lr, train_iters=train_iters, lr_decay_iters=decay_iters,
        lr_decay_style=case["style"], lr_warmup_iters=case.get("warmup_iters", 0),
        lr_warmup_fraction=case.get("warmup_fraction"), lr_warmup_init=case.get("init_lr", 0.0),
        lr_wsd_decay_iters=case.get("wsd_iters"), lr_wsd_decay_style=case.get("wsd_style", "exponential"),
        global_batch_size=gbs,
    )


@pytest.mark.parametrize("gbs", [1, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_matches_megatron_every_iteration(case, gbs):
    lr, min_lr, train_iters, decay_iters = 3e-4, 3e-5, 130, 100
    ours = _ours(case, lr, min_lr, train_iters, decay_iters, gbs)
    ref = MegatronScheduler(
        lr, min_lr, train_iters, decay_iters, gbs, case["style"],
        warmup_iters=case.get("warmup_iters", 0), warmup_fraction=case.get("warmup_fraction"),
        init_lr=case.get("init_lr", 0.0), wsd_iters=case.get("wsd_iters"), wsd_style=case.get("wsd_style"),
    )
    expected = []
    for _ in range(train_iters + 1):  # lr of update k (0-based) is taken before the k-th advance
        expected.append(ref.get_lr())
        ref.step()
    expected = np.array(expected)
    py = np.array([ours.lr_at(i) for i in range(train_iters + 1)])
    np.testing.assert_allclose(py, expected, rtol=1e-12, atol=0)
    jx = np.asarray(jax.jit(jax.vmap(ours))(jnp.arange(train_iters + 1)))
    np.testing.assert_allclose(jx, expected, rtol=2e-6, atol=lr * 1e-6)


def test_seed_warmup_fraction():
    """The seed: --lr-warmup-fraction 0.002 of --lr-decay-iters 5000 -> 10 iterations."""
    cfg = cli.parse(
        "--lr 1.0e-5 --min-lr 1.0e-6 --train-iters 50 --lr-decay-iters 5000 --lr-decay-style cosine "
        "--lr-warmup-fraction 0.002 --global-batch-size 128 --micro-batch-size 1".split()
    )
    s = build.lr_schedule_of(cfg.training, cfg.training.global_batch_size)
    assert s.warmup_steps == pytest.approx(0.002 * 5000 * 128) and s.warmup_iters == pytest.approx(10)
    assert s.decay_steps == 5000 * 128
    assert s.lr_at(0) == 0.0
    assert s.lr_at(5) == pytest.approx(5e-6, rel=1e-12)
    assert s.lr_at(10) == pytest.approx(1e-5, rel=1e-12)
    r = (20 - 10) / (5000 - 10)
    assert s.lr_at(20) == pytest.approx(1e-6 + 0.5 * (math.cos(math.pi * r) + 1) * 9e-6, rel=1e-12)
    assert s.lr_at(6000) == 1e-6


def test_lr_decay_iters_defaults_to_train_iters():
    s = megatron_lr_schedule(lr=1.0, train_iters=40, lr_decay_style="linear")
    assert s.decay_steps == 40 and s.lr_at(40) == 0.0 and s.lr_at(20) == 0.5


def test_optax_uses_schedule_at_count():
    """optax's first update uses schedule(0), the k-th uses schedule(k): Megatron's order."""
    s = megatron_lr_schedule(lr=1.0, train_iters=10, lr_warmup_iters=4, lr_decay_style="linear")
    tx = optax.scale_by_learning_rate(s)
    state = tx.init(jnp.zeros(()))
    for k in range(8):
        upd, state = tx.update(jnp.ones(()), state)
        assert float(upd) == pytest.approx(-s.lr_at(k), rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr_warmup_iters=100), "shorter"),
        (dict(lr_decay_style="WSD"), "lr-wsd-decay-iters"),
        (dict(lr_decay_style="step"), "lr-decay-style"),
        (dict(min_lr=2.0), "min-lr"),
    ],
)
def test_megatron_asserts_become_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        megatron_lr_schedule(lr=1.0, train_iters=100, **kwargs)


def test_is_an_optax_schedule_under_jit():
    s = LRSchedule(max_lr=2.0, min_lr=0.0, warmup_steps=0, decay_steps=10, decay_style="linear")
    assert float(jax.jit(s)(jnp.int32(5))) == pytest.approx(1.0)
