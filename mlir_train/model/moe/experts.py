"""Expert kernels of the MoE block: the SwiGLU experts on rows already grouped by expert.

Shape suffixes as in :mod:`mlir_train.model.moe.block`: S tokens, D hidden, F expert width, E experts,
C capacity slots, A assignments (rows sorted by expert), N blocks of b rows, R = N*b block rows.

* :func:`swiglu_experts` the batched ``[E, C, D]`` form (padded buffers, the EP receive buffer).
* :func:`blocked_experts` the block-grouped form (MegaBlocks' layout) with its custom VJP.
* :func:`ragged_experts` ``jax.lax.ragged_dot`` groups with their custom VJP.
* :func:`grouped_experts` rows in the same block layout on pluggable
  :class:`~mlir_train.model.kernels.blocks.BlockKernels` (:mod:`mlir_train.model.kernels`: Pallas
  Mosaic-GPU or tokamax kernels on Hopper, ``ragged_dot`` as the reference), with its custom VJP.

Nothing here routes, sorts or communicates (:mod:`mlir_train.model.moe.dispatch` and
:mod:`mlir_train.model.moe.parallel` do).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from mlir_train.model.kernels.blocks import BlockKernels, common_vma, varying_zeros
from mlir_train.model.recompute import checkpointed


def swiglu_down(g, u, down, recompute: bool = False):
    """``down(silu(g) * u)``, the experts' activation and fc2. ``recompute`` makes the
    activation megatron-core's output-discarding "moe_act" recompute: activation and fc2 are
    one checkpoint, whose backward reruns only the activation (fc2's output is not needed to
    differentiate it), so only the fc1 outputs ``g`` and ``u`` are kept. The custom-VJP forms
    below keep only those two already: their backward recomputes the activation."""
    return checkpointed(lambda g, u: down(jax.nn.silu(g) * u), recompute)(g, u)


def swiglu_experts(x_ECD, wg_EDF, wu_EDF, wd_EFD, recompute_act: bool = False):
    g_ECF, u_ECF = jnp.einsum("ecd,edf->ecf", x_ECD, wg_EDF), jnp.einsum("ecd,edf->ecf", x_ECD, wu_EDF)
    return swiglu_down(g_ECF, u_ECF, lambda h_ECF: jnp.einsum("ecf,efd->ecd", h_ECF, wd_EFD), recompute_act)


def _swiglu_fwd(x_BD, wg_DF, wu_DF, wd_FD):
    g_BF = x_BD @ wg_DF
    u_BF = x_BD @ wu_DF
    return g_BF, u_BF, (jax.nn.silu(g_BF) * u_BF) @ wd_FD


def _swiglu_grads(g_BF, u_BF, dh_BF, r_B):
    """For rows scaled by ``r`` after ``h = silu(g) * u``, from ``dh`` (the cotangent of ``h``
    before the scale: ``dy wd^T``): the gradients of ``r``, ``g`` and ``u``. ``d r = dy . y =
    (dy wd^T) . h`` comes from the product the rest needs anyway, so ``y`` is neither kept nor
    recomputed."""
    sig_BF = jax.nn.sigmoid(g_BF)
    silu_BF = g_BF * sig_BF
    dr_B = jnp.sum(dh_BF * silu_BF * u_BF, axis=-1)
    dh_BF = dh_BF * r_B[:, None]
    return dr_B, dh_BF * u_BF * sig_BF * (1 + g_BF * (1 - sig_BF)), dh_BF * silu_BF


def _swiglu_bwd(x_BD, g_BF, u_BF, dy_BD, r_B, wg_DF, wu_DF, wd_FD):
    """Gradients of ``r * y`` for ``y = (silu(x wg) * (x wu)) wd`` scaled per row by ``r``:
    for the input, the row scales and the three weights."""
    dr_B, dg_BF, du_BF = _swiglu_grads(g_BF, u_BF, dy_BD @ wd_FD.T, r_B)
    dx_BD = dg_BF @ wg_DF.T + du_BF @ wu_DF.T
    rh_BF = jax.nn.silu(g_BF) * u_BF * r_B[:, None]
    return dx_BD, dr_B, x_BD.T @ dg_BF, x_BD.T @ du_BF, rh_BF.T @ dy_BD


def _gather_rows(v_SD, token_R, n_blocks):
    """Rows of ``v`` in block layout ``[N, b, D]``; row index ``S`` (padding) reads zeros."""
    return v_SD.at[token_R].get(mode="fill", fill_value=0).reshape(n_blocks, -1, v_SD.shape[-1])


def _blocked_fwd(x_SD, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used, loop):
    weights = (wg_EDF, wu_EDF, wd_EFD)
    x_NBD = _gather_rows(x_SD, token_R, expert_N.shape[0])
    if loop:
        # Only the ``used`` blocks that hold rows run: the static block count is a bound.
        def block(n, carry):
            out = _swiglu_fwd(x_NBD[n], *(w[expert_N[n]] for w in weights))
            return tuple(c.at[n].set(o) for c, o in zip(carry, out))

        f = wg_EDF.shape[-1]
        zeros = (jnp.zeros_like(x_NBD, shape=x_NBD.shape[:2] + (f,)),) * 2 + (jnp.zeros_like(x_NBD),)
        g_NBF, u_NBF, y_NBD = jax.lax.fori_loop(0, used, block, zeros)
    else:
        g_NBF, u_NBF, y_NBD = jax.vmap(_swiglu_fwd)(x_NBD, *(w[expert_N] for w in weights))
    out_RD = y_NBD.reshape(-1, x_SD.shape[-1]) * weight_R[:, None]
    y_SD = jnp.zeros_like(x_SD).at[token_R].add(out_RD, mode="drop")
    return y_SD, (x_SD, g_NBF, u_NBF, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used)


def _blocked_bwd(loop, res, dy_SD):
    x_SD, g_NBF, u_NBF, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used = res
    weights = (wg_EDF, wu_EDF, wd_EFD)
    n_blocks = expert_N.shape[0]
    x_NBD = _gather_rows(x_SD, token_R, n_blocks)
    dy_NBD = _gather_rows(dy_SD, token_R, n_blocks)
    weight_NB = weight_R.reshape(n_blocks, -1)
    per_block = (x_NBD, g_NBF, u_NBF, dy_NBD, weight_NB)
    if loop:
        def block(n, carry):
            dx_NBD, dweight_NB, *acc = carry
            e = expert_N[n]
            dx_BD, dweight_B, *dw = _swiglu_bwd(*(v[n] for v in per_block), *(w[e] for w in weights))
            return (dx_NBD.at[n].set(dx_BD), dweight_NB.at[n].set(dweight_B),
                    *(a.at[e].add(d) for a, d in zip(acc, dw)))

        zeros = tuple(jnp.zeros_like(w, jnp.float32) for w in weights)  # same varying-ness as w
        init = (jnp.zeros_like(x_NBD), jnp.zeros_like(weight_NB), *zeros)
        dx_NBD, dweight_NB, *dws = jax.lax.fori_loop(0, used, block, init)
    else:
        dx_NBD, dweight_NB, *dw_N = jax.vmap(_swiglu_bwd)(*per_block, *(w[expert_N] for w in weights))
        dws = [jax.ops.segment_sum(d, expert_N, num_segments=wg_EDF.shape[0], indices_are_sorted=True) for d in dw_N]
    dx_SD = jnp.zeros_like(x_SD).at[token_R].add(dx_NBD.reshape(-1, x_SD.shape[-1]), mode="drop")
    return (dx_SD, dweight_NB.reshape(-1), *(d.astype(w.dtype) for d, w in zip(dws, weights)), None, None, None)


@partial(jax.custom_vjp, nondiff_argnums=(8,))
def _blocked_vjp(x_SD, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used, loop):
    return _blocked_fwd(x_SD, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used, loop)[0]


_blocked_vjp.defvjp(_blocked_fwd, _blocked_bwd)


def _ragged_fwd(x_SD, weight_A, wg_EDF, wu_EDF, wd_EFD, token_A, group_sizes_E):
    x_AD = x_SD[token_A]
    g_AF = jax.lax.ragged_dot(x_AD, wg_EDF, group_sizes_E)
    u_AF = jax.lax.ragged_dot(x_AD, wu_EDF, group_sizes_E)
    y_AD = jax.lax.ragged_dot(jax.nn.silu(g_AF) * u_AF, wd_EFD, group_sizes_E)
    y_SD = jnp.zeros_like(x_SD).at[token_A].add(y_AD * weight_A[:, None])
    return y_SD, (x_SD, g_AF, u_AF, weight_A, wg_EDF, wu_EDF, wd_EFD, token_A, group_sizes_E)


def _ragged_bwd(res, dy_SD):
    x_SD, g_AF, u_AF, weight_A, wg_EDF, wu_EDF, wd_EFD, token_A, group_sizes_E = res

    def grouped(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes_E)

    # out = (r * h) wd: the cotangent of (r * h) is dy wd^T, the unweighted dh that
    # :func:`_swiglu_grads` takes.
    _, down_vjp = jax.vjp(grouped, jax.nn.silu(g_AF) * u_AF * weight_A[:, None], wd_EFD)
    dh_AF, dwd = down_vjp(dy_SD[token_A])
    dweight_A, dg_AF, du_AF = _swiglu_grads(g_AF, u_AF, dh_AF, weight_A)
    x_AD = x_SD[token_A]
    _, gate_vjp = jax.vjp(grouped, x_AD, wg_EDF)
    dx_g, dwg = gate_vjp(dg_AF)
    _, up_vjp = jax.vjp(grouped, x_AD, wu_EDF)
    dx_u, dwu = up_vjp(du_AF)
    dx_SD = jnp.zeros_like(x_SD).at[token_A].add(dx_g + dx_u)
    return dx_SD, dweight_A, dwg, dwu, dwd, None, None


@jax.custom_vjp
def ragged_experts(x_SD, weight_A, wg_EDF, wu_EDF, wd_EFD, token_A, group_sizes_E):
    """``sum over assignments a of token s: weight_A[a] * SwiGLU_{expert}(x_SD[s])`` with the
    assignments sorted by expert (``group_sizes_E`` of them each) and run as
    ``jax.lax.ragged_dot`` groups. The custom gradient keeps the tokens, the gate and up
    activations and the routing, not the gathered rows or the expert outputs (two ``[S*K, D]``
    buffers per layer that autodiff would keep); the backward gathers the rows again and
    takes the routing weights' gradient from the ``dy wd^T`` product it needs anyway. The
    matmuls' transposes are ``ragged_dot``'s own (``jax.vjp``; their forward products are
    unused and removed by XLA)."""
    return _ragged_fwd(x_SD, weight_A, wg_EDF, wu_EDF, wd_EFD, token_A, group_sizes_E)[0]


ragged_experts.defvjp(_ragged_fwd, _ragged_bwd)


def blocked_experts(x_SD, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used, *, block_loop: bool | None = None):
    """``sum over rows r of token s: weight_R[r] * SwiGLU_{expert of r}(x_SD[s])``, with the
    rows in blocks of ``b``: block n runs expert ``expert_N[n]``'s weights, row ``r`` reads token
    ``token_R[r]`` (``S`` for padding: a zero row, added nowhere), and only the first ``used``
    blocks hold rows (the rest are padding of the static bound).

    Two forms of the same function, ``block_loop`` True / False forcing one, None picking by
    size (below). *Batched*: gather each block's weights (``[N, D, F]``)
    and run one batched matmul per weight over all ``N`` blocks. *Loop*: a ``fori_loop``
    over the ``used`` blocks only, each reading its expert's weights in place, with the
    weight gradients accumulated per expert in the backward loop. The loop avoids the ``N``-fold weight copies and wins once a
    block's matmul is big enough to hide the per-iteration cost: measured on 2 CPU cores,
    the vs_hf "small" MoE layer (b*D*F = 128*512*256) ran fwd+bwd 15-25% faster as a loop,
    the tiny one (128*128*64) ran as fast either way.

    The custom gradient keeps only the tokens ``x_SD``, the gate and up activations
    ``[N, b, F]``, the routing rows and the expert weights. The backward gathers the rows
    again; the routing weights' gradient comes from the ``dy wd^T`` product
    (:func:`_swiglu_bwd`). Autodiff would keep the gathered rows and the expert outputs
    (two ``[N*b, D]`` buffers per layer) and, in the batched form, ``[N, D, F]`` copies
    of all three weights.
    """
    b, d = token_R.shape[0] // expert_N.shape[0], x_SD.shape[-1]
    loop = block_loop if block_loop is not None else b * d * wg_EDF.shape[-1] >= 4 * 2**20
    return _blocked_vjp(x_SD, weight_R, wg_EDF, wu_EDF, wd_EFD, token_R, expert_N, used, loop)


# ----- block-grouped experts on pluggable kernels ------------------------------------------------
def _grouped_fwd(kernels, x_RD, weight_R, wg_EDF, wu_EDF, wd_EFD, *layout):
    g_RF = kernels.matmul(x_RD, wg_EDF, *layout)
    u_RF = kernels.matmul(x_RD, wu_EDF, *layout)
    y_RD = kernels.matmul(jax.nn.silu(g_RF) * u_RF, wd_EFD, *layout)
    return y_RD * weight_R[:, None], (x_RD, g_RF, u_RF, weight_R, wg_EDF, wu_EDF, wd_EFD, layout)


def _grouped_bwd(kernels, res, dy_RD):
    x_RD, g_RF, u_RF, weight_R, wg_EDF, wu_EDF, wd_EFD, layout = res

    def t(w_EXY):
        return jnp.swapaxes(w_EXY, 1, 2)

    dh_RF = kernels.matmul(dy_RD, t(wd_EFD), *layout)
    dweight_R, dg_RF, du_RF = _swiglu_grads(g_RF, u_RF, dh_RF, weight_R)
    dx_RD = kernels.matmul(dg_RF, t(wg_EDF), *layout) + kernels.matmul(du_RF, t(wu_EDF), *layout)
    rh_RF = jax.nn.silu(g_RF) * u_RF * weight_R[:, None]
    x_DR = x_RD.T
    dwg = kernels.matmul_t(x_DR, dg_RF, *layout)
    dwu = kernels.matmul_t(x_DR, du_RF, *layout)
    dwd = kernels.matmul_t(rh_RF.T, dy_RD, *layout)
    grads = tuple(d.astype(w.dtype) for d, w in zip((dwg, dwu, dwd), (wg_EDF, wu_EDF, wd_EFD)))
    return (dx_RD, dweight_R.astype(weight_R.dtype), *grads) + (None,) * len(layout)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped_vjp(kernels, x_RD, weight_R, wg_EDF, wu_EDF, wd_EFD, *layout):
    return _grouped_fwd(kernels, x_RD, weight_R, wg_EDF, wu_EDF, wd_EFD, *layout)[0]


_grouped_vjp.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_experts(kernels: BlockKernels, x_RD, weight_R, wg_EDF, wu_EDF, wd_EFD, expert_N, used, first_block_E, num_blocks_E):
    """``weight_R[r] * SwiGLU_{expert of r}(x_RD[r])`` on rows in the block layout (see
    :class:`BlockKernels`; spare and padding rows are zero and stay zero), every matmul of the
    forward and backward on ``kernels``. The custom gradient keeps the rows and the gate and up
    activations; the routing weights' gradient comes from the ``dy wd^T`` product
    (:func:`_swiglu_grads`); the weight gradients are float32 sums per expert.

    Inside a manual region the float operands are first marked varying over every mesh axis
    any of them varies over (a tensor rank's routing-weight gradient, say, is a partial sum
    over its F shard): the custom VJP needs an input and its gradient to have one type, and
    the marks' transposes sum the gradients where they are partial."""
    x_RD, weight_R, wg_EDF, wu_EDF, wd_EFD = common_vma(x_RD, weight_R, wg_EDF, wu_EDF, wd_EFD)
    return _grouped_vjp(kernels, x_RD, weight_R, wg_EDF, wu_EDF, wd_EFD, expert_N, used, first_block_E, num_blocks_E)


