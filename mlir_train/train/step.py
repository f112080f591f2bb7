"""What one training or evaluation step computes: the objective, its gradients, the update and
the logged metrics, as pure functions of the state and a batch. :class:`~mlir_train.train.trainer.Trainer`
compiles them (one ``jax.jit`` each, with the shardings of :mod:`mlir_train.train.state`).

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
* MoE load balancing (``losses.router_losses``, the run's one ``policies.LoadBalancing``): each of
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
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mlir_train.config import policies
from mlir_train.config.models import ModelConfig
from mlir_train.model import losses, mtp, tree
from mlir_train.model.moe.dispatch import COUNTS as DISPATCH_COUNTS
from mlir_train.model.moe.router import updated_expert_bias
from mlir_train.train import pipeline, reduction
from mlir_train.train.optim import LossScaler, global_norm, select_tree
from sharding import logical_shard_map

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """How a step computes, beyond the model and the layout (both resolved elsewhere, once)."""

    num_micro_batches: int = 1
    compute_dtype: str = "float32"  # float32 | bfloat16 | float16
    # --moe-router-load-balancing-type with --moe-aux-loss-coeff / --moe-z-loss-coeff
    balancing: policies.LoadBalancing = policies.LoadBalancing()
    expert_bias_update_rate: float = 1e-3  # --moe-router-bias-update-rate (with an expert bias)
    micro_batch_size: int = 1  # --micro-batch-size: rows of one data-parallel rank's micro-batch
    per_token_loss: bool = False  # --calculate-per-token-loss
    # logged "lm loss": "objective" (AIAK's SFT phase: the normalised LM objective) or
    # "token-mean" (Megatron-LM: global CE sum / global loss tokens, whatever the normalisation)
    lm_loss_report: str = "objective"
    mtp_loss_scaling_factor: float = 0.1  # --mtp-loss-scaling-factor (with --mtp-num-layers)

    def __post_init__(self):
        if self.lm_loss_report not in ("objective", "token-mean"):
            raise ValueError(f"StepConfig.lm_loss_report {self.lm_loss_report!r}: 'objective' or 'token-mean'")


def is_expert_bias(path) -> bool:
    """Whether a tree path names an ``expert_bias``: kept float32 (Megatron does too), it only
    compares router scores."""
    return bool(path) and getattr(path[-1], "key", None) == "expert_bias"


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """The static settings of a trainer's steps; :meth:`train` and :meth:`evaluate` are the
    functions the trainer compiles. Under LoRA ``trained`` is the adapters' template and the
    frozen base comes beside the trained weights, in the compute dtype."""

    model_cfg: ModelConfig
    cfg: StepConfig
    optimizer: optax.GradientTransformation
    loss_scaler: LossScaler | None
    graphdef: Any
    eval_graphdef: Any
    stack_kinds: tuple
    schedule: pipeline.Schedule | None
    remat: Any
    fsdp: bool
    moves_expert_bias: bool      # --moe-router-enable-expert-bias
    trained: Any                 # LoRA's template of the trained part; None: every parameter
    compute: Any                 # the trained weights' compute-layout shardings
    master: Any                  # their float32 master shardings
    logical: Any = None          # the trained weights' logical axes
    base_compute: Any = None     # the frozen base's compute-layout shardings (LoRA)
    base_logical: Any = None     # the frozen base's logical axes (LoRA)

    # ----- the weights in the compute dtype and layout ------------------------------------------
    def cast(self, params: Any) -> Any:
        """The trained ``params`` in the compute dtype and layout (gathered over the data ranks
        when the master copy is ZeRO-1 or FSDP-sharded)."""
        dtype = DTYPES[self.cfg.compute_dtype]
        return jax.tree_util.tree_map_with_path(
            lambda path, p, s: jax.lax.with_sharding_constraint(p if is_expert_bias(path) else p.astype(dtype), s),
            params, self.compute)

    def with_base(self, cast: Any, base: Any) -> Any:
        """The model's weights: the ``cast`` trained ones, under LoRA merged with the frozen ``base``."""
        if self.trained is None:
            return cast
        return tree.merge(jax.tree.map(jax.lax.with_sharding_constraint, base, self.base_compute), cast)

    def to_compute(self, params: Any, base: Any = None) -> Any:
        """The model's weights in the compute dtype and layout: ``params`` cast (and under LoRA
        merged with the frozen ``base``, already in the compute dtype)."""
        return self.with_base(self.cast(params), base)

    # ----- the objective ----------------------------------------------------------------------
    def micro_loss(self, params, mb, scale, global_counts=None, micro_index=None, base=None, cast=True):
        """One micro-batch's scaled objective and its aux; ``params`` are the float32 master
        weights, or with ``cast=False`` the trained weights already in the compute dtype and layout
        (and ``base`` placed: this may run inside the data-manual region, where the constraints
        are the caller's)."""
        weights = self.to_compute(params, base) if cast else params if self.trained is None else tree.merge(base, params)
        model = nnx.merge(self.graphdef, weights)
        h, stats = model.hidden_states(mb["input_ids"], segment_ids=mb["segment_ids"], positions=mb["positions"])
        objective, ce_sum, count = model.weighted_loss_sums(h, mb["labels"], mb["loss_mask"], mb["loss_weight"])
        aux = {"ce_sum": ce_sum, "loss_tokens": count, "lm_objective": objective}
        if self.model_cfg.mtp_num_layers:  # the MTP depths after the decoder, their routers after its
            h_mtp, mtp_stats = model.mtp_hidden_states(
                h, [mb[mtp.key("mtp_input_ids", k)] for k in range(1, self.model_cfg.mtp_num_layers + 1)],
                segment_ids=mb["segment_ids"], positions=mb["positions"])
            mtp_objective, aux["mtp_losses"] = mtp.depth_loss(model, h_mtp, mb)
            objective = objective + mtp_objective
            if mtp_stats:
                stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, mtp_stats)
        if stats:
            router_objective, per_layer, counts = losses.router_losses(
                stats, self.cfg.balancing, self.model_cfg.top_k, global_counts, micro_index,
                num_micro_batches=self.cfg.num_micro_batches, loss_tokens=mb.get(losses.ROUTER_LOSS_TOKENS))
            objective = objective + router_objective
            aux.update(router_layers=per_layer, tokens_per_expert=stats["tokens_per_expert"],
                       **{name: jnp.sum(stats[name]) for name in DISPATCH_COUNTS})
            if global_counts is not None:
                aux["global_counts"] = counts
        return objective * scale, aux

    def data_manual(self, batch) -> tuple[str, ...]:
        """What the step's region is manual over for its unreduced gradients
        (:func:`~mlir_train.train.reduction.data_manual_names`): none under FSDP."""
        if self.fsdp:
            return ()
        groups = self.cfg.micro_batch_size if self.model_cfg.is_moe else 1
        return reduction.data_manual_names(batch["input_ids"].shape[1], groups)

    def pipeline_loss(self, params, batch, scale, graphdef=None, base=None, data_manual=()):
        """All micro-batches through the pipeline stages at once (see ``mlir_train.train.pipeline``)."""
        return pipeline.pipeline_loss(
            self.graphdef if graphdef is None else graphdef, self.to_compute(params, base), batch,
            schedule=self.schedule, scale=scale, top_k=self.model_cfg.top_k, remat=self.remat,
            balancing=self.cfg.balancing, data_manual=data_manual)

    def pipeline_value_and_grad(self, params, batch, scale, base=None):
        """1F1B's objective and gradients. Under LoRA it differentiates the adapters alone (the
        frozen base is closed over: no weight-gradient matmuls, no accumulators for it)."""
        (objective, aux), grads = pipeline.pipeline_value_and_grad(
            self.graphdef, self.to_compute(params, base), batch, schedule=self.schedule,
            scale=scale, top_k=self.model_cfg.top_k, remat=self.remat, balancing=self.cfg.balancing,
            trainable=self.trained, data_manual=self.data_manual(batch))
        # The data ranks' float32 sum placed in the master layout (the transpose of to_compute's
        # cast and compute-layout constraint): one reduce-scatter per gradient under ZeRO-1.
        return (objective, aux), jax.tree.map(jax.lax.with_sharding_constraint, grads, self.master)

    def accumulated(self, params, base, batch, scale):
        """``(aux, gradients)`` summed over the micro-batches of ``batch`` (no pipeline).

        The compute-dtype weights are formed once per step, before the accumulation loop, as
        Megatron's distributed optimizer keeps its bf16 weights whole over the data ranks during
        the step: under ZeRO-1 one all-gather per step, not one per micro-batch (the gradient
        w.r.t. the cast weights is the master's: the cast's transpose is a cast back to float32).
        The loop then runs per data rank, each accumulating its own gradients unreduced in
        float32, reduced once after it (:mod:`mlir_train.train.reduction`). Under FSDP the
        gather stays per use (inside the loop): not holding whole weights is its point, and its
        gradients are reduce-scattered per micro-batch into the master layout."""
        if self.fsdp:
            return self.micro_batches(params, base, batch, scale, cast=True)
        weights = self.cast(params)
        if base is not None:
            base = jax.tree.map(jax.lax.with_sharding_constraint, base, self.base_compute)
        manual = self.data_manual(batch)
        if not manual:
            aux, grads = self.micro_batches(weights, base, batch, scale, cast=False)
            return aux, jax.tree.map(jax.lax.with_sharding_constraint, grads, self.master)

        def per_rank(weights, base, batch, scale):
            aux, grads = self.micro_batches(weights, base, batch, scale, cast=False)
            return reduction.reduced_aux(aux), reduction.with_rank_axis(grads)

        # The weights enter as their logical axes split them (routed experts over expert ranks,
        # which are data ranks too; the router's over its token ranks); each rank's gradients
        # leave with a leading rank axis.
        weights, names = reduction.token_partial(weights, self.logical, manual)
        run = logical_shard_map(per_rank, in_names=(names, self.base_logical,
                                                    jax.tree.map(reduction.row_names, batch), ()),
                                out_names=((), reduction.partial_specs(names, manual)), manual=manual,
                                check_vma=False)
        aux, partials = run(weights, base, batch, scale)
        return aux, reduction.summed(partials, self.master, self.logical)

    def micro_batches(self, weights, base, batch, scale, *, cast: bool):
        """``(aux, float32 gradients)`` of ``batch``'s micro-batches, a scan adding each one's into
        accumulators: ``weights`` are the master ones (``cast``: cast per use, FSDP's gather) or
        the compute-dtype ones with ``base`` placed."""
        grad_fn = jax.value_and_grad(self.micro_loss, has_aux=True)

        def micro(carry, xs):
            acc, counts = carry  # counts: global_aux_loss's running expert counts, or None
            mb, i = xs
            w = weights
            if cast:
                # FSDP gathers per use: the master weights tied to this micro-batch, so that no
                # compiler moves their gather out of the loop (jax 0.12.1's XLA:CPU did, with its
                # loop-invariant code motion off), which would hold every weight whole for the step.
                w, mb = jax.lax.optimization_barrier((w, mb))
            (_, aux), g = grad_fn(w, mb, scale, counts, i, base, cast)
            if cast:  # FSDP: reduce-scattered into the master layout per micro-batch
                g = jax.tree.map(jax.lax.with_sharding_constraint, g, self.master)
            acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)
            return (acc, aux.pop("global_counts", None)), aux

        counts = None
        if self.model_cfg.is_moe and self.cfg.balancing.uses_global:
            counts = jnp.zeros((self.model_cfg.router_layers(), self.model_cfg.num_experts), jnp.float32)
        m = batch["input_ids"].shape[0]
        zeros = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), weights)
        (grads, _), aux = jax.lax.scan(micro, (zeros, counts), (batch, jnp.arange(m)))
        return aux, grads

    def gradients(self, params, base, batch, scale):
        """``(aux, gradients of the scaled objective)``, by the run's schedule."""
        if self.schedule is None:
            return self.accumulated(params, base, batch, scale)
        if self.schedule.kind == "1f1b":  # the schedule forms the gradients itself
            (_, aux), grads = self.pipeline_value_and_grad(params, batch, scale, base)
        else:
            loss = functools.partial(self.pipeline_loss, data_manual=self.data_manual(batch))
            (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, scale, None, base)
        return aux, grads

    # ----- the step -----------------------------------------------------------------------------
    def train(self, state, batch):
        """One optimizer step on a global batch with leaves ``[num_micro, rows, seq]``: the new
        state and the step's metrics."""
        scaler, ls = self.loss_scaler, state["loss_scale"]
        scale = ls.scale if scaler is not None else jnp.float32(1.0)
        n_loss_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        batch = dict(batch, loss_weight=losses.loss_token_weights(
            batch["loss_mask"], micro_batch_size=self.cfg.micro_batch_size, per_token=self.cfg.per_token_loss))
        if self.cfg.per_token_loss and self.model_cfg.is_moe:  # the router losses weigh by it (losses.router_losses)
            batch[losses.ROUTER_LOSS_TOKENS] = jnp.broadcast_to(n_loss_tokens, batch["loss_mask"].shape[:1])
        if self.model_cfg.mtp_num_layers:
            batch.update(mtp.depth_inputs(batch, self.model_cfg.mtp_num_layers, self.cfg.mtp_loss_scaling_factor,
                                          micro_batch_size=self.cfg.micro_batch_size, per_token=self.cfg.per_token_loss))
        aux, grads = self.gradients(state["params"], state.get("base"), batch, scale)
        grads = jax.tree.map(lambda g: g / scale, grads)
        grad_norm = global_norm(grads)
        finite = jnp.isfinite(grad_norm)
        new_state = self.updated(state, grads, finite, aux)
        return new_state, self.metrics(aux, grad_norm, finite, scale, n_loss_tokens)

    def updated(self, state, grads, finite, aux):
        """The state after the optimizer update of ``grads``."""
        params, scaler, ls = state["params"], self.loss_scaler, state["loss_scale"]
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        new_state = {"params": new_params, "opt_state": opt_state, "iteration": state["iteration"] + 1, "loss_scale": ls}
        if self.trained is not None:
            new_state["base"] = state["base"]
        if scaler is not None:
            # An fp16 overflow skips the update (weights, moments and schedule count stay).
            new_state["params"] = select_tree(finite, new_params, params)
            new_state["opt_state"] = select_tree(finite, opt_state, state["opt_state"])
            new_state["loss_scale"] = scaler.update(ls, ~finite)
        if self.moves_expert_bias:
            # Aux-loss-free balancing, outside the gradient: each layer's bias moves by the update
            # rate against its load over the whole global batch. Megatron does this in
            # finalize_model_grads, before the optimizer step, so an fp16-skipped step moves it too.
            new_state["params"] = self.with_expert_bias(new_state["params"], jnp.sum(aux["tokens_per_expert"], axis=0))
        return new_state

    def with_expert_bias(self, params, tokens_LE):
        """``params`` with every MoE stack's ``expert_bias`` moved by Megatron's
        ``get_updated_expert_bias`` from ``tokens_LE`` (the step's routed load, MoE layers in order)."""
        layers = dict(params["layers"])
        kinds = self.model_cfg.layer_kinds() + self.model_cfg.mtp_kinds()
        moe_index = np.cumsum([k.moe for k in kinds]) - 1  # each layer's MoE row (the MTP depths' last)
        moved = lambda mlp, rows: {**mlp, "expert_bias": updated_expert_bias(mlp["expert_bias"], tokens_LE[rows],
                                                                            self.cfg.expert_bias_update_rate)}
        for i, stack in enumerate(self.stack_kinds):
            if not stack.moe:
                continue
            stack, rows = dict(layers[i]), moe_index[list(stack.layers)]
            stack["mlp"], layers[i] = moved(stack["mlp"], rows), stack
        params = {**params, "layers": layers}
        if params.get("mtp"):
            first = self.model_cfg.num_layers
            depths = dict(params["mtp"])
            for d, kind in enumerate(self.model_cfg.mtp_kinds()):
                if kind.moe:
                    depth = dict(depths[d])
                    depth["layer"] = {**depth["layer"], "mlp": moved(depth["layer"]["mlp"], moe_index[[first + d]])}
                    depths[d] = depth
            params["mtp"] = depths
        return params

    def metrics(self, aux, grad_norm, finite, scale, n_loss_tokens):
        """The step's logged values (:class:`~mlir_train.train.metrics.StepLogger` reads them)."""
        metrics = {
            "lm loss": (jnp.sum(aux["lm_objective"]) if self.cfg.lm_loss_report == "objective"
                        else jnp.sum(aux["ce_sum"]) / n_loss_tokens),
            "grad-norm": grad_norm,
            "loss tokens": jnp.sum(aux["loss_tokens"]),
            "skipped": (~finite).astype(jnp.int32) if self.loss_scaler is not None else jnp.int32(0),
            "loss-scale": scale,
        }
        if "mtp_losses" in aux:  # megatron-core's "mtp_k loss": summed over the micro-batches' weighted means
            metrics |= {f"mtp_{k + 1} loss": v for k, v in enumerate(jnp.sum(aux["mtp_losses"], axis=0))}
        if "router_layers" in aux:
            metrics.update(self.router_metrics(aux))
        return metrics

    def router_metrics(self, aux):
        lb = self.cfg.balancing
        # Raw (coefficient-free) per-layer values, the mean over micro-batches: [L_moe] each.
        layers = {k: jnp.mean(v, axis=0) for k, v in aux["router_layers"].items()}
        metrics = {f"{name} per layer": v for name, v in layers.items()}
        metrics["load_balancing_loss"] = lb.coeff("aux_loss") * jnp.mean(layers["load_balancing_loss"])
        metrics["aux_loss_raw"] = jnp.mean(layers["load_balancing_loss"])
        metrics["z_loss"] = lb.z_loss_coeff * jnp.mean(layers["z_loss"])
        for kind in ("seq_aux_loss", "global_aux_loss"):
            name = policies.TRACKER_NAMES[kind]
            if name in layers:
                metrics[name] = lb.coeff(kind) * jnp.mean(layers[name])
        metrics["tokens_per_expert"] = jnp.sum(aux["tokens_per_expert"], axis=0)  # [L_moe, E]
        metrics |= {name: jnp.sum(aux[name]) for name in DISPATCH_COUNTS}
        return metrics

    # ----- evaluation ---------------------------------------------------------------------------
    def evaluate(self, weights, batch):
        """Summed token loss and loss-token count of ``batch`` (``[micro, rows, seq]`` or one
        ``[rows, seq]`` micro-batch), forward only, the model routed as in evaluation."""
        params, base = (weights, None) if self.trained is None else (tree.select(weights, self.trained),
                                                                     tree.drop(weights, self.trained))
        if batch["input_ids"].ndim == 2:
            batch = {k: v[None] for k, v in batch.items()}
        if self.schedule is not None:  # the forward half of the training pipeline
            _, aux = self.pipeline_loss(params, dict(batch, loss_weight=batch["loss_mask"]), jnp.float32(1.0),
                                        self.eval_graphdef, base)
            return {"ce_sum": aux["ce_sum"], "loss_tokens": aux["loss_tokens"]}
        model = nnx.merge(self.eval_graphdef, self.to_compute(params, base))

        def micro(acc, mb):
            h, _ = model.hidden_states(mb["input_ids"], segment_ids=mb["segment_ids"], positions=mb["positions"])
            ce_sum, count = losses.cross_entropy_sum(model.logits(h), mb["labels"], mb["loss_mask"])
            return (acc[0] + ce_sum, acc[1] + count), None

        (ce_sum, count), _ = jax.lax.scan(micro, (jnp.float32(0.0), jnp.float32(0.0)), batch)
        return {"ce_sum": ce_sum, "loss_tokens": count}
