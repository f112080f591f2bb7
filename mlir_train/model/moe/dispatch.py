"""Token dispatch of the MoE block on one rank: sort the routed assignments by expert, lay them
out for an expert kernel (:mod:`mlir_train.model.moe.experts`), run it, combine the outputs;
and the rounds through one bounded buffer (:func:`in_rounds`) that the padded dispatcher and the
expert-parallel exchange (:mod:`mlir_train.model.moe.exchange`) share.

Shape suffixes as in :mod:`mlir_train.model.moe.block`. Every function takes the block's
:class:`ExpertsPlan`, fixed when the block is built; the parallel wrappers
(:mod:`mlir_train.model.moe.parallel`) call these inside their manual regions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from mlir_train.model.kernels.blocks import BlockKernels
from mlir_train.model.moe.experts import blocked_experts, grouped_experts, ragged_experts, swiglu_experts
from sharding import constrain, varying_axes

MOE_IMPLS = ("dense", "padded", "ragged", "grouped")
# The implementation a run takes when the user names none, by the platform it compiles for:
# XLA:CPU runs the padded/blocked path fastest; on GPUs the block-grouped kernels do the routed
# work (XLA:GPU's ragged_dot is a dense dot over every expert); on TPUs ragged_dot is grouped.
DEFAULT_MOE_IMPL = {"cpu": "padded", "gpu": "grouped", "tpu": "ragged"}
# --moe-ep-buffer-factor: the dropless expert-parallel dispatchers' buffers hold this many times
# the rows a balanced routing sends (module docstring of :mod:`mlir_train.model.moe.parallel`).
# 2: the padded path's long-standing capacity guess; on the ragged/grouped exchange it is the
# worst case at EP2 (so no overflow branch there: at the seed's TP2 PP2 EP2 the branch's own
# expert-weight gradients cost more memory, +1.2 GiB at factor 1.5, than the smaller buffers
# save), and 1/2, 1/4 of it at EP4, EP8 (benchmarks/README.md, "EP buffers sized by routing").
DEFAULT_EP_BUFFER_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class ExpertsPlan:
    """How one MoE block runs its experts, decided once when the block is built.

    ``ragged_all_to_all`` is the collective of the expert-parallel ragged dispatcher
    (``jax.lax.ragged_all_to_all`` on platforms that have it, or a stand-in for tests), None
    where the padded dispatcher runs instead (``impl != "ragged"``, a capacity, or XLA:CPU).
    ``block_loop`` forces the dropless blocked experts' loop (True) or batched form (False);
    None picks by size (:func:`mlir_train.model.moe.experts.blocked_experts`).
    ``block_kernels`` are the matmuls of ``impl="grouped"`` (Mosaic-GPU or the XLA reference).
    ``recompute_act``: the activation is megatron-core's "moe_act" recompute
    (:func:`mlir_train.model.moe.experts.swiglu_down`).
    ``ep_buffer_factor`` (``--moe-ep-buffer-factor``): the dropless dispatchers' exchange buffers
    hold this many times the balanced rows; rows beyond go in further rounds (:func:`in_rounds`).
    """

    @property
    def dropless_dispatch(self) -> str | None:
        """The dropless dispatcher this plan runs ("ragged", "grouped"), None for the padded one."""
        if self.capacity_factor is None and self.impl in ("ragged", "grouped"):
            return self.impl
        return None

    impl: str
    num_experts: int
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    block_loop: bool | None = None
    ragged_all_to_all: Callable | None = None
    block_kernels: BlockKernels | None = None
    recompute_act: bool = False
    ep_buffer_factor: float = DEFAULT_EP_BUFFER_FACTOR

    def __post_init__(self):
        if not self.ep_buffer_factor > 0:
            raise ValueError(f"--moe-ep-buffer-factor must be positive, got {self.ep_buffer_factor!r}")
        if self.impl not in MOE_IMPLS:
            raise ValueError(f"unknown MoE implementation {self.impl!r}; choose one of {MOE_IMPLS}")
        if self.impl == "grouped" and self.block_kernels is None:
            raise ValueError("the 'grouped' MoE implementation needs its block kernels")
        if self.drop_policy not in ("probs", "position"):
            raise ValueError(f"--moe-token-drop-policy must be 'probs' or 'position', got {self.drop_policy!r}")


def ragged_collective_for(platform: str) -> Callable | None:
    """``jax.lax.ragged_all_to_all`` where the platform implements it (GPU, TPU), else None:
    XLA:CPU has no ragged all-to-all, so there the padded dispatcher runs instead."""
    return jax.lax.ragged_all_to_all if platform in ("gpu", "cuda", "rocm", "tpu") else None


# Named scopes (``jax.named_scope``: the name stacks of the jaxpr's ops, ``op_name`` metadata in
# the HLO, nothing else of the program) that say which code issued an expert-parallel exchange:
# ``mlir_train.planner.code_paths`` reads them (``python -m mlir_train.check``'s table). Each EP
# dispatcher runs under ``DISPATCH_SCOPE + name`` (:data:`DISPATCHERS`), the rounds of
# :func:`in_rounds` under ``ROUNDS_SCOPE + max rounds``, the stand-in under :data:`STAND_IN_SCOPE`.
DISPATCH_SCOPE = "moe_dispatch_"
DISPATCHERS = {"padded": "padded", "ragged": "ragged", "grouped": "grouped",
               "gathered": "grouped, gathered over the expert-tensor ranks (ETP = TP with SP)"}
ROUNDS_SCOPE = "moe_rounds_max"
STAND_IN_SCOPE = "ragged_all_to_all_dense"


def dispatcher_scope(name: str):
    """The named scope of EP dispatcher ``name`` (a key of :data:`DISPATCHERS`), as a context
    manager or decorator."""
    assert name in DISPATCHERS, name
    return jax.named_scope(DISPATCH_SCOPE + name)


@jax.named_scope(STAND_IN_SCOPE)
def ragged_all_to_all_dense(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``'s documented semantics from a dense ``all_to_all``, typed as
    the real op types its result: like ``output``, the buffer the slices land in (its varying
    manual axes; JAX_NOTES 2026-12-02). The real op accepts a buffer typed as the same on every
    rank and then sums its gradient over the ranks (the receive-buffer bug of stop 30); this
    stand-in refuses it (:func:`check_receive_buffer`), so a CPU test of the dispatcher catches
    what only a GPU run would have shown.

    Every slice is padded to the operand's full length, so this moves N times the operand:
    the ragged exchange on CPU (tests, ``--code-paths gpu``), not a fast path.
    """
    check_receive_buffer(operand, output, (input_offsets, send_sizes, output_offsets, recv_sizes), axis_name)
    n, length = input_offsets.shape[0], operand.shape[0]
    j_L = jnp.arange(length)
    rows_NL = input_offsets[:, None] + j_L
    send = operand.at[rows_NL].get(mode="fill", fill_value=0)
    send = jnp.where((j_L < send_sizes[:, None]).reshape((n, length) + (1,) * (operand.ndim - 1)), send, 0)
    recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)
    offsets_N = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dest_NL = jnp.where(j_L < recv_sizes[:, None], offsets_N[:, None] + j_L, output.shape[0])
    result = output.at[dest_NL].set(recv, mode="drop")
    assert varying_axes(result) == varying_axes(output), (varying_axes(result), varying_axes(output))
    return result


