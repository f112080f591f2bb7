"""Token dispatch of the MoE block on one rank: sort the routed assignments by expert, lay them
out for an expert kernel (:mod:`mlir_train.model.moe.experts`), run it, combine the outputs.

Shape suffixes as in :mod:`mlir_train.model.moe.block`. Every function takes the block's
:class:`ExpertsPlan`, fixed when the block is built; the parallel wrappers
(:mod:`mlir_train.model.moe.parallel`) call these inside their manual regions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mlir_train.model.moe.experts import (
    BlockKernels, blocked_experts, grouped_experts, ragged_experts, swiglu_down, swiglu_experts,
)
from sharding import constrain, varying_axes

MOE_IMPLS = ("dense", "padded", "ragged", "grouped")
# The implementation a run takes when the user names none, by the platform it compiles for:
# XLA:CPU runs the padded/blocked path fastest; on GPUs the block-grouped kernels do the routed
# work (XLA:GPU's ragged_dot is a dense dot over every expert); on TPUs ragged_dot is grouped.
DEFAULT_MOE_IMPL = {"cpu": "padded", "gpu": "grouped", "tpu": "ragged"}


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

    def __post_init__(self):
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


def constrained_swiglu(weights, recompute_act: bool = False):
    """The batched experts on an ``[E, C, D]`` buffer left to XLA's partitioner (one device):
    the buffer's expert and capacity axes carry their logical names."""

    def run(buf_ECD):
        buf_ECD = constrain(buf_ECD, ("act_exp", "act_capacity", "act_embed"))
        out_ECD = swiglu_experts(buf_ECD, *weights, recompute_act=recompute_act)
        return constrain(out_ECD, ("act_exp", "act_capacity", "act_embed"))

    return run


def local_experts(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, valid_S, weights, experts_fn=None):
    """The experts on this rank's tokens, all experts here (one device, or each data rank
    of a pure data-parallel layout). ``experts_fn`` runs the padded ``[E, C, D]`` buffer
    (default: the plain batched SwiGLU with ``weights``)."""
    if plan.dropless_dispatch == "ragged":
        return ragged(plan, x_SD, weights_SK, experts_SK, weights), jnp.zeros((), jnp.float32)
    if plan.dropless_dispatch == "grouped":
        return grouped(plan, x_SD, weights_SK, experts_SK, weights), jnp.zeros((), jnp.float32)
    s, k = experts_SK.shape
    e = plan.num_experts
    b, n_blocks = block_layout(s * k, e)
    if plan.capacity_factor is None and n_blocks * b < e * s:
        return blocked(plan, x_SD, weights_SK, experts_SK, weights), jnp.zeros((), jnp.float32)
    # Capacity runs, and so few tokens (decoding) that the [E, S, D] buffer, which can
    # never overflow, is smaller than the blocked layout's bound.
    experts_fn = experts_fn or (lambda buf_ECD: swiglu_experts(buf_ECD, *weights, recompute_act=plan.recompute_act))
    return dispatch_padded(plan, x_SD, weights_SK, experts_SK, valid_S, experts_fn, lambda n: n)


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


def dispatch_padded(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, valid_S, experts_fn, global_max):
    """Scatter assignments into an ``[E, C, D]`` buffer, run ``experts_fn`` on it, combine.

    ``experts_fn`` maps the buffer to the experts' outputs in the same layout: the local
    batched matmul, or all-to-all -> local experts -> all-to-all under expert parallelism.
    ``global_max`` makes the dropless overflow test agree across every rank that takes
    part in ``experts_fn``'s collectives (identity on one device).
    """
    s, k = experts_SK.shape
    e = plan.num_experts
    token_A, expert_A, weight_A = sort_assignments(plan, weights_SK, experts_SK)
    group_sizes_E = jnp.bincount(expert_A, length=e)
    starts_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    slot_A = jnp.arange(s * k) - starts_E[expert_A]

    def run(capacity: int):
        keep_A = slot_A < capacity
        # Dropped assignments go to an out-of-range slot, which scatter mode="drop" ignores.
        safe_slot_A = jnp.where(keep_A, slot_A, capacity)
        buf_ECD = jnp.zeros((e, capacity, x_SD.shape[1]), x_SD.dtype)
        buf_ECD = buf_ECD.at[expert_A, safe_slot_A].set(x_SD[token_A], mode="drop")
        out_ECD = experts_fn(buf_ECD)
        y_AD = out_ECD.at[expert_A, safe_slot_A].get(mode="fill", fill_value=0)
        y_SD = jnp.zeros_like(x_SD).at[token_A].add(y_AD * (weight_A * keep_A)[:, None])
        dropped = jnp.sum((~keep_A) & valid_S[token_A].astype(bool)).astype(jnp.float32)
        return y_SD, dropped

    if plan.capacity_factor is not None:
        return run(max(1, math.ceil(plan.capacity_factor * s * k / e)))
    # Dropless: an expert receives at most one assignment per token, so C = S never drops.
    guess = min(s, _round_up(max(1, math.ceil(2 * s * k / e)), 8))
    if guess >= s:
        return run(s)
    return jax.lax.cond(global_max(jnp.max(group_sizes_E)) <= guess, lambda: run(guess), lambda: run(s))


