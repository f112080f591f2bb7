"""Pallas Mosaic-GPU kernels (Hopper, sm_90a) for the block-grouped MoE experts.

The experts' rows are laid out in blocks of ``BLOCK_ROWS`` rows, each block holding rows of one
expert (``moe_dispatch.block_grouped``): block ``n`` belongs to expert ``expert_N[n]`` and only
the first ``used`` blocks hold rows, the rest being the static bound's spare. Both kernels do
the work of the used blocks only, so a step's matmul work is the routed rows plus, per expert,
the round-up of its rows to a whole block:

* :func:`block_matmul`   ``out[block n] = lhs[block n] @ rhs[expert_N[n]]`` (``[R, K] x [E, K, N]
  -> [R, N]``), one CTA per (block, N tile); a spare block stores zeros and computes nothing.
  The forward matmuls and the input gradients (with the weights' two last axes swapped).
* :func:`block_matmul_t` ``out[e] = lhs[:, rows of e] @ rhs[rows of e]`` (``[K, R] x [R, N] ->
  [E, K, N]``, float32), one CTA per (expert, K tile, N tile) looping over that expert's
  blocks only: the weight gradients.

XLA's own ``ragged_dot`` on GPU is a dense padded dot over every expert (E/K times the routed
work), which is why these exist. Their operands are plain (no transposed SMEM views): the
Mosaic-GPU interpreter runs them on CPU (tests), and it cannot run transposed views.
:func:`~.blocks.xla_block_kernels` computes the same two functions with ``jax.lax.ragged_dot``;
:func:`mosaic_block_kernels` gives these two as the experts' ``BlockKernels``.

In the optimized HLO each kernel is a ``mosaic_gpu_v2`` custom call whose ``op_name`` ends in
the kernel body's name (``moe_block_matmul``, ``moe_block_matmul_t``): ``mlir_train.planner.hlo_kernels``
counts their work from the operand shapes (the static bound) and the block counts.
"""

from __future__ import annotations

import functools
import hashlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mlir_train.model.kernels.blocks import BlockKernels, common_vma
from sharding import replicated_on_remaining_axes

# wgmma's M is 64 rows per warpgroup: the smallest block, and the least padding per expert.
BLOCK_ROWS = 64
TILE_N = 128
TILE_K = 64
STAGES = 4
# wgmma's accumulator has a multiple of 64 rows: the weight gradient's first width (each rank's
# expert input or FFN width) must be a multiple of this.
WEIGHT_GRAD_ROWS = 64
KERNEL_NAMES = ("moe_block_matmul", "moe_block_matmul_t")


def _check(what: str, size: int, tile: int):
    if size % tile:
        raise ValueError(
            f"Mosaic-GPU MoE kernel: {what} = {size} is not a multiple of {tile}; build the model with "
            f"moe_impl='padded' instead"
        )


def _tile(size: int, preferred: int) -> int:
    """The largest power of two up to ``preferred`` dividing ``size``, at least 16 (then
    :func:`_check` refuses a size it does not divide). Widths per tensor rank such as 192
    (768 over 4 ranks) take 64-wide tiles."""
    tile = preferred
    while tile > 16 and size % tile:
        tile //= 2
    return tile


