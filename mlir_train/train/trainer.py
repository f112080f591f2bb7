"""The compiled training and eval steps, their state and its shardings.

One ``jax.jit`` per step kind, with explicit in/out shardings and the state donated. The
state is a plain pytree::

    {"params": float32 master weights (nested dict, the model's nnx state as pure arrays),
     "opt_state": optax state, "iteration": int32, "loss_scale": LossScaleState | None}

Under LoRA (the model built with ``lora=``, :mod:`mlir_train.model.lora`) ``params`` are the
adapters alone and the state gains ``"base"``: the frozen rest of the model in the compute dtype
(storage layout), never differentiated, with no master copy, moments or gradient buffers.
:meth:`Trainer.weights` gives the full tree the model, evaluation and export take.

Megatron semantics matched here (see the tests for each):

* gradient accumulation over ``num_micro_batches`` micro-batches inside the step (a scan);
* the LM objective as Megatron normalises it, one per-token weight computed once per step
  (:func:`losses.loss_token_weights`): by default the mean over every data-parallel rank's
  micro-batch (``--micro-batch-size`` consecutive rows) of its summed token loss / its loss
  tokens; with ``--calculate-per-token-loss`` the sum of token losses over the whole global
  batch / the number of loss tokens in it. Logged ``lm loss``, as AIAK's SFT phase reports it
  (``--training-phase sft``, its ``train_step``): that objective's value, i.e. the mean of the
  micro-batch means by default and the global token mean with ``--calculate-per-token-loss``;
  under ``--training-phase pretrain`` Megatron-LM's report, the global token mean in both
  modes. Evaluation reports the global token mean (Megatron-LM's ``evaluate``, which AIAK
  calls);
* MoE load balancing (``losses.router_losses``, one ``policies.LoadBalancing``): each of
  ``aux_loss`` / ``seq_aux_loss`` / ``global_aux_loss`` in use, ``coeff * sum over layers``,
  formed per data-parallel rank's micro-batch (``--micro-batch-size`` rows, the router's
  balancing group) and averaged over ranks and micro-batches as Megatron's gradient scaling
  does, or under ``--calculate-per-token-loss`` each rank's weighted by its router tokens over
  the global batch's loss tokens, as Megatron's; z-loss likewise. Logged ``load_balancing_loss`` (and
  ``seq_/global_load_balancing_loss``) is ``coeff * mean over layers``; ``"<name> per layer"``
  holds the raw per-layer values (``--moe-per-layer-logging``);
* aux-loss-free balancing (``--moe-router-enable-expert-bias``): after the optimizer update each
  MoE layer's ``expert_bias`` (a float32 parameter with no gradient, never cast to the compute
  dtype) moves by ``expert_bias_update_rate`` against the step's routed load;
* ``bf16``/``fp16``: float32 master weights and optimizer state, the forward/backward in the
  low precision (router, attention softmax, logits and loss stay float32 inside the model);
  fp16 adds dynamic loss scaling, skipping the update on overflow;
* grad norm: L2 over all gradients before clipping.

Shardings come from the logical axes through ``sharding.rules.state_specs``: master weights
and optimizer state use the ZeRO-1 layout under ``--use-distributed-optimizer``; inside the
step the weights are cast and constrained to the compute layout (XLA all-gathers them and
reduce-scatters the gradients back).
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

from mlir_train.config import policies
from mlir_train.model import losses, tree
from mlir_train.train import pipeline
from mlir_train.config.models import ModelConfig
from mlir_train.data.dataset import BATCH_KEYS
from mlir_train.families import build_model
from mlir_train.model import CausalLM, ModelOptions, logical_axes
from mlir_train.model.lora import folded, trained_part
from mlir_train.model.moe.router import updated_expert_bias
from mlir_train.train.optim import LossScaler, global_norm, select_tree
from mlir_train.runtime.platform_setup import compile_target
from sharding import logical_to_spec, use_rules
from sharding.context import split_within_processes, to_zigzag
from sharding.logical import axes_tuple
from sharding.layout import Layout
from sharding.rules import StateSpecs, rules_for, state_specs

def _is_expert_bias(path) -> bool:
    return bool(path) and getattr(path[-1], "key", None) == "expert_bias"


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class StepConfig:
    num_micro_batches: int = 1
    compute_dtype: str = "float32"  # float32 | bfloat16 | float16
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    layers_per_virtual_stage: int | None = None  # --num-layers-per-virtual-pipeline-stage
    # --moe-router-load-balancing-type with --moe-aux-loss-coeff / --moe-z-loss-coeff; None: an
    # ``aux_loss`` of ``aux_loss_coeff`` and a z-loss of ``z_loss_coeff``.
    balancing: policies.LoadBalancing | None = None
    expert_bias_update_rate: float = 1e-3  # --moe-router-bias-update-rate (with an expert bias)
    micro_batch_size: int = 1  # --micro-batch-size: rows of one data-parallel rank's micro-batch
    per_token_loss: bool = False  # --calculate-per-token-loss
    # logged "lm loss": "objective" (AIAK's SFT phase: the normalised LM objective) or
    # "token-mean" (Megatron-LM: global CE sum / global loss tokens, whatever the normalisation)
    lm_loss_report: str = "objective"
    pipeline_schedule: str = "1f1b"              # --pipeline-schedule: 1f1b | gpipe | circular
    first_stage_layers: int | None = None        # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None         # --decoder-last-pipeline-num-layers

    def load_balancing(self) -> policies.LoadBalancing:
        """The router losses of the step, the one place they are configured (the plain and the
        pipelined steps both read it): ``balancing`` when given, else an ``aux_loss`` of
        ``aux_loss_coeff`` and a z-loss of ``z_loss_coeff``."""
        if self.balancing is not None:
            return self.balancing
        return policies.LoadBalancing(coeffs=(("aux_loss", self.aux_loss_coeff),) if self.aux_loss_coeff else (),
                                      z_loss_coeff=self.z_loss_coeff)


def model_dims(cfg: ModelConfig) -> dict[str, int]:
    return dict(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, num_experts=cfg.num_experts,
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
    )


class Trainer:
    """Builds the state, its shardings and the jitted steps for one model/mesh/optimizer."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        step_cfg: StepConfig,
        optimizer: optax.GradientTransformation,
        parallel: Layout,
        mesh: jax.sharding.Mesh,
        *,
        loss_scaler: LossScaler | None = None,
        options: ModelOptions = ModelOptions(),
    ):
        if step_cfg.lm_loss_report not in ("objective", "token-mean"):
            raise ValueError(f"StepConfig.lm_loss_report {step_cfg.lm_loss_report!r}: 'objective' or 'token-mean'")
        self.model_cfg, self.step_cfg, self.optimizer = model_cfg, step_cfg, optimizer
        self.parallel, self.mesh, self.loss_scaler = parallel, mesh, loss_scaler
        if model_cfg.is_moe:
            # The router's balancing groups are the data-parallel ranks' micro-batches, the same
            # rows loss_token_weights groups the LM loss by (Megatron forms both per rank).
            router = options.router or policies.RouterConfig()
            options = options.replace(router=dataclasses.replace(router, balancing_rows=step_cfg.micro_batch_size))
        self.options = options
        self.rules = rules_for(parallel, model_dims(model_cfg))
        abstract = build_model(model_cfg, options, abstract=True)
        self.schedule = None if parallel.pipeline == 1 else pipeline.make_schedule(
            model_cfg.num_layers, parallel.pipeline, kind=step_cfg.pipeline_schedule,
            layers_per_virtual_stage=step_cfg.layers_per_virtual_stage,
            first_stage_layers=step_cfg.first_stage_layers, last_stage_layers=step_cfg.last_stage_layers,
            num_micro_batches=step_cfg.num_micro_batches,
        )
        self.graphdef, abstract_state = nnx.split(abstract)
        self.stack_kinds = abstract.stack_kinds
        router_cfg = options.router
        # The eval step's model: the same weights, routed as in evaluation (ModelOptions.for_eval).
        eval_options = options.for_eval()
        self.eval_graphdef = self.graphdef if eval_options is options else \
            nnx.split(build_model(model_cfg, eval_options, abstract=True))[0]
        self.expert_bias = bool(model_cfg.is_moe and router_cfg is not None and router_cfg.enable_expert_bias)
        all_shapes = nnx.to_pure_dict(abstract_state)
        all_logical = nnx.to_pure_dict(logical_axes(abstract))
        if parallel.pipeline > 1:
            all_logical = pipeline.storage_axes(all_logical, abstract.stack_kinds, parallel.pipeline)
        all_specs = state_specs(parallel, all_shapes, all_logical, mesh, model_dims(model_cfg))
        named = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        # LoRA (``options.lora``): only the adapters (LoRAParam) are trained, so
        # only they are "params" (float32 master, optimizer state, gradients); the rest is the
        # frozen base, held in the compute dtype in its storage layout, with no optimizer state.
        self.lora = options.lora
        self.trainable = trained_part(abstract) if self.lora is not None else all_shapes
        self.param_shapes = tree.select(all_shapes, self.trainable)
        self.logical = tree.select(all_logical, self.trainable)
        self.specs: StateSpecs = StateSpecs(*(tree.select(getattr(all_specs, f.name), self.trainable)
                                              for f in dataclasses.fields(StateSpecs)))
        self.base_shapes = tree.drop(all_shapes, self.trainable) if self.lora is not None else None
        self.base_shardings = named(tree.drop(all_specs.params, self.trainable)) if self.lora is not None else None
        self.base_compute_shardings = named(tree.drop(all_specs.compute, self.trainable)) if self.lora is not None else None
        self.compute_shardings = named(self.specs.compute)
        # Float32 master weights are optimizer state in Megatron's accounting: ZeRO-1 shards them.
        self.master_shardings = named(self.specs.optimizer if parallel.distributed_optimizer else self.specs.params)
        opt_shapes = jax.eval_shape(optimizer.init, self.param_shapes)
        opt_specs = optax.tree_map_params(
            optimizer, lambda _, spec: spec, opt_shapes, self.specs.optimizer,
            transform_non_params=lambda _: PartitionSpec(),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
        self.state_shardings = {
            "params": self.master_shardings,
            "opt_state": named(opt_specs),
            "iteration": NamedSharding(mesh, PartitionSpec()),
            "loss_scale": None if loss_scaler is None else jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), loss_scaler.init()),
        }
        if self.lora is not None:
            self.state_shardings["base"] = self.base_shardings
        with use_rules(self.rules):
            # Under context parallelism each row's tokens are split over the context ranks, in
            # the load-balanced order shard_batch lays them out in (sharding.context).
            batch_spec = logical_to_spec((None, "act_batch", "act_seq"), self.rules, mesh.axis_names)
        if not split_within_processes(mesh, axes_tuple(batch_spec[2] if len(batch_spec) > 2 else None)):
            raise ValueError(
                f"--context-parallel-size {parallel.context}: a row's context ranks span several processes "
                "(hosts), and feeding rows split across hosts is not implemented; keep --tensor-model-parallel-size "
                "x --context-parallel-size within one host's devices")
        self.batch_sharding = NamedSharding(mesh, batch_spec)       # [micro, rows, seq]
        self.eval_batch_sharding = NamedSharding(mesh, PartitionSpec(*batch_spec[1:]))  # [rows, seq]
        self._train_step = None
        self._eval_step: dict[bool, Any] = {}  # jitted eval, by whether the batch has a micro axis

    # ----- state --------------------------------------------------------------------------
    def _wrap(self, params: Any, base: Any = None) -> dict[str, Any]:
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.state_shardings["opt_state"])(params)
        state = {
            "params": params,
            "opt_state": opt_state,
            "iteration": jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings["iteration"]),
            "loss_scale": None if self.loss_scaler is None else jax.device_put(self.loss_scaler.init(), self.state_shardings["loss_scale"]),
        }
        if self.lora is not None:
            state["base"] = base
        return state

    @property
    def base_dtype(self):
        """The frozen base's dtype under LoRA: the compute dtype."""
        return DTYPES[self.step_cfg.compute_dtype]

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
            params, base = jax.jit(lambda: (self._split(build())[0], self._split(build_base(), cast=True)[1]),
                                   out_shardings=(self.master_shardings, self.base_shardings))()
        return self._wrap(params, base)

    def _split(self, full: Any, cast: bool = False) -> tuple[Any, Any]:
        """A full weights tree -> (adapters, base), the base cast to the compute dtype with ``cast``."""
        base = tree.drop(full, self.trainable)
        if cast:
            base = jax.tree_util.tree_map_with_path(
                lambda path, p: p if _is_expert_bias(path) else p.astype(self.base_dtype), base)
        return tree.select(full, self.trainable), base

    def weights(self, state: dict[str, Any]) -> Any:
        """The model's full weights tree of a state (what :meth:`model` and :meth:`eval_step`
        take): the params, and under LoRA the frozen base with the adapters."""
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
                lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype if _is_expert_bias(path) else self.base_dtype),
                self.base_shapes)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    def state_from_params(self, params: Any, seed: int = 0) -> dict[str, Any]:
        """State around given weights (e.g. from ``load_pretrained``), optimizer fresh. Under
        LoRA ``params`` is the base, with or without adapters: missing adapters start fresh
        (``seed``'s A, B = 0, so the model starts equal to its base)."""
        if self.lora is not None:
            base = tree.drop(params, self.trainable)
            base = jax.device_put(self._split(tree.merge(base, {}), cast=True)[1], self.base_shardings)
            if tree.contains(params, self.trainable):
                adapters = tree.select(params, self.trainable)
            else:
                adapters = self._fresh_adapters(seed)
            adapters = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), adapters)
            return self._wrap(jax.device_put(adapters, self.master_shardings), base)
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        return self._wrap(jax.device_put(params, self.master_shardings))

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
            merged = jax.jit(lambda base, adapters: folded(base, adapters, self.lora.scaling))(state["base"], state["params"])
        return nnx.merge(graphdef, merged)

    # ----- the step -------------------------------------------------------------------------
    def _to_compute(self, params: Any, base: Any = None) -> Any:
        """The model's weights in the compute dtype and layout: ``params`` cast (and under LoRA
        merged with the frozen ``base``, already in the compute dtype)."""
        return self._with_base(self._cast(params), base)

    def _cast(self, params: Any) -> Any:
        """The trained ``params`` in the compute dtype and layout (gathered over the data ranks
        when the master copy is ZeRO-1 or FSDP-sharded)."""
        dtype = DTYPES[self.step_cfg.compute_dtype]
        # The expert bias stays float32 (Megatron keeps it so too): it only compares scores.
        return jax.tree_util.tree_map_with_path(
            lambda path, p, s: jax.lax.with_sharding_constraint(p if _is_expert_bias(path) else p.astype(dtype), s),
            params, self.compute_shardings,
        )

    def _with_base(self, cast: Any, base: Any) -> Any:
        """The model's weights: the ``cast`` trained ones, under LoRA merged with the frozen ``base``."""
        if self.lora is None:
            return cast
        base = jax.tree.map(jax.lax.with_sharding_constraint, base, self.base_compute_shardings)
        return tree.merge(base, cast)

    def _micro_loss(self, params, mb, scale, global_counts=None, micro_index=None, base=None, cast=True):
        """One micro-batch's scaled objective and its aux; ``params`` are the float32 master
        weights, or with ``cast=False`` the trained weights already in the compute dtype and layout."""
        cfg, sc = self.model_cfg, self.step_cfg
        model = nnx.merge(self.graphdef, self._to_compute(params, base) if cast else self._with_base(params, base))
        h, stats = model.hidden_states(mb["input_ids"], segment_ids=mb["segment_ids"], positions=mb["positions"])
        objective, ce_sum, count = model.weighted_loss_sums(h, mb["labels"], mb["loss_mask"], mb["loss_weight"])
        aux = {"ce_sum": ce_sum, "loss_tokens": count, "lm_objective": objective}
        if stats:
            router_objective, per_layer, counts = losses.router_losses(
                stats, sc.load_balancing(), cfg.top_k, global_counts, micro_index,
                num_micro_batches=sc.num_micro_batches, loss_tokens=mb.get(losses.ROUTER_LOSS_TOKENS))
            objective = objective + router_objective
            aux.update(router_layers=per_layer, tokens_per_expert=stats["tokens_per_expert"],
                       dropped_tokens=jnp.sum(stats["dropped_tokens"]),
                       ep_overflow_rows=jnp.sum(stats["ep_overflow_rows"]))
            if global_counts is not None:
                aux["global_counts"] = counts
        return objective * scale, aux

    def _update_expert_bias(self, params, tokens_LE):
        """``params`` with every MoE stack's ``expert_bias`` moved by Megatron's
        ``get_updated_expert_bias`` from ``tokens_LE`` (the step's routed load, MoE layers in order)."""
        layers, first = dict(params["layers"]), 0
        for i, stack in enumerate(self.stack_kinds):
            if not stack.moe:
                continue
            n = stack.count
            stack = dict(layers[i])
            mlp = dict(stack["mlp"])
            mlp["expert_bias"] = updated_expert_bias(mlp["expert_bias"], tokens_LE[first:first + n],
                                                     self.step_cfg.expert_bias_update_rate)
            stack["mlp"], layers[i] = mlp, stack
            first += n
        return {**params, "layers": layers}

    def _pipeline_loss(self, params, batch, scale, graphdef=None, base=None):
        """All micro-batches through the pipeline stages at once (see ``mlir_train.train.pipeline``)."""
        sc = self.step_cfg
        return pipeline.pipeline_loss(
            self.graphdef if graphdef is None else graphdef, self._to_compute(params, base), batch, schedule=self.schedule,
            scale=scale, top_k=self.model_cfg.top_k, remat=self.options.remat,
            balancing=sc.load_balancing(),
        )

    def _pipeline_value_and_grad(self, params, batch, scale, base=None):
        sc = self.step_cfg
        (objective, aux), grads = pipeline.pipeline_value_and_grad(
            self.graphdef, self._to_compute(params, base), batch, schedule=self.schedule,
            scale=scale, top_k=self.model_cfg.top_k, remat=self.options.remat,
            balancing=sc.load_balancing(), trainable=None if self.lora is None else self.trainable,
        )
        # Under LoRA 1F1B differentiates the adapters alone (the frozen base is closed over: no
        # weight-gradient matmuls, no accumulators for it); the gradients are the adapters'.
        # The transpose of _to_compute (cast, compute-layout constraint), kept in float32.
        grads = jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g, s), grads, self.compute_shardings)
        return (objective, aux), grads

    def _step(self, state, batch):
        params, base = state["params"], state.get("base")
        scaler, ls = self.loss_scaler, state["loss_scale"]
        scale = ls.scale if scaler is not None else jnp.float32(1.0)
        n_loss_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        sc = self.step_cfg
        batch = dict(batch, loss_weight=losses.loss_token_weights(
            batch["loss_mask"], micro_batch_size=sc.micro_batch_size, per_token=sc.per_token_loss))
        if sc.per_token_loss and self.model_cfg.is_moe:  # the router losses weigh by it (losses.router_losses)
            batch[losses.ROUTER_LOSS_TOKENS] = jnp.broadcast_to(n_loss_tokens, batch["loss_mask"].shape[:1])
        grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)
        # The compute-dtype weights are formed once per step, before the accumulation loop, as
        # Megatron's distributed optimizer keeps its bf16 weights whole over the data ranks during
        # the step: under ZeRO-1 one all-gather per step, not one per micro-batch (the gradient
        # w.r.t. the cast weights is the master's: the cast's transpose is a cast back to float32).
        # Under FSDP the gather stays per use (inside the loop): not holding whole weights is its point.
        hoist = not self.parallel.fsdp
        weights = self._cast(params) if hoist else params

        def micro(carry, xs):
            acc, counts = carry  # counts: global_aux_loss's running expert counts, or None
            mb, i = xs
            (_, aux), g = grad_fn(weights, mb, scale, counts, i, base, not hoist)
            if hoist:  # reduced over the data ranks into the accumulator's (master) layout
                g = jax.tree.map(jax.lax.with_sharding_constraint, g, self.master_shardings)
            acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)
            return (acc, aux.pop("global_counts", None)), aux

        if self.schedule is None:
            zeros = jax.tree.map(jnp.zeros_like, params)
            counts = None
            if self.model_cfg.is_moe and self.step_cfg.load_balancing().uses_global:
                counts = jnp.zeros((sum(self.model_cfg.moe_layers()), self.model_cfg.num_experts), jnp.float32)
            m = batch["input_ids"].shape[0]
            (grads, _), aux = jax.lax.scan(micro, (zeros, counts), (batch, jnp.arange(m)))
        elif self.schedule.kind == "1f1b":  # the schedule forms the gradients itself
            (_, aux), grads = self._pipeline_value_and_grad(params, batch, scale, base)
        else:
            (_, aux), grads = jax.value_and_grad(self._pipeline_loss, has_aux=True)(params, batch, scale, None, base)
        grads = jax.tree.map(lambda g: g / scale, grads)
        grad_norm = global_norm(grads)
        finite = jnp.isfinite(grad_norm)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        new_state = {"params": new_params, "opt_state": opt_state, "iteration": state["iteration"] + 1, "loss_scale": ls}
        if self.lora is not None:
            new_state["base"] = base
        if scaler is not None:
            # An fp16 overflow skips the update (weights, moments and schedule count stay).
            new_state["params"] = select_tree(finite, new_params, params)
            new_state["opt_state"] = select_tree(finite, opt_state, state["opt_state"])
            new_state["loss_scale"] = scaler.update(ls, ~finite)
        if self.expert_bias:
            # Aux-loss-free balancing, outside the gradient: each layer's bias moves by the update
            # rate against its load over the whole global batch. Megatron does this in
            # finalize_model_grads, before the optimizer step, so an fp16-skipped step moves it too.
            new_state["params"] = self._update_expert_bias(new_state["params"], jnp.sum(aux["tokens_per_expert"], axis=0))
        metrics = {
            "lm loss": (jnp.sum(aux["lm_objective"]) if self.step_cfg.lm_loss_report == "objective"
                        else jnp.sum(aux["ce_sum"]) / n_loss_tokens),
            "grad-norm": grad_norm,
            "loss tokens": jnp.sum(aux["loss_tokens"]),
            "skipped": (~finite).astype(jnp.int32) if scaler is not None else jnp.int32(0),
            "loss-scale": scale,
        }
        if "router_layers" in aux:
            lb = self.step_cfg.load_balancing()
            # Raw (coefficient-free) per-layer values, the mean over micro-batches: [L_moe] each.
            layers = {k: jnp.mean(v, axis=0) for k, v in aux["router_layers"].items()}
            metrics.update({f"{name} per layer": v for name, v in layers.items()})
            metrics["load_balancing_loss"] = lb.coeff("aux_loss") * jnp.mean(layers["load_balancing_loss"])
            metrics["aux_loss_raw"] = jnp.mean(layers["load_balancing_loss"])
            metrics["z_loss"] = lb.z_loss_coeff * jnp.mean(layers["z_loss"])
            for kind in ("seq_aux_loss", "global_aux_loss"):
                name = policies.TRACKER_NAMES[kind]
                if name in layers:
                    metrics[name] = lb.coeff(kind) * jnp.mean(layers[name])
            metrics["tokens_per_expert"] = jnp.sum(aux["tokens_per_expert"], axis=0)  # [L_moe, E]
            metrics["dropped_tokens"] = jnp.sum(aux["dropped_tokens"])
            metrics["ep_overflow_rows"] = jnp.sum(aux["ep_overflow_rows"])
        return new_state, metrics

    def _jitted_train_step(self):
        if self._train_step is None:
            self._train_step = jax.jit(
                self._step,
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

    def _eval(self, weights, batch):
        params, base = (weights, None) if self.lora is None else (tree.select(weights, self.trainable),
                                                                  tree.drop(weights, self.trainable))
        if batch["input_ids"].ndim == 2:
            batch = {k: v[None] for k, v in batch.items()}
        if self.schedule is not None:  # the forward half of the training pipeline
            _, aux = self._pipeline_loss(params, dict(batch, loss_weight=batch["loss_mask"]), jnp.float32(1.0),
                                         self.eval_graphdef, base)
            return {"ce_sum": aux["ce_sum"], "loss_tokens": aux["loss_tokens"]}
        model = nnx.merge(self.eval_graphdef, self._to_compute(params, base))

        def micro(acc, mb):
            h, _ = model.hidden_states(mb["input_ids"], segment_ids=mb["segment_ids"], positions=mb["positions"])
            ce_sum, count = losses.cross_entropy_sum(model.logits(h), mb["labels"], mb["loss_mask"])
            return (acc[0] + ce_sum, acc[1] + count), None

        (ce_sum, count), _ = jax.lax.scan(micro, (jnp.float32(0.0), jnp.float32(0.0)), batch)
        return {"ce_sum": ce_sum, "loss_tokens": count}

    def eval_step(self, params, batch):
        """``params``: :meth:`weights` of a state. Summed token loss and loss-token count, forward only, of a ``[micro, rows, seq]`` batch
        (as :meth:`train_step` takes; Megatron's evaluation iteration is one global batch in
        micro-batches, pipelined under PP as here) or of one ``[rows, seq]`` micro-batch."""
        micro = batch["input_ids"].ndim == 3
        if self._eval_step.get(micro) is None:
            sharding = self.batch_sharding if micro else self.eval_batch_sharding
            weights = self.master_shardings if self.lora is None else tree.merge(self.base_shardings, self.master_shardings)
            self._eval_step[micro] = jax.jit(self._eval, in_shardings=(weights, {k: sharding for k in BATCH_KEYS}))
        with jax.set_mesh(self.mesh), use_rules(self.rules), compile_target(self.mesh):
            return self._eval_step[micro](params, batch)

    def global_batch(self, rows: dict[str, Any]) -> dict[str, jax.Array]:
        """This process's rows of one global batch (``[rows, seq]`` host arrays, as the loader
        yields them) as the step's sharded ``[micro, rows / micro, seq]`` batch."""
        m = self.step_cfg.num_micro_batches
        return self.shard_batch({k: v.reshape(m, v.shape[0] // m, *v.shape[1:]) for k, v in rows.items()})

    def shard_batch(self, batch: dict[str, Any], *, micro: bool = True) -> dict[str, jax.Array]:
        """Host numpy arrays of this process's rows -> global sharded arrays. Under context
        parallelism every per-token array is first put in Megatron's load-balanced order
        (:func:`sharding.context.to_zigzag`), the same permutation for all of them, so each
        context rank receives chunks ``r`` and ``2CP-1-r`` of every row."""
        sharding = self.batch_sharding if micro else self.eval_batch_sharding
        cp = self.parallel.context
        return {k: jax.make_array_from_process_local_data(sharding, to_zigzag(np.asarray(batch[k]), cp, axis=-1))
                for k in BATCH_KEYS}
