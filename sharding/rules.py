"""Rule tables: which mesh axes each logical axis is split over, one table per layout.

Tables are plain data so they can be printed, diffed and tested for completeness against
``LOGICAL_AXES`` (every name the model uses). Each layout is a small overlay on
``DATA_PARALLEL``; :func:`rules_for` stacks the overlays a :class:`~sharding.mesh.Layout`
asks for (Levanter-style: the table is a function of a few knobs, not a config file).

Two kinds of placement come out of here:

* the *compute* layout, from the rule tables: how parameters and activations are split while
  the forward and backward run (tensor, expert and pipeline splits; parameters replicated
  over the data-parallel ranks);
* the *storage* layout of the optimizer state and float32 master weights (and, under FSDP,
  of the parameters themselves): the compute spec plus a split over the data-parallel ranks on
  one dimension that divides, added per array by :func:`zero_spec`. That is ZeRO-1 (Megatron's
  ``--use-distributed-optimizer``): XLA turns the gradient all-reduce into a reduce-scatter
  onto this layout and all-gathers the updated parameters back to the compute layout.

The data-parallel split is added per array rather than through a logical axis because no
single logical axis is on every parameter and divisible by the data-parallel size (norm
scales, q/k norms and the router would stay replicated, experts already use "expert").
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from sharding.logical import MeshAxes, Rules, axes_tuple, tree_specs, trimmed_spec
from sharding.mesh import kv_heads_replicated
from sharding.layout import ALL_MESH_AXES, DATA_AXES, Layout

# Every logical axis name the model may put on a parameter or an activation.
PARAM_AXES = (
    "layers",     # stacked decoder layers (-> stage under pipeline parallelism)
    "mtp_layers", # a multi-token-prediction depth's one-layer stack (whole on every stage)
    "mtp_concat", # the MTP projection's input: embedding and hidden state side by side
    "vocab",      # embedding rows / LM-head columns
    "embed",      # hidden size of weights
    "norm",       # RMSNorm scale vectors over the hidden size
    "q_heads",    # query heads
    "kv_heads",   # key/value heads
    "head_dim",   # per-head dimension
    "mlp",        # dense SwiGLU intermediate
    "exp",        # routed experts
    "moe_mlp",    # expert SwiGLU intermediate
    "router_exp", # router output columns (one per expert; kept whole, as Megatron does)
    "gdn_key_heads",  # a linear-attention (gated DeltaNet) layer's query/key heads
    "gdn_heads",      # its value heads (each key head's H/G value heads next to it)
    "token_ranks",    # a leading rank axis of a weight whose gradient each token rank forms from
                      # its own tokens (the router's): the MoE's token ranks that are not data
                      # ranks (mlir_train.train.reduction.token_partial)
    "seq_ranks",      # the same for a weight each sequence rank uses on its own rows (the
                      # residual stream's norms under --sequence-parallel / context parallelism)
)
ACTIVATION_AXES = (
    "act_batch",
    "act_seq",       # sequence inside attention / MLP / logits (whole on every tensor rank)
    "act_res_seq",   # sequence of the residual stream and norm inputs/outputs between the
                     # tensor-parallel regions: split over "tensor" under --sequence-parallel
    "act_embed",
    "act_heads",
    "act_kv_heads",
    "act_head_dim",
    "act_mlp",
    "act_vocab",
    "act_exp",       # expert dimension of dispatched tokens
    "act_capacity",  # per-expert token slots in the padded dispatch buffer
    "act_tokens",    # flattened batch*seq tokens inside the MoE block
    "act_gdn_key_heads",  # a linear-attention layer's query/key heads (activations)
    "act_gdn_heads",      # its value heads (activations)
)
LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES

_BATCH = ("data", "expert")  # every data-like axis: the expert ranks are data ranks outside the experts


def _overlay(base: Rules, *overrides: Mapping[str, MeshAxes]) -> Rules:
    table = dict(base)
    for override in overrides:
        unknown = set(override) - set(table)
        assert not unknown, f"overlay names unknown logical axes {sorted(unknown)}"
        table.update(override)
    return tuple((name, table[name]) for name in LOGICAL_AXES)


# Pure data parallelism: weights replicated, batch split over every data-like axis.
DATA_PARALLEL: Rules = tuple(
    (name, {
        "act_batch": _BATCH,
        "act_tokens": _BATCH,
        # The capacity slots are the batch-like dimension of the expert dispatch buffer;
        # splitting them over the data ranks keeps expert compute data-parallel instead of
        # replicated (the MoE block rounds capacity up to a multiple of the data-parallel
        # size). Under expert parallelism "act_exp" claims "expert" first, so the slots are
        # split over "data" only.
        "act_capacity": _BATCH,
    }.get(name))
    for name in LOGICAL_AXES
)

# Megatron tensor parallelism: q/k/v and gate/up column-parallel (output features split),
# o and down row-parallel (input features split, partial sums reduced), embedding and LM head
# vocab-parallel. Activations inside those regions follow the split features.
TENSOR_PARALLEL_OVERRIDES: Mapping[str, MeshAxes] = {
    "vocab": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "moe_mlp": "tensor",
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    # A linear-attention layer's heads split like attention heads: each tensor rank runs whole
    # heads, so the recurrence needs no communication. Key and value heads both split
    # contiguously, which keeps a key head and its value heads on one rank when TP divides the
    # key heads (sharding.mesh checks it); unlike kv_heads they are never replicated.
    "gdn_key_heads": "tensor",
    "gdn_heads": "tensor",
    "act_gdn_key_heads": "tensor",
    "act_gdn_heads": "tensor",
}
# TP with more ranks than kv heads (see sharding.mesh.kv_heads_replicated).
REPLICATED_KV_OVERRIDES: Mapping[str, MeshAxes] = {"kv_heads": None, "act_kv_heads": None}
# Megatron sequence parallelism: what lies between the TP regions (residual adds, RMSNorm)
# is split along the sequence over the tensor ranks, so the TP all-reduce becomes a
# reduce-scatter into that layout and an all-gather out of it.
SEQUENCE_PARALLEL_OVERRIDES: Mapping[str, MeshAxes] = {"act_res_seq": "tensor"}
EXPERT_PARALLEL_OVERRIDES: Mapping[str, MeshAxes] = {"exp": "expert", "act_exp": "expert"}
PIPELINE_PARALLEL_OVERRIDES: Mapping[str, MeshAxes] = {"layers": "stage"}

TENSOR_PARALLEL: Rules = _overlay(DATA_PARALLEL, TENSOR_PARALLEL_OVERRIDES)
TENSOR_SEQUENCE_PARALLEL: Rules = _overlay(TENSOR_PARALLEL, SEQUENCE_PARALLEL_OVERRIDES)
EXPERT_PARALLEL: Rules = _overlay(DATA_PARALLEL, EXPERT_PARALLEL_OVERRIDES)
PIPELINE_PARALLEL: Rules = _overlay(DATA_PARALLEL, PIPELINE_PARALLEL_OVERRIDES)


def _entry(axes: tuple[str, ...]) -> MeshAxes:
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _on_roles(overrides: Mapping[str, MeshAxes], cfg: Layout) -> dict[str, MeshAxes]:
    """``overrides`` written for the default mesh (role-named axes "tensor", "expert"),
    re-targeted at the axes carrying those roles in ``cfg``'s mesh."""
    role_of = {"tensor": "tensor", "expert": "expert", "stage": "stage"}
    return {name: _entry(cfg.role_axes(role_of[axes])) if isinstance(axes, str) else axes
            for name, axes in overrides.items()}