def check_receive_buffer(operand, output, ints, axis_name) -> None:
    """Refuse (ValueError) a ragged all-to-all's ``output`` buffer whose varying manual axes do
    not cover the operand's, the offsets' and sizes' and the exchange's own axes: the real op
    would type what each rank receives as the same on every rank, and its gradient would then be
    summed over the ranks. Then :func:`check_ragged_typing`, the rule jax 0.12's primitive applies.
    Outside a checked manual region nothing is typed, nothing refused."""
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    needed = set().union(varying_axes(operand), *(varying_axes(i) for i in ints))
    if varying_axes(operand):  # inside a checked region: the exchange varies over its own axes
        needed |= set(axes)
    missing = sorted(needed - set(varying_axes(output)))
    if missing:
        raise ValueError(
            f"ragged_all_to_all: the output buffer is typed as the same on the manual mesh axes {missing}, where "
            f"the rows that land in it vary (operand varying over {sorted(varying_axes(operand))}, exchange over "
            f"{list(axes)}); jax.lax.ragged_all_to_all types its result like the buffer, so its gradient would be "
            f"summed over those ranks. Make the buffer varying first: jax.lax.pcast(buffer, {tuple(missing)}, "
            "to='varying') (model.moe.exchange.ragged_into_zeros does)")
    check_ragged_typing(operand, output, ints, axis_name)


