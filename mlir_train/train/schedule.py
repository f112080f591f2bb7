"""Learning-rate schedule with Megatron-LM's ``OptimizerParamScheduler.get_lr`` semantics.

Megatron counts scheduler steps in *samples*, also for iteration-based runs: after every
successful optimizer step it advances by ``global_batch_size``, and ``training.py`` builds

    lr_decay_steps  = lr_decay_iters * global_batch_size      (lr_decay_iters defaults to train_iters)
    lr_warmup_steps = lr_warmup_fraction * lr_decay_steps      if --lr-warmup-fraction
                    = lr_warmup_iters * global_batch_size      otherwise
    wsd_decay_steps = lr_wsd_decay_iters * global_batch_size

We keep those sample counts (``samples_per_iter = global_batch_size``) so the edge cases —
a fractional warmup length, ``max(steps, 1)`` of inverse-square-root — come out identical.
With ``n`` = samples seen so far:

* warmup (``warmup_steps > 0 and n <= warmup_steps``): ``init + (max - init) * n / warmup``
* ``constant``: ``max``
* ``n > decay_steps``: ``min``
* ``inverse-square-root``: ``max(min, max * sqrt(max(warmup, 1)) / sqrt(max(n, 1)))``
* otherwise ``min + coeff * (max - min)`` with ``r = (n - warmup) / (decay - warmup)`` and
  ``linear``: ``1 - r``; ``cosine``: ``(cos(pi r) + 1) / 2``; ``WSD``: ``1`` until
  ``decay - wsd_decay``, then with ``w = (n - (decay - wsd_decay)) / wsd_decay``:
  ``exponential`` ``2 * 0.5**w - 1``, ``linear`` ``1 - w``, ``cosine`` ``(cos(pi w) + 1) / 2``,
  ``minus_sqrt`` ``1 - sqrt(w)``.

Which step gets which rate: Megatron calls ``step(0)`` at construction, so the first update
uses ``n = 0`` (the rate is ``--lr-warmup-init``, 0 by default, when there is warmup), and it
advances only after a *successful* step (an fp16 overflow skip does not advance it). optax's
``count`` behaves the same when a skipped step keeps the old optimizer state: ``schedule(count)``
is the rate of the update being made. Megatron *logs* the rate after advancing, i.e.
``lr_at(iteration)`` for 1-based ``iteration``; the trainer logs that to match Megatron's lines.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """Megatron's LR schedule. Step counts are in Megatron's units (samples); ``lr_at`` and
    ``__call__`` take optimizer iterations. An instance is an ``optax.Schedule``."""

    max_lr: float
    min_lr: float
    warmup_steps: float
    decay_steps: float
    decay_style: str
    init_lr: float = 0.0
    wsd_decay_steps: float | None = None
    wsd_decay_style: str = "exponential"
    samples_per_iter: int = 1

    def __post_init__(self):
        # Megatron's constructor asserts, as errors naming the flags.
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {self.decay_style!r}: expected one of {DECAY_STYLES}")
        if self.min_lr < 0.0 or self.max_lr < self.min_lr:
            raise ValueError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.max_lr})")
        if self.init_lr > self.max_lr:
            raise ValueError(f"--lr-warmup-init {self.init_lr} exceeds --lr {self.max_lr}")
        if self.decay_steps <= 0:
            raise ValueError("--lr-decay-iters (or --train-iters) must be positive")
        if self.warmup_steps >= self.decay_steps:
            raise ValueError(
                f"warmup ({self.warmup_steps / self.samples_per_iter:g} iterations) must be shorter "
                f"than --lr-decay-iters ({self.decay_steps / self.samples_per_iter:g}; default --train-iters): give "
                "a smaller --lr-warmup-iters (or --lr-warmup-fraction) or more iterations"
            )
        if self.decay_style == "WSD":
            if self.wsd_decay_steps is None:
                raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters")
            if self.wsd_decay_style not in WSD_DECAY_STYLES:
                raise ValueError(
                    f"--lr-wsd-decay-style {self.wsd_decay_style!r}: expected one of {WSD_DECAY_STYLES}"
                )

    @property
    def warmup_iters(self) -> float:
        return self.warmup_steps / self.samples_per_iter

    def lr_at(self, iteration: int) -> float:
        """Python-float rate after ``iteration`` successful optimizer steps (float64 math)."""
        return float(self._rate(np.float64(iteration * self.samples_per_iter), np))

    def __call__(self, count: Any) -> Any:
        """Traceable rate (float32) for optax's step ``count`` (= successful steps so far)."""
        return self._rate(jnp.asarray(count).astype(jnp.float32) * self.samples_per_iter, jnp)

    def _rate(self, n, xp):
        """Megatron's ``OptimizerParamScheduler.get_lr`` at ``n`` samples, written once for
        numpy (host logging) and jax.numpy (inside the step)."""
        max_lr, min_lr, warm, decay = self.max_lr, self.min_lr, self.warmup_steps, self.decay_steps
        if self.decay_style == "constant":
            decayed = xp.full_like(n, max_lr)
        elif self.decay_style == "inverse-square-root":
            isr = max_lr * math.sqrt(max(warm, 1)) / xp.sqrt(xp.maximum(n, 1.0))
            decayed = xp.where(n > decay, min_lr, xp.maximum(min_lr, isr))
        else:
            ratio = xp.clip((n - warm) / (decay - warm), 0.0, 1.0)
            if self.decay_style == "linear":
                coeff = 1.0 - ratio
            elif self.decay_style == "cosine":
                coeff = 0.5 * (xp.cos(math.pi * ratio) + 1.0)
            else:  # WSD
                anneal_start = decay - self.wsd_decay_steps
                w = xp.clip((n - anneal_start) / max(self.wsd_decay_steps, 1e-30), 0.0, 1.0)
                coeff = xp.where(n <= anneal_start, 1.0, _wsd_coeff(self.wsd_decay_style, w, xp))
            decayed = xp.where(n > decay, min_lr, min_lr + coeff * (max_lr - min_lr))
        if warm > 0:
            warmup = self.init_lr + (max_lr - self.init_lr) * n / warm
            return xp.where(n <= warm, warmup, decayed)
        return decayed