# ----- the same on rows placed into the block layout ---------------------------------------------
def _placed(x_GD, pos_G, rows: int):
    """``x_GD``'s rows at ``pos_G`` (each position once) of ``rows`` zero rows, typed as ``x_GD``."""
    return varying_zeros((rows, x_GD.shape[-1]), x_GD.dtype, x_GD).at[pos_G].set(x_GD, unique_indices=True)


def _placed_fwd(kernels, rows, x_GD, pos_G, wg_EDF, wu_EDF, wd_EFD, *layout):
    x_RD = _placed(x_GD, pos_G, rows)
    ones_R = jnp.ones_like(x_RD[:, 0])
    y_RD, res = _grouped_fwd(kernels, x_RD, ones_R, wg_EDF, wu_EDF, wd_EFD, *layout)
    return y_RD, (x_GD, pos_G) + res[1:]


def _placed_bwd(kernels, rows, res, dy_RD):
    x_GD, pos_G, *rest = res
    dx_RD, _, *grads = _grouped_bwd(kernels, (_placed(x_GD, pos_G, rows), *rest), dy_RD)
    return (dx_RD[pos_G], None, *grads)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _placed_vjp(kernels, rows, x_GD, pos_G, wg_EDF, wu_EDF, wd_EFD, *layout):
    return _placed_fwd(kernels, rows, x_GD, pos_G, wg_EDF, wu_EDF, wd_EFD, *layout)[0]


_placed_vjp.defvjp(_placed_fwd, _placed_bwd)


def placed_grouped_experts(kernels: BlockKernels, x_GD, pos_G, rows: int, wg_EDF, wu_EDF, wd_EFD, expert_N, used,
                           first_block_E, num_blocks_E):
    """:func:`grouped_experts` (routing weights of one, applied at home) on ``x_GD``'s rows placed
    at ``pos_G`` of ``rows`` zero rows in the block layout. The custom gradient keeps ``x_GD``
    and the positions, not the placed rows: the backward places them again (a copy), so the
    block layout's padding rows (up to a block per expert) are never kept (the seed's
    gathered exchange: 20480 placed rows for 16384 gathered, 16 MiB per layer and micro-batch
    on a device)."""
    x_GD, wg_EDF, wu_EDF, wd_EFD = common_vma(x_GD, wg_EDF, wu_EDF, wd_EFD)
    return _placed_vjp(kernels, rows, x_GD, pos_G, wg_EDF, wu_EDF, wd_EFD, expert_N, used, first_block_E,
                       num_blocks_E)