RAGGED_ARGS = ("operand", "output", "input_offsets", "send_sizes", "output_offsets", "recv_sizes")


def check_ragged_typing(operand, output, ints, axis_name) -> None:
    """jax 0.12's ``ragged_all_to_all`` primitive: the operand, the output buffer and the four
    offset / size arrays vary over the same manual axes, and the operand over the exchange's own
    (its wrapper casts them while ``jax_auto_pcast`` is on, jax's default today and not
    tomorrow: our exchange casts them itself, :func:`~mlir_train.model.moe.exchange.typed_alike`).
    Applied by the stand-in on every jax, so a CPU test sees what a GPU run on 0.12 refuses.
    Nothing is checked outside a checked manual region (no argument typed varying)."""
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    vmas = [frozenset(varying_axes(x)) for x in (operand, output, *ints)]
    if not any(vmas):
        return
    if not set(axes) <= vmas[0]:
        raise ValueError(f"ragged_all_to_all: the operand varies over {sorted(vmas[0])}, not over the exchange's "
                         f"axes {list(axes)} (jax 0.12 refuses it); cast it: "
                         f"sharding.vary_over(operand, {tuple(axes)})")
    odd = {n: sorted(v) for n, v in zip(RAGGED_ARGS, vmas) if v != vmas[0]}
    if odd:
        raise ValueError(f"ragged_all_to_all: its arguments vary over different manual axes (operand "
                         f"{sorted(vmas[0])}; {odd}); jax 0.12's ragged_all_to_all requires them alike. Cast "
                         "them first (model.moe.exchange.typed_alike)")


def sort_assignments(plan: ExpertsPlan, weights_SK, experts_SK):
    """Assignments ordered by expert; within an expert by token (or by weight for 'probs')."""
    s, k = experts_SK.shape
    experts_A = experts_SK.reshape(-1)
    weights_A = weights_SK.reshape(-1)
    if plan.capacity_factor is not None and plan.drop_policy == "probs":
        order_A = jnp.lexsort((-weights_A.astype(jnp.float32), experts_A))
    else:
        order_A = jnp.argsort(experts_A, stable=True)
    return order_A // k, experts_A[order_A], weights_A[order_A]


def constrained_swiglu(recompute_act: bool = False):
    """The batched experts ``run(buf, *weights)`` on an ``[E, C, D]`` buffer left to XLA's
    partitioner (one device): the buffer's expert and capacity axes carry their logical names."""

    def run(buf_ECD, *weights):
        buf_ECD = constrain(buf_ECD, ("act_exp", "act_capacity", "act_embed"))
        out_ECD = swiglu_experts(buf_ECD, *weights, recompute_act=recompute_act)
        return constrain(out_ECD, ("act_exp", "act_capacity", "act_embed"))

    return run


def local_experts(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, valid_S, weights, experts_fn=None):
    """The experts on this rank's tokens, all experts here (one device, or each data rank
    of a pure data-parallel layout). ``experts_fn(buf, *weights)`` runs the padded ``[E, C, D]``
    buffer (default: the plain batched SwiGLU). ``(y_SD, counts)``: :data:`COUNTS`."""
    none = jnp.zeros((len(COUNTS),), jnp.float32)
    if plan.dropless_dispatch == "ragged":
        return ragged(plan, x_SD, weights_SK, experts_SK, weights), none
    if plan.dropless_dispatch == "grouped":
        return grouped(plan, x_SD, weights_SK, experts_SK, weights), none
    s, k = experts_SK.shape
    e = plan.num_experts
    b, n_blocks = block_layout(s * k, e)
    if plan.capacity_factor is None and n_blocks * b < e * s:
        return blocked(plan, x_SD, weights_SK, experts_SK, weights), none
    # Capacity runs, and so few tokens (decoding) that the [E, S, D] buffer, which can
    # never overflow, is smaller than the blocked layout's bound.
    experts_fn = experts_fn or (lambda buf_ECD, *w: swiglu_experts(buf_ECD, *w, recompute_act=plan.recompute_act))
    return dispatch_padded(plan, x_SD, weights_SK, experts_SK, valid_S, experts_fn, lambda n: n, weights)


def ragged(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, weights):
    token_A, expert_A, weight_A = sort_assignments(plan, weights_SK, experts_SK)
    group_sizes_E = jnp.bincount(expert_A, length=plan.num_experts).astype(jnp.int32)
    return ragged_experts(x_SD, weight_A, *weights, token_A.astype(jnp.int32), group_sizes_E)


