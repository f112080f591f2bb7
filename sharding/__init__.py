"""Mesh construction, logical-axis rule tables and logical -> mesh spec translation.

Imports nothing from ``mlir_train``: the model only ever names logical axes.
"""

from sharding.logical import Rules, active_rules, constrain, logical_to_spec, tree_shardings, tree_specs, use_rules

__all__ = ["Rules", "active_rules", "constrain", "logical_to_spec", "tree_shardings", "tree_specs", "use_rules"]
