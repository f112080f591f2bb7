"""The Trainer: one model on one mesh, its state (:mod:`mlir_train.train.state`) and its
compiled steps (:mod:`mlir_train.train.step`).

One ``jax.jit`` per step kind, with explicit in/out shardings and the state donated, entered
under the trainer's mesh, logical-axis rules and compile target. Everything a Trainer is built
from is resolved before it (``mlir_train.train.build``: the layout, the pipeline schedule, the
router and load-balancing settings, the kernels); the Trainer only places and compiles.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from mlir_train.config.models import ModelConfig
from mlir_train.data.dataset import BATCH_KEYS
from mlir_train.model import ModelOptions, tree
from mlir_train.runtime.platform_setup import compile_target
from mlir_train.train.optim import LossScaler
from mlir_train.train.pipeline import Schedule
from mlir_train.train.state import StateLayout, model_dims
from mlir_train.train.step import DTYPES, Step, StepConfig
from sharding import use_rules
from sharding.layout import Layout

__all__ = ["BATCH_KEYS", "DTYPES", "StepConfig", "Trainer", "model_dims"]


class Trainer(StateLayout):
    """The state of ``model_cfg`` on ``mesh`` (:class:`~mlir_train.train.state.StateLayout`) and
    its jitted train and eval steps. ``schedule``: the pipeline schedule, given exactly when the
    layout has pipeline stages."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        step_cfg: StepConfig,
        optimizer: optax.GradientTransformation,
        parallel: Layout,
        mesh: jax.sharding.Mesh,
        *,
        schedule: Schedule | None = None,
        loss_scaler: LossScaler | None = None,
        options: ModelOptions = ModelOptions(),
    ):
        if (schedule is None) != (parallel.pipeline == 1) or schedule is not None and schedule.stages != parallel.pipeline:
            raise ValueError(f"a layout of {parallel.pipeline} pipeline stage(s) with the schedule {schedule}")
        super().__init__(model_cfg, options, parallel, mesh, optimizer, loss_scaler, step_cfg.compute_dtype)
        self.step_cfg, self.schedule = step_cfg, schedule
        router = options.router
        self.expert_bias = bool(model_cfg.is_moe and router is not None and router.enable_expert_bias)
        self.step = Step(
            model_cfg=model_cfg, cfg=step_cfg, optimizer=optimizer, loss_scaler=loss_scaler, graphdef=self.graphdef,
            eval_graphdef=self.eval_graphdef, stack_kinds=self.stack_kinds, schedule=schedule, remat=options.remat,
            fsdp=parallel.fsdp, moves_expert_bias=self.expert_bias, trained=self.trainable,
            compute=self.compute_shardings, master=self.master_shardings, logical=self.logical,
            base_compute=self.base_compute_shardings, base_logical=self.base_logical)
        self._train_step = None
        self._eval_step: dict[bool, Any] = {}  # jitted eval, by whether the batch has a micro axis

    def _jitted_train_step(self):
        if self._train_step is None:
            self._train_step = jax.jit(
                self.step.train,
                in_shardings=(self.state_shardings, {k: self.batch_sharding for k in BATCH_KEYS}),
                out_shardings=(self.state_shardings, None),
                donate_argnums=(0,),
            )
        return self._train_step

    def train_step(self, state, batch):
        """One optimizer step on a global batch with leaves ``[num_micro, rows, seq]``."""
        step = self._jitted_train_step()
        with jax.set_mesh(self.mesh), use_rules(self.rules), compile_target(self.mesh):
            return step(state, batch)

    def lower_train_step(self, state_shapes, batch_shapes):
        """Ahead-of-time lowering, for FLOP and memory analysis without running anything."""
        step = self._jitted_train_step()
        with jax.set_mesh(self.mesh), use_rules(self.rules), compile_target(self.mesh):
            return step.lower(state_shapes, batch_shapes)

    def trace_train_step(self, state_shapes, batch_shapes):
        """The traced train step and its lowering: ``traced.jaxpr`` is the program as JAX built it
        (which ops, kernels and collectives it runs, and where in our code each came from:
        :mod:`mlir_train.planner.code_paths`), ``lowered.compile()`` what XLA runs."""
        step = self._jitted_train_step()
        with jax.set_mesh(self.mesh), use_rules(self.rules), compile_target(self.mesh):
            traced = step.trace(state_shapes, batch_shapes)
            return traced, traced.lower()

    def eval_step(self, params, batch):
        """``params``: :meth:`weights` of a state. Summed token loss and loss-token count, forward only, of a ``[micro, rows, seq]`` batch
        (as :meth:`train_step` takes; Megatron's evaluation iteration is one global batch in
        micro-batches, pipelined under PP as here) or of one ``[rows, seq]`` micro-batch."""
        micro = batch["input_ids"].ndim == 3
        if self._eval_step.get(micro) is None:
            sharding = self.batch_sharding if micro else self.eval_batch_sharding
            weights = self.master_shardings if self.lora is None else tree.merge(self.base_shardings,
                                                                                 self.master_shardings)
            self._eval_step[micro] = jax.jit(self.step.evaluate, in_shardings=(weights, {k: sharding for k in BATCH_KEYS}))
        with jax.set_mesh(self.mesh), use_rules(self.rules), compile_target(self.mesh):
            return self._eval_step[micro](params, batch)

    def global_batch(self, rows: dict[str, Any]) -> dict[str, jax.Array]:
        """This process's rows of one global batch (``[rows, seq]`` host arrays, as the loader
        yields them) as the step's sharded ``[micro, rows / micro, seq]`` batch."""
        m = self.step_cfg.num_micro_batches
        return self.shard_batch({k: v.reshape(m, v.shape[0] // m, *v.shape[1:]) for k, v in rows.items()})
