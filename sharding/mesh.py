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

# Roles in each grid, fastest-varying first (Megatron's tp-cp-dp and etp-ep-edp orders).
DENSE_ROLES = ("tensor", "context", "data")
EXPERT_ROLES = ("expert_tensor", "expert", "expert_data")
ROLES = DENSE_ROLES + EXPERT_ROLES
# Mesh-axis name of each (dense role, expert role) pair that can be an atom.
ATOM_NAMES: dict[tuple[str, str], str] = {
    ("tensor", "expert_tensor"): "tensor",
    ("tensor", "expert"): "tensor_expert",
    ("tensor", "expert_data"): "tensor_edata",
    ("context", "expert_tensor"): "context_etensor",
    ("context", "expert"): "context_expert",
    ("context", "expert_data"): "context",
    ("data", "expert_tensor"): "data_etensor",
    ("data", "expert"): "expert",
    ("data", "expert_data"): "data",
}
# Every possible axis, slowest first: a total order extending the product order of the two
# role sequences, so whatever atoms a layout has, this order is their rank-stride order.
ALL_MESH_AXES = ("stage",) + tuple(
    ATOM_NAMES[pair] for pair in sorted(
        ATOM_NAMES, key=lambda p: (-(DENSE_ROLES.index(p[0]) + EXPERT_ROLES.index(p[1])), -DENSE_ROLES.index(p[0]))))
# The axes every mesh has (size 1 when unused).
MESH_AXES = ("stage", "data", "expert", "tensor")
_CLASSIC_ROLES = {name: pair for pair, name in ATOM_NAMES.items() if name in MESH_AXES}
# Mesh axes a dense weight is replicated over in the default layout (its data-parallel
# group): ZeRO-1 and FSDP shard over these. :func:`data_axes` gives them for any layout.
DATA_AXES = ("data", "expert")


