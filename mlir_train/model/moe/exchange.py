"""The dropless expert-parallel exchange (``impl="ragged"`` and ``"grouped"`` under expert
parallelism; :mod:`mlir_train.model.moe.parallel` runs it inside its manual region): the ranks
exchange their per-expert counts, then each rank's assignments, sorted by expert, go as one
``ragged_all_to_all`` slice per (destination, local expert) into a receive buffer of
:func:`exchange_capacity` rows, in rounds (:func:`~mlir_train.model.moe.dispatch.in_rounds`)
when a routing overflows it; the local experts run there and the rows go home the same way.
The one-rank dispatch (sorting, the padded, blocked and grouped layouts, the rounds) is
:mod:`mlir_train.model.moe.dispatch`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mlir_train.model.moe.dispatch import (ExpertsPlan, block_grouping, dispatcher_scope, further_rounds, in_rounds,
                                           round_up, sort_assignments)
from mlir_train.model.kernels.blocks import varying_zeros
from mlir_train.model.moe.experts import grouped_experts, placed_grouped_experts, swiglu_down
from sharding import varying_axes, vary_over


def exchange_capacity(plan: ExpertsPlan, s: int, k: int, ep: int, align: int,
                      factor: float | None = None) -> tuple[int, int]:
    """(rows per round, most rounds) of a rank's receive buffer under the dropless ragged
    dispatchers: ``factor`` (default ``ep_buffer_factor``) x the S*K rows a balanced routing
    sends it (rounded up to ``align``), never more than the worst routing's EP * S * min(K, L)
    rows (every token of every source to this rank's experts), which then takes ``most rounds``."""
    worst = ep * s * min(k, plan.num_experts // ep)
    factor = plan.ep_buffer_factor if factor is None else factor
    rows = min(round_up(worst, align), round_up(max(1, math.ceil(factor * s * k)), align))
    return rows, -(-worst // rows)


class _Exchange(NamedTuple):
    """The bookkeeping of one rank's ragged exchange, from the exchanged counts. Slices are
    (destination or source rank, local expert), flattened rank-major. A rank's receive *stream*
    is every row sent to it, ordered by local expert, then by source; round r moves the rows at
    stream positions [r*M, (r+1)*M)."""
    send_sizes_E: jax.Array    # rows this rank sends per (destination, local expert)
    send_offsets_E: jax.Array  # where they start in its sorted rows
    send_pos_E: jax.Array      # where they start in the destination's stream
    recv_sizes_E: jax.Array    # rows it receives per (source, local expert)
    recv_pos_E: jax.Array      # where they start in its own stream


def _exchange(expert_A, e: int, ep: int, ep_axes) -> tuple[_Exchange, jax.Array]:
    """Megatron's alltoall dispatcher also exchanges the counts first. Also the rank's total
    received rows."""
    el = e // ep

    def a2a(v):
        return jax.lax.all_to_all(v, ep_axes, 0, 0, tiled=True)

    send_sizes_E = jnp.bincount(expert_A, length=e).astype(jnp.int32)
    send_offsets_E = jnp.cumsum(send_sizes_E) - send_sizes_E
    recv_sizes_E = a2a(send_sizes_E)
    by_expert = recv_sizes_E.reshape(ep, el).T.reshape(-1)
    recv_pos_E = (jnp.cumsum(by_expert) - by_expert).reshape(el, ep).T.reshape(-1)
    ex = _Exchange(send_sizes_E, send_offsets_E, a2a(recv_pos_E), recv_sizes_E, recv_pos_E)
    return ex, jnp.sum(recv_sizes_E)


def _window(pos, size, r, rows: int):
    """(skipped, taken) rows of slices starting at stream position ``pos`` with ``size`` rows
    in round ``r``'s window [r*rows, (r+1)*rows)."""
    lo = jnp.clip(r * rows - pos, 0, size)
    return lo, jnp.clip((r + 1) * rows - pos, 0, size) - lo


def _ep_rounds(plan, x_SD, weights_SK, experts_SK, weights, ep_axes, ep, agree, align, recv_layout, experts,
               factor=None):
    """The dropless ragged exchange in rounds (:func:`in_rounds`) through a receive buffer of
    :func:`exchange_capacity` rows: ``recv_layout(r_sizes_RL) -> (buffer rows, out offsets
    [src, local expert], extra)`` places a round's slices in it, ``experts(buf, extra, weights)``
    runs the local experts there; ``factor``: :func:`exchange_capacity`'s. ``(y_SD, [0, overflow
    rows, further rounds])`` (``dispatch.COUNTS``)."""
    s, k = experts_SK.shape
    e = plan.num_experts
    el = e // ep
    ragged_a2a = plan.ragged_all_to_all
    token_A, expert_A, weight_A = sort_assignments(plan, weights_SK, experts_SK)
    rows, max_rounds = exchange_capacity(plan, s, k, ep, align, factor)
    ex, received = _exchange(expert_A, e, ep, ep_axes)

    def one_round(r, args, ints):
        # The rows are gathered inside the round: the rounds' custom VJP keeps its arguments for
        # the overflow rounds' backward, and the token rows are S x D where their S*K copies are
        # K times that (the seed: 28 MiB per layer and micro-batch on a device).
        x_SD, *weights = args
        ex, token_A = ints
        x_AD = x_SD[token_A]

        def a2a(v):
            return jax.lax.all_to_all(v, ep_axes, 0, 0, tiled=True)

        skip_E, send_E = _window(ex.send_pos_E, ex.send_sizes_E, r, rows)
        _, recv_E = _window(ex.recv_pos_E, ex.recv_sizes_E, r, rows)
        buf_rows, recv_offsets_E, extra = recv_layout(recv_E.reshape(ep, el))
        send_offsets_E = ex.send_offsets_E + skip_E
        recv_MD = ragged_into_zeros(ragged_a2a, x_AD, buf_rows, send_offsets_E, send_E, a2a(recv_offsets_E), recv_E,
                                    ep_axes)
        out_MD = experts(recv_MD, extra, weights)
        return ragged_into_zeros(ragged_a2a, out_MD, x_AD.shape[0], recv_offsets_E, recv_E, a2a(send_offsets_E), send_E,
                                 ep_axes)

    n_rounds = -(-agree(received) // rows)
    y_AD = in_rounds(one_round, (x_SD, *weights), (ex, token_A), n_rounds, max_rounds)
    overflow = jnp.maximum(received - rows, 0).astype(jnp.float32)
    y_SD = jnp.zeros_like(x_SD).at[token_A].add(y_AD * weight_A[:, None])
    return y_SD, jnp.stack([jnp.zeros((), jnp.float32), overflow, further_rounds(n_rounds)])


@dispatcher_scope("ragged")
def ep_ragged(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, weights, ep_axes, ep, agree=lambda n: n):
    """Dropless dispatch with ``ragged_all_to_all``: one slice per (destination, expert).

    Slices arrive grouped by local expert, then by source rank, so ``ragged_dot`` runs on
    the receive buffer as it is; the return trip swaps the offsets. The buffer holds
    :func:`exchange_capacity` rows; a round moves that window of the rank's receive stream
    (:func:`in_rounds`). ``agree``: the max over every rank of the exchange."""
    el = plan.num_experts // ep
    rows = exchange_capacity(plan, *experts_SK.shape, ep, 8)[0]

    def layout(recv_RL):
        by_expert = recv_RL.T.reshape(-1)
        offsets = (jnp.cumsum(by_expert) - by_expert).reshape(el, ep).T.reshape(-1)
        return rows, offsets, jnp.sum(recv_RL, axis=0)

    def experts(recv_MD, group_sizes_L, weights):
        wg, wu, wd = weights
        g_MF = jax.lax.ragged_dot(recv_MD, wg, group_sizes_L)
        return swiglu_down(g_MF, jax.lax.ragged_dot(recv_MD, wu, group_sizes_L),
                           lambda h_MF: jax.lax.ragged_dot(h_MF, wd, group_sizes_L), plan.recompute_act)

    return _ep_rounds(plan, x_SD, weights_SK, experts_SK, weights, ep_axes, ep, agree, 8, layout, experts)


@dispatcher_scope("grouped")
def ep_grouped(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, weights, ep_axes, ep, agree=lambda n: n):
    """Dropless expert-parallel dispatch onto the block kernels: as :func:`ep_ragged`, one
    ``ragged_all_to_all`` slice per (destination, local expert), but each local expert's rows
    land from a block boundary of the receive buffer, so the buffer is in the block layout as
    it arrives and the kernels work on its used blocks only. The buffer holds
    :func:`exchange_capacity` rows plus a block per local expert (each expert's round-up);
    rows beyond go in further rounds (:func:`in_rounds`). Only real rows move and only used
    blocks are computed."""
    b, n_blocks, layout = _block_receive_layout(plan, experts_SK.shape, ep)

    def experts(recv_MD, grouping, weights):
        ones_M = jnp.ones_like(recv_MD[:, 0])  # the routing weights are applied at home
        return grouped_experts(plan.block_kernels, recv_MD, ones_M, *weights, *grouping)

    return _ep_rounds(plan, x_SD, weights_SK, experts_SK, weights, ep_axes, ep, agree, b, layout, experts)


def _block_receive_layout(plan: ExpertsPlan, sk: tuple[int, int], ep: int):
    """``(block rows, blocks, layout)`` of :func:`ep_grouped`'s receive buffer: each local
    expert's rows from a block boundary, the sources in order within it (``layout`` as
    :func:`_ep_rounds` takes it)."""
    el, b = plan.num_experts // ep, plan.block_kernels.block_rows
    rows = exchange_capacity(plan, *sk, ep, b)[0]
    n_blocks = rows // b + el

    def layout(recv_RL):
        grouping = block_grouping(jnp.sum(recv_RL, axis=0), b, n_blocks)
        offsets = (grouping[2][None, :] * b + jnp.cumsum(recv_RL, axis=0) - recv_RL).reshape(-1).astype(jnp.int32)
        return n_blocks * b, offsets, grouping

    return b, n_blocks, layout


GATHER_CHUNK_FACTOR = 1.0  # the gathered exchange's rounds: at most this x the S*K rows a balanced routing brings


@dispatcher_scope("gathered")
def ep_grouped_gathered(plan: ExpertsPlan, x_SD, weights_SK, experts_SK, weights, ep_axes, ep, gather_axes,
                        agree=lambda n: n):
    """:func:`ep_ragged`'s exchange where the expert width F is split over ranks that hold their
    own tokens (``gather_axes``: ETP = TP under sequence parallelism, each tensor rank routing
    its own ``T/TP`` tokens), as Megatron's alltoall dispatcher runs it: each rank dispatches only
    its own ``T/TP x K`` rows into a compact receive buffer (sorted by local expert); the
    ``gather_axes`` ranks all-gather the rows they received, each runs its F shard's experts on
    all of them (one block layout: :func:`gathered_positions`), and a reduce-scatter sums the
    partial outputs and hands each rank its own rows back (Megatron's expert-tensor all-gather
    and reduce-scatter around the experts). The gather moves the receive buffer whole, so its
    rounds hold ``min(--moe-ep-buffer-factor, GATHER_CHUNK_FACTOR)`` x the rows a balanced routing
    brings: a balanced routing gathers what Megatron's does, a rank receiving more takes further
    rounds (:func:`in_rounds`), each moving the rows of its window only. ``agree`` must span
    ``gather_axes`` too (the rounds' gathers are collectives over them)."""
    el, b = plan.num_experts // ep, plan.block_kernels.block_rows
    factor = min(plan.ep_buffer_factor, GATHER_CHUNK_FACTOR)
    rows = exchange_capacity(plan, *experts_SK.shape, ep, 8, factor)[0]

    def layout(recv_RL):
        by_expert = recv_RL.T.reshape(-1)
        offsets = (jnp.cumsum(by_expert) - by_expert).reshape(el, ep).T.reshape(-1)
        return rows, offsets, jnp.sum(recv_RL, axis=0)

    def experts(recv_MD, count_L, weights):
        x_GMD = jax.lax.all_gather(recv_MD, gather_axes, tiled=True)
        count_GL = jax.lax.all_gather(count_L[None], gather_axes, tiled=True)
        pos, grouping = gathered_positions(count_GL, rows, b)
        # Padding and spare rows are zero and stay zero through the kernels (grouped_experts).
        y_RD = placed_grouped_experts(plan.block_kernels, x_GMD, pos, grouping[0].shape[0] * b, *weights, *grouping)
        return jax.lax.psum_scatter(y_RD[pos], gather_axes, scatter_dimension=0, tiled=True)

    return _ep_rounds(plan, x_SD, weights_SK, experts_SK, weights, ep_axes, ep, agree, 8, layout, experts, factor)


def gathered_positions(count_GL, chunk: int, b: int):
    """The one block layout of ``G`` ranks' gathered chunks of ``chunk`` rows (``count_GL``: each
    rank's rows per local expert, sorted by expert, the unused rows after them): each expert's
    rows from every rank together in rank order from a block boundary, the unused rows in the
    spare rows at the end. ``(pos, grouping)``: row ``i`` of the gathered ``[G * chunk]`` rows goes
    to ``pos[i]`` (each position once) of ``N`` blocks, ``N * b >= G * chunk + L * b`` bounding
    any counts; ``grouping`` the layout's :func:`block_grouping`."""
    g, el = count_GL.shape
    n_blocks = -(-g * chunk // b) + el
    total_L = jnp.sum(count_GL, axis=0)
    grouping = block_grouping(total_L, b, n_blocks)
    before_GL = jnp.cumsum(count_GL, axis=0) - count_GL                  # its rows from earlier ranks
    own_first_GL = jnp.cumsum(count_GL, axis=1) - count_GL               # where they start in the chunk
    used_G = jnp.sum(count_GL, axis=1)
    row = jnp.arange(chunk)
    expert_GC = jnp.clip(jnp.sum(own_first_GL[:, None, :] + count_GL[:, None, :] <= row[None, :, None], axis=-1),
                         0, el - 1)
    take = lambda a_GL: jnp.take_along_axis(a_GL, expert_GC, axis=1)
    used_pos_GC = take(grouping[2][None, :] * b + before_GL) + row[None, :] - take(own_first_GL)
    spare_before_G = jnp.cumsum(chunk - used_G) - (chunk - used_G)
    spare_pos_GC = grouping[1] * b + spare_before_G[:, None] + row[None, :] - used_G[:, None]
    pos = jnp.where(row[None, :] < used_G[:, None], used_pos_GC, spare_pos_GC)
    return pos.reshape(-1).astype(jnp.int32), grouping


def ragged_into_zeros(ragged_a2a, operand, rows, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    """``ragged_a2a(operand, zeros((rows, ...)), offsets and sizes...)``: the slices land in a
    fresh zero buffer of ``rows`` rows, typed varying over the manual axes the operand varies
    over. ``jax.lax.ragged_all_to_all`` (jax 0.10.2) gives its result the output buffer's type:
    with plain zeros the rows a rank received were typed the same on every rank, and the block
    kernels' custom VJP (``kernels.blocks.common_vma``) then all-reduced their input gradient over
    every manual axis, the whole receive buffer per call (about 420 GiB per step on the seed
    layout, benchmarks/README.md's communication audit), summing unrelated ranks' rows. The VJP
    transposes the operand only (JAX's rule also instantiates a tangent for the zeros)."""
    shapes = (rows, operand.shape, jnp.dtype(operand.dtype).name, tuple(sorted(varying_axes(operand))))
    return _into_zeros(ragged_a2a, shapes, axis_name, operand, input_offsets, send_sizes, output_offsets, recv_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _into_zeros(ragged_a2a, shapes, axis_name, operand, input_offsets, send_sizes, output_offsets, recv_sizes):
    rows, shape, dtype, _ = shapes
    # The result takes the output buffer's type (jax 0.10.2's rule): mark the fresh zeros varying
    # as the rows that land in them are, or the region would treat what each rank receives as
    # the same on every rank (and the experts' custom VJP would sum its gradient over the ranks).
    # jax 0.12's primitive wants all six typed alike, the operand varying over the exchange's axes
    # (its wrapper casts them while jax_auto_pcast is on, the default it plans to turn off): cast here.
    operand, *ints = typed_alike(axis_name, operand, input_offsets, send_sizes, output_offsets, recv_sizes)
    output = varying_zeros((rows,) + tuple(shape[1:]), dtype, operand, *ints)
    return ragged_a2a(operand, output, *ints, axis_name=axis_name)


def typed_alike(axis_name, *xs):
    """``xs`` each typed varying over every manual axis any of them varies over, and over the
    exchange's ``axis_name``: the typing jax 0.12's ``ragged_all_to_all`` requires of its operands
    (:func:`~mlir_train.model.moe.dispatch.check_ragged_typing`)."""
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    vma = tuple(sorted(set(axes).union(*(varying_axes(x) for x in xs))))
    return [vary_over(x, vma) for x in xs]


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

    ct, *ints = typed_alike(axis_name, ct, a2a(output_offsets), recv_sizes, a2a(input_offsets), send_sizes)
    operand_ct = ragged_a2a(ct, varying_zeros(shape, dtype, ct, *ints), *ints, axis_name=axis_name)
    # The operand's cotangent has the operand's type: varying over the manual axes it varies over.
    # Axes the forward cast it to vary over (typed_alike) are summed back, as a cast's transpose is.
    extra = tuple(a for a in sorted(varying_axes(operand_ct)) if a not in vma)
    if extra:
        operand_ct = jax.lax.psum(operand_ct, extra)
    missing = tuple(a for a in vma if a not in varying_axes(operand_ct))
    if missing:
        operand_ct = jax.lax.pcast(operand_ct, missing, to="varying")
    return operand_ct, None, None, None, None


_into_zeros.defvjp(_into_zeros_fwd, _into_zeros_bwd)