def _wsd_coeff(style: str, w, xp):
    if style == "linear":
        return 1.0 - w
    if style == "cosine":
        return 0.5 * (xp.cos(math.pi * w) + 1.0)
    if style == "exponential":
        return 2.0 * xp.power(0.5, w) - 1.0
    return 1.0 - xp.sqrt(w)  # minus_sqrt


def megatron_lr_schedule(
    *,
    lr: float,
    train_iters: int,
    min_lr: float = 0.0,
    lr_decay_iters: int | None = None,
    lr_decay_style: str = "linear",
    lr_warmup_iters: int = 0,
    lr_warmup_fraction: float | None = None,
    lr_warmup_init: float = 0.0,
    lr_wsd_decay_iters: int | None = None,
    lr_wsd_decay_style: str = "exponential",
    global_batch_size: int = 1,
) -> LRSchedule:
    """The schedule Megatron's ``get_optimizer_param_scheduler`` builds from these flags
    (iteration-based training)."""
    if lr_warmup_fraction is not None and lr_warmup_iters:
        raise ValueError("give only one of --lr-warmup-fraction and --lr-warmup-iters")
    decay_iters = train_iters if lr_decay_iters is None else lr_decay_iters
    decay_steps = decay_iters * global_batch_size
    if lr_warmup_fraction is not None:
        warmup_steps = lr_warmup_fraction * decay_steps
    else:
        warmup_steps = lr_warmup_iters * global_batch_size
    wsd_steps = None if lr_wsd_decay_iters is None else lr_wsd_decay_iters * global_batch_size
    return LRSchedule(
        max_lr=float(lr),
        min_lr=float(min_lr),
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        decay_style=lr_decay_style,
        init_lr=float(lr_warmup_init),
        wsd_decay_steps=wsd_steps,
        wsd_decay_style=lr_wsd_decay_style,
        samples_per_iter=global_batch_size,
    )