@dataclasses.dataclass(frozen=True)
class Atom:
    """One mesh axis: ``size`` consecutive rank strides with one role in each grid."""

    name: str
    size: int
    dense: str   # one of DENSE_ROLES
    expert: str  # one of EXPERT_ROLES


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Megatron's parallel layout flags.

    ``num_devices=None`` means every device ``jax.devices()`` sees.
    """

    tensor: int = 1                      # --tensor-model-parallel-size
    pipeline: int = 1                    # --pipeline-model-parallel-size
    expert: int = 1                      # --expert-model-parallel-size
    context: int = 1                     # --context-parallel-size
    expert_tensor: int | None = None     # --expert-tensor-parallel-size (None: = tensor)
    sequence_parallel: bool = False      # --sequence-parallel
    distributed_optimizer: bool = False  # --use-distributed-optimizer (ZeRO-1)
    fsdp: bool = False                   # parameters sharded over the data ranks too
    num_devices: int | None = None

    def device_count(self) -> int:
        return jax.device_count() if self.num_devices is None else self.num_devices

    @property
    def etp(self) -> int:
        """The expert-tensor-parallel size (TP unless given)."""
        return self.tensor if self.expert_tensor is None else self.expert_tensor

    @property
    def data_parallel(self) -> int:
        """Megatron's data-parallel size: devices / (TP x CP x PP), expert ranks included."""
        return self.device_count() // (self.tensor * self.context * self.pipeline)

    @property
    def expert_data_parallel(self) -> int:
        """Megatron's expert-data-parallel size: devices / (ETP x EP x PP)."""
        return self.device_count() // (self.etp * self.expert * self.pipeline)

    def atoms(self) -> tuple[Atom, ...]:
        """The mesh axes of one pipeline stage, fastest-varying first (call :func:`validate`
        first): the common refinement of the ``tp-cp-dp`` and ``etp-ep-edp`` grids."""
        per_stage = self.device_count() // self.pipeline
        dense = _boundaries((self.tensor, self.context), per_stage)
        expert = _boundaries((self.etp, self.expert), per_stage)
        cuts = sorted(set(dense) | set(expert))
        out = []
        for lo, hi in zip(cuts, cuts[1:]):
            if hi % lo:
                raise ParallelConfigError(_nesting_message(self))
            d = DENSE_ROLES[_role_index(dense, lo)]
            e = EXPERT_ROLES[_role_index(expert, lo)]
            out.append(Atom(ATOM_NAMES[(d, e)], hi // lo, d, e))
        return tuple(out)

    def mesh_shape(self) -> dict[str, int]:
        """Mesh axis sizes, slowest first (call :func:`validate` first): ``"stage"``, then
        the atoms of :meth:`atoms`; the axes of :data:`MESH_AXES` are always present."""
        sizes = {a.name: a.size for a in self.atoms()}
        sizes["stage"] = self.pipeline
        return {name: sizes.get(name, 1) for name in ALL_MESH_AXES if name in sizes or name in MESH_AXES}

    def role_axes(self, role: str) -> tuple[str, ...]:
        """The mesh axes carrying ``role`` (one of :data:`ROLES`, or "stage"), slowest first."""
        if role == "stage":
            return ("stage",)
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; choose one of {ROLES} or 'stage'")
        names = {a.name for a in self.atoms() if role in (a.dense, a.expert)}
        # The always-present axes keep their roles at size 1 too, so the default layouts'
        # tables read as before (e.g. the batch over ("data", "expert") at any EP).
        names |= {n for n in MESH_AXES if role in _CLASSIC_ROLES.get(n, ())}
        return tuple(n for n in ALL_MESH_AXES if n in names)

    def data_axes(self, *, expert: bool = False) -> tuple[str, ...]:
        """Mesh axes a weight is replicated over for data parallelism: Megatron's dp x cp
        group for dense weights (the distributed optimizer shards over it), the expert-data
        group for routed-expert weights."""
        if expert:
            return self.role_axes("expert_data")
        return tuple(n for n in ALL_MESH_AXES if n in set(self.role_axes("data")) | set(self.role_axes("context")))


def _boundaries(sizes: Sequence[int], total: int) -> list[int]:
    """Rank strides where each role of a grid starts: 1, s0, s0*s1, ..., total."""
    out = [1]
    for s in sizes:
        out.append(out[-1] * s)
    out.append(total)
    return out


def _role_index(boundaries: list[int], stride: int) -> int:
    """Which role of a grid (index into its roles) the ranks at ``stride`` belong to."""
    for i in range(len(boundaries) - 1):
        if boundaries[i] <= stride < boundaries[i + 1]:
            return i
    raise AssertionError((boundaries, stride))


def _nesting_message(cfg: ParallelConfig) -> str:
    return (f"the expert grid --expert-tensor-parallel-size ({cfg.etp}) x --expert-model-parallel-size "
            f"({cfg.expert}) does not nest with the dense grid --tensor-model-parallel-size ({cfg.tensor}) x "
            f"--context-parallel-size ({cfg.context}): each of TP, TP x CP, ETP, ETP x EP must divide the next "
            "larger of them (Megatron's rank orders tp-cp-dp and etp-ep-edp over the same ranks); use sizes that "
            "are powers of two or multiples of each other")


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work for this device count or model."""


def _check_sizes(cfg: ParallelConfig) -> None:
    for flag, value in (
        ("--tensor-model-parallel-size", cfg.tensor),
        ("--pipeline-model-parallel-size", cfg.pipeline),
        ("--expert-model-parallel-size", cfg.expert),
        ("--context-parallel-size", cfg.context),
        ("--expert-tensor-parallel-size", cfg.etp),
    ):
        if not isinstance(value, int) or value < 1:
            raise ParallelConfigError(f"{flag} must be a positive integer, got {value!r}")
    n = cfg.device_count()
    if n < 1:
        raise ParallelConfigError(f"number of devices must be positive, got {n}")
    if n % (cfg.tensor * cfg.context * cfg.pipeline):
        raise ParallelConfigError(
            f"{n} devices are not divisible by --tensor-model-parallel-size ({cfg.tensor}) x "
            f"--context-parallel-size ({cfg.context}) x --pipeline-model-parallel-size ({cfg.pipeline}) = "
            f"{cfg.tensor * cfg.context * cfg.pipeline}"
        )
    per_stage = n // cfg.pipeline
    if per_stage % (cfg.etp * cfg.expert):
        what = ("expert parallelism is carved out of the context x data-parallel ranks"
                if cfg.etp == cfg.tensor else "the experts' grid ETP x EP must divide the ranks of a stage")
        raise ParallelConfigError(
            f"--expert-model-parallel-size ({cfg.expert}) x --expert-tensor-parallel-size ({cfg.etp}) must divide "
            f"the {per_stage} ranks of a pipeline stage = {n} devices / PP {cfg.pipeline}: {what}"
        )
    cfg.atoms()  # the two grids must nest


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
            if cfg.expert_tensor is None:
                need("moe_intermediate_size", tp, "--tensor-model-parallel-size", "expert FFN size")
            else:
                need("moe_intermediate_size", cfg.etp, "--expert-tensor-parallel-size", "expert FFN size")

    if cfg.sequence_parallel and tp == 1:
        warnings.warn(
            "--sequence-parallel has no effect without --tensor-model-parallel-size > 1; "
            "disabling it (as Megatron does)",
            stacklevel=2,
        )
        cfg = dataclasses.replace(cfg, sequence_parallel=False)
    if cfg.context > 1 and seq_length is not None:
        cp = cfg.context
        if seq_length % (2 * cp):
            raise ParallelConfigError(
                f"--context-parallel-size ({cp}) cuts each row into 2 x {cp} chunks (Megatron's load-balanced "
                f"layout): --seq-length ({seq_length}) is not divisible by 2 x --context-parallel-size = {2 * cp}")
        if cfg.sequence_parallel and seq_length % (cp * tp):
            raise ParallelConfigError(
                f"--sequence-parallel splits each context rank's {seq_length // cp} tokens further over the "
                f"tensor ranks: --seq-length ({seq_length}) is not divisible by --context-parallel-size ({cp}) x "
                f"--tensor-model-parallel-size ({tp}) = {cp * tp}")
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
    """The mesh for ``cfg`` (``"stage"`` then the atoms of :meth:`ParallelConfig.atoms`,
    slowest first; always at least :data:`MESH_AXES`), all axes Auto.

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
    sizes = cfg.mesh_shape()
    names = tuple(sizes)
    assert math.prod(sizes.values()) == len(devices)
    return Mesh(np.asarray(devices, dtype=object).reshape(tuple(sizes.values())), names,
                axis_types=(AxisType.Auto,) * len(names))
