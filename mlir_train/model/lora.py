"""LoRA adapters, written once with logical axis names, so every layout shards them with their base.

An adapted weight ``W`` (input axes ``I``, output axes ``O``) computes ``x W + s (x A) B`` with
``A [I..., R]``, ``B [R, O...]`` and ``s = alpha / R`` (peft's and Megatron-Bridge's LoRA). ``A``
carries ``W``'s input axes, ``B`` its output axes and the rank axis is replicated (``None``), so
under TP a column-parallel layer's ``B`` splits like its output and a row-parallel layer's ``A``
like its input (the partial ``x A`` sums over the tensor ranks as the base's output does), EP
splits per-expert adapters with their experts and PP stacks them with their layer. ``A`` starts
as peft's ``kaiming_uniform_(a=sqrt(5))`` (uniform in +-1/sqrt(fan_in)), ``B`` at zero, so an
adapted model starts equal to its base.

The routed experts' adapters are folded into the expert weights before the expert kernels run
(``W_e + s A_e B_e``, :func:`expert_delta`): every expert implementation (padded, blocked,
ragged, grouped, the EP/ETP regions) then runs unchanged, and the weight gradient those kernels
already form flows back into ``A`` and ``B`` only. That is exactly peft's LoRA on a fused expert
parameter (``target_parameters``, a parametrization ``W + delta W``).

Adapter weights are :class:`LoRAParam`, a ``nnx.Param`` subclass: the trainer tells trainable
from frozen by type (:func:`trained_part`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mlir_train.model import tree

Axes = tuple[str | None, ...]


class LoRAParam(nnx.Param):
    """An adapter weight: the only parameters a LoRA run trains."""


def _uniform(rngs: nnx.Rngs, shape, fan_in: int, dtype) -> jax.Array:
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(rngs.params(), tuple(shape), jnp.float32, -bound, bound).astype(dtype)


class LoRA(nnx.Module):
    """The low-rank update of one weight with input shape ``in_shape`` and output shape
    ``out_shape`` (each with its logical axes); ``experts``: one adapter per expert on a leading
    ``"exp"`` axis (``(E, "exp")``) for the routed experts."""

    def __init__(self, rngs: nnx.Rngs, in_shape: Sequence[int], in_axes: Axes, out_shape: Sequence[int], out_axes: Axes,
                 rank: int, scaling: float, *, experts: tuple[int, str] | None = None, dtype=jnp.float32):
        lead, lead_axes = ((experts[0],), (experts[1],)) if experts else ((), ())
        self.a = LoRAParam(_uniform(rngs, lead + tuple(in_shape) + (rank,), math.prod(in_shape), dtype),
                           logical_axes=lead_axes + tuple(in_axes) + (None,))
        self.b = LoRAParam(jnp.zeros(lead + (rank,) + tuple(out_shape), dtype),
                           logical_axes=lead_axes + (None,) + tuple(out_axes))
        self.n_in = len(in_shape)
        self.scaling = scaling

    def __call__(self, x: jax.Array) -> jax.Array:
        """``s (x A) B`` for ``x [..., in...]`` (no expert axis): ``[..., out...]`` in ``x``'s dtype."""
        dt = x.dtype
        h = jnp.tensordot(x, self.a[...].astype(dt), axes=self.n_in)
        return jnp.tensordot(h * jnp.asarray(self.scaling, dt), self.b[...].astype(dt), axes=1)

    def delta(self, dt) -> jax.Array:
        """``s A B``, the full-size update ``[(E,) in..., out...]`` (the expert weights' form)."""
        a, b = self.a[...].astype(dt), self.b[...].astype(dt)
        lead = "e" if a.ndim == self.n_in + 2 else ""
        ins = "ijkl"[:self.n_in]
        outs = "uvw"[:b.ndim - 1 - len(lead)]
        d = jnp.einsum(f"{lead}{ins}r,{lead}r{outs}->{lead}{ins}{outs}", a, b)
        return d * jnp.asarray(self.scaling, dt)


def trained_part(model: nnx.Module) -> dict:
    """The adapters of ``model`` as a template (pure nested dicts): the part of the weights a
    LoRA run trains, which :mod:`mlir_train.model.tree` cuts the weights by (the rest is the
    frozen base)."""
    return nnx.to_pure_dict(nnx.state(model, LoRAParam))


