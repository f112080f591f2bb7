"""How a model is built to run, as one frozen value: :class:`ModelOptions`.

A :class:`~mlir_train.config.models.ModelConfig` says what a model *is* (its shapes); the
options say how this run builds and executes it: the parameters' dtype, the attention and MoE
implementations the platform runs (:func:`mlir_train.model.platform.kernel_options` picks them),
what the backward recomputes, the router's settings, LoRA, and the expert-parallel exchange's
buffers. :func:`mlir_train.train.build.resolve` builds them once per run from the flags; every
layer reads the fields it needs when it is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from mlir_train.config.policies import LoRAPolicy, RecomputePolicy, RouterConfig
from mlir_train.model.moe.dispatch import DEFAULT_EP_BUFFER_FACTOR


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """``param_dtype``: the dtype parameters are created in. ``attention_impl``: one of
    :data:`mlir_train.model.attention.ATTENTION_IMPLS`. ``moe_impl``: the experts' implementation
    (:mod:`mlir_train.model.moe.block`), ``moe_platform`` the platform it is compiled for (None:
    the default backend's), ``moe_kernels`` the block kernels of ``"grouped"`` (None / "mosaic":
    ours, "tokamax"), ``moe_block_loop`` the dropless blocked experts' loop form (None: by size),
    ``capacity_factor`` / ``drop_policy`` Megatron's token dropping, ``ep_buffer_factor`` the EP
    exchange's buffer size, ``ragged_all_to_all`` the collective the ragged EP dispatch uses
    (None: the platform's). ``kernel_interpret``: the GPU kernels (flash attention, the MoE block
    kernels) run in the Pallas / Mosaic-GPU interpreters (``--code-paths gpu`` on CPU);
    ``compute_capability`` the CUDA capability their tiles are chosen for ("9.0"; None: the
    devices'). ``remat``: what the backward recomputes. ``router``: the MoE router's
    settings (None: megatron-core's defaults). ``lora``: the adapters (None: a plain model)."""

    param_dtype: Any = jnp.float32
    attention_impl: str = "xla"
    moe_impl: str = "padded"
    moe_platform: str | None = None
    moe_kernels: str | None = None
    moe_block_loop: bool | None = None
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    ep_buffer_factor: float = DEFAULT_EP_BUFFER_FACTOR
    ragged_all_to_all: Callable | None = None
    kernel_interpret: bool = False
    compute_capability: str | None = None
    remat: RecomputePolicy = RecomputePolicy()
    router: RouterConfig | None = None
    lora: LoRAPolicy | None = None

    def __post_init__(self):
        # The older remat strings ("none", "full", "selective") are still taken.
        object.__setattr__(self, "remat", RecomputePolicy.of(self.remat))

    def replace(self, **changes: Any) -> "ModelOptions":
        return dataclasses.replace(self, **changes)

    def plain(self) -> "ModelOptions":
        """The same model without LoRA adapters (the base a LoRA run trains on, or its merged export)."""
        return self.replace(lora=None)

    def for_eval(self) -> "ModelOptions":
        """The options of the eval step's model: routed as in evaluation (Sinkhorn balancing,
        like Megatron's, applies in training only)."""
        if self.router is None or not self.router.sinkhorn:
            return self
        return self.replace(router=dataclasses.replace(self.router, training=False))
