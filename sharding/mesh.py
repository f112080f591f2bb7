"""The device mesh, laid out as Megatron lays out its process groups, and up-front validation.

Mesh axes, outermost first: ``("stage", "data", "expert", "tensor")``.

Megatron numbers ranks in the order tp-cp-ep-dp-pp, fastest-varying first: tensor-parallel
peers are adjacent ranks (one NVLink island), expert-parallel ranks are carved out of the
data-parallel ranks, and pipeline stages are the slowest-varying. Reshaping the device list
row-major into ``(PP, DP/EP, EP, TP)`` gives exactly that numbering: device ``i`` of the list is
Megatron's global rank ``i``. So the data-parallel group of a dense weight is the
``("data", "expert")`` plane, and that of an expert weight (already split over "expert") is
``"data"`` alone, as in Megatron's expert-data-parallel group.

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

MESH_AXES = ("stage", "data", "expert", "tensor")
# Mesh axes a dense weight is replicated over (its data-parallel group): ZeRO-1 and FSDP
# shard over these.
DATA_AXES = ("data", "expert")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Megatron's parallel layout flags.

    ``num_devices=None`` means every device ``jax.devices()`` sees.
    """

    tensor: int = 1                      # --tensor-model-parallel-size
    pipeline: int = 1                    # --pipeline-model-parallel-size
    expert: int = 1                      # --expert-model-parallel-size
    sequence_parallel: bool = False      # --sequence-parallel
    distributed_optimizer: bool = False  # --use-distributed-optimizer (ZeRO-1)
    fsdp: bool = False                   # parameters sharded over the data ranks too
    num_devices: int | None = None

    def device_count(self) -> int:
        return jax.device_count() if self.num_devices is None else self.num_devices

    @property
    def data_parallel(self) -> int:
        """Megatron's data-parallel size: devices / (TP x PP), expert ranks included."""
        return self.device_count() // (self.tensor * self.pipeline)

    def mesh_shape(self) -> dict[str, int]:
        """Mesh axis sizes in :data:`MESH_AXES` order (call :func:`validate` first)."""
        dp = self.data_parallel
        return {"stage": self.pipeline, "data": dp // self.expert, "expert": self.expert, "tensor": self.tensor}


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work for this device count or model."""


def _check_sizes(cfg: ParallelConfig) -> None:
    for flag, value in (
        ("--tensor-model-parallel-size", cfg.tensor),
        ("--pipeline-model-parallel-size", cfg.pipeline),
        ("--expert-model-parallel-size", cfg.expert),
    ):
        if not isinstance(value, int) or value < 1:
            raise ParallelConfigError(f"{flag} must be a positive integer, got {value!r}")
    n = cfg.device_count()
    if n < 1:
        raise ParallelConfigError(f"number of devices must be positive, got {n}")
    if n % (cfg.tensor * cfg.pipeline):
        raise ParallelConfigError(
            f"{n} devices are not divisible by --tensor-model-parallel-size ({cfg.tensor}) x "
            f"--pipeline-model-parallel-size ({cfg.pipeline}) = {cfg.tensor * cfg.pipeline}"
        )
    dp = cfg.data_parallel
    if dp % cfg.expert:
        raise ParallelConfigError(
            f"--expert-model-parallel-size ({cfg.expert}) must divide the data-parallel size "
            f"{dp} = {n} devices / (TP {cfg.tensor} x PP {cfg.pipeline}): expert parallelism is "
            "carved out of the data-parallel ranks"
        )


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
    cfg: ParallelConfig,
    model_dims: Mapping[str, int] | None = None,
    *,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    seq_length: int | None = None,
) -> ParallelConfig:
    """Check ``cfg`` against the device count and the model before anything compiles.

    ``model_dims`` holds plain ints: num_heads, num_kv_heads, num_experts (0 for dense),
    intermediate_size, moe_intermediate_size, num_layers, vocab_size, hidden_size (missing
    keys are not checked). Raises :class:`ParallelConfigError` naming the offending flag.

    Returns the config to use: ``--sequence-parallel`` without tensor parallelism is turned
    off with a warning, as Megatron does.
    """
    _check_sizes(cfg)
    tp, pp, ep = cfg.tensor, cfg.pipeline, cfg.expert
    dims = dict(model_dims or {})

    def need(key: str, divisor: int, flag: str, what: str, hint: str = "") -> None:
        if key in dims and divisor > 1 and dims[key] % divisor:
            raise ParallelConfigError(
                f"{what} ({key}={dims[key]}) is not divisible by {flag} ({divisor}){hint}"
            )

    need("num_heads", tp, "--tensor-model-parallel-size", "attention heads")
    if "num_kv_heads" in dims and tp > 1 and dims["num_kv_heads"] % tp:
        kv = dims["num_kv_heads"]
        if not kv_heads_replicated(tp, kv):
            raise ParallelConfigError(
                f"kv heads (num_kv_heads={kv}) must divide or be divided by "
                f"--tensor-model-parallel-size ({tp}): kv heads are split over tensor ranks when "
                "TP divides them and replicated on every rank when TP is a multiple of them"
            )
    need("vocab_size", tp, "--tensor-model-parallel-size", "vocabulary",
         ": the embedding and LM head are vocab-parallel; pad the vocabulary "
         "(Megatron's --make-vocab-size-divisible-by)")
    need("intermediate_size", tp, "--tensor-model-parallel-size", "dense FFN size")
    need("num_layers", pp, "--pipeline-model-parallel-size", "decoder layers")
    experts = dims.get("num_experts")
    if experts is not None:
        if ep > 1 and experts == 0:
            raise ParallelConfigError(
                f"--expert-model-parallel-size ({ep}) > 1 needs a mixture-of-experts model (num_experts=0)"
            )
        if experts:
            need("num_experts", ep, "--expert-model-parallel-size", "routed experts")
            need("moe_intermediate_size", tp, "--tensor-model-parallel-size", "expert FFN size")

    if cfg.sequence_parallel and tp == 1:
        warnings.warn(
            "--sequence-parallel has no effect without --tensor-model-parallel-size > 1; "
            "disabling it (as Megatron does)",
            stacklevel=2,
        )
        cfg = dataclasses.replace(cfg, sequence_parallel=False)
    if cfg.sequence_parallel and seq_length is not None and seq_length % tp:
        raise ParallelConfigError(
            f"--sequence-parallel splits the sequence over tensor ranks: --seq-length ({seq_length}) "
            f"is not divisible by --tensor-model-parallel-size ({tp})"
        )

    if global_batch_size is not None or micro_batch_size is not None:
        mbs = 1 if micro_batch_size is None else micro_batch_size
        dp = cfg.data_parallel
        if mbs < 1:
            raise ParallelConfigError(f"--micro-batch-size must be positive, got {mbs}")
        if global_batch_size is not None and global_batch_size % (mbs * dp):
            raise ParallelConfigError(
                f"--global-batch-size ({global_batch_size}) is not divisible by --micro-batch-size "
                f"({mbs}) x data-parallel size ({dp})"
            )
    return cfg


def make_mesh(cfg: ParallelConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """The ``("stage", "data", "expert", "tensor")`` mesh for ``cfg``, all axes Auto.

    ``devices`` defaults to the first ``cfg.num_devices`` of ``jax.devices()``, whose order
    (process by process, then local id) keeps tensor-parallel peers on one host.
    """
    if devices is None:
        all_devices = jax.devices()
        n = cfg.device_count()
        if n > len(all_devices):
            raise ParallelConfigError(f"asked for {n} devices but only {len(all_devices)} are visible")
        devices = all_devices[:n]
    devices = list(devices)
    if cfg.num_devices is not None and len(devices) != cfg.num_devices:
        raise ParallelConfigError(f"got {len(devices)} devices for a config of num_devices={cfg.num_devices}")
    cfg = dataclasses.replace(cfg, num_devices=len(devices))
    _check_sizes(cfg)
    shape = tuple(cfg.mesh_shape()[a] for a in MESH_AXES)
    assert math.prod(shape) == len(devices)
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