@dataclasses.dataclass(frozen=True)
class Adapters:
    """The adapters of one module: their rank, scaling and expert adapters (a
    :class:`~mlir_train.config.policies.LoRAPolicy`'s) and which of its weights take one, by
    their paths under the module (the family's table resolves the policy's Megatron names into
    them: :meth:`mlir_train.families.table.Table.lora_weights`)."""

    dim: int
    scaling: float
    expert_adapters: str
    weights: frozenset[tuple[str, ...]]

    @classmethod
    def of(cls, policy, weights) -> "Adapters | None":
        """``policy``'s adapters on ``weights`` (None without a policy: a plain model)."""
        if policy is None:
            return None
        return cls(policy.dim, policy.scaling, policy.expert_adapters, frozenset(map(tuple, weights)))

    def under(self, name: str) -> "Adapters":
        """The adapters of the submodule ``name``."""
        return dataclasses.replace(self, weights=frozenset(w[1:] for w in self.weights if w[:1] == (name,)))

    def adapts(self, weight: str) -> bool:
        return (weight,) in self.weights


def maybe(adapters: Adapters | None, weight: str, make) -> LoRA | None:
    """``make()`` when ``adapters`` adapt the module's weight ``weight``, else None."""
    return make() if adapters is not None and adapters.adapts(weight) else None


def adapted(x: jax.Array, y: jax.Array, adapter: LoRA | None) -> jax.Array:
    """``y`` (the base layer's output on ``x``) plus the adapter's update, if any."""
    return y if adapter is None else y + adapter(x)


def expert_delta(w: jax.Array, adapter: LoRA | None) -> jax.Array:
    """The expert weights ``w [E, in, out]`` with the adapter folded in (a shared adapter,
    without an expert axis, adds the same update to every expert)."""
    return w if adapter is None else w + adapter.delta(w.dtype)


# Where each adapter's update goes, where its name is not ``<weight>_lora`` beside its weight.
FOLDS = {"q_lora": ("q_proj",), "k_lora": ("k_proj",), "v_lora": ("v_proj",), "o_lora": ("o_proj",),
         "gate_lora": ("gate_proj",), "up_lora": ("up_proj",), "down_lora": ("down_proj",),
         "fc1_lora": ("gate_proj", "up_proj"), "fc2_lora": ("down_proj",)}


def folded(base: dict, adapters: dict, scaling: float) -> dict:
    """A plain model's weights: the frozen ``base`` (a pure dict without adapters) with every
    adapter's update ``s A B`` of ``adapters`` (:func:`trained_part` of the weights) added into
    the weight it adapts, in float32 and stored back in that weight's dtype: the merged model
    ``--save-hf`` writes. Layer stacks keep their leading ``"layers"`` axis; a shared expert
    adapter adds its update to every expert."""
    updated = {"layers": {i: _folded_module(base["layers"][i], stack, scaling)
                          for i, stack in adapters["layers"].items()}}
    return tree.merge(base, updated)


def _is_adapter(node) -> bool:
    return isinstance(node, dict) and set(node) == {"a", "b"}


def _folded_module(weights: dict, adapters: dict, scaling: float) -> dict:
    """The weights of one module (a layer stack's, or a submodule of it, at any depth) that its
    ``adapters`` update, updated."""
    out = {}
    for name, adapter in adapters.items():
        if not _is_adapter(adapter):  # a submodule ("attn", "mlp", a shared expert inside the MLP)
            out[name] = _folded_module(weights[name], adapter, scaling)
            continue
        a, b = (jnp.asarray(adapter[x], jnp.float32) for x in ("a", "b"))
        experts = name in ("fc1_lora", "fc2_lora")
        n_lead = 2 if experts and a.ndim == 4 else 1  # [L, E] per expert, [L] otherwise
        lead, ins, r, outs = a.shape[:n_lead], a.shape[n_lead:-1], a.shape[-1], b.shape[n_lead + 1:]
        d = jnp.matmul(a.reshape(*lead, math.prod(ins), r), b.reshape(*lead, r, math.prod(outs)))
        d = d.reshape(*lead, *ins, *outs) * scaling
        if experts and n_lead == 1:
            d = d[:, None]  # shared: the same update for every expert
        parts = [d[..., j, :] for j in range(2)] if name == "fc1_lora" else [d]
        for target, update in zip(FOLDS.get(name, (name.removesuffix("_lora"),)), parts):
            w = weights[target]
            out[target] = (w.astype(jnp.float32) + update).astype(w.dtype)
    return out
