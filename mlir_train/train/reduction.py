"""Weight gradients reduced once per step, as Megatron's distributed optimizer reduces them.

A step's micro-batches (and, under pipeline parallelism, its ticks) run in a region manual over
the data axes, the mesh axes the batch rows (``"act_batch"``) are split over
(:func:`data_manual_names`). Each data rank forms the weight gradients of its own rows and adds
them, unreduced, to float32 accumulators; they leave the region with a leading data-rank axis
(:func:`with_rank_axis`) and are summed once per step into the float32 master weights' layout
(:func:`summed`): with ``--use-distributed-optimizer`` one reduce-scatter into the optimizer's
shards, in float32 (Megatron's ``--accumulate-allreduce-grads-in-fp32`` grad buffer and its one
reduce-scatter per step), without it one all-reduce (Megatron's DDP).

Left to XLA's automatic partitioning (the weights replicated over the data ranks), every
weight-gradient matmul contracts over rows split over those ranks and is reduced where it is
formed: per layer, per micro-batch, per 1F1B tick (the seed job: 1560 attention-gradient
all-reduces per step), and XLA moves none of them out of the layer and tick loops.
``PartitionSpec(unreduced=..., reduced=...)`` says the same in types, but only over Explicit mesh
axes; the mesh here is Auto (``sharding.mesh``), so the region is manual instead, with the same
compiled result: no data-axis collective in the loops, one per gradient after them.

What the region changes for the code inside (each in its own module):

* shapes are the rank's own rows; ``sharding.constrain`` names the automatic axes only, and a
  model region over axes that are manual already is manual over the rest
  (``sharding.logical_shard_map``);
* the router's balancing groups are weighed over every rank's groups and ``global_aux_loss``
  sums the ranks' expert counts (``mlir_train.model.losses.router_losses``);
* the logged sums and per-group means are reduced over the ranks at the end (:func:`reduced_aux`).

Not under FSDP: its weights stay split over the data ranks and are gathered per use, and its
gradients are reduce-scattered per micro-batch, as Megatron-FSDP (``optim_grads_params``) and torch
FSDP2 do; whole gradients on every rank are what FSDP exists to avoid.

The tensor ranks are the same story for one weight. Under ``--sequence-parallel`` (and the MoE
fold) each MoE token rank that is not a data rank routes its own tokens, so the router weight's
gradient is partial over those ranks and XLA all-reduces it where it is formed, per MoE layer
and tick (the seed: 1.50 of its 1.54 GiB of all-reduce). Megatron marks the router weight
``sequence_parallel`` and all-reduces it once per step (``finalize_model_grads``). Here the
weights whose logical axes end as :data:`TOKEN_PARTIAL` say are broadcast, before the loops,
over a leading ``"token_ranks"`` axis split over those ranks (:func:`token_partial`); the router
forms its logits per rank (``mlir_train.model.moe.router.router_logits``), so each rank's
gradient stays on its own row, and the broadcast's transpose (the sum over the ranks) is taken
once after the loops, in float32, with the data ranks' (:func:`summed`).

The unchecked region (``check_vma=False``) transposes nothing here: the gradients are formed
inside it (``jax.vjp`` per item, ``jax.grad`` per micro-batch). GPipe, whose gradient is
autodiff through the region, gets the same one reduction from the region's transpose (a psum
over the data axes of each weight's cotangent, after the tick loop).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mlir_train.config.policies import TRACKER_NAMES
from sharding import active_rules, logical_to_spec, manual_axes_of, mesh_axes_of
from sharding.logical import axes_tuple

BATCH = "act_batch"
TOKEN_RANKS = "token_ranks"
SEQ_RANKS = "seq_ranks"
RANK_AXES = (TOKEN_RANKS, SEQ_RANKS)
# The weights' own logical axes of the replicated weights whose gradient each MoE token rank
# forms from its own tokens: the router's (Megatron's sequence_parallel-marked router weight).
# And the residual stream's RMSNorm scales under --sequence-parallel / context parallelism:
# each sequence rank normalises its own rows (Megatron all-reduces these "sequence_parallel"
# weights' gradients over TP once per step, as the router's). Each pattern's rank axis:
TOKEN_PARTIAL = {("embed", "router_exp"): TOKEN_RANKS, ("norm",): SEQ_RANKS}
# The step's sums over rows (a rank's share adds up to the step's) and the router's per-layer
# values: the mean over balancing groups (a rank's mean over its groups; the step's is the mean
# over ranks), but global_aux_loss, which is a sum over them.
SUMMED = ("objective", "ce_sum", "loss_tokens", "lm_objective", "tokens_per_expert")
ROUTER_SUMMED = (TRACKER_NAMES["global_aux_loss"],)


def data_manual_names(rows: int, group_rows: int = 1) -> tuple[str, ...]:
    """The logical axes a step's region is manual over for the unreduced gradients: the batch
    rows', when they are split at all and each data rank holds whole balancing groups of the
    router (``group_rows``, ``--micro-batch-size`` for an MoE model: the rows of a micro-batch
    ``rows`` over the ranks, a multiple of it; always so when a micro-batch is
    ``--micro-batch-size`` x DP rows, as the trainer's are). Otherwise a group's statistics
    would span ranks that no longer see each other's rows: no region, XLA's reduction."""
    axes, ranks = mesh_axes_of(BATCH)
    return (BATCH,) if ranks > 1 and rows % (ranks * group_rows) == 0 else ()


def partial_specs(names: Any, manual: tuple[str, ...], lead: tuple = ()) -> Any:
    """Out specs of the region's per-rank partial gradients, per leaf of ``names`` (the weights'
    logical axes) in the region manual over ``manual`` (:func:`data_manual_names`): ``P(*lead,
    rank axes, *the weight's own spec)``, the rank axis over the region's data axes the weight is
    replicated over. A weight split over some of them (routed
    experts over expert ranks that are data ranks too) holds its own part there already: those
    stay on its own dimension, and its partials are summed over the others only."""
    rules, mesh = active_rules(), jax.sharding.get_abstract_mesh()
    region = mesh_axes_of(BATCH)[0] if manual else ()

    def one(leaf_names):
        spec = logical_to_spec(leaf_names, rules, mesh.axis_names)
        used = {a for entry in spec for a in axes_tuple(entry)}
        rank = tuple(a for a in region if a not in used)
        return PartitionSpec(*lead, None if not rank else rank[0] if len(rank) == 1 else rank, *spec)

    return jax.tree.map(one, names, is_leaf=is_names)


def row_names(x) -> tuple:
    """Logical axes of a batch leaf: ``[M, B, T]`` micro-batches of rows, or ``[M]`` per
    micro-batch."""
    return (None, BATCH, "act_seq")[:x.ndim] if x.ndim >= 2 else (None,) * x.ndim


def is_names(x: Any) -> bool:
    """A leaf of a tree of logical axes: a tuple of names (None for an unsplit dimension)."""
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


def token_axis(names: tuple) -> int | None:
    """Where :func:`token_partial` puts a weight's rank axis (before its own axes, after any
    stacking ones), or None for a weight it leaves alone."""
    found = _pattern(names)
    return None if found is None else found[0]


def _pattern(names: tuple) -> tuple[int, str] | None:
    for own, rank in TOKEN_PARTIAL.items():
        if len(names) >= len(own) and tuple(names[len(names) - len(own):]) == own:
            return len(names) - len(own), rank
    return None


def rank_axis(names: tuple) -> int | None:
    """The position of :func:`token_partial`'s rank axis in expanded ``names``, or None."""
    return next((names.index(r) for r in RANK_AXES if r in names), None)