def blocked(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, weights):
    """Dropless experts on one rank as a block-grouped matmul (MegaBlocks' layout).

    Assignments sorted by expert fill rows of a ``[N*b, D]`` buffer in which each
    expert's group starts on a block boundary, so every block of ``b`` rows belongs to
    one expert. ``N`` = ceil(A/b) + E bounds the blocks any routing can need (each
    expert wastes less than one block), so the shape is static, nothing is dropped and
    no branch is needed; padding is at most ``E*(b-1)`` rows, which the choice of ``b``
    (:func:`block_rows`) keeps under half the routed ``A = S*K`` rows (unless the batch
    is tiny). Each block runs with its expert's weights (:func:`blocked_experts`). One
    gather brings tokens in and one scatter-add takes the weighted outputs home; unused
    rows read a zero row and add into a discarded one.
    """
    s, k = experts_SK.shape
    e, a = plan.num_experts, s * k
    b, n_blocks = block_layout(a, e)
    token_A, expert_A, weight_A = sort_assignments(plan, weights_SK, experts_SK)
    sizes_E = jnp.bincount(expert_A, length=e)
    blocks_E = (sizes_E + b - 1) // b
    block_end_E = jnp.cumsum(blocks_E)
    first_row_E = (block_end_E - blocks_E) * b
    first_assignment_E = jnp.cumsum(sizes_E) - sizes_E
    row_A = first_row_E[expert_A] + jnp.arange(a) - first_assignment_E[expert_A]
    rows = n_blocks * b
    # Row -> token (s, a zero row, for padding) and row -> routing weight (0 for padding).
    token_R = jnp.full((rows,), s, jnp.int32).at[row_A].set(token_A.astype(jnp.int32), unique_indices=True)
    weight_R = jnp.zeros((rows,), x_SD.dtype).at[row_A].set(weight_A, unique_indices=True)
    # Block n belongs to the first expert whose blocks end after it (unused blocks: the last).
    expert_N = jnp.minimum(jnp.sum(block_end_E[None, :] <= jnp.arange(n_blocks)[:, None], axis=1), e - 1)
    return blocked_experts(x_SD, weight_R, *weights, token_R, expert_N, block_end_E[-1], block_loop=plan.block_loop)


