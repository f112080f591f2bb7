"""The block-grouped MoE experts' two matmuls as one value, :class:`BlockKernels`, and their
reference on XLA's ``ragged_dot``.

The experts (:func:`mlir_train.model.moe.experts.grouped_experts`) run on any
:class:`BlockKernels`: ours on Mosaic GPU (:mod:`.mosaic_moe`), tokamax's (:mod:`.tokamax_ops`)
or :func:`xla_block_kernels`, the reference every other one is tested against and the one the
CPU runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from sharding import varying_axes, vary_over


@dataclasses.dataclass(frozen=True)
class BlockKernels:
    """The two matmuls the block-grouped experts need, on rows in blocks of ``block_rows``
    (block ``n`` of expert ``expert_N[n]``; blocks from ``used`` on are spare):

    ``matmul(lhs_RK, rhs_EKN, expert_N, used, first_block_E, num_blocks_E) -> [R, N]``
        each used block times its expert's matrix, spare blocks zero;
    ``matmul_t(lhs_KR, rhs_RN, expert_N, used, first_block_E, num_blocks_E) -> [E, K, N]``
        float32, per expert the sum over its blocks of ``lhs[:, block] @ rhs[block]``.

    :func:`~.mosaic_moe.mosaic_block_kernels` (Hopper GPUs) does only the used blocks' work;
    :func:`xla_block_kernels` computes the same with ``jax.lax.ragged_dot`` (the reference the
    CPU tests run the same wrapper with)."""

    name: str
    block_rows: int
    matmul: Callable
    matmul_t: Callable


def xla_block_kernels(block_rows: int) -> BlockKernels:
    def matmul(lhs_RK, rhs_EKN, expert_N, used, first_block_E, num_blocks_E):
        # Rows past the last group belong to no group: ragged_dot makes them zero.
        return jax.lax.ragged_dot(lhs_RK, rhs_EKN.astype(lhs_RK.dtype), (num_blocks_E * block_rows).astype(jnp.int32))

    def matmul_t(lhs_KR, rhs_RN, expert_N, used, first_block_E, num_blocks_E):
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((1,), (0,)), ((), ())), lhs_ragged_dimensions=[1], rhs_group_dimensions=[]
        )
        return jax.lax.ragged_dot_general(
            lhs_KR, rhs_RN.astype(lhs_KR.dtype), (num_blocks_E * block_rows).astype(jnp.int32), dims,
            preferred_element_type=jnp.float32,
        )

    return BlockKernels("xla", block_rows, matmul, matmul_t)


def varying_zeros(shape, dtype, *like):
    """Zeros typed varying over every manual axis any of ``like`` varies over: a buffer typed as
    the rows that fill it (a receive buffer, a block layout)."""
    return vary_over(jnp.zeros(shape, dtype), sorted(set().union(*(varying_axes(x) for x in like))))


def common_vma(*arrays):
    """``arrays`` each marked varying over every manual mesh axis any of them varies over. A
    Pallas call's result is typed invariant over every manual axis, and a custom VJP needs an
    input and its gradient to have one type: this gives a kernel's result, or the operands of
    one, the variance of the others (the marks' transposes sum gradients where they are partial)."""
    axes = set().union(*(varying_axes(a) for a in arrays))
    out = []
    for a in arrays:
        missing = tuple(sorted(axes - varying_axes(a)))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return tuple(out)
