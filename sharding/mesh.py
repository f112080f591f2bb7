"""The device mesh, laid out as Megatron lays out its process groups, and up-front validation.

Megatron numbers the ranks of one pipeline stage twice, fastest-varying first:

* for dense weights and attention, ``tp - cp - dp`` (tensor, context, data parallel);
* for the routed experts, ``etp - ep - edp`` (expert-tensor, expert, expert-data parallel),
  over the *same* ranks: "MoE parallel folding" (attention TP4 while the experts run ETP1 x
  EP8 on the same 8 GPUs). By default ETP = TP, so expert parallelism is carved out of the
  context x data ranks.

The mesh here is the common refinement of the two grids: each mesh axis (an *atom*) is a run
of consecutive rank strides that has one role in each grid, named by the pair
(:data:`ATOM_NAMES`): ``"tensor"`` is tensor in both (TP = ETP), ``"expert"`` is data for
dense weights and expert for experts, ``"data"`` is data in both, ``"context_expert"`` is
context for attention and expert for experts, and so on. Every logical role then maps to the
atoms that carry it (:func:`role_axes`), slowest first, so a spec entry such as
``("expert", "tensor_expert")`` numbers experts exactly as Megatron's expert group does.
Reshaping the device list row-major into ``("stage", atoms slowest first)`` makes device ``i``
Megatron's global rank ``i``. Both grids must nest (each boundary of one divides the next
boundary of the other), which every power-of-two layout does; other layouts are refused.

The axes ``("stage", "data", "expert", "tensor")`` (:data:`MESH_AXES`) are always present
(size 1 when unused), so the common layouts (no CP, ETP = TP) keep their familiar mesh.

All axes are ``AxisType.Auto``: the model only adds sharding constraints at a few points and
XLA's propagation fills in the rest (a bare ``PartitionSpec`` works inside ``jit`` without
``jax.set_mesh``, and no ``out_sharding=`` is needed on matmuls). ``jax.make_mesh`` would make
them Explicit by default in jax 0.10.

Nothing here imports ``mlir_train``: :func:`validate` takes the model's sizes as plain ints.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from sharding.layout import Layout, LayoutError, _check_sizes


def kv_heads_replicated(tensor: int, num_kv_heads: int) -> bool:
    """Whether k/v heads are replicated across tensor ranks instead of split.

    Megatron requires ``num_query_groups % TP == 0``. When TP exceeds the number of kv heads
    (GQA models with few kv heads, e.g. Qwen3-30B-A3B's 4 at TP 8) we replicate the k/v
    projections on every tensor rank instead, as vLLM and Megatron-derived inference engines
    do: each rank then holds every kv head (a few small matrices), computes k/v redundantly,
    and XLA all-reduces their gradients over "tensor". Requires TP to be a multiple of the kv
    head count so each rank's query heads still fall into whole kv groups.
    """
    return tensor > 1 and tensor > num_kv_heads and tensor % num_kv_heads == 0


def validate(
    cfg: Layout,
    model_dims: Mapping[str, int] | None = None,
    *,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    seq_length: int | None = None,
) -> Layout:
    """Check ``cfg`` against the device count and the model before anything compiles.

    ``model_dims`` holds plain ints: num_heads, num_kv_heads, num_experts (0 for dense),
    intermediate_size, moe_intermediate_size, num_layers, vocab_size, hidden_size, and where a
    model has them shared_expert_intermediate_size, gdn_key_heads and gdn_conv_width (missing keys are not
    checked). Raises :class:`LayoutError` naming the offending flag.

    Returns the config to use: ``--sequence-parallel`` without tensor parallelism is turned
    off with a warning, as Megatron does.
    """
    _check_sizes(cfg)
    _check_model(cfg, dict(model_dims or {}))
    if cfg.sequence_parallel and cfg.tensor == 1:
        warnings.warn(
            "--sequence-parallel has no effect without --tensor-model-parallel-size > 1; "
            "disabling it (as Megatron does)",
            stacklevel=2,
        )
        cfg = dataclasses.replace(cfg, sequence_parallel=False)
    if seq_length is not None:
        _check_sequence(cfg, seq_length, dict(model_dims or {}).get("gdn_conv_width", 0))
    if global_batch_size is not None or micro_batch_size is not None:
        _check_batch(cfg, global_batch_size, micro_batch_size)
    return cfg


def _need(dims: dict[str, int], key: str, divisor: int, flag: str, what: str, hint: str = "") -> None:
    if key in dims and divisor > 1 and dims[key] % divisor:
        raise LayoutError(
            f"{what} ({key}={dims[key]}) is not divisible by {flag} ({divisor}){hint}"
        )


def _check_model(cfg: Layout, dims: dict[str, int]) -> None:
    """The model's sizes against the tensor, pipeline and expert splits."""
    tp, pp, ep = cfg.tensor, cfg.pipeline, cfg.expert
    _need(dims, "num_heads", tp, "--tensor-model-parallel-size", "attention heads")
    if "num_kv_heads" in dims and tp > 1 and dims["num_kv_heads"] % tp:
        kv = dims["num_kv_heads"]
        if not kv_heads_replicated(tp, kv):
            raise LayoutError(
                f"kv heads (num_kv_heads={kv}) must divide or be divided by "
                f"--tensor-model-parallel-size ({tp}): kv heads are split over tensor ranks when "
                "TP divides them and replicated on every rank when TP is a multiple of them"
            )
    _need(dims, "vocab_size", tp, "--tensor-model-parallel-size", "vocabulary",
          ": the embedding and LM head are vocab-parallel; pad the vocabulary "
          "(Megatron's --make-vocab-size-divisible-by)")
    _need(dims, "intermediate_size", tp, "--tensor-model-parallel-size", "dense FFN size")
    _need(dims, "shared_expert_intermediate_size", tp, "--tensor-model-parallel-size", "shared expert FFN size")
    # A linear-attention layer's key heads split over the tensor ranks, each with its value heads.
    _need(dims, "gdn_key_heads", tp, "--tensor-model-parallel-size", "linear-attention key heads",
          ": each tensor rank holds whole key heads and their value heads")
    _need(dims, "num_layers", pp, "--pipeline-model-parallel-size", "decoder layers")
    experts = dims.get("num_experts")
    if experts is not None:
        if ep > 1 and experts == 0:
            raise LayoutError(
                f"--expert-model-parallel-size ({ep}) > 1 needs a mixture-of-experts model (num_experts=0)"
            )
        if experts:
            _need(dims, "num_experts", ep, "--expert-model-parallel-size", "routed experts")
            if cfg.expert_tensor is None:
                _need(dims, "moe_intermediate_size", tp, "--tensor-model-parallel-size", "expert FFN size")
            else:
                _need(dims, "moe_intermediate_size", cfg.etp, "--expert-tensor-parallel-size", "expert FFN size")


def _check_sequence(cfg: Layout, seq_length: int, conv_width: int = 0) -> None:
    """``--seq-length`` against the context and sequence-parallel splits (``conv_width``: a
    gated DeltaNet's, whose window must fit in one of the 2 x CP chunks)."""
    tp = cfg.tensor
    if cfg.context > 1:
        cp = cfg.context
        if seq_length % (2 * cp):
            raise LayoutError(
                f"--context-parallel-size ({cp}) cuts each row into 2 x {cp} chunks (Megatron's load-balanced "
                f"layout): --seq-length ({seq_length}) is not divisible by 2 x --context-parallel-size = {2 * cp}")
        if seq_length // (2 * cp) < conv_width - 1:
            raise LayoutError(
                f"--context-parallel-size ({cp}) with --seq-length ({seq_length}): the gated DeltaNet passes its "
                f"conv window ({conv_width - 1} tokens) between the 2 x {cp} chunks, so a chunk needs at least "
                f"{conv_width - 1} tokens (a longer --seq-length or a smaller --context-parallel-size)")
        if cfg.sequence_parallel and seq_length % (cp * tp):
            raise LayoutError(
                f"--sequence-parallel splits each context rank's {seq_length // cp} tokens further over the "
                f"tensor ranks: --seq-length ({seq_length}) is not divisible by --context-parallel-size ({cp}) x "
                f"--tensor-model-parallel-size ({tp}) = {cp * tp}")
    if cfg.sequence_parallel and seq_length % tp:
        raise LayoutError(
            f"--sequence-parallel splits the sequence over tensor ranks: --seq-length ({seq_length}) "
            f"is not divisible by --tensor-model-parallel-size ({tp})"
        )


def _check_batch(cfg: Layout, global_batch_size: int | None, micro_batch_size: int | None) -> None:
    """``--global-batch-size`` against ``--micro-batch-size`` x the data-parallel size."""
    mbs = 1 if micro_batch_size is None else micro_batch_size
    dp = cfg.data_parallel
    if mbs < 1:
        raise LayoutError(f"--micro-batch-size must be positive, got {mbs}")
    if global_batch_size is not None and global_batch_size % (mbs * dp):
        raise LayoutError(
            f"--global-batch-size ({global_batch_size}) is not divisible by --micro-batch-size "
            f"({mbs}) x data-parallel size ({dp})"
        )


def make_mesh(cfg: Layout, devices: Sequence[Any] | None = None) -> Mesh:
    """The mesh for ``cfg`` (``"stage"`` then the atoms of :meth:`Layout.atoms`,
    slowest first; always at least :data:`MESH_AXES`), all axes Auto.

    ``devices`` defaults to the first ``cfg.num_devices`` of ``jax.devices()``, whose order
    (process by process, then local id) keeps tensor-parallel peers on one host.
    """
    if devices is None:
        all_devices = jax.devices()
        n = cfg.device_count()
        if n > len(all_devices):
            raise LayoutError(f"asked for {n} devices but only {len(all_devices)} are visible")
        devices = all_devices[:n]
    devices = list(devices)
    if cfg.num_devices is not None and len(devices) != cfg.num_devices:
        raise LayoutError(f"got {len(devices)} devices for a config of num_devices={cfg.num_devices}")
    cfg = dataclasses.replace(cfg, num_devices=len(devices))
    _check_sizes(cfg)
    sizes = cfg.mesh_shape()
    names = tuple(sizes)
    assert math.prod(sizes.values()) == len(devices)
    return Mesh(np.asarray(devices, dtype=object).reshape(tuple(sizes.values())), names,
                axis_types=(AxisType.Auto,) * len(names))