def etp_tp_fold(cfg: Layout) -> bool:
    """ETP = TP > 1 under SP with EP: each tensor rank routes its own sequence chunk and the
    expert-tensor group gathers the rows it received (:func:`rules_for`)."""
    return cfg.expert > 1 and cfg.sequence_parallel and cfg.etp == cfg.tensor > 1


def expert_rows_gathered(cfg: Layout) -> bool:
    """Whether the expert width is split over ranks that hold distinct tokens, so the MoE's
    grouped dispatcher gathers the received rows over them (``exchange.ep_grouped_gathered``):
    the ETP = TP fold, or ETP above TP."""
    return cfg.expert > 1 and (etp_tp_fold(cfg) or cfg.etp > cfg.tensor)


def rules_for(cfg: Layout, model_dims: Mapping[str, int] | None = None) -> Rules:
    """The compute-layout table for any combination of TP, SP, CP, EP, ETP and PP.

    Each logical axis maps to the mesh axes that carry its role in ``cfg``'s mesh
    (:meth:`~sharding.mesh.Layout.role_axes`): the dense-weight splits to the tensor
    role, the expert dimension to the expert role, the expert width to the expert-tensor role
    (= tensor unless --expert-tensor-parallel-size differs), the batch to the data role, and,
    under context parallelism, the sequence to the context role (the MoE's flattened tokens
    and capacity slots to data x context, and under MoE parallel folding to the tensor ranks
    that are expert or expert-data ranks too). ``model_dims`` is only read for ``num_kv_heads``:
    when TP exceeds it, k/v heads are replicated over the tensor ranks instead of split.
    Overlays for sizes of 1 are left out, so the table says what is actually split.
    """
    data = cfg.role_axes("data")
    # The MoE's tokens are split over every rank that holds distinct tokens for the experts:
    # the data (and context) ranks, and under MoE parallel folding (ETP < TP) the dense
    # tensor ranks that are expert or expert-data ranks too. Under --sequence-parallel those
    # already hold their own sequence chunk (Megatron's folding dispatches from there); without
    # it each takes a slice of the replicated tokens and the output is all-gathered.
    folded = set(cfg.role_axes("tensor")) - set(cfg.role_axes("expert_tensor"))
    if etp_tp_fold(cfg):
        # ETP = TP under SP: each tensor rank routes and dispatches its own sequence chunk,
        # T/TP x K rows, and the expert-tensor group gathers what it received (Megatron's
        # alltoall dispatcher), rather than every tensor rank dispatching the whole sequence.
        folded |= set(cfg.role_axes("tensor"))
    tokens = tuple(a for a in ALL_MESH_AXES if a in set(data) | set(cfg.role_axes("context")) | folded)
    overlays: list[Mapping[str, MeshAxes]] = [
        {"act_batch": _entry(data), "act_tokens": _entry(tokens), "act_capacity": _entry(tokens),
         "token_ranks": _entry(tuple(a for a in tokens if a not in data))}]
    if cfg.tensor > 1:
        overlays.append(_on_roles(TENSOR_PARALLEL_OVERRIDES, cfg))
        kv = (model_dims or {}).get("num_kv_heads")
        if kv is not None and kv_heads_replicated(cfg.tensor, kv):
            overlays.append(REPLICATED_KV_OVERRIDES)
    # The expert width follows the expert-tensor role (the tensor role when ETP = TP).
    overlays.append({"moe_mlp": _entry(cfg.role_axes("expert_tensor")) if cfg.etp > 1 else None})
    seq = cfg.role_axes("context") if cfg.context > 1 else ()
    res_seq = seq + (cfg.role_axes("tensor") if cfg.tensor > 1 and cfg.sequence_parallel else ())
    if seq or res_seq:
        overlays.append({"act_seq": _entry(seq), "act_res_seq": _entry(res_seq), "seq_ranks": _entry(res_seq)})
    if cfg.expert > 1:
        overlays.append(_on_roles(EXPERT_PARALLEL_OVERRIDES, cfg))
    if cfg.pipeline > 1:
        overlays.append(PIPELINE_PARALLEL_OVERRIDES)
    return _overlay(DATA_PARALLEL, *overlays)