def block_grouping(sizes_E, block_rows: int, n_blocks: int):
    """Block layout of groups of ``sizes_E`` rows, each rounded up to whole blocks of
    ``block_rows``: ``(expert_N, used, first_block_E, num_blocks_E)`` as the block kernels take
    them (spare blocks, from ``used`` on, are attributed to the last expert)."""
    num_blocks_E = ((sizes_E + block_rows - 1) // block_rows).astype(jnp.int32)
    block_end_E = jnp.cumsum(num_blocks_E)
    first_block_E = block_end_E - num_blocks_E
    e = sizes_E.shape[0]
    expert_N = jnp.minimum(jnp.sum(block_end_E[None, :] <= jnp.arange(n_blocks)[:, None], axis=1), e - 1)
    return expert_N.astype(jnp.int32), block_end_E[-1], first_block_E, num_blocks_E


def grouped(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, weights):
    """Dropless experts on one rank on the block kernels (:class:`BlockKernels`): the
    assignments, sorted by expert, fill a ``[N*b, D]`` buffer in which each expert's rows start
    on a block boundary (``N = ceil(A/b) + E`` bounds any routing); the kernels do the work of
    the used blocks only, i.e. the routed rows plus each expert's round-up to a block."""
    s, k = experts_SK.shape
    e, a, d = plan.num_experts, s * k, x_SD.shape[1]
    b = plan.block_kernels.block_rows
    n_blocks = -(-a // b) + e
    token_A, expert_A, weight_A = sort_assignments(plan, weights_SK, experts_SK)
    sizes_E = jnp.bincount(expert_A, length=e)
    layout = block_grouping(sizes_E, b, n_blocks)
    first_assignment_E = jnp.cumsum(sizes_E) - sizes_E
    row_A = layout[2][expert_A] * b + jnp.arange(a) - first_assignment_E[expert_A]
    x_RD = jnp.zeros((n_blocks * b, d), x_SD.dtype).at[row_A].set(x_SD[token_A], unique_indices=True)
    weight_R = jnp.zeros((n_blocks * b,), x_SD.dtype).at[row_A].set(weight_A, unique_indices=True)
    y_RD = grouped_experts(plan.block_kernels, x_RD, weight_R, *weights, *layout)
    return jnp.zeros_like(x_SD).at[token_A].add(y_RD[row_A])


def dispatch_padded(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, valid_S, experts_fn, global_max, weights):
    """Scatter assignments into an ``[E, C, D]`` buffer, run ``experts_fn(buf, *weights)`` on it,
    combine. ``(y_SD, counts)``: :data:`COUNTS`.

    ``experts_fn`` maps the buffer to the experts' outputs in the same layout: the local
    batched matmul, or all-to-all -> local experts -> all-to-all under expert parallelism.
    ``global_max`` makes the dropless round count agree across every rank that takes
    part in ``experts_fn``'s collectives (identity on one device).

    With a capacity, C = ceil(capacity_factor * S*K/E) and the rest is dropped (Megatron). Dropless,
    C = ``ep_buffer_factor`` x the balanced S*K/E (rounded up to 8): an expert's slots from C on
    go through the same buffer in further rounds (:func:`in_rounds`), slots [r*C, (r+1)*C) in
    round r, so nothing is dropped and the buffer never grows; those rows are counted.
    """
    s, k = experts_SK.shape
    e = plan.num_experts
    token_A, expert_A, weight_A = sort_assignments(plan, weights_SK, experts_SK)
    group_sizes_E = jnp.bincount(expert_A, length=e)
    starts_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    slot_A = (jnp.arange(s * k) - starts_E[expert_A]).astype(jnp.int32)
    d = x_SD.shape[1]

    def one_round(capacity: int):
        def run(r, args, ints):
            x_SD, *weights = args
            token_A, expert_A, slot_A = ints
            first = r * capacity
            keep_A = (slot_A >= first) & (slot_A < first + capacity)
            # Assignments of other rounds go to an out-of-range slot, which mode="drop" ignores.
            safe_slot_A = jnp.where(keep_A, slot_A - first, capacity)
            buf_ECD = jnp.zeros((e, capacity, d), x_SD.dtype).at[expert_A, safe_slot_A].set(x_SD[token_A], mode="drop")
            out_ECD = experts_fn(buf_ECD, *weights)
            return out_ECD.at[expert_A, safe_slot_A].get(mode="fill", fill_value=0)
        return run

    def combine(y_AD, keep_A):
        return jnp.zeros_like(x_SD).at[token_A].add(y_AD * (weight_A * keep_A)[:, None])

    ints = (token_A.astype(jnp.int32), expert_A, slot_A)
    if plan.capacity_factor is not None:
        capacity = max(1, math.ceil(plan.capacity_factor * s * k / e))
        keep_A = slot_A < capacity
        dropped = jnp.sum((~keep_A) & valid_S[token_A].astype(bool)).astype(jnp.float32)
        y_AD = one_round(capacity)(0, (x_SD, *weights), ints)
        return combine(y_AD, keep_A), jnp.stack([dropped, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)])
    # Dropless: an expert receives at most one assignment per token, so C = S never overflows.
    capacity = min(s, round_up(max(1, math.ceil(plan.ep_buffer_factor * s * k / e)), 8))
    n_rounds = -(-global_max(jnp.max(group_sizes_E).astype(jnp.int32)) // capacity)
    y_AD = in_rounds(one_round(capacity), (x_SD, *weights), ints, n_rounds, -(-s // capacity))
    overflow = jnp.sum(slot_A >= capacity).astype(jnp.float32)
    return combine(y_AD, 1), jnp.stack([jnp.zeros((), jnp.float32), overflow, further_rounds(n_rounds)])


# What a dispatcher counts, in this order: assignments a capacity dropped, dropless rows past the
# first round's buffer, and the rounds after the first (the same on every rank that exchanges;
# summed over ranks like the others, then the most of any rank: ``parallel.reduce_counts``).
COUNTS = ("dropped_tokens", "ep_overflow_rows", "ep_further_rounds")


def further_rounds(n_rounds) -> jax.Array:
    """The rounds a dropless exchange took after its first (each costs what the first did)."""
    return jnp.maximum(n_rounds - 1, 0).astype(jnp.float32)


# The overflow rounds' conditionals are traced under this name: the planner's HLO reader
# (``mlir_train.planner.hlo``, ``branch="balanced"``) counts their no-overflow branch for a
# balanced routing, where no rank overflows its buffer.
OVERFLOW_SCOPE = "ep_overflow_rounds"


def in_rounds(round_fn, args, ints, n_rounds, max_rounds: int):
    """``sum over r < n_rounds of round_fn(r, args, ints)``: the exchange of a dropless
    dispatcher in rounds through one bounded buffer, ``n_rounds`` (a traced count, the same on
    every rank that exchanges) of at most ``max_rounds`` (static: the worst routing's).

    Round 0 always runs and is differentiated as usual (its activations kept for the backward).
    The further rounds run only when some rank's rows overflow round 0's buffer (a
    ``lax.cond``), after round 0 in both directions, keeping nothing: the backward reruns an
    overflow round's forward (``jax.vjp``) before its backward and adds its gradients into round
    0's. So an overflow round needs no more memory than round 0's buffers, which are free by
    then, and a step without overflow pays nothing but the branch. ``args`` are the
    differentiable arrays, ``ints`` the routing bookkeeping; ``round_fn`` closes over nothing
    traced. The rounds' rows are disjoint, so the sum adds zeros: the result is exactly the
    one-buffer result.
    """
    with jax.named_scope(f"{ROUNDS_SCOPE}{max_rounds}"):
        if max_rounds <= 1:
            return round_fn(0, args, ints)
        return _rounds(round_fn, max_rounds, args, ints, n_rounds)


def _first_round(round_fn, ints, axes):
    """Round 0 as a function of ``args``, typed varying over ``axes`` (every axis an input
    varies over: the later rounds' sum has that type, and a ``lax.cond``'s branches agree)."""
    def run(args):
        y = round_fn(0, args, ints)
        missing = tuple(sorted(set(axes) - set(varying_axes(y))))
        return jax.lax.pcast(y, missing, to="varying") if missing else y
    return run


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rounds(round_fn, max_rounds, args, ints, n_rounds):
    return _rounds_fwd(round_fn, max_rounds, args, ints, n_rounds)[0]


def _rounds_fwd(round_fn, max_rounds, args, ints, n_rounds):
    axes = set().union(*(varying_axes(leaf) for leaf in jax.tree.leaves((args, ints))))
    y0, first_vjp = jax.vjp(_first_round(round_fn, ints, axes), args)

    def body(r, acc):
        return jax.lax.cond(r < n_rounds, lambda: acc + round_fn(r, args, ints), lambda: acc)

    with jax.named_scope(OVERFLOW_SCOPE):
        y = jax.lax.cond(n_rounds > 1, lambda: jax.lax.fori_loop(1, max_rounds, body, y0), lambda: y0)
    return y, (first_vjp, args, ints, n_rounds)


def _rounds_bwd(round_fn, max_rounds, res, ct):
    first_vjp, args, ints, n_rounds = res
    (grads,) = first_vjp(ct)

    def body(r, acc):
        def add():
            _, vjp = jax.vjp(lambda a: round_fn(r, a, ints), args)
            return jax.tree.map(jnp.add, acc, vjp(ct)[0])
        return jax.lax.cond(r < n_rounds, add, lambda: acc)

    with jax.named_scope(OVERFLOW_SCOPE):
        grads = jax.lax.cond(n_rounds > 1, lambda: jax.lax.fori_loop(1, max_rounds, body, grads), lambda: grads)
    return grads, None, None


_rounds.defvjp(_rounds_fwd, _rounds_bwd)


def block_layout(assignments: int, experts: int) -> tuple[int, int]:
    """(rows per block, static block count) of the dropless blocked layout: each expert's
    rows fill whole blocks and waste less than one, so ceil(A/b) + E blocks hold any routing."""
    b = block_rows(assignments, experts)
    return b, -(-assignments // b) + experts


def block_rows(assignments: int, experts: int) -> int:
    """Rows per block of the dropless grouped matmul: the largest power of two from 8 to 128
    with ``experts * b <= assignments / 2``, so block padding stays under half the routed
    rows. Larger blocks mean fewer per-block weight copies and bigger matmuls (on 2 CPU cores
    b = 128 beat 64 and 256 for the vs_hf sizes)."""
    b = 8
    while b < 128 and experts * b * 2 * 2 <= assignments:
        b *= 2
    return b


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
