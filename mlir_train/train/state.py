"""A trainer's state, where it lives and how one is made.

The state is a plain pytree::

    {"params": float32 master weights (nested dict, the model's nnx state as pure arrays),
     "opt_state": optax state, "iteration": int32, "loss_scale": LossScaleState | None}

Under LoRA (the model built with ``lora=``, :mod:`mlir_train.model.lora`) ``params`` are the
adapters alone and the state gains ``"base"``: the frozen rest of the model in the compute dtype
(storage layout), never differentiated, with no master copy, moments or gradient buffers.
:meth:`StateLayout.weights` gives the full tree the model, evaluation and export take; the
adapters and the base are cut apart and joined by :mod:`mlir_train.model.tree`.

Shardings come from the logical axes through ``sharding.rules.state_specs``: master weights
and optimizer state use the ZeRO-1 layout under ``--use-distributed-optimizer``; inside the
step the weights are cast and constrained to the compute layout (XLA all-gathers them and
reduce-scatters the gradients back). Everything here is computed once, from the abstract
model: nothing is allocated until a state is made.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mlir_train.config.models import ModelConfig
from mlir_train.data.dataset import BATCH_KEYS
from mlir_train.families import build_model
from mlir_train.model import CausalLM, ModelOptions, logical_axes, tree
from mlir_train.model.lora import folded, trained_part
from mlir_train.train import pipeline
from mlir_train.train.optim import LossScaler
from mlir_train.train.step import DTYPES, is_expert_bias
from sharding import logical_to_spec, use_rules
from sharding.context import split_within_processes, to_zigzag
from sharding.layout import Layout
from sharding.logical import axes_tuple
from sharding.rules import StateSpecs, rules_for, state_specs


def model_dims(cfg: ModelConfig) -> dict[str, int]:
    """The model sizes a layout must divide (``sharding.mesh.validate``, ``sharding.rules``):
    :meth:`ModelConfig.layout_dims`, which a family extends with its own."""
    return cfg.layout_dims()


class StateLayout:
    """The state of one model on one mesh: its shapes, logical axes, partition specs and
    shardings, and the ways to make one (fresh, around given weights, abstract).

    ``trainable`` is LoRA's template of the trained part (None: every parameter is trained);
    ``param_shapes``, ``logical`` and ``specs`` describe the trained part, ``base_*`` the frozen
    rest under LoRA."""

    def __init__(self, model_cfg: ModelConfig, options: ModelOptions, parallel: Layout, mesh: jax.sharding.Mesh,
                 optimizer: optax.GradientTransformation, loss_scaler: LossScaler | None, compute_dtype: str):
        self.model_cfg, self.options, self.parallel, self.mesh = model_cfg, options, parallel, mesh
        self.optimizer, self.loss_scaler, self.lora = optimizer, loss_scaler, options.lora
        self.base_dtype = DTYPES[compute_dtype]  # the frozen base's under LoRA
        dims = model_dims(model_cfg)
        abstract = build_model(model_cfg, options, abstract=True)
        self.graphdef, abstract_state = nnx.split(abstract)
        self.stack_kinds = abstract.stack_kinds
        # The eval step's model: the same weights, routed as in evaluation (ModelOptions.for_eval).
        eval_options = options.for_eval()
        self.eval_graphdef = self.graphdef if eval_options is options else \
            nnx.split(build_model(model_cfg, eval_options, abstract=True))[0]
        self.trainable = trained_part(abstract) if self.lora is not None else None
        self.rules = rules_for(parallel, dims)
        self._place_params(nnx.to_pure_dict(abstract_state), nnx.to_pure_dict(logical_axes(abstract)), dims)
        self._place_state()
        self._place_batches()

    def _named(self, specs: Any) -> Any:
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))

    def _place_params(self, shapes: dict, logical: dict, dims: dict[str, int]) -> None:
        """Shapes, logical axes, specs and shardings of the trained weights (and under LoRA of the
        frozen base: held in the compute dtype in its storage layout, with no optimizer state)."""
        if self.parallel.pipeline > 1:
            logical = pipeline.storage_axes(logical, self.stack_kinds, self.parallel.pipeline)
        specs = state_specs(self.parallel, shapes, logical, self.mesh, dims)
        part = self.trainable
        self.param_shapes = tree.select(shapes, part)
        self.logical = tree.select(logical, part)
        self.specs = StateSpecs(*(tree.select(getattr(specs, f.name), part) for f in dataclasses.fields(StateSpecs)))
        self.compute_shardings = self._named(self.specs.compute)
        # Float32 master weights are optimizer state in Megatron's accounting: ZeRO-1 shards them.
        self.master_shardings = self._named(self.specs.optimizer if self.parallel.distributed_optimizer
                                            else self.specs.params)
        lora = self.lora is not None
        self.base_shapes = tree.drop(shapes, part) if lora else None
        self.base_logical = tree.drop(logical, part) if lora else None
        self.base_shardings = self._named(tree.drop(specs.params, part)) if lora else None
        self.base_compute_shardings = self._named(tree.drop(specs.compute, part)) if lora else None

    def _place_state(self) -> None:
        opt_shapes = jax.eval_shape(self.optimizer.init, self.param_shapes)
        opt_specs = optax.tree_map_params(
            self.optimizer, lambda _, spec: spec, opt_shapes, self.specs.optimizer,
            transform_non_params=lambda _: PartitionSpec(), is_leaf=lambda x: isinstance(x, PartitionSpec))
        replicated = NamedSharding(self.mesh, PartitionSpec())
        scaler = self.loss_scaler
        self.state_shardings = {
            "params": self.master_shardings,
            "opt_state": self._named(opt_specs),
            "iteration": replicated,
            "loss_scale": None if scaler is None else jax.tree.map(lambda _: replicated, scaler.init()),
        }
        if self.lora is not None:
            self.state_shardings["base"] = self.base_shardings

    def _place_batches(self) -> None:
        with use_rules(self.rules):
            # Under context parallelism each row's tokens are split over the context ranks, in
            # the load-balanced order shard_batch lays them out in (sharding.context).
            batch_spec = logical_to_spec((None, "act_batch", "act_seq"), self.rules, self.mesh.axis_names)
        if not split_within_processes(self.mesh, axes_tuple(batch_spec[2] if len(batch_spec) > 2 else None)):
            raise ValueError(
                f"--context-parallel-size {self.parallel.context}: a row's context ranks span several processes "
                "(hosts), and feeding rows split across hosts is not implemented; keep --tensor-model-parallel-size "
                "x --context-parallel-size within one host's devices")
        self.batch_sharding = NamedSharding(self.mesh, batch_spec)       # [micro, rows, seq]
        self.eval_batch_sharding = NamedSharding(self.mesh, PartitionSpec(*batch_spec[1:]))  # [rows, seq]

    # ----- making a state -----------------------------------------------------------------------
    def _wrap(self, params: Any, base: Any = None) -> dict[str, Any]:
        shardings = self.state_shardings
        state = {
            "params": params,
            "opt_state": jax.jit(self.optimizer.init, out_shardings=shardings["opt_state"])(params),
            "iteration": jax.device_put(jnp.zeros((), jnp.int32), shardings["iteration"]),
            "loss_scale": None if self.loss_scaler is None else jax.device_put(self.loss_scaler.init(),
                                                                               shardings["loss_scale"]),
        }
        if self.lora is not None:
            state["base"] = base
        return state

    def init_state(self, seed: int) -> dict[str, Any]:
        """Fresh weights (Megatron's normal init with ``init_std``), born sharded: one compiled
        program creates every parameter directly in its master sharding (under LoRA the base in
        the compute dtype)."""
        cfg, options = self.model_cfg, self.options
        build = lambda: nnx.to_pure_dict(nnx.state(build_model(cfg, options, seed=seed)))
        with jax.set_mesh(self.mesh):
            if self.lora is None:
                return self._wrap(jax.jit(build, out_shardings=self.master_shardings)())
            # The base as a plain model draws it from the seed (drawing the adapters in between would
            # give another base): the same weights a full run of this seed starts from.
            build_base = lambda: nnx.to_pure_dict(nnx.state(build_model(cfg, options.plain(), seed=seed)))
            params, base = jax.jit(lambda: (tree.select(build(), self.trainable), self._frozen(build_base())),
                                   out_shardings=(self.master_shardings, self.base_shardings))()
        return self._wrap(params, base)

    def _frozen(self, weights: Any) -> Any:
        """The frozen base of a full weights tree, in the compute dtype (the expert bias float32)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, p: p if is_expert_bias(path) else p.astype(self.base_dtype), tree.drop(weights, self.trainable))

    def weights(self, state: dict[str, Any]) -> Any:
        """The model's full weights tree of a state (what :meth:`model` and the eval step take):
        the params, and under LoRA the frozen base with the adapters."""
        return state["params"] if self.lora is None else tree.merge(state["base"], state["params"])

    def abstract_state(self) -> dict[str, Any]:
        """The state as ``ShapeDtypeStruct``s carrying their shardings: nothing allocated. For
        ahead-of-time compilation (memory/FLOP planning) and as a checkpoint restore target."""
        shapes = {
            "params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), self.param_shapes),
            "iteration": jax.ShapeDtypeStruct((), jnp.int32),
            "loss_scale": None if self.loss_scaler is None else jax.eval_shape(self.loss_scaler.init),
        }
        shapes["opt_state"] = jax.eval_shape(self.optimizer.init, shapes["params"])
        if self.lora is not None:
            shapes["base"] = jax.tree_util.tree_map_with_path(
                lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype if is_expert_bias(path) else self.base_dtype),
                self.base_shapes)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    def state_from_params(self, params: Any, seed: int = 0) -> dict[str, Any]:
        """State around given weights (e.g. from ``load_pretrained``), optimizer fresh. Under
        LoRA ``params`` is the base, with or without adapters: missing adapters start fresh
        (``seed``'s A, B = 0, so the model starts equal to its base)."""
        if self.lora is None:
            params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
            return self._wrap(jax.device_put(params, self.master_shardings))
        base = jax.device_put(self._frozen(params), self.base_shardings)
        adapters = tree.select(params, self.trainable) if tree.contains(params, self.trainable) \
            else self._fresh_adapters(seed)
        adapters = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), adapters)
        return self._wrap(jax.device_put(adapters, self.master_shardings), base)

    def state_with_base(self, adapters: Any, base: Any) -> dict[str, Any]:
        """Under LoRA: the state of these adapters (float32, optimizer fresh) on ``base`` (the
        frozen base in the compute dtype, as :meth:`init_state` holds it)."""
        adapters = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), adapters)
        return self._wrap(jax.device_put(adapters, self.master_shardings), jax.device_put(base, self.base_shardings))

    def _fresh_adapters(self, seed: int) -> Any:
        """Freshly initialised adapters alone (the base is not built: XLA drops what the
        output does not need)."""
        build = lambda: tree.select(nnx.to_pure_dict(nnx.state(build_model(self.model_cfg, self.options, seed=seed))),
                                    self.trainable)
        with jax.set_mesh(self.mesh):
            return jax.jit(build, out_shardings=self.master_shardings)()

    # ----- reading a state ----------------------------------------------------------------------
    def model(self, params: Any) -> CausalLM:
        """The model of a full weights tree (:meth:`weights`)."""
        return nnx.merge(self.graphdef, params)

    def export_model(self, state: dict[str, Any]) -> CausalLM:
        """The model a state's weights describe, as a plain model: under LoRA the base with every
        adapter's update folded in (the merged model), else :meth:`model` of the params."""
        if self.lora is None:
            return self.model(state["params"])
        graphdef = nnx.split(build_model(self.model_cfg, self.options.plain(), abstract=True))[0]
        with jax.set_mesh(self.mesh):
            merged = jax.jit(lambda base, adapters: folded(base, adapters, self.lora.scaling))(state["base"],
                                                                                              state["params"])
        return nnx.merge(graphdef, merged)

    def shard_batch(self, batch: dict[str, Any], *, micro: bool = True) -> dict[str, jax.Array]:
        """Host numpy arrays of this process's rows -> global sharded arrays. Under context
        parallelism every per-token array is first put in Megatron's load-balanced order
        (:func:`sharding.context.to_zigzag`), the same permutation for all of them, so each
        context rank receives chunks ``r`` and ``2CP-1-r`` of every row."""
        sharding = self.batch_sharding if micro else self.eval_batch_sharding
        cp = self.parallel.context
        return {k: jax.make_array_from_process_local_data(sharding, to_zigzag(np.asarray(batch[k]), cp, axis=-1))
                for k in BATCH_KEYS}
