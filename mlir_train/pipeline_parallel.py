"""Pipeline parallelism inside the one compiled train step: GPipe and circular schedules.

Shape suffixes: M micro-batches, B rows per micro-batch, T sequence, D hidden, P pipeline
stages, R virtual stages (layer chunks) per stage, V layers per chunk (L = P * R * V), E experts.

Layout
------
Every decoder-layer parameter is stacked ``[L, ...]`` with the logical axis ``"layers"``, which
the pipeline rule table maps to the ``"stage"`` mesh axis, so the stored (and checkpointed)
weights are just ``[L, ...]`` split contiguously over the stages. Inside the step
:func:`to_stages` views them as ``[P, R, V, ...]``: layer ``l = (r * P + s) * V + j`` is chunk
``r``, layer ``j`` of stage ``s`` (Megatron's interleaved assignment). For GPipe (R = 1) that is
a pure reshape of the stored split, no data moves. For R > 1 the stored contiguous split is not
the interleaved one, so XLA moves the layer weights between stages once per step (an
all-to-all of (P-1)/P of each stage's layer weights, in the compute dtype; the gradients go back
the same way). Only ``"stage"`` is manual (``shard_map`` via :func:`sharding.logical_shard_map`
with ``manual=("layers",)``); data, expert and tensor stay under XLA's automatic partitioning,
so TP, SP, DP and ZeRO-1 compose unchanged, and the expert-parallel ``shard_map`` of the MoE
block nests inside (manual over data and expert).

Schedule
--------
One ``lax.scan`` over ticks. At tick ``t`` stage ``s`` works on item ``w = t - s`` (valid when
``0 <= w < M * R``), item ``w = r * M + m`` being micro-batch ``m`` in chunk ``r``. A stage's
output moves to the next stage with one ``ppermute`` per tick (stage P-1 -> 0 closes the ring
for the circular schedule). Stage 0 takes new micro-batches for ``t < M`` and, for R > 1,
micro-batches coming round the ring after that, parked in an M-slot buffer until their turn
(needs ``M >= P``). What travels between stages is the micro-batch itself: its hidden states
and its segment ids, positions, labels and loss mask, so every stage builds the attention mask
and RoPE tables of the micro-batch it is working on. Autodiff through the scan gives the
backward (the reverse pipeline, with the transposed permutes).

The embedding is looked up on every stage each tick and used on stage 0 (a gather of ``B*T``
rows: no matmul); final norm, LM head and cross-entropy run under ``jax.checkpoint`` each tick
and count only on the last stage for the final chunk (their loss mask is zeroed elsewhere).
All stages execute them in lockstep (SPMD), which costs no wall time over doing it on the last
stage alone (that stage is on every tick's critical path), only idle-rank FLOPs: the head
adds ``2*B*T*D*V`` per tick to the ``P``-th of the layers' work, the imbalance Megatron has
too (hence its ``--decoder-last-pipeline-num-layers``). Router statistics are accumulated per
(chunk, layer) over valid items and come back in layer order, so aux and z losses are the
sums over all stages, as without the pipeline.

Cost per schedule (ticks of one chunk's work; a GPipe tick is one stage = R chunks):

=============  ===========================  ==========================  ==========================
schedule       step time                    bubble fraction             activations per device
=============  ===========================  ==========================  ==========================
GPipe (R=1)    (M + P - 1) stage-ticks      (P - 1) / (M + P - 1)       M micro-batches x L/P layers
circular (R)   (M*R + P - 1) chunk-ticks    (P - 1) / (M*R + P - 1)     M x L/P layers, plus an
                                                                        M-slot ring buffer [B,T,D]
=============  ===========================  ==========================  ==========================

Both keep the residuals of every tick for the backward, i.e. all M micro-batches in flight
(GPipe's memory profile; ``--recompute-granularity full`` cuts each layer's share to its
input). A 1F1B schedule, which bounds this by P in-flight micro-batches, is not implemented.
Bubble ticks compute on zeros and are masked out; ``benchmarks/pipeline.py`` measures both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mlir_train import losses
from mlir_train.model.transformer import run_stack
from sharding import logical_shard_map, mesh_axes_of
from sharding.mesh import ParallelConfigError

TRAVELLING = ("segment_ids", "positions", "labels", "loss_mask", "loss_weight")


@dataclasses.dataclass(frozen=True)
class Schedule:
    stages: int        # P, --pipeline-model-parallel-size
    virtual: int = 1   # R chunks per stage: 1 = GPipe, > 1 = circular (interleaved)


def make_schedule(
    num_layers: int,
    stages: int,
    *,
    layers_per_virtual_stage: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    num_stacks: int = 1,
    num_micro_batches: int | None = None,
) -> Schedule:
    """The schedule Megatron's flags ask for, or a :class:`ParallelConfigError` naming the flag."""
    p = stages
    if num_stacks > 1:
        raise ParallelConfigError(
            f"--pipeline-model-parallel-size {p}: the model mixes dense and MoE decoder layers "
            f"({num_stacks} layer stacks, from decoder_sparse_step / mlp_only_layers); pipeline "
            "stages over mixed stacks are not implemented"
        )
    even = num_layers // p if num_layers % p == 0 else None
    for flag, n in (("--decoder-first-pipeline-num-layers", first_stage_layers),
                    ("--decoder-last-pipeline-num-layers", last_stage_layers)):
        if n is not None and n != even:
            raise ParallelConfigError(
                f"{flag} {n}: uneven pipeline stages are not implemented; every stage holds "
                f"num_layers / --pipeline-model-parallel-size layers"
                + (f" = {even}" if even else f", and {num_layers} layers do not divide by {p}")
            )
    if num_layers % p:
        raise ParallelConfigError(
            f"decoder layers (num_layers={num_layers}) are not divisible by --pipeline-model-parallel-size ({p}); "
            "uneven splits (--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers) "
            "are not implemented"
        )
    virtual = 1
    if layers_per_virtual_stage is not None:
        per_stage = num_layers // p
        if layers_per_virtual_stage < 1 or per_stage % layers_per_virtual_stage:
            raise ParallelConfigError(
                f"--num-layers-per-virtual-pipeline-stage ({layers_per_virtual_stage}) must divide the "
                f"{per_stage} layers of each of the {p} pipeline stages"
            )
        virtual = per_stage // layers_per_virtual_stage
    if virtual > 1 and num_micro_batches is not None and num_micro_batches < p:
        raise ParallelConfigError(
            f"the circular schedule (--num-layers-per-virtual-pipeline-stage) needs at least as many "
            f"micro-batches as stages: {num_micro_batches} < --pipeline-model-parallel-size ({p})"
        )
    return Schedule(stages=p, virtual=virtual)