def _wgmma_step(acc_ref, _, lhs_smem, rhs_smem):
    """One pipeline step: issue this step's wgmma, then wait until at most it is in flight.
    wgmma is asynchronous and the pipeline refills a shared-memory slot as soon as the step
    that read it returns; with ``delay_release=1`` on the block specs the slot refilled after
    step ``s`` is step ``s - 1``'s, whose wgmma this wait has retired (JAX's Mosaic-GPU
    pipelining guide). Without both, a refill can overwrite operands a wgmma still reads."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
    plgpu.wgmma_wait(1)


def block_matmul(lhs_RK, rhs_EKN, expert_N, used, *, block_rows: int = BLOCK_ROWS, interpret=None):
    """``out[n*b:(n+1)*b] = lhs[n*b:(n+1)*b] @ rhs[expert_N[n]]`` for blocks ``n < used``, zero
    rows after. ``interpret``: a ``InterpretGPUParams`` to run it on CPU (tests)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    r, k = lhs_RK.shape
    n = rhs_EKN.shape[2]
    b, tile_k, tile_n = block_rows, _tile(k, TILE_K), _tile(n, TILE_N)
    _check("rows", r, b)
    _check("contracting width", k, tile_k)
    _check("output width", n, tile_n)
    dtype = lhs_RK.dtype

    def moe_block_matmul(expert_ref, used_ref, lhs_ref, rhs_ref, out_ref):
        ni, blk = lax.axis_index("n"), lax.axis_index("m")
        live = blk < used_ref[0]

        def store(value):
            def scope(o_smem):
                o_smem[...] = value
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, out_ref.at[pl.ds(blk * b, b), pl.ds(ni * tile_n, tile_n)])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(scope, plgpu.SMEM((b, tile_n), dtype))

        # One K step has no refill to delay (and emit_pipeline then runs one stage, which
        # must exceed the delay).
        delay = 1 if k // tile_k > 1 else 0

        @pl.when(live)
        def _():
            def acc_scope(acc_ref):
                plgpu.emit_pipeline(
                    functools.partial(_wgmma_step, acc_ref),
                    grid=(k // tile_k,),
                    in_specs=[plgpu.BlockSpec((b, tile_k), lambda kk: (blk, kk), delay_release=delay),
                              plgpu.BlockSpec((tile_k, tile_n), lambda kk: (kk, ni), delay_release=delay)],
                    max_concurrent_steps=STAGES,
                )(lhs_ref, rhs_ref.at[expert_ref[blk]])
                return acc_ref[...]

            store(pl.run_scoped(acc_scope, plgpu.ACC((b, tile_n))).astype(dtype))

        @pl.when(jnp.logical_not(live))
        def _():
            store(jnp.zeros((b, tile_n), dtype))

    kernel = plgpu.kernel(
        moe_block_matmul,
        out_type=jax.ShapeDtypeStruct((r, n), dtype),
        grid=(n // tile_n, r // b),
        grid_names=("n", "m"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
    return kernel(expert_N.astype(jnp.int32), jnp.reshape(used, (1,)).astype(jnp.int32), lhs_RK, rhs_EKN.astype(dtype))


def block_matmul_t(lhs_KR, rhs_RN, first_block_E, num_blocks_E, *, block_rows: int = BLOCK_ROWS, interpret=None):
    """``out[e] = lhs[:, rows of e] @ rhs[rows of e]`` in float32, expert ``e``'s rows being
    blocks ``first_block_E[e]`` to ``first_block_E[e] + num_blocks_E[e]`` (an expert without
    blocks gets zeros)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, r = lhs_KR.shape
    n = rhs_RN.shape[1]
    e = first_block_E.shape[0]
    b, tile_m, tile_n = block_rows, WEIGHT_GRAD_ROWS, _tile(n, TILE_N)
    _check("rows", r, b)
    _check("weight input width", m, tile_m)
    _check("weight output width", n, tile_n)

    def moe_block_matmul_t(first_ref, count_ref, lhs_ref, rhs_ref, out_ref):
        mi, ni, ei = lax.axis_index("m"), lax.axis_index("n"), lax.axis_index("e")
        first, count = first_ref[ei], count_ref[ei]

        def acc_scope(acc_ref):
            @pl.when(count > 0)
            def _():
                plgpu.emit_pipeline(
                    functools.partial(_wgmma_step, acc_ref),
                    grid=(count,),
                    in_specs=[plgpu.BlockSpec((tile_m, b), lambda kk: (mi, first + kk), delay_release=1),
                              plgpu.BlockSpec((b, tile_n), lambda kk: (first + kk, ni), delay_release=1)],
                    max_concurrent_steps=STAGES,
                )(lhs_ref, rhs_ref)

            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_m, tile_n)))

        def scope(o_smem):
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[ei, pl.ds(mi * tile_m, tile_m), pl.ds(ni * tile_n, tile_n)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scope, plgpu.SMEM((tile_m, tile_n), jnp.float32))

    kernel = plgpu.kernel(
        moe_block_matmul_t,
        out_type=jax.ShapeDtypeStruct((e, m, n), jnp.float32),
        grid=(m // tile_m, n // tile_n, e),
        grid_names=("m", "n", "e"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
    return kernel(first_block_E.astype(jnp.int32), num_blocks_E.astype(jnp.int32), lhs_KR, rhs_RN.astype(lhs_KR.dtype))


def mosaic_block_kernels(interpret=None) -> BlockKernels:
    """:func:`block_matmul` and :func:`block_matmul_t` as the experts' kernels (``interpret``:
    run them in the Mosaic-GPU interpreter, on CPU, for tests)."""

    def named(kernel, *args, **kwargs):
        try:
            return kernel(*args, **kwargs)
        except ValueError as e:  # a width the kernels cannot tile: say which flag chose them
            raise ValueError(f"--moe-gemm-backend mosaic (the GPU default): {e}; or --moe-gemm-backend padded") from None

    # A Pallas call's result is typed invariant over every manual mesh axis: give it the
    # variance of its operands, as any other op's result would have.
    def matmul(lhs_RK, rhs_EKN, expert_N, used, first_block_E, num_blocks_E):
        kernel = lambda *a: named(block_matmul, *a, interpret=interpret)
        out = _interpretable(kernel, interpret)(lhs_RK, rhs_EKN, expert_N, used)
        return common_vma(out, lhs_RK, rhs_EKN)[0]

    def matmul_t(lhs_KR, rhs_RN, expert_N, used, first_block_E, num_blocks_E):
        kernel = lambda *a: named(block_matmul_t, *a, interpret=interpret)
        out = _interpretable(kernel, interpret)(lhs_KR, rhs_RN, first_block_E, num_blocks_E)
        return common_vma(out, lhs_KR, rhs_RN)[0]

    return BlockKernels("mosaic" if interpret is None else "mosaic-interpret", BLOCK_ROWS, matmul, matmul_t)


def interpret_params():
    """Parameters that run the kernels in the Mosaic-GPU interpreter: public as
    ``jax.experimental.pallas.mosaic_gpu.InterpretGPUParams`` from jax 0.11.2 (its interpreter
    reworked there); jax 0.10.2 spells them only privately."""
    try:
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
    except ImportError:  # jax < 0.11.2
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _interpretable(kernel, interpret):
    """``kernel`` as it runs: on a GPU as it is; in the interpreter (``interpret`` given) the same
    kernel, one device's call at a time, on the host (:func:`_on_host`), inside a region manual
    over every mesh axis the caller's region is not, because JAX accepts callbacks only there
    (the MoE regions are manual over the token axes only). The operands are whole on those axes
    there (the same on each rank of them), and so is the result."""
    if interpret is None:
        return kernel
    return replicated_on_remaining_axes(_on_host(kernel))


# One interpreted kernel at a time in this process: the interpreter keeps its simulated GPU
# memory in one module-level object, which each kernel's run creates and clears.
_INTERPRETER = threading.Lock()


def _on_host(kernel):
    """``kernel`` run by a host callback: each device's call traces and runs it as a one-device
    program, holding :data:`_INTERPRETER`.

    Why not the interpreter inside the step, as on one device: there it simulates every device of
    the region at once (``jax_core.get_axis_env``), each device's callbacks meeting the others'
    at a barrier at the kernel's end. That couples devices that share nothing (each MoE rank's
    kernel reads its own rows only): a device whose overflow rounds (``dispatch.in_rounds``, a
    ``lax.cond``) run the kernel more often than another's would wait forever; its ordered
    callbacks thread an effect token through the step's control flow, and compiling the seed
    layout so aborted in XLA:CPU's Shardy export (``Check failed: buffer != nullptr`` in
    ``HloSharding::Validate`` of a region's parameter; the token's part is our reading); and
    jax 0.10.2 asserts no barrier of *any* device is allocated when one device ends (fails at
    random beyond about 4 devices). Run per device, the kernel sees one GPU, its code and tiles
    unchanged. The callbacks hold XLA:CPU pool threads while they wait for the lock: a
    ``--code-paths gpu`` process sizes the pools for that (``platform_setup``'s
    ``callback_threads``)."""
    compiled = jax.jit(kernel)

    def call(*args):
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        traced, out_shape = jax.make_jaxpr(kernel, return_shape=True)(*shapes)
        return jax.pure_callback(_HostKernel(compiled, traced), out_shape, *args)

    return call


class _HostKernel:
    """The host side of :func:`_on_host`: runs the compiled one-device kernel under the lock.
    ``kernel_jaxpr`` (the kernel's own program, its ``pallas_call`` inside) is what
    ``mlir_train.planner.code_paths`` reads to name the kernel the callback runs.

    A call whose kernel program and operands (bytes, shapes and dtypes) equal a recent call's
    takes that call's result (:data:`RESULTS`) instead of interpreting the same kernel again: the
    devices of the axes the MoE region is not manual over hold the same operands and call it
    alike (:func:`_interpretable`), and an overflow round that moves no rows on a rank passes
    the same empty blocks each time. The interpreter is deterministic, so the result is the
    one it would compute; every distinct call still runs the kernel (:data:`CALLS` counts both)."""

    def __init__(self, compiled, kernel_jaxpr):
        self.compiled, self.kernel_jaxpr = compiled, kernel_jaxpr
        self.program = hashlib.sha1(str(kernel_jaxpr).encode()).digest()

    def __call__(self, *args):
        arrays = [np.ascontiguousarray(a) for a in args]
        key = hashlib.sha1(self.program)
        for a in arrays:
            key.update(f"{a.dtype}{a.shape}".encode())
            key.update(a.tobytes())
        key = key.digest()
        with _INTERPRETER:
            out = RESULTS.get(key)
            CALLS["reused" if out is not None else "run"] += 1
            if out is None:
                out = RESULTS[key] = np.asarray(self.compiled(*args))
                while len(RESULTS) > RESULTS_KEPT:
                    RESULTS.pop(next(iter(RESULTS)))
            return out.copy()


# The latest interpreted kernels' results by program and operands (:class:`_HostKernel`), oldest first.
RESULTS: dict[bytes, np.ndarray] = {}
RESULTS_KEPT = 1024  # at the check's shrunk widths at most ~128 KiB each
CALLS = {"run": 0, "reused": 0}  # interpreted kernel calls in this process: run, or a recent identical call's result
