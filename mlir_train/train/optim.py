"""The optimizer as Megatron-LM builds it, as optax transformations, plus fp16 loss scaling.

Adam (``--optimizer adam``) is Megatron's fused Adam in AdamW mode (decoupled decay):

    g      <- g * min(1, clip_grad / (||g||_2 + 1e-6))          (global L2 norm over all params)
    m, v   <- beta1 m + (1-beta1) g,  beta2 v + (1-beta2) g^2
    p      <- p - lr * ( m/(1-beta1^t) / (sqrt(v/(1-beta2^t)) + eps)  +  wd * p )

SGD (``--optimizer sgd``) is ``torch.optim.SGD(momentum=--sgd-momentum, weight_decay=wd)``:
L2 decay added to the (clipped) gradient before momentum, ``buf <- mu buf + g``, ``p -= lr buf``.

Weight-decay mask. Megatron exempts params whose name ends in ``.bias`` or that are 1-D
(``len(param.shape) == 1``: LayerNorm/RMSNorm weights). Our decoder layers are stacked, so a
norm scale is ``[layers, hidden]`` and the shape rule alone would decay it. We decide from the
parameter's *tree path* (Flax NNX state paths such as ``('layers', 0, 'attn', 'q_norm', 'scale')``):

* no decay if a path component contains ``"norm"``, or the leaf is named ``"bias"`` or
  ``"scale"`` (Flax's name for a norm weight);
* otherwise no decay if the parameter is 1-D *per layer*: its rank, minus one when a path
  component is ``"layers"`` (the stacked axis), is at most 1;
* everything else (embedding, attention and expert projections, router, LM head) decays,
  as in Megatron.

The mask is a function of the tree it is given (not a precomputed tree), because optax calls it
on the parameters at ``init`` and on the updates at ``update``, and ``nnx.Optimizer`` passes
``nnx.Variable`` leaves to the first and plain arrays to the second.

Loss scaling (``--fp16``) follows Megatron's ``DynamicGradScaler``: the loss is multiplied by
``scale``; grads are unscaled, and if any is inf/nan the step is skipped (the caller keeps its old
params *and* optimizer state, so the LR schedule does not advance either, as in Megatron); each
overflow decrements a hysteresis counter and the scale is multiplied by ``backoff_factor`` (not
below ``min_scale``) once it reaches 0; after ``growth_interval`` clean steps in a row the scale is
multiplied by ``growth_factor`` and the hysteresis counter is reset. ``--loss-scale X`` gives a
constant scale (Megatron's ``ConstantGradScaler``: overflow still skips the step). Megatron uses
no scaler for ``--bf16`` unless ``--loss-scale`` is given; ``--initial-loss-scale`` alone is
ignored under bf16, as there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

# Megatron's clip_grad_norm_fp32 divides by (total_norm + 1e-6).
_CLIP_EPS = 1.0e-6


# ----- weight-decay mask -------------------------------------------------------------------
def _path_names(path) -> list[str]:
    names = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
        else:
            names.append(str(k))
    # nnx.Variable leaves add a trailing 'value' attribute key; it is not part of the param name.
    if names and names[-1] == "value":
        names = names[:-1]
    return names


def decays_weight(path: tuple, value: Any) -> bool:
    """Whether the parameter at ``path`` (a ``jax.tree_util`` key path) gets weight decay."""
    names = _path_names(path)
    if any("norm" in n.lower() for n in names) or (names and names[-1] in ("bias", "scale")):
        return False
    ndim = len(getattr(value, "shape", ()))
    per_layer_ndim = ndim - (1 if "layers" in names else 0)
    return per_layer_ndim > 1


def weight_decay_mask(params: Any) -> Any:
    """Bool pytree, same structure as ``params``: True where weight decay applies."""
    return jax.tree_util.tree_map_with_path(decays_weight, params)


# ----- clipping ----------------------------------------------------------------------------
def global_norm(grads: Any) -> jax.Array:
    """Megatron's grad norm: the L2 norm over all parameters, in float32 (before clipping)."""
    leaves = jax.tree_util.tree_leaves(grads)
    return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Megatron's clipping: scale by ``max_norm / (norm + 1e-6)`` when that is below 1."""

    def update_fn(updates, state, params=None):
        del params
        coeff = max_norm / (global_norm(updates) + _CLIP_EPS)
        scale = jnp.minimum(coeff, 1.0)
        return jax.tree_util.tree_map(lambda g: (g * scale).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


# ----- optimizer ---------------------------------------------------------------------------
def make_optimizer(
    *,
    lr_schedule: optax.Schedule | float,
    weight_decay: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    clip_grad: float = 1.0,
    optimizer: str = "adam",
    sgd_momentum: float = 0.9,
    mask: Callable[[Any], Any] = weight_decay_mask,
) -> optax.GradientTransformation:
    """Megatron's Adam(W) or SGD with global-norm clipping and the no-decay mask.

    ``clip_grad <= 0`` disables clipping, as Megatron. The grad norm for logging is
    :func:`global_norm` of the raw gradients (Megatron reports the pre-clip norm).
    """
    parts = []
    if clip_grad and clip_grad > 0:
        parts.append(clip_by_global_norm(clip_grad))
    if optimizer == "adam":
        parts += [
            optax.scale_by_adam(b1=beta1, b2=beta2, eps=eps),
            optax.add_decayed_weights(weight_decay, mask=mask),
        ]
    elif optimizer == "sgd":
        parts += [
            optax.add_decayed_weights(weight_decay, mask=mask),
            optax.trace(decay=sgd_momentum, nesterov=False),
        ]
    else:
        raise ValueError(f"--optimizer {optimizer!r}: expected 'adam' or 'sgd'")
    parts.append(optax.scale_by_learning_rate(lr_schedule))
    return optax.chain(*parts)


# ----- fp16 loss scaling -------------------------------------------------------------------
class LossScaleState(NamedTuple):
    scale: jax.Array  # float32 scalar
    growth_tracker: jax.Array  # int32: clean steps since the last growth or overflow
    hysteresis_tracker: jax.Array  # int32: overflows left before the next backoff


@dataclasses.dataclass(frozen=True)
class LossScaler:
    """Megatron's DynamicGradScaler (``dynamic=True``) or ConstantGradScaler, as pure functions
    of a small :class:`LossScaleState` pytree, usable inside a jitted step."""

    initial_scale: float = 2.0**32
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    dynamic: bool = True

    def __post_init__(self):
        if self.initial_scale <= 0:
            raise ValueError("the loss scale must be positive")
        if self.dynamic:
            if not 0 < self.min_scale <= self.initial_scale:
                raise ValueError("need 0 < --min-loss-scale <= --initial-loss-scale")
            if self.growth_factor <= 1.0 or not 0.0 < self.backoff_factor < 1.0:
                raise ValueError("need growth_factor > 1 and 0 < backoff_factor < 1")
            if self.growth_interval <= 0 or self.hysteresis <= 0:
                raise ValueError("--loss-scale-window and --hysteresis must be positive")

    def init(self) -> LossScaleState:
        return LossScaleState(
            scale=jnp.asarray(self.initial_scale, jnp.float32),
            growth_tracker=jnp.asarray(0, jnp.int32),
            hysteresis_tracker=jnp.asarray(self.hysteresis, jnp.int32),
        )

    def update(self, state: LossScaleState, found_inf: jax.Array) -> LossScaleState:
        if not self.dynamic:
            return state
        found_inf = jnp.asarray(found_inf, bool)
        # Overflow: reset growth, spend one unit of hysteresis, back off when it is used up.
        hyst_after_inf = state.hysteresis_tracker - 1
        scale_after_inf = jnp.where(
            hyst_after_inf <= 0,
            jnp.maximum(state.scale * self.backoff_factor, self.min_scale),
            state.scale,
        )
        # Clean step: grow after growth_interval clean steps in a row.
        growth = state.growth_tracker + 1
        grow = growth == self.growth_interval
        return LossScaleState(
            scale=jnp.where(found_inf, scale_after_inf, jnp.where(grow, state.scale * self.growth_factor, state.scale)),
            growth_tracker=jnp.where(found_inf, 0, jnp.where(grow, 0, growth)).astype(jnp.int32),
            hysteresis_tracker=jnp.where(
                found_inf, hyst_after_inf, jnp.where(grow, self.hysteresis, state.hysteresis_tracker)
            ).astype(jnp.int32),
        )


def all_finite(tree: Any) -> jax.Array:
    """True when every element of every leaf is finite."""
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise ``where(pred, a, b)``: keep the old state on a skipped step."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
