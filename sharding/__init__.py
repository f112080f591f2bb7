"""Mesh construction, logical-axis rule tables and logical -> mesh spec translation.

Imports nothing from ``mlir_train``: the model only ever names logical axes.
"""

from sharding.table import sharding_rows, sharding_table
from sharding.logical import Rules, active_rules, constrain, constrain_cotangent, logical_to_spec, tree_shardings, tree_specs, use_rules
from sharding.manual import (logical_shard_map, manual_axes_of, manual_now, mesh_axes_of,
                             replicated_on_remaining_axes, split_size, varying_axes, vary_over)
from sharding.mesh import kv_heads_replicated, make_mesh, validate
from sharding.layout import ALL_MESH_AXES, DATA_AXES, MESH_AXES, Layout, LayoutError
from sharding.rules import (
    ACTIVATION_AXES,
    DATA_PARALLEL,
    EXPERT_PARALLEL,
    LOGICAL_AXES,
    PARAM_AXES,
    PIPELINE_PARALLEL,
    TENSOR_PARALLEL,
    TENSOR_SEQUENCE_PARALLEL,
    StateSpecs,
    optimizer_state_specs,
    rules_for,
    state_specs,
    zero_spec,
)

__all__ = [
    "ACTIVATION_AXES",
    "ALL_MESH_AXES",
    "DATA_AXES",
    "DATA_PARALLEL",
    "EXPERT_PARALLEL",
    "LOGICAL_AXES",
    "MESH_AXES",
    "PARAM_AXES",
    "PIPELINE_PARALLEL",
    "TENSOR_PARALLEL",
    "TENSOR_SEQUENCE_PARALLEL",
    "Layout",
    "LayoutError",
    "Rules",
    "StateSpecs",
    "active_rules",
    "constrain",
    "constrain_cotangent",
    "kv_heads_replicated",
    "logical_shard_map",
    "logical_to_spec",
    "manual_axes_of",
    "manual_now",
    "replicated_on_remaining_axes",
    "make_mesh",
    "mesh_axes_of",
    "optimizer_state_specs",
    "rules_for",
    "sharding_rows",
    "sharding_table",
    "split_size",
    "state_specs",
    "tree_shardings",
    "tree_specs",
    "use_rules",
    "validate",
    "varying_axes",
    "vary_over",
    "zero_spec",
]
