"""Manual (per-device) regions by logical names: ``shard_map`` without naming a mesh axis.

Some computations are not expressible as sharding constraints for XLA to propagate: the
expert-parallel token dispatch needs an explicit ``all_to_all`` between the ranks that hold
different experts. The model asks for such a region in logical terms:

* :func:`mesh_axes_of` tells it which mesh axes a logical axis is split over under the active
  rules and mesh (and their total size), so it can name them to collectives (``psum``,
  ``all_to_all``) as opaque values without spelling a mesh axis itself;
* :func:`logical_shard_map` is ``jax.shard_map`` with in/out specs given as logical names,
  resolved with the active rules exactly as :func:`sharding.constrain` resolves them. Only
  the mesh axes that the ``manual`` logical axes map to become manual; every other mesh axis
  (say "tensor" splitting the expert FFN width) stays under XLA's automatic partitioning
  inside the region, and is dropped from the specs.

Both read the rules installed by :func:`sharding.use_rules` and the mesh set with
``jax.set_mesh``; without them (or when an axis maps to nothing) the model keeps to its
single-device code and never calls :func:`logical_shard_map`.

Regions nest by what is already manual: the trainer runs a step's micro-batches in a region
manual over the data axes (each data rank accumulating its own, unreduced weight gradients;
:func:`data_axes_manual`), and a model region asking for axes that are manual already (the
expert-parallel dispatch over the token axes) is manual over the others only, or, when none
are left, is its body called as it is. :func:`mesh_axes_of` still names every axis (the
collectives over them run the same either way); :func:`split_size` is what a shape inside the
current region is still split by.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from sharding.logical import active_rules, axes_tuple, logical_to_spec, trimmed_spec


def _abstract_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def manual_now() -> frozenset[str]:
    """The mesh axes that are manual where this is traced (inside ``shard_map`` regions)."""
    mesh = _abstract_mesh()
    if mesh is None:
        return frozenset()
    return frozenset(name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == jax.sharding.AxisType.Manual)


def mesh_axes_of(logical_name: str) -> tuple[tuple[str, ...], int]:
    """Mesh axes ``logical_name`` is split over under the active rules and mesh, and their size.

    ``((), 1)`` when no rules or mesh are active or the name maps to nothing. Axes of size 1
    are left out: they split nothing, and leaving them out keeps the single-device paths for
    tables that name axes a mesh has at size 1.
    """
    rules, mesh = active_rules(), _abstract_mesh()
    if rules is None or mesh is None:
        return (), 1
    table = dict(rules)
    if logical_name not in table:
        raise KeyError(f"logical axis {logical_name!r} has no rule in the sharding table {sorted(table)}")
    sizes = dict(mesh.shape)
    axes = tuple(a for a in axes_tuple(table[logical_name]) if sizes.get(a, 1) > 1)
    return axes, math.prod(sizes[a] for a in axes)


def split_size(logical_name: str) -> int:
    """How many ways a dimension named ``logical_name`` is still split where this is traced:
    the sizes of its mesh axes that are not manual here (an array inside a region manual over
    some of them holds the local part along those already)."""
    axes, _ = mesh_axes_of(logical_name)
    manual = manual_now()
    sizes = dict(_abstract_mesh().shape) if axes else {}
    return math.prod(sizes[a] for a in axes if a not in manual)


def manual_axes_of(logical_name: str) -> tuple[tuple[str, ...], int]:
    """The mesh axes of ``logical_name`` that are manual where this is traced, and their size:
    e.g. inside the trainer's data-manual region, the data ranks whose rows this rank does not
    see (a statistic over all rows is the sum over these ranks)."""
    axes, _ = mesh_axes_of(logical_name)
    manual = manual_now()
    sizes = dict(_abstract_mesh().shape) if axes else {}
    inside = tuple(a for a in axes if a in manual)
    return inside, math.prod(sizes[a] for a in inside)


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


def _keep_axes(spec: PartitionSpec, keep: set[str]) -> PartitionSpec:
    out = []
    for entry in spec:
        axes = tuple(a for a in axes_tuple(entry) if a in keep)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return trimmed_spec(out)


def logical_shard_map(
    f: Callable[..., Any],
    in_names: Any,
    out_names: Any,
    *,
    manual: Sequence[str],
    check_vma: bool = True,
) -> Callable[..., Any]:
    """``jax.shard_map(f)`` over the mesh axes the logical axes ``manual`` map to.

    ``in_names`` has one entry per positional argument and ``out_names`` mirrors ``f``'s
    output; each leaf is a tuple of logical names (``None`` for an unsplit dimension, ``()``
    for a replicated scalar), or a ``PartitionSpec`` of mesh axes (what a spec of logical names
    cannot say, e.g. a leading axis over only some of a logical axis's mesh axes), applied as a
    prefix to the matching array(s). A dimension whose
    logical name maps only to non-manual mesh axes is whole inside ``f`` as far as ``f`` can
    tell (XLA may still split it over those axes). Must be called under active rules and a
    mesh. Axes already manual where this is traced (an enclosing region's) are left out: the
    region is manual over the others, and with none left ``f`` itself is returned (its
    arguments are already the local ones).
    """
    rules, mesh = active_rules(), _abstract_mesh()
    if rules is None or mesh is None:
        raise ValueError("logical_shard_map needs sharding rules (sharding.use_rules) and a mesh (jax.set_mesh)")
    wanted = {a for name in manual for a in mesh_axes_of(name)[0]}
    if not wanted:
        raise ValueError(f"logical axes {tuple(manual)} map to no mesh axis of size > 1: nothing to make manual")
    outer = wanted & manual_now()
    manual_axes = wanted - outer
    if not manual_axes:
        return f
    if outer:
        # Nested in a region manual over some of the same axes (the trainer's unchecked
        # data-manual step): collectives over those give values typed varying over axes this
        # region does not make manual, and jax 0.10 then names them in the residuals' shardings
        # of its transpose, which Shardy rejects. Unchecked, the transpose follows the enclosing
        # region's convention (psum transposes to psum, replicated inputs' cotangents summed).
        check_vma = False

    def specs(names_tree):
        return jax.tree.map(
            lambda names: _keep_axes(names if isinstance(names, PartitionSpec) else
                                     logical_to_spec(names, rules, mesh.axis_names), manual_axes),
            names_tree,
            is_leaf=lambda x: isinstance(x, PartitionSpec) or _is_names(x),
        )

    return jax.shard_map(
        f,
        in_specs=specs(tuple(in_names)),
        out_specs=specs(out_names),
        axis_names=manual_axes,
        check_vma=check_vma,
    )


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes ``x`` is typed as varying over inside a ``shard_map`` region (empty
    outside one). jax 0.10 keeps them in ``aval.manual_axis_type.varying``, later versions in
    ``aval.vma``."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()) or ())


def vary_over(x, axes):
    """``x`` typed varying over every manual axis of ``axes`` (``jax.lax.pcast``; a no-op on the
    axes it already varies over, and outside checked regions). jax 0.12 refuses a collective over
    axes on which its operand is in mixed states (varying over some, invariant over others), and a
    ``ragged_all_to_all`` whose operands are not all typed alike; the forward costs nothing, the
    gradient of a cast is a sum over the added axes."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def replicated_on_remaining_axes(fn: Callable) -> Callable:
    """``fn`` in a region manual over every mesh axis the current region is not, its operands and
    result whole (the same) on those axes; ``fn`` itself where none remain (no mesh, one device,
    or every axis already manual). For callbacks accepted only in a fully manual region (the
    Pallas / Mosaic-GPU interpreters)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn
    remaining = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    if not remaining:
        return fn
    return jax.shard_map(fn, in_specs=PartitionSpec(), out_specs=PartitionSpec(), axis_names=remaining,
                         check_vma=False)