def token_partial(weights: Any, names: Any, manual: tuple[str, ...]) -> tuple[Any, Any]:
    """``(weights, names)`` with each :data:`TOKEN_PARTIAL` weight broadcast over a new rank
    axis: ``"token_ranks"`` (the router's: one row per MoE token rank that is not a data rank,
    module docstring), ``"seq_ranks"`` (a residual-stream norm's: one row per sequence rank),
    for a region manual over ``manual`` (:func:`data_manual_names`). Unchanged where there are
    no such ranks, or where the MoE's tokens are also split over data ranks the region leaves
    automatic (each token rank's rows would not be one block of them). Call it outside the
    loops that form the gradients: the broadcast's transpose is the once-per-step sum
    (:func:`summed`)."""
    def ranks_of(rank: str) -> int:
        try:
            axes, ranks = mesh_axes_of(rank)
        except KeyError:  # a table without the name splits nothing over it
            return 1
        region = set(mesh_axes_of(BATCH)[0]) if manual else set()
        rows = mesh_axes_of("act_tokens" if rank == TOKEN_RANKS else "act_res_seq")[0]
        return 1 if ranks == 1 or set(rows) - set(axes) - region else ranks

    counts = {r: ranks_of(r) for r in RANK_AXES}

    def expand(n):
        found = _pattern(n)
        return None if found is None or counts[found[1]] == 1 else found

    def weight(n, w):
        found = expand(n)
        if found is None:
            return w
        at, rank = found
        return jnp.broadcast_to(jnp.expand_dims(w, at), w.shape[:at] + (counts[rank],) + w.shape[at:])

    def name(n):
        found = expand(n)
        return n if found is None else n[:found[0]] + (found[1],) + n[found[0]:]

    return jax.tree.map(weight, names, weights, is_leaf=is_names), jax.tree.map(name, names, is_leaf=is_names)