def ep_ragged(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, weights, ep_axes, ep):
    """Dropless dispatch with ``ragged_all_to_all``: one slice per (destination, expert).

    Slices arrive grouped by local expert, then by source rank, so ``ragged_dot`` runs on
    the receive buffer as it is; the return trip swaps the offsets.
    """
    ragged_a2a = plan.ragged_all_to_all
    wg, wu, wd = weights
    s, k = experts_SK.shape
    e, d = plan.num_experts, x_SD.shape[1]
    el = e // ep
    token_A, expert_A, weight_A = sort_assignments(plan, weights_SK, experts_SK)

    def a2a(v):
        return jax.lax.all_to_all(v, ep_axes, 0, 0, tiled=True)

    send_sizes_E = jnp.bincount(expert_A, length=e).astype(jnp.int32)  # slice (dest, local expert)
    send_offsets_E = jnp.cumsum(send_sizes_E) - send_sizes_E
    recv_sizes_E = a2a(send_sizes_E)  # slice (source, local expert)
    recv_RL = recv_sizes_E.reshape(ep, el)
    by_expert = recv_RL.T.reshape(-1)
    recv_offsets_E = (jnp.cumsum(by_expert) - by_expert).reshape(el, ep).T.reshape(-1)
    # The most a rank can receive: every token of every source, once per local expert.
    max_rows = ep * s * min(k, el)
    recv_MD = ragged_into_zeros(
        ragged_a2a, x_SD[token_A], max_rows, send_offsets_E, send_sizes_E, a2a(recv_offsets_E), recv_sizes_E, ep_axes)
    group_sizes_L = jnp.sum(recv_RL, axis=0)
    g_MF = jax.lax.ragged_dot(recv_MD, wg, group_sizes_L)
    out_MD = swiglu_down(g_MF, jax.lax.ragged_dot(recv_MD, wu, group_sizes_L),
                         lambda h_MF: jax.lax.ragged_dot(h_MF, wd, group_sizes_L), plan.recompute_act)
    y_AD = ragged_into_zeros(
        ragged_a2a, out_MD, s * k, recv_offsets_E, recv_sizes_E, a2a(send_offsets_E), send_sizes_E, ep_axes)
    return jnp.zeros_like(x_SD).at[token_A].add(y_AD * weight_A[:, None])


