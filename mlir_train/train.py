"""The compiled training and eval steps, their state and its shardings.

One ``jax.jit`` per step kind, with explicit in/out shardings and the state donated. The
state is a plain pytree::

    {"params": float32 master weights (nested dict, the model's nnx state as pure arrays),
     "opt_state": optax state, "iteration": int32, "loss_scale": LossScaleState | None}

Megatron semantics matched here (see the tests for each):

* gradient accumulation over ``num_micro_batches`` micro-batches inside the step (a scan);
* loss = sum of token losses over the *whole global batch* / number of loss tokens in it, so
  micro-batches with more loss tokens weigh more (Megatron's per-token loss normalisation);
* MoE aux loss: ``coeff * sum over layers of switch_aux_loss(layer)`` per micro-batch,
  averaged over micro-batches (Megatron scales its aux-loss gradient by 1/num_microbatches);
  z-loss likewise. Logged ``load_balancing_loss`` is ``coeff * mean over layers`` as Megatron's
  tracker reports it;
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
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mlir_train import losses, pipeline
from mlir_train.config import ModelConfig
from mlir_train.model import Qwen3, logical_axes
from mlir_train.optim import LossScaler, global_norm, select_tree
from sharding import logical_to_spec, use_rules
from sharding.mesh import ParallelConfig
from sharding.rules import StateSpecs, rules_for, state_specs

BATCH_KEYS = ("input_ids", "labels", "loss_mask", "segment_ids", "positions")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class StepConfig:
    num_micro_batches: int = 1
    compute_dtype: str = "float32"  # float32 | bfloat16 | float16
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    layers_per_virtual_stage: int | None = None  # --num-layers-per-virtual-pipeline-stage
    pipeline_schedule: str = "1f1b"              # --pipeline-schedule: 1f1b | gpipe | circular
    first_stage_layers: int | None = None        # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None         # --decoder-last-pipeline-num-layers


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
        parallel: ParallelConfig,
        mesh: jax.sharding.Mesh,
        *,
        loss_scaler: LossScaler | None = None,
        model_kwargs: dict[str, Any] | None = None,
    ):
        self.model_cfg, self.step_cfg, self.optimizer = model_cfg, step_cfg, optimizer
        self.parallel, self.mesh, self.loss_scaler = parallel, mesh, loss_scaler
        self.model_kwargs = dict(model_kwargs or {})
        self.rules = rules_for(parallel, model_dims(model_cfg))
        abstract = nnx.eval_shape(lambda: Qwen3(model_cfg, rngs=nnx.Rngs(0), **self.model_kwargs))
        self.schedule = None if parallel.pipeline == 1 else pipeline.make_schedule(
            model_cfg.num_layers, parallel.pipeline, kind=step_cfg.pipeline_schedule,
            layers_per_virtual_stage=step_cfg.layers_per_virtual_stage,
            first_stage_layers=step_cfg.first_stage_layers, last_stage_layers=step_cfg.last_stage_layers,
            num_micro_batches=step_cfg.num_micro_batches,
        )
        self.graphdef, abstract_state = nnx.split(abstract)
        self.param_shapes = nnx.to_pure_dict(abstract_state)
        self.logical = nnx.to_pure_dict(logical_axes(abstract))
        if parallel.pipeline > 1:
            self.logical = pipeline.storage_axes(self.logical, abstract.stack_kinds, parallel.pipeline)
        self.specs: StateSpecs = state_specs(parallel, self.param_shapes, self.logical, mesh, model_dims(model_cfg))
        named = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda x: isinstance(x, PartitionSpec))
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
        with use_rules(self.rules):
            batch_spec = logical_to_spec((None, "act_batch", None), self.rules, mesh.axis_names)
        self.batch_sharding = NamedSharding(mesh, batch_spec)       # [micro, rows, seq]
        self.eval_batch_sharding = NamedSharding(mesh, PartitionSpec(*batch_spec[1:]))  # [rows, seq]
        self._train_step = None
        self._eval_step: dict[bool, Any] = {}  # jitted eval, by whether the batch has a micro axis

    # ----- state --------------------------------------------------------------------------
    def _wrap(self, params: Any) -> dict[str, Any]:
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.state_shardings["opt_state"])(params)
        return {
            "params": params,
            "opt_state": opt_state,
            "iteration": jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings["iteration"]),
            "loss_scale": None if self.loss_scaler is None else jax.device_put(self.loss_scaler.init(), self.state_shardings["loss_scale"]),
        }

    def init_state(self, seed: int) -> dict[str, Any]:
        """Fresh weights (Megatron's normal init with ``init_std``), born sharded: one compiled
        program creates every parameter directly in its master sharding."""
        cfg, kwargs = self.model_cfg, self.model_kwargs
        build = lambda: nnx.to_pure_dict(nnx.state(Qwen3(cfg, rngs=nnx.Rngs(seed), **kwargs)))
        with jax.set_mesh(self.mesh):
            params = jax.jit(build, out_shardings=self.master_shardings)()
        return self._wrap(params)

    def abstract_state(self) -> dict[str, Any]:
        """The state as ``ShapeDtypeStruct``s carrying their shardings: nothing allocated. For
        ahead-of-time compilation (memory/FLOP planning) and as a checkpoint restore target."""
        shapes = {
            "params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), self.param_shapes),
            "iteration": jax.ShapeDtypeStruct((), jnp.int32),
            "loss_scale": None if self.loss_scaler is None else jax.eval_shape(self.loss_scaler.init),
        }
        shapes["opt_state"] = jax.eval_shape(self.optimizer.init, shapes["params"])
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    def state_from_params(self, params: Any) -> dict[str, Any]:
        """State around given weights (e.g. from ``load_pretrained``), optimizer fresh."""
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        return self._wrap(jax.device_put(params, self.master_shardings))

    def model(self, params: Any) -> Qwen3:
        return nnx.merge(self.graphdef, params)

    # ----- the step -------------------------------------------------------------------------
    def _to_compute(self, params: Any) -> Any:
        dtype = DTYPES[self.step_cfg.compute_dtype]
        return jax.tree.map(
            lambda p, s: jax.lax.with_sharding_constraint(p.astype(dtype), s), params, self.compute_shardings
        )

    def _micro_loss(self, params, mb, n_loss_tokens, scale):
        cfg, sc = self.model_cfg, self.step_cfg
        model = nnx.merge(self.graphdef, self._to_compute(params))
        h, stats = model.hidden_states(mb["input_ids"], segment_ids=mb["segment_ids"], positions=mb["positions"])
        ce_sum, count = model.loss_sums(h, mb["labels"], mb["loss_mask"])
        objective = ce_sum / n_loss_tokens
        aux = {"ce_sum": ce_sum, "loss_tokens": count}
        if stats:
            aux_l = losses.switch_aux_loss_per_layer(stats, cfg.top_k)
            z_l = losses.z_loss_per_layer(stats)
            m = sc.num_micro_batches
            objective = objective + (sc.aux_loss_coeff * jnp.sum(aux_l) + sc.z_loss_coeff * jnp.sum(z_l)) / m
            aux.update(aux_layers=aux_l, z_layers=z_l, tokens_per_expert=stats["tokens_per_expert"],
                       dropped_tokens=jnp.sum(stats["dropped_tokens"]))
        return objective * scale, aux

    def _pipeline_loss(self, params, batch, n_loss_tokens, scale):
        """All micro-batches through the pipeline stages at once (see ``mlir_train.pipeline``)."""
        sc = self.step_cfg
        return pipeline.pipeline_loss(
            self.graphdef, self._to_compute(params), batch, schedule=self.schedule, n_loss_tokens=n_loss_tokens,
            scale=scale, top_k=self.model_cfg.top_k, aux_loss_coeff=sc.aux_loss_coeff, z_loss_coeff=sc.z_loss_coeff,
            remat=self.model_kwargs.get("remat", "none"),
        )

    def _pipeline_value_and_grad(self, params, batch, n_loss_tokens, scale):
        sc = self.step_cfg
        (objective, aux), grads = pipeline.pipeline_value_and_grad(
            self.graphdef, self._to_compute(params), batch, schedule=self.schedule, n_loss_tokens=n_loss_tokens,
            scale=scale, top_k=self.model_cfg.top_k, aux_loss_coeff=sc.aux_loss_coeff, z_loss_coeff=sc.z_loss_coeff,
            remat=self.model_kwargs.get("remat", "none"),
        )
        # The transpose of _to_compute (cast, compute-layout constraint), kept in float32.
        grads = jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g, s), grads, self.compute_shardings)
        return (objective, aux), grads

    def _step(self, state, batch):
        params = state["params"]
        scaler, ls = self.loss_scaler, state["loss_scale"]
        scale = ls.scale if scaler is not None else jnp.float32(1.0)
        n_loss_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

        def micro(acc, mb):
            (_, aux), g = grad_fn(params, mb, n_loss_tokens, scale)
            acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)
            return acc, aux

        if self.schedule is None:
            zeros = jax.tree.map(jnp.zeros_like, params)
            grads, aux = jax.lax.scan(micro, zeros, batch)
        elif self.schedule.kind == "1f1b":  # the schedule forms the gradients itself
            (_, aux), grads = self._pipeline_value_and_grad(params, batch, n_loss_tokens, scale)
        else:
            (_, aux), grads = jax.value_and_grad(self._pipeline_loss, has_aux=True)(params, batch, n_loss_tokens, scale)
        grads = jax.tree.map(lambda g: g / scale, grads)
        grad_norm = global_norm(grads)
        finite = jnp.isfinite(grad_norm)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        new_state = {"params": new_params, "opt_state": opt_state, "iteration": state["iteration"] + 1, "loss_scale": ls}
        if scaler is not None:
            # An fp16 overflow skips the update (weights, moments and schedule count stay).
            new_state["params"] = select_tree(finite, new_params, params)
            new_state["opt_state"] = select_tree(finite, opt_state, state["opt_state"])
            new_state["loss_scale"] = scaler.update(ls, ~finite)
        metrics = {
            "lm loss": jnp.sum(aux["ce_sum"]) / n_loss_tokens,
            "grad-norm": grad_norm,
            "loss tokens": jnp.sum(aux["loss_tokens"]),
            "skipped": (~finite).astype(jnp.int32) if scaler is not None else jnp.int32(0),
            "loss-scale": scale,
        }
        if "aux_layers" in aux:
            metrics["load_balancing_loss"] = self.step_cfg.aux_loss_coeff * jnp.mean(aux["aux_layers"])
            metrics["aux_loss_raw"] = jnp.mean(aux["aux_layers"])
            metrics["z_loss"] = self.step_cfg.z_loss_coeff * jnp.mean(aux["z_layers"])
            metrics["tokens_per_expert"] = jnp.sum(aux["tokens_per_expert"], axis=0)  # [L_moe, E]
            metrics["dropped_tokens"] = jnp.sum(aux["dropped_tokens"])
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
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            return step(state, batch)

    def lower_train_step(self, state_shapes, batch_shapes):
        """Ahead-of-time lowering, for FLOP and memory analysis without running anything."""
        step = self._jitted_train_step()
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            return step.lower(state_shapes, batch_shapes)

    def _eval(self, params, batch):
        if batch["input_ids"].ndim == 2:
            batch = {k: v[None] for k, v in batch.items()}
        if self.schedule is not None:  # the forward half of the training pipeline
            one = jnp.float32(1.0)
            _, aux = self._pipeline_loss(params, batch, one, one)
            return {"ce_sum": aux["ce_sum"], "loss_tokens": aux["loss_tokens"]}
        model = nnx.merge(self.graphdef, self._to_compute(params))

        def micro(acc, mb):
            h, _ = model.hidden_states(mb["input_ids"], segment_ids=mb["segment_ids"], positions=mb["positions"])
            ce_sum, count = losses.cross_entropy_sum(model.logits(h), mb["labels"], mb["loss_mask"])
            return (acc[0] + ce_sum, acc[1] + count), None

        (ce_sum, count), _ = jax.lax.scan(micro, (jnp.float32(0.0), jnp.float32(0.0)), batch)
        return {"ce_sum": ce_sum, "loss_tokens": count}

    def eval_step(self, params, batch):
        """Summed token loss and loss-token count, forward only, of a ``[micro, rows, seq]`` batch
        (as :meth:`train_step` takes; Megatron's evaluation iteration is one global batch in
        micro-batches, pipelined under PP as here) or of one ``[rows, seq]`` micro-batch."""
        micro = batch["input_ids"].ndim == 3
        if self._eval_step.get(micro) is None:
            sharding = self.batch_sharding if micro else self.eval_batch_sharding
            self._eval_step[micro] = jax.jit(
                self._eval, in_shardings=(self.master_shardings, {k: sharding for k in BATCH_KEYS})
            )
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            return self._eval_step[micro](params, batch)

    def shard_batch(self, batch: dict[str, Any], *, micro: bool = True) -> dict[str, jax.Array]:
        """Host numpy arrays of this process's rows -> global sharded arrays."""
        sharding = self.batch_sharding if micro else self.eval_batch_sharding
        return {k: jax.make_array_from_process_local_data(sharding, batch[k]) for k in BATCH_KEYS}
