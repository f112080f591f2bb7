"""Parallel wrappers of the MoE experts: the manual regions that run the dispatch of
:mod:`mlir_train.model.moe.dispatch` (and the exchange of :mod:`mlir_train.model.moe.exchange`) per
rank, under data and expert parallelism.

Data parallelism without expert ranks
-------------------------------------
When the tokens are split over data ranks (``"act_tokens"``) but the experts are not, each
rank runs its own S_r tokens through all E experts in a region manual over the token axes
(:func:`data_parallel`), with the weights whole on every rank ("tensor" may still split
F; under FSDP they are gathered on entry) and their gradients summed over the ranks by the
region's transpose. The router's ``top_k`` runs manual over the tokens too. Left to XLA, the
sort by expert over the global batch all-gathered every rank's tokens and routing to every
rank. Capacity (``capacity_factor`` set) is then per rank, C = ceil(cf * S_r*K/E), as under
expert parallelism and in Megatron.

Expert parallelism
------------------
When the active sharding rules split ``"exp"`` over mesh axes of total size EP > 1, the
``"padded"`` and ``"ragged"`` paths run inside :func:`sharding.logical_shard_map`, manual over
the token axes (``"act_tokens"``, which include the expert axes: EP is carved out of DP) and
automatic over the rest (``"tensor"`` may still split the expert width F). The router and
its stats run before the manual region, partitioned by XLA (``top_k`` manual over the
tokens), so the stats are reduced over the global batch and are the single-device arrays.
Each rank then dispatches its own S_r = S / (token ranks) tokens to the ranks holding their
experts, runs its L = E / EP local experts, and sends the results back; the combine (weights, scatter-add) happens at the token's home rank.
``"dense"`` stays the plain reference under every layout (XLA partitions it).

* Padded dispatcher (any backend; the one used on CPU, where XLA has no ragged all-to-all):
  the local padded path's ``[E, C, D]`` buffer, built from the rank's own tokens, *is* the
  send buffer: a tiled ``all_to_all`` over the expert axes sends expert block r to rank r,
  the receiver runs its experts on ``[L, EP*C, D]`` with the same batched matmul, and a second
  ``all_to_all`` returns the ``[E, C, D]`` outputs. Per (rank, expert) the buffer has C slots:
  dropless takes C = ``--moe-ep-buffer-factor`` (default 2) x the balanced S_r*K/E, rounded
  up to 8. An expert whose rows from one rank exceed C sends slots [C, 2C) in a second round
  through the same buffer, and so on (:func:`~mlir_train.model.moe.dispatch.in_rounds`; the
  round count is a ``pmax`` over the ranks so all take the same branch), so nothing is dropped
  and no buffer is sized for the worst routing; the rows past the first round are counted
  (``ep_overflow_rows``) and so are the rounds after the first (``ep_further_rounds``, the most
  of any rank), which the run reports once at its end. Memory and compute per rank: E*C*D for
  each of the send and receive buffers and an expert matmul over E*C rows, i.e. the factor x
  the routed work (S_r*K rows) per round, and the all-to-all moves the padding too.
* Capacity (``capacity_factor`` set): C = ceil(capacity_factor * S_r*K/E) per rank, so each
  rank keeps at most C of *its own* tokens per expert and drops the rest by its own policy.
  This is Megatron's semantics (its router drops per rank, before the dispatch), not a global
  capacity over the whole batch; ``dropped_tokens`` is summed over all ranks.
* Ragged dispatcher (``impl="ragged"``, dropless, on platforms with ``ragged_all_to_all``:
  GPU, TPU; the plan's ``ragged_all_to_all``): the ranks first exchange their per-expert counts
  (as Megatron's alltoall dispatcher does), then the rank's assignments, sorted by expert, go as
  one slice per (destination, local expert) with ``jax.lax.ragged_all_to_all``; slices land
  grouped by local expert, so ``ragged_dot`` runs on the receive buffer directly and only real
  rows move. The receive buffer holds M = ``--moe-ep-buffer-factor`` x S_r*K rows (what a
  balanced routing sends a rank), never more than the worst routing's EP * S_r * min(K, L).
  A rank's rows, ordered by local expert then source, are its *stream*; round r moves stream
  rows [r*M, (r+1)*M), with the offsets and sizes of each slice cut to that window from the
  exchanged counts. Round 0 always runs; the further rounds only when some rank receives more
  than M rows (a ``lax.cond`` on the ``pmax`` of the counts), then in a loop that keeps nothing
  for the backward (it recomputes those rounds there), so the no-overflow path's buffers and
  FLOPs are round 0's; the overflow branch's temporaries are one round's buffers plus a second
  set of the local experts' weight gradients (to add into round 0's), which the program's
  temp memory includes. Rows past round 0 are counted
  (``ep_overflow_rows``). On CPU ``impl="ragged"`` uses the padded dispatcher;
  :func:`ragged_all_to_all_dense` emulates the collective so tests can check the ragged
  bookkeeping there.
* Grouped dispatcher (``impl="grouped"``, dropless, where ``ragged_all_to_all`` exists): as the
  ragged one, but each local expert's rows land from a block boundary of the receive buffer
  (M rows plus a block per local expert for the round-ups), so it arrives in the block layout of
  the block kernels (``moe_gpu``), which compute its used blocks only. With "moe_mlp" split over
  tensor ranks the region is manual over those axes too (a kernel's custom call cannot be split
  by XLA) and the down projection's partial sums are added with a ``psum``; the same holds for
  the data-parallel region.

Expert-tensor parallelism different from TP (Megatron's MoE parallel folding)
----------------------------------------------------------------------------
The rules decide which ranks hold distinct tokens (``"act_tokens"``): with ETP below TP the
dense tensor ranks that are expert (or expert-data) ranks are among them, so "exp" may span
tensor ranks and the all-to-all above runs over them unchanged, each rank dispatching its own
tokens. With ETP above TP the expert width is split over ranks that are dense *data* ranks
(:func:`width_token_axes`), so those ranks hold different tokens and different F shards: as
Megatron's expert-tensor group does, they all-gather each other's rows, each computes its F
shard's partial output for all of them, and a reduce-scatter sums the partials and returns
each rank's own rows. The padded dispatchers gather the rank's padded slots after its own
(per-rank) drop decision, so a capacity stays per rank; the dropless ones (blocked, ragged,
grouped) gather the tokens before dispatching (the same result, whoever sorts the rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlir_train.model.moe import dispatch as moe_dispatch
from mlir_train.model.moe import exchange
from mlir_train.model.moe.dispatch import ExpertsPlan, constrained_swiglu
from mlir_train.model.moe.experts import swiglu_experts
from sharding import logical_shard_map, manual_now, mesh_axes_of, split_size, varying_axes, vary_over


def run_experts(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, valid_S, weights):
    """The routed experts under the active layout: expert-parallel, data-parallel or on one
    rank, as the sharding rules split "exp" and "act_tokens". ``(y_SD, dropped assignments)``."""
    if mesh_axes_of("exp")[1] > 1:
        return expert_parallel(plan, x_SD, weights_SK, experts_SK, valid_S, weights)
    if mesh_axes_of("act_tokens")[1] > 1 or _kernel_tp_axes(plan):
        return data_parallel(plan, x_SD, weights_SK, experts_SK, valid_S, weights)
    return moe_dispatch.local_experts(plan, x_SD, weights_SK, experts_SK, valid_S, weights,
                                      constrained_swiglu(plan.recompute_act))


def _kernel_tp_axes(plan: ExpertsPlan) -> tuple[str, ...]:
    """The mesh axes splitting the expert width F that the region must make manual: XLA cannot
    split a kernel's custom call (it would gather the weights and do every rank's work on each),
    so with the grouped kernels each tensor rank runs its F shard and the down projection's
    partial sums are added over those axes. Only axes over which the tokens are replicated:
    the width axes that hold distinct tokens are manual anyway (:func:`width_token_axes`)."""
    tokens = set(mesh_axes_of("act_tokens")[0])
    axes = tuple(a for a in mesh_axes_of("moe_mlp")[0] if a not in tokens)
    return axes if plan.dropless_dispatch == "grouped" else ()


def width_token_axes() -> tuple[str, ...]:
    """The mesh axes that split the expert width F *and* hold distinct tokens: with
    --expert-tensor-parallel-size above --tensor-model-parallel-size the expert-tensor group
    takes in dense data-parallel ranks. Inside the manual region each such rank holds its own
    tokens and its own F shard of the weights, so, as Megatron's expert-tensor group does,
    the rows are all-gathered over these axes before the experts, every rank computes its F
    shard's partial output for all of them, and a reduce-scatter sums the partials and hands
    each rank its own rows back (:func:`_gather_rows`)."""
    tokens = set(mesh_axes_of("act_tokens")[0])
    return tuple(a for a in mesh_axes_of("moe_mlp")[0] if a in tokens)


def _gather_rows(fn, axes, axis: int = 0):
    """``fn`` on the rows (along ``axis``) of every rank of ``axes`` (see
    :func:`width_token_axes`); each rank gets its own rows of the summed outputs back. The
    first argument is the row-indexed buffer; the others (row-indexed too) are gathered alike
    and only the first output is reduce-scattered."""
    if not axes:
        return fn

    def run(*rows):
        full = [jax.lax.all_gather(r, axes, axis=axis, tiled=True) for r in rows]
        out = fn(*full)
        if isinstance(out, tuple):
            return (jax.lax.psum_scatter(out[0], axes, scatter_dimension=axis, tiled=True),) + out[1:]
        return jax.lax.psum_scatter(out, axes, scatter_dimension=axis, tiled=True)

    return run


def _tensor_manual(plan: ExpertsPlan, tp_axes, experts):
    """``experts(x_SD, ...)`` run on this tensor rank's F shard of the weights (``tp_axes``
    manual): the tokens are marked varying over ``tp_axes`` (so their gradient is summed over
    them) and the outputs summed over them."""
    if not tp_axes:
        return experts

    def run(x_SD, *args):
        (x_SD,) = _varying((x_SD,), tp_axes)
        y_SD, dropped = experts(x_SD, *args)
        return jax.lax.psum(y_SD, tp_axes), dropped

    return run


def data_parallel(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, valid_S, weights):
    """Pure data parallelism (no expert ranks): each data rank runs *its own* tokens through
    every expert, in a region manual over the token axes, with the expert weights whole on
    every rank (gathered first under FSDP; "tensor" may still split F). Left to XLA, the
    sort-by-expert over the whole batch would gather every rank's tokens and routing to
    every rank. Capacity drops are per rank, as under EP and in Megatron."""
    axes = token_axes(x_SD.shape[0])
    own = _own_axes(axes)
    tp_axes = _kernel_tp_axes(plan)
    w_axes = width_token_axes()

    def body(x_SD, weights_SK, experts_SK, valid_S, *weights):
        # The weights are the same on every rank, their per-rank gradients are not: mark
        # them varying over the region's token axes, whose transpose sums the gradients over
        # the ranks (the custom VJPs inside must see one type for a weight and its gradient).
        weights = _varying(weights, own)
        if plan.capacity_factor is not None:
            # Each rank drops from its own tokens (Megatron's per-rank capacity); the padded
            # buffers' slots are gathered over the expert-tensor ranks that hold other tokens.
            swiglu = lambda buf_ECD, *w: _gather_rows(lambda b: swiglu_experts(b, *w), w_axes, axis=1)(buf_ECD)
            experts = lambda x_SD, *a: moe_dispatch.local_experts(plan, x_SD, *a, weights, swiglu)
        else:  # dropless: the same whichever rank sorts the rows, so gather the tokens first
            experts = _gather_rows(lambda x_SD, *a: moe_dispatch.local_experts(plan, x_SD, *a, weights), w_axes)
        experts = _tensor_manual(plan, tp_axes, experts)
        y_SD, counts = experts(x_SD, weights_SK, experts_SK, valid_S)
        return y_SD, _count_over(counts, axes, ())

    tokens = ("act_tokens", None)
    w_in, w_out = (None, None, "moe_mlp"), (None, "moe_mlp", None)
    run = logical_shard_map(
        body,
        in_names=(tokens, tokens, tokens, ("act_tokens",), w_in, w_in, w_out),
        out_names=(tokens, ()),
        manual=("act_tokens",) + (("moe_mlp",) if tp_axes else ()),
    )
    return run(x_SD, weights_SK, experts_SK, valid_S, *weights)


def expert_parallel(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, valid_S, weights):
    """Experts split over the mesh axes "exp" maps to; tokens travel by all-to-all.

    Each rank of the manual region holds its tokens (``act_tokens`` is split over the
    data-like axes, the expert axes among them) and ``E / EP`` experts. See the module
    docstring for the two dispatchers and their buffers.
    """
    ep_axes, ep = mesh_axes_of("exp")
    manual_axes = tuple(token_axes(x_SD.shape[0]))
    own = _own_axes(manual_axes)
    _check_expert_split(plan.num_experts, ep, ep_axes, manual_axes)
    dispatcher = plan.dropless_dispatch if plan.ragged_all_to_all is not None else None
    tp_axes = _kernel_tp_axes(plan) if dispatcher == "grouped" else ()
    w_axes = width_token_axes()
    # Every rank of the region takes the same branch of the dispatchers' overflow rounds.
    # (typed varying over all of them first: jax 0.12 refuses a pmax over axes in mixed states)
    agree = lambda n: jax.lax.pmax(vary_over(n, manual_axes + tp_axes), manual_axes + tp_axes)

    def body(x_SD, weights_SK, experts_SK, valid_S, wg, wu, wd):
        if dispatcher == "ragged":
            # Dropless: the expert-tensor ranks holding other tokens gather them first, and
            # each dispatches them all to the ranks of its own F shard.
            experts = _gather_rows(lambda x_SD, w_SK, e_SK: exchange.ep_ragged(
                plan, x_SD, w_SK, e_SK, (wg, wu, wd), ep_axes, ep, agree), w_axes)
            y_SD, counts = experts(x_SD, weights_SK, experts_SK)
            return y_SD, _count_over(counts, manual_axes, w_axes)
        if dispatcher == "grouped":
            # The kernels' custom VJP needs a weight and its gradient (summed over the token
            # ranks by the region's transpose) to have one type.
            weights = _varying((wg, wu, wd), own)
            # Expert-tensor ranks holding their own tokens dispatch their own rows and gather
            # what they received, as Megatron does (each rank's counts are its own).
            experts = (lambda x_SD, w_SK, e_SK: exchange.ep_grouped_gathered(
                plan, x_SD, w_SK, e_SK, weights, ep_axes, ep, w_axes, agree)) if w_axes else (
                lambda x_SD, w_SK, e_SK: exchange.ep_grouped(plan, x_SD, w_SK, e_SK, weights, ep_axes, ep, agree))
            y_SD, counts = _tensor_manual(plan, tp_axes, experts)(x_SD, weights_SK, experts_SK)
            return y_SD, _count_over(counts, manual_axes + tp_axes, tp_axes)
        return _ep_padded(plan, x_SD, weights_SK, experts_SK, valid_S, (wg, wu, wd), ep_axes, ep, manual_axes,
                          w_axes)

    tokens = ("act_tokens", None)
    w_in, w_out = ("exp", "embed", "moe_mlp"), ("exp", "moe_mlp", "embed")
    run = logical_shard_map(
        body,
        in_names=(tokens, tokens, tokens, ("act_tokens",), w_in, w_in, w_out),
        out_names=(tokens, ()),
        manual=("act_tokens", "exp") + (("moe_mlp",) if tp_axes else ()),
    )
    return run(x_SD, weights_SK, experts_SK, valid_S, *weights)


def _check_expert_split(e: int, ep: int, ep_axes, manual_axes) -> None:
    if e % ep:
        raise ValueError(f"{e} experts cannot be split over {ep} expert-parallel ranks")
    if not set(ep_axes) <= set(manual_axes):
        raise ValueError(
            f"expert parallelism needs the tokens split over the expert ranks too (the rules map "
            f"'exp' to {ep_axes} but 'act_tokens' to {manual_axes}): EP is carved out of DP"
        )


@moe_dispatch.dispatcher_scope("padded")
def _ep_padded(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, valid_S, weights, ep_axes, ep: int, manual_axes,
               w_axes):
    """The padded dispatcher across expert ranks, inside :func:`expert_parallel`'s region (see
    the module docstring): the rank's ``[E, C, D]`` buffer goes out by a tiled all-to-all, the
    local experts run on what arrives, a second all-to-all brings the outputs back.
    ``(y_SD, dropped assignments summed over the ranks)``."""
    e = plan.num_experts

    def experts_fn(buf_ECD, wg, wu, wd):
        _, c, d = buf_ECD.shape
        el = e // ep
        # Tiled all-to-all: block r of the expert axis (rank r's experts) goes to rank
        # r; what arrives is indexed (source rank, local expert).
        recv = jax.lax.all_to_all(buf_ECD, ep_axes, 0, 0, tiled=True)
        recv_LCD = recv.reshape(ep, el, c, d).swapaxes(0, 1).reshape(el, ep * c, d)
        # Each rank's own slots; with expert-tensor ranks that hold other tokens, the
        # slots of all of them meet on each rank's F shard (Megatron's ETP all-gather).
        out_LCD = _gather_rows(lambda r_LCD: swiglu_experts(r_LCD, wg, wu, wd, recompute_act=plan.recompute_act), w_axes, axis=1)(recv_LCD)
        out = out_LCD.reshape(el, ep, c, d).swapaxes(0, 1).reshape(e, c, d)
        return jax.lax.all_to_all(out, ep_axes, 0, 0, tiled=True)

    y_SD, counts = moe_dispatch.dispatch_padded(
        plan, x_SD, weights_SK, experts_SK, valid_S, experts_fn, lambda n: jax.lax.pmax(n, manual_axes), weights
    )
    return y_SD, _count_over(counts, manual_axes, ())


def _count_over(counts, axes, same_axes):
    """A rank's counts (``dispatch.COUNTS``) over the ranks of ``axes``: the dropped and overflow
    rows summed, counted once over ``same_axes`` (ranks that hold the same rows: tensor ranks, or
    expert-tensor ranks after the gather); the further rounds, which every rank waits for, the
    most any rank took."""
    rows, rounds = counts[:2], counts[2:]
    distinct = tuple(a for a in axes if a not in same_axes)
    rows = jax.lax.psum(rows, distinct) if distinct else rows
    same = tuple(a for a in same_axes if a in varying_axes(rows))
    rows = jax.lax.pmax(rows, same) if same else rows
    everywhere = tuple(a for a in axes if a in varying_axes(rounds))
    return jnp.concatenate([rows, jax.lax.pmax(rounds, everywhere) if everywhere else rounds])


def _varying(arrays, axes):
    """``arrays`` marked varying over those of ``axes`` they do not vary over yet."""
    out = []
    for a in arrays:
        missing = tuple(ax for ax in axes if ax not in varying_axes(a))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return tuple(out)


def _own_axes(axes) -> tuple[str, ...]:
    """Those of ``axes`` the MoE's region itself makes manual. The others are manual in an
    enclosing region already (the trainer's data-manual step, whose ranks accumulate their own
    weight gradients and reduce them once per step): a weight is not marked varying over
    those, or its transpose would sum the gradients over them on every use."""
    outer = manual_now()
    return tuple(a for a in axes if a not in outer)


def token_axes(num_tokens: int) -> tuple[str, ...]:
    """The mesh axes the MoE's tokens are split over; the token count (the local one inside
    an enclosing manual region) must divide evenly over those still split here."""
    axes, _ = mesh_axes_of("act_tokens")
    n_token_ranks = split_size("act_tokens")
    if num_tokens % n_token_ranks:
        raise ValueError(f"{num_tokens} tokens (batch x sequence) cannot be split over the MoE's {n_token_ranks} token ranks "
                         "(data x context ranks, and the tensor ranks folded into the expert grid)")
    return axes