def ep_grouped(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, weights, ep_axes, ep):
    """Dropless expert-parallel dispatch onto the block kernels: as :func:`ep_ragged`, one
    ``ragged_all_to_all`` slice per (destination, local expert), but each local expert's rows
    land from a block boundary of the receive buffer, so the buffer is in the block layout as
    it arrives and the kernels work on its used blocks only. The buffer is sized for the worst
    case (every token of every source to this rank's experts, plus a block per local expert)
    in memory only: only real rows move and only used blocks are computed."""
    s, k = experts_SK.shape
    e, d = plan.num_experts, x_SD.shape[1]
    el, b = e // ep, plan.block_kernels.block_rows
    ragged_a2a = plan.ragged_all_to_all
    token_A, expert_A, weight_A = sort_assignments(plan, weights_SK, experts_SK)

    def a2a(v):
        return jax.lax.all_to_all(v, ep_axes, 0, 0, tiled=True)

    send_sizes_E = jnp.bincount(expert_A, length=e).astype(jnp.int32)  # slice (dest, local expert)
    send_offsets_E = jnp.cumsum(send_sizes_E) - send_sizes_E
    recv_RL = a2a(send_sizes_E).reshape(ep, el)  # slice (source, local expert)
    n_blocks = -(-ep * s * min(k, el) // b) + el
    layout = block_grouping(jnp.sum(recv_RL, axis=0), b, n_blocks)
    recv_offsets_E = (layout[2][None, :] * b + jnp.cumsum(recv_RL, axis=0) - recv_RL).reshape(-1).astype(jnp.int32)
    recv_sizes_E = recv_RL.reshape(-1)
    recv_MD = ragged_into_zeros(
        ragged_a2a, x_SD[token_A], n_blocks * b, send_offsets_E, send_sizes_E, a2a(recv_offsets_E), recv_sizes_E,
        ep_axes)
    ones_M = jnp.ones_like(recv_MD[:, 0])  # the routing weights are applied at home
    out_MD = grouped_experts(plan.block_kernels, recv_MD, ones_M, *weights, *layout)
    y_AD = ragged_into_zeros(
        ragged_a2a, out_MD, s * k, recv_offsets_E, recv_sizes_E, a2a(send_offsets_E), send_sizes_E, ep_axes)
    return jnp.zeros_like(x_SD).at[token_A].add(y_AD * weight_A[:, None])


def ragged_into_zeros(ragged_a2a, operand, rows, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    """``ragged_a2a(operand, zeros((rows, ...)), offsets and sizes...)``: the slices land in a
    fresh zero buffer of ``rows`` rows, typed varying over the manual axes the operand varies
    over. ``jax.lax.ragged_all_to_all`` (jax 0.10.2) gives its result the output buffer's type:
    with plain zeros the rows a rank received were typed the same on every rank, and the block
    kernels' custom VJP (``experts._common_vma``) then all-reduced their input gradient over
    every manual axis, the whole receive buffer per call (about 420 GiB per step on the seed
    layout, benchmarks/README.md's communication audit), summing unrelated ranks' rows. The VJP
    transposes the operand only (JAX's rule also instantiates a tangent for the zeros)."""
    shapes = (rows, operand.shape, jnp.dtype(operand.dtype).name, tuple(sorted(varying_axes(operand))))
    return _into_zeros(ragged_a2a, shapes, axis_name, operand, input_offsets, send_sizes, output_offsets, recv_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _into_zeros(ragged_a2a, shapes, axis_name, operand, input_offsets, send_sizes, output_offsets, recv_sizes):
    rows, shape, dtype, vma = shapes
    # The result takes the output buffer's type (jax 0.10.2's rule): mark the fresh zeros varying
    # as the rows that land in them are, or the region would treat what each rank receives as
    # the same on every rank (and the experts' custom VJP would sum its gradient over the ranks).
    output = jnp.zeros((rows,) + tuple(shape[1:]), dtype)
    if vma:
        output = jax.lax.pcast(output, vma, to="varying")
    return ragged_a2a(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)


def _into_zeros_fwd(ragged_a2a, shapes, axis_name, operand, input_offsets, send_sizes, output_offsets, recv_sizes):
    out = _into_zeros(ragged_a2a, shapes, axis_name, operand, input_offsets, send_sizes, output_offsets, recv_sizes)
    return out, (input_offsets, send_sizes, output_offsets, recv_sizes)


def _into_zeros_bwd(ragged_a2a, shapes, axis_name, res, ct):
    # The slices go back: what arrived at (output offset, recv size) returns to (input offset,
    # send size); each rank's offsets into the other's buffer come by all-to-all (JAX's rule).
    input_offsets, send_sizes, output_offsets, recv_sizes = res
    _, shape, dtype, vma = shapes

    def a2a(v):
        return jax.lax.all_to_all(v, axis_name, 0, 0, tiled=True)

    zero = jnp.zeros(shape, dtype)
    operand_ct = ragged_a2a(ct, zero, a2a(output_offsets), recv_sizes, a2a(input_offsets), send_sizes,
                            axis_name=axis_name)
    # The operand's cotangent has the operand's type: varying over the manual axes it varies over.
    missing = tuple(a for a in vma if a not in varying_axes(operand_ct))
    if missing:
        operand_ct = jax.lax.pcast(operand_ct, missing, to="varying")
    return operand_ct, None, None, None, None


_into_zeros.defvjp(_into_zeros_fwd, _into_zeros_bwd)


def ragged_all_to_all_dense(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``'s documented semantics from a dense ``all_to_all``.

    Every slice is padded to the operand's full length, so this moves N times the operand:
    a reference for tests of the ragged dispatcher's bookkeeping on CPU, not a fast path.
    """
    n, length = input_offsets.shape[0], operand.shape[0]
    j_L = jnp.arange(length)
    rows_NL = input_offsets[:, None] + j_L
    send = operand.at[rows_NL].get(mode="fill", fill_value=0)
    send = jnp.where((j_L < send_sizes[:, None]).reshape((n, length) + (1,) * (operand.ndim - 1)), send, 0)
    recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)
    offsets_N = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dest_NL = jnp.where(j_L < recv_sizes[:, None], offsets_N[:, None] + j_L, output.shape[0])
    return output.at[dest_NL].set(recv, mode="drop")


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


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
