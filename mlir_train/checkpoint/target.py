"""What reading and writing checkpoints needs from a run: :class:`Target`.

The formats (:mod:`~mlir_train.checkpoint.sources`) lay weights into a run's state and write a
run's state out through this, never through the trainer's other parts; the
:class:`~mlir_train.train.trainer.Trainer` is one (``convert`` reads and writes through a
data-parallel one). Trees are nested dicts like ``nnx.to_pure_dict`` of the model.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from mlir_train.config.models import ModelConfig
from mlir_train.config.policies import LoRAPolicy
from mlir_train.model import CausalLM, ModelOptions
from sharding import Rules


class Target(Protocol):
    """A model on a mesh, and the state a run holds of it."""

    model_cfg: ModelConfig
    options: ModelOptions          # how the model is built (its kernels; ``lora``: adapters)
    lora: LoRAPolicy | None        # the adapters a LoRA run trains (None: every weight)
    mesh: jax.sharding.Mesh
    rules: Rules                   # the logical-axis rules the parameters are laid out by
    stack_kinds: tuple[Any, ...]   # the model's layer stacks (mlir_train.model.transformer.Stack)
    param_shapes: Any              # the trained parameters' shapes (under LoRA the adapters')
    master_shardings: Any          # and their (float32 master) shardings
    state_shardings: dict[str, Any]

    def init_state(self, seed: int) -> dict[str, Any]:
        """A fresh state, its weights drawn from ``seed``."""

    def abstract_state(self) -> dict[str, Any]:
        """The state's shapes with their shardings: the target of a restore."""

    def state_from_params(self, params: Any, seed: int = 0) -> dict[str, Any]:
        """The state around given weights, the optimizer fresh."""

    def state_with_base(self, adapters: Any, base: Any) -> dict[str, Any]:
        """Under LoRA: the state of these adapters on the frozen ``base``."""

    def model(self, params: Any) -> CausalLM:
        """The model of a full weights tree."""

    def export_model(self, state: dict[str, Any]) -> CausalLM:
        """The plain model a state's weights describe (under LoRA the adapters merged in)."""