# ----- storage layout: ZeRO-1 / FSDP ------------------------------------------------------


def zero_spec(
    shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh, axes: tuple[str, ...] = DATA_AXES
) -> PartitionSpec:
    """``spec`` plus a split over the data-parallel mesh ``axes`` it does not use yet.

    Picks the largest group of those axes (all of them first) that divides some dimension,
    preferring dimensions not yet split and, among those, the largest: that keeps the split
    off the small stacked "layers" axis, which under FSDP would make the layer scan gather
    every layer at once. A dimension already split (say over "tensor") is split further only
    if no free one divides. Arrays nothing divides (scalars, odd sizes) keep ``spec``,
    i.e. stay replicated over the data ranks.
    """
    entries: list[MeshAxes] = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries for a in axes_tuple(e)}
    free = [a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used]
    if not free or not shape:
        return spec
    groups = sorted(
        (g for r in range(len(free), 0, -1) for g in itertools.combinations(free, r)),
        key=lambda g: -math.prod(mesh.shape[a] for a in g),
    )
    by_size = sorted(range(len(shape)), key=lambda i: -shape[i])
    for group in groups:
        n = math.prod(mesh.shape[a] for a in group)
        for i in by_size:
            if entries[i] is None and shape[i] % n == 0:
                entries[i] = group[0] if len(group) == 1 else group
                return trimmed_spec(entries)
        for i in by_size:
            if entries[i] is not None:
                existing = axes_tuple(entries[i])
                if shape[i] % (n * math.prod(mesh.shape[a] for a in existing)) == 0:
                    entries[i] = existing + group
                    return trimmed_spec(entries)
    return spec


