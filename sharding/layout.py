"""The one layout value type: Megatron's parallel sizes, and the mesh axes they make.

A :class:`Layout` is what ``--tensor-model-parallel-size`` and its siblings say: TP, PP, EP,
CP, ETP, sequence parallelism, ZeRO-1 / FSDP and the device count. The mesh
(:mod:`sharding.mesh`), the planner (``mlir_train.planner``) and Megatron checkpoint I/O
(``mlir_train.checkpoint.megatron``) all take this one type. See :mod:`sharding.mesh` for how
the two rank grids (dense ``tp-cp-dp``, expert ``etp-ep-edp``) refine into mesh axes
(:meth:`Layout.atoms`).

No jax at import time: :meth:`Layout.device_count` asks jax only when ``num_devices`` is None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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
class Layout:
    """Megatron's parallel layout flags: the one layout type of the mesh, the planner and Megatron I/O.

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
        if self.num_devices is not None:
            return self.num_devices
        import jax

        return jax.device_count()

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
                raise LayoutError(_nesting_message(self))
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


def _nesting_message(cfg: Layout) -> str:
    return (f"the expert grid --expert-tensor-parallel-size ({cfg.etp}) x --expert-model-parallel-size "
            f"({cfg.expert}) does not nest with the dense grid --tensor-model-parallel-size ({cfg.tensor}) x "
            f"--context-parallel-size ({cfg.context}): each of TP, TP x CP, ETP, ETP x EP must divide the next "
            "larger of them (Megatron's rank orders tp-cp-dp and etp-ep-edp over the same ranks); use sizes that "
            "are powers of two or multiples of each other")


class LayoutError(ValueError):
    """A parallel layout that cannot work for this device count or model."""


def _check_sizes(cfg: Layout) -> None:
    for flag, value in (
        ("--tensor-model-parallel-size", cfg.tensor),
        ("--pipeline-model-parallel-size", cfg.pipeline),
        ("--expert-model-parallel-size", cfg.expert),
        ("--context-parallel-size", cfg.context),
        ("--expert-tensor-parallel-size", cfg.etp),
    ):
        if not isinstance(value, int) or value < 1:
            raise LayoutError(f"{flag} must be a positive integer, got {value!r}")
    n = cfg.device_count()
    if n < 1:
        raise LayoutError(f"number of devices must be positive, got {n}")
    if n % (cfg.tensor * cfg.context * cfg.pipeline):
        raise LayoutError(
            f"{n} devices are not divisible by --tensor-model-parallel-size ({cfg.tensor}) x "
            f"--context-parallel-size ({cfg.context}) x --pipeline-model-parallel-size ({cfg.pipeline}) = "
            f"{cfg.tensor * cfg.context * cfg.pipeline}"
        )
    per_stage = n // cfg.pipeline
    if per_stage % (cfg.etp * cfg.expert):
        what = ("expert parallelism is carved out of the context x data-parallel ranks"
                if cfg.etp == cfg.tensor else "the experts' grid ETP x EP must divide the ranks of a stage")
        raise LayoutError(
            f"--expert-model-parallel-size ({cfg.expert}) x --expert-tensor-parallel-size ({cfg.etp}) must divide "
            f"the {per_stage} ranks of a pipeline stage = {n} devices / PP {cfg.pipeline}: {what}"
        )
    cfg.atoms()  # the two grids must nest