def to_stages(x_L: jax.Array, schedule: Schedule) -> jax.Array:
    """``[L, ...]`` -> ``[P, R, V, ...]``: layer ``(r * P + s) * V + j`` at ``[s, r, j]``."""
    p, r = schedule.stages, schedule.virtual
    x = x_L.reshape(r, p, x_L.shape[0] // (p * r), *x_L.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def from_stages(x_PRV: jax.Array) -> jax.Array:
    """Inverse of :func:`to_stages`."""
    x = jnp.swapaxes(x_PRV, 0, 1)
    return x.reshape(-1, *x.shape[3:])


def pipeline_loss(graphdef, params: dict[str, Any], batch: dict[str, jax.Array], *, schedule: Schedule,
                  scale, top_k: int, aux_loss_coeff: float, z_loss_coeff: float, remat: str,
                  balancing: losses.LoadBalancing | None = None):
    """The scaled training objective of all ``M`` micro-batches of ``batch`` (leaves
    ``[M, B, T]``, with the per-token ``loss_weight`` of :func:`losses.loss_token_weights`)
    through the pipeline, and the same ``aux`` the non-pipelined step collects.

    ``params`` are the compute-layout weights as a pure dict with one layer stack,
    ``params["layers"][0]`` (leaves ``[L, ...]``). Must run under the trainer's mesh and rules.
    """
    stage_axes, p = mesh_axes_of("layers")
    if p != schedule.stages:
        raise ValueError(f"'layers' is split over {p} devices but the schedule has {schedule.stages} stages")
    r_chunks = schedule.virtual
    m = batch["input_ids"].shape[0]
    if balancing is None:
        balancing = losses.LoadBalancing(coeffs=(("aux_loss", aux_loss_coeff),) if aux_loss_coeff else (),
                                         z_loss_coeff=z_loss_coeff)
    layers = jax.tree.map(lambda x: to_stages(x, schedule), params["layers"][0])
    rest = {k: v for k, v in params.items() if k != "layers"}

    def body(layers_1RV, rest, batch):
        stage = jax.lax.axis_index(stage_axes)
        layers_RV = jax.tree.map(lambda x: x[0], layers_1RV)
        model = nnx.merge(graphdef, {**rest, "layers": {0: jax.tree.map(lambda x: x[0], layers_RV)}})
        stack_graph = nnx.split(model.layers[0])[0]
        dtype = jax.tree.leaves(layers_RV)[0].dtype

        def inject(i):  # micro-batch i enters stage 0, its context with it
            mb = {k: jax.lax.dynamic_index_in_dim(batch[k], i, keepdims=False) for k in ("input_ids",) + TRAVELLING}
            return {"x": model.embed_tokens(mb.pop("input_ids")).astype(dtype), **mb}

        empty = jax.tree.map(jnp.zeros_like, jax.eval_shape(inject, 0))

        @jax.checkpoint
        def head_loss(x_BTD, labels_BT, mask_BT, weight_BT):
            return model.weighted_loss_sums(model.final_norm(x_BTD), labels_BT, mask_BT, weight_BT)

        def tick(carry, t):
            received, ring, acc = carry
            if r_chunks > 1:  # park what came round the ring until stage 0's turn for it
                ring = jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, (t - p) % m, 0),
                                    ring, received)
                from_ring = jax.tree.map(lambda buf: jax.lax.dynamic_index_in_dim(buf, t % m, keepdims=False), ring)
                first = jax.tree.map(lambda a, b: jnp.where(t < m, a, b), inject(jnp.minimum(t, m - 1)), from_ring)
            else:
                first = inject(jnp.minimum(t, m - 1))
            cur = jax.tree.map(lambda a, b: jnp.where(stage == 0, a, b), first, received)
            w = t - stage
            valid = (w >= 0) & (w < m * r_chunks)
            chunk = jnp.clip(w // m, 0, r_chunks - 1)
            chunk_state = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, chunk, keepdims=False), layers_RV)
            context = model.layer_context(cur["segment_ids"], cur["positions"])
            x, stats = run_stack(nnx.merge(stack_graph, chunk_state), cur["x"], context, remat)
            last = valid & (stage == p - 1) & (chunk == r_chunks - 1)
            objective, ce_sum, count = head_loss(x, cur["labels"], cur["loss_mask"] * last.astype(cur["loss_mask"].dtype),
                                                 cur["loss_weight"] * last.astype(cur["loss_weight"].dtype))
            acc = dict(acc, ce_sum=acc["ce_sum"] + ce_sum, loss_tokens=acc["loss_tokens"] + count,
                       lm_objective=acc["lm_objective"] + objective)
            if stats:
                keep = valid.astype(jnp.float32)
                add = lambda a, v: a.at[chunk].add(v)
                # global_aux_loss: this chunk's running counts over the micro-batches before item w.
                counts = acc["global_counts"][chunk] if "global_counts" in acc else None
                router_objective, per_layer, counts = losses.router_losses(
                    stats, balancing, top_k, counts, jnp.clip(w - chunk * m, 0, m - 1))
                objective = objective + router_objective * keep / m
                acc = dict(acc, router_layers={k: add(acc["router_layers"][k], v * keep) for k, v in per_layer.items()},
                           tokens_per_expert=add(acc["tokens_per_expert"], stats["tokens_per_expert"] * keep),
                           dropped_tokens=acc["dropped_tokens"] + jnp.sum(stats["dropped_tokens"]) * keep)
                if counts is not None:
                    acc["global_counts"] = acc["global_counts"].at[chunk].set(
                        jnp.where(valid, counts, acc["global_counts"][chunk]))
            acc = dict(acc, objective=acc["objective"] + objective)
            shift = [(i, (i + 1) % p) for i in range(p if r_chunks > 1 else p - 1)]
            sent = jax.lax.ppermute(dict(cur, x=x), stage_axes, shift)
            return (sent, ring, acc), None

        v = jax.tree.leaves(layers_RV)[0].shape[1]
        acc = {"objective": 0.0, "ce_sum": 0.0, "loss_tokens": 0.0, "lm_objective": 0.0}
        if model.layers[0].is_moe:
            e = model.layers[0].mlp.num_experts
            names = ["load_balancing_loss", "z_loss"] + [
                losses.TRACKER_NAMES[k] for k in ("seq_aux_loss", "global_aux_loss") if balancing.coeff(k) > 0]
            acc.update(router_layers={k: jnp.zeros((r_chunks, v)) for k in names},
                       tokens_per_expert=jnp.zeros((r_chunks, v, e)), dropped_tokens=0.0)
            if balancing.uses_global:
                acc["global_counts"] = jnp.zeros((r_chunks, v, e))
        acc = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), acc)
        ring = jax.tree.map(lambda x: jnp.zeros((m,) + x.shape, x.dtype), empty) if r_chunks > 1 else None
        (_, _, acc), _ = jax.lax.scan(tick, (empty, ring, acc), jnp.arange(m * r_chunks + p - 1))
        return jax.tree.map(lambda x: x[None], acc)

    per_stage = ("layers",)
    run = logical_shard_map(
        body,
        in_names=(jax.tree.map(lambda _: per_stage, layers), jax.tree.map(lambda _: (), rest),
                  jax.tree.map(lambda _: (), batch)),
        out_names=per_stage,
        manual=("layers",),
        # jax 0.10's transpose of a shard_map nested in a vma-checked one (the expert-parallel
        # dispatch inside a stage) names the outer manual axis in the inner region's shardings,
        # which Shardy rejects; unchecked, the outer region transposes cleanly.
        check_vma=False,
    )
    acc = run(layers, rest, batch)
    objective = jnp.sum(acc.pop("objective"))
    aux = {k: jnp.sum(acc[k]) for k in ("ce_sum", "loss_tokens", "lm_objective")}
    if "router_layers" in acc:
        # Per-layer sums over micro-batches, back in layer order; /M gives the per-micro mean the
        # non-pipelined step logs, and a leading axis of 1 stands for its micro-batch axis.
        aux.update(router_layers={k: (from_stages(v) / m)[None] for k, v in acc["router_layers"].items()},
                   tokens_per_expert=from_stages(acc["tokens_per_expert"])[None],
                   dropped_tokens=jnp.sum(acc["dropped_tokens"]))
    return objective * scale, aux