def with_rank_axis(tree: Any) -> Any:
    """Each rank's partial gradients with a leading axis of 1 (out of the region: one row per
    data rank, named :data:`BATCH`)."""
    return jax.tree.map(lambda x: x[None], tree)


def summed(partials: Any, shardings: Any, names: Any = None) -> Any:
    """The data ranks' partial gradients (leading rank axis) summed, in float32, straight into
    ``shardings`` (the master weights': the distributed optimizer's shards make it one
    reduce-scatter per gradient); with the weights' own ``names``, a gradient that carries
    :func:`token_partial`'s axis is summed over it too."""
    def one(g, s, n=None):
        at = None if n is None or g.ndim != len(n) + 2 else token_axis(n)
        axes = (0,) if at is None else (0, at + 1)
        return jax.lax.with_sharding_constraint(jnp.sum(g.astype(jnp.float32), axis=axes), s)

    if names is None:
        return jax.tree.map(one, partials, shardings)
    return jax.tree.map(lambda n, g, s: one(g, s, n), names, partials, shardings, is_leaf=is_names)


def reduced_aux(aux: dict[str, Any]) -> dict[str, Any]:
    """A rank's logged values inside the data-manual region -> the step's: sums summed over the
    data ranks, per-group means averaged over them. Counts already summed over the token ranks
    inside the MoE region (dropped tokens, EP overflow rows) and ``global_aux_loss``'s running
    counts (summed in ``losses.router_losses``) are left as they are."""
    axes, n = manual_axes_of(BATCH)
    if not axes:
        return aux
    total = lambda x: jax.lax.psum(x, axes)
    out = dict(aux)
    for key in SUMMED:
        if key in aux:
            out[key] = total(aux[key])
    if "router_layers" in aux:
        out["router_layers"] = {k: total(v) if k in ROUTER_SUMMED else total(v) / n
                                for k, v in aux["router_layers"].items()}
    if "moe" in aux:  # the pipeline's per-segment accumulators
        out["moe"] = [dict(m, layers={k: total(v) if k in ROUTER_SUMMED else total(v) / n
                                      for k, v in m["layers"].items()},
                           tokens_per_expert=total(m["tokens_per_expert"])) for m in aux["moe"]]
    return out
