"""Human-readable sharding report: what ``--print-sharding`` and notebooks print.

One row per array: path, global shape, dtype, logical axes, mesh spec, per-device shape and
bytes; then totals. Per-device figures are computed from the spec and mesh alone, so the
report works on an abstract (``jax.ShapeDtypeStruct``) state before anything is allocated.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from sharding.logical import axes_tuple


def per_device_shape(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> tuple[int, ...]:
    """The largest shard's shape (uneven splits round up, as XLA pads them)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    return tuple(
        -(-dim // math.prod(mesh.shape[a] for a in axes_tuple(e))) for dim, e in zip(shape, entries)
    )


def per_device_bytes(shape: tuple[int, ...], dtype: Any, spec: PartitionSpec, mesh: Mesh) -> int:
    return math.prod(per_device_shape(shape, spec, mesh)) * np.dtype(dtype).itemsize


def held_bytes(tree: Any) -> int:
    """Bytes the fullest device really holds of the live arrays in ``tree`` (their shards)."""
    per_device: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _fmt_spec(spec: PartitionSpec) -> str:
    return "P(" + ", ".join("None" if e is None else repr(e) for e in spec) + ")"


def _fmt_logical(names: Any) -> str:
    if names is None:
        return "-"
    return "(" + ", ".join("None" if n is None else str(n) for n in names) + ")"


def sharding_rows(
    state_shapes_tree: Any, logical_axes_tree: Any, specs_tree: Any, mesh: Mesh
) -> list[dict[str, Any]]:
    """The table's rows as dicts (path, shape, dtype, logical, spec, device_shape, bytes, device_bytes)."""
    rows: list[dict[str, Any]] = []

    def row(path: Any, leaf: Any, logical: Any, spec: Any) -> None:
        shape = tuple(leaf.shape)
        spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec(*(spec or ()))
        dtype = np.dtype(leaf.dtype)
        rows.append(
            {
                "path": jax.tree_util.keystr(path, simple=True, separator="/"),
                "shape": shape,
                "dtype": dtype.name,
                "logical": None if logical is None else tuple(logical),
                "spec": spec,
                "device_shape": per_device_shape(shape, spec, mesh),
                "bytes": math.prod(shape) * dtype.itemsize,
                "device_bytes": per_device_bytes(shape, dtype, spec, mesh),
            }
        )

    if logical_axes_tree is None:
        logical_axes_tree = jax.tree.map(lambda _: None, state_shapes_tree)
    jax.tree_util.tree_map_with_path(row, state_shapes_tree, logical_axes_tree, specs_tree)
    return rows


def sharding_table(state_shapes_tree: Any, logical_axes_tree: Any, specs_tree: Any, mesh: Mesh) -> str:
    """Every array's path, shape, dtype, logical axes, mesh spec and per-device bytes, with totals.

    The three trees share a structure; leaves are arrays or ``jax.ShapeDtypeStruct`` (shapes),
    tuples of logical names or ``None`` (logical axes; the whole tree may be ``None``) and
    ``PartitionSpec`` (specs).
    """
    rows = sharding_rows(state_shapes_tree, logical_axes_tree, specs_tree, mesh)
    header = ("path", "shape", "dtype", "logical axes", "mesh spec", "per-device shape", "per-device")
    cells = [
        (
            r["path"],
            str(r["shape"]),
            r["dtype"],
            _fmt_logical(r["logical"]),
            _fmt_spec(r["spec"]),
            str(r["device_shape"]),
            _fmt_bytes(r["device_bytes"]),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    right = {6}

    def line(values: tuple[str, ...]) -> str:
        return "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    mesh_desc = " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
    total = sum(r["bytes"] for r in rows)
    device = sum(r["device_bytes"] for r in rows)
    count = sum(math.prod(r["shape"]) for r in rows)
    out = [f"mesh: {mesh_desc} ({mesh.size} devices)", line(header), line(tuple("-" * w for w in widths))]
    out += [line(c) for c in cells]
    out.append(
        f"total: {len(rows)} arrays, {count:,} elements, {_fmt_bytes(total)} global, "
        f"{_fmt_bytes(device)} per device ({total / max(device, 1):.2f}x split)"
    )
    return "\n".join(out)