def _shape_of(leaf: Any) -> tuple[int, ...]:
    return tuple(getattr(leaf, "shape", ()))


def optimizer_state_specs(param_shapes_tree: Any, param_specs_tree: Any, mesh: Mesh, axes_tree: Any = None) -> Any:
    """ZeRO-1 specs: each parameter's compute spec plus a split over the data-parallel ranks.

    ``param_shapes_tree`` has arrays or ``jax.ShapeDtypeStruct`` leaves, ``param_specs_tree``
    the compute ``PartitionSpec`` of each. Works for any tree of per-parameter arrays: the
    float32 master weights, Adam's moments (same shapes as the parameters), and the
    parameters themselves under FSDP. ``axes_tree`` (same structure, a tuple of mesh axes per
    leaf) names each leaf's data-parallel group; default :data:`~sharding.mesh.DATA_AXES`.
    """
    if axes_tree is None:
        return jax.tree.map(lambda leaf, spec: zero_spec(_shape_of(leaf), spec, mesh),
                            param_shapes_tree, param_specs_tree)
    return jax.tree.map(
        lambda leaf, spec, axes: zero_spec(_shape_of(leaf), spec, mesh, axes),
        param_shapes_tree, param_specs_tree, axes_tree,
    )


def data_axes_tree(cfg: Layout, logical_axes_tree: Any) -> Any:
    """Each parameter's data-parallel group (mesh axes): the expert-data group for routed
    experts (a leaf whose logical axes include "exp"), the dp x cp group for the rest. Under
    pipeline parallelism the weights outside the layer stacks (embedding, final norm, LM head)
    are held by every stage but their gradients are formed on one (the embedding's on the
    first, the head's on the last): their optimizer state is split over the stages too, so the
    gradient's sum over stages and data ranks is one reduce-scatter, not an all-reduce of the
    whole table, and no stage keeps a whole copy of their moments (Megatron keeps them on
    their stage only)."""
    dense, expert = cfg.data_axes(), cfg.data_axes(expert=True)
    staged = ("stage",) + dense if cfg.pipeline > 1 else dense

    def group(names):
        if "exp" in names:
            return expert
        return dense if "layers" in names else staged

    return jax.tree.map(group, logical_axes_tree, is_leaf=lambda x: isinstance(x, tuple) or x is None)


@dataclasses.dataclass(frozen=True)
class StateSpecs:
    """Where the training state lives, as trees of ``PartitionSpec`` shaped like the params."""

    compute: Any  # parameters as the forward/backward uses them
    params: Any   # parameters as stored between steps (= compute, or data-split under FSDP)
    optimizer: Any  # optimizer moments and float32 master weights


def state_specs(
    cfg: Layout,
    param_shapes_tree: Any,
    logical_axes_tree: Any,
    mesh: Mesh,
    model_dims: Mapping[str, int] | None = None,
) -> StateSpecs:
    """Compute, parameter-storage and optimizer-state specs for ``cfg``.

    ``logical_axes_tree`` mirrors the parameters with a tuple of logical names per leaf.
    Without ``--use-distributed-optimizer`` or FSDP the optimizer state is laid out like the
    parameters (replicated over the data ranks), as Megatron's plain DDP optimizer is.
    """
    compute = tree_specs(logical_axes_tree, rules_for(cfg, model_dims), mesh.axis_names)
    zero = optimizer_state_specs(param_shapes_tree, compute, mesh, data_axes_tree(cfg, logical_axes_tree))
    return StateSpecs(
        compute=compute,
        params=zero if cfg.fsdp else compute,
        optimizer=zero if (cfg.distributed_optimizer or cfg.fsdp) else compute,
    )
