"""Logical axis names -> mesh partition specs.

The model annotates parameters and activations with *logical* axis names ("embed", "exp",
"act_batch", ...). A rule table (plain data: a tuple of ``(logical_name, mesh_axes)`` pairs,
see ``sharding.rules``) says which mesh axis or axes each logical name is split over. This
module is the only place that turns the two into ``PartitionSpec``s.

Rules are installed for a region of code with :func:`use_rules`, next to ``jax.set_mesh`` at
an entry point; outside such a region :func:`constrain` is a no-op, so the model runs
unsharded in notebooks and tests without any setup.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

_ACTIVE_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar(
    "mlir_train_logical_rules", default=None
)


@contextlib.contextmanager
def use_rules(rules: Rules | None) -> Iterator[None]:
    """Make ``rules`` the table :func:`constrain` resolves against, for the ``with`` body."""
    token = _ACTIVE_RULES.set(None if rules is None else tuple(rules))
    try:
        yield
    finally:
        _ACTIVE_RULES.reset(token)


def active_rules() -> Rules | None:
    return _ACTIVE_RULES.get()


def axes_tuple(entry: MeshAxes) -> tuple[str, ...]:
    """A spec entry (None, one mesh axis, or several) as a tuple of mesh axis names."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def trimmed_spec(entries: Sequence[MeshAxes]) -> PartitionSpec:
    """``PartitionSpec(*entries)`` without trailing Nones (the canonical spelling)."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def logical_to_spec(
    names: Sequence[str | None] | None, rules: Rules, mesh_axis_names: Sequence[str] | None = None
) -> PartitionSpec:
    """Translate one array's logical axis names into a ``PartitionSpec``.

    A mesh axis is used at most once per array (the first logical axis that claims it wins,
    as in MaxText), and mesh axes absent from ``mesh_axis_names`` (when given) are dropped,
    so one table serves meshes that lack some axes. Unknown logical names raise: a table
    missing a rule is a bug we want to see, not a silently replicated tensor.
    """
    if names is None:
        return PartitionSpec()
    table = dict(rules)
    used: set[str] = set()
    out: list[MeshAxes] = []
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in the sharding table {sorted(table)}")
        axes = [
            a
            for a in axes_tuple(table[name])
            if a not in used and (mesh_axis_names is None or a in mesh_axis_names)
        ]
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return trimmed_spec(out)


def _current_mesh_axis_names() -> tuple[str, ...] | None:
    """The mesh axes a constraint may name here: those not manual (inside a ``shard_map``
    region an array is already the local part along its manual axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    manual = jax.sharding.AxisType.Manual
    return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != manual)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical names; identity without rules or mesh."""
    rules = _ACTIVE_RULES.get()
    if rules is None:
        return x
    axis_names = _current_mesh_axis_names()
    if axis_names is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} logical names {tuple(names)} for an array of rank {x.ndim}")
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules, axis_names))


def constrain_cotangent(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Identity on ``x``; in the backward, :func:`constrain` on its cotangent (``names``).

    For the output of a row-parallel linear under sequence parallelism: the forward leaves its
    partial sums to the caller's reduce-scatter, and the transpose of that reduce-scatter is an
    all-gather of the cotangent over the sequence. Both of the linear's transposes (input and
    weight gradient) need that gathered cotangent; left to the SPMD partitioner, each dot gets
    its own all-gather of the same buffer (XLA does not merge them: their operands differ by
    a reshape until layout assignment). Constraining the cotangent to the gathered layout once,
    here, is Megatron's single all-gather of the output gradient.
    """
    return _constrain_cotangent(x, tuple(names))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _constrain_cotangent(x, names):
    return x


def _constrain_cotangent_fwd(x, names):
    return x, None


def _constrain_cotangent_bwd(names, _, g):
    return (constrain(g, names),)


_constrain_cotangent.defvjp(_constrain_cotangent_fwd, _constrain_cotangent_bwd)


def tree_specs(logical_tree: Any, rules: Rules, mesh_axis_names: Sequence[str] | None = None) -> Any:
    """Map a pytree whose leaves are tuples of logical names to a pytree of ``PartitionSpec``."""
    return jax.tree.map(
        lambda names: logical_to_spec(names, rules, mesh_axis_names),
        logical_tree,
        is_leaf=lambda x: isinstance(x, tuple) or x is None,
    )


def tree_shardings(logical_tree: Any, rules: Rules, mesh: jax.sharding.Mesh) -> Any:
    """Like :func:`tree_specs` but gives ``NamedSharding``s on ``mesh``."""
    specs = tree_specs(logical_tree, rules, mesh.axis_names)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
