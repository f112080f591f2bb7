"""tokamax's maintained GPU kernels as backends of the MoE experts and of attention.

Shape suffixes as in :mod:`mlir_train.model.layers` and :mod:`mlir_train.model.moe.experts`.

* :func:`tokamax_block_kernels` the :class:`~.blocks.BlockKernels` of
  ``--moe-gemm-backend tokamax``: ``tokamax.ragged_dot`` on the block layout, the Mosaic-GPU
  kernel (Hopper wgmma) for the forward and input-gradient matmuls and, for the weight gradients,
  tokamax's Mosaic-GPU ragged-contracting kernel. Its Pallas-Triton one (reported much faster at
  the MoE shapes) does not compile inside our checked shard_map regions: its output declares no
  variance over the manual axes (``implementation_t="triton"`` selects it where that does not
  apply). The groups are each expert's blocks, so the kernels compute the used blocks only.
* :func:`tokamax_attention` ``--attention-kernel tokamax``: tokamax's Mosaic-GPU flash attention
  with the packed documents given as per-query key starts (``Mask(k_start=..., is_causal=True)``),
  whose forward skips the key tiles of earlier documents; native GQA (no repeated K/V).

tokamax picks a kernel from ``jax.extend.backend.get_default_device()`` at trace time: a
deviceless compile for H200 must trace under ``jax.default_device(<a topology device>)``
(:func:`mlir_train.runtime.platform_setup.compile_target`), or ``tokamax.ragged_dot`` with its default
implementation quietly lowers to XLA's dense ``ragged_dot``. The implementations here are always
named, and named exactly (``"mosaic_gpu"``, not tokamax's ``"mosaic"``, which it resolves by the
default device's kind string to the GPU or the TPU kernel), so a wrong device is an error, never a
silent dense fallback. From tokamax 0.0.17 a named implementation skips tokamax's own device check
(its ``bypass_device_check`` defaults to True then), so the GPU kernels are guarded here
(:func:`_check_gpu_device`) on every version; and its ``"triton"`` ragged dot is a jax_triton
kernel (0.0.12's was Pallas-Triton), present only with the ``jax_triton`` and ``triton`` packages:
:func:`_ragged_dot_implementation` names the flag and what to install where one is missing.

tokamax is imported lazily: the CPU path never needs it (:func:`require_tokamax`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mlir_train.model.kernels.blocks import BlockKernels, common_vma
from mlir_train.runtime.platform_setup import platform_name

MOE_FLAG = "--moe-gemm-backend"
ATTENTION_FLAG = "--attention-kernel"


def require_tokamax(flag: str):
    """The ``tokamax`` module, or an ImportError naming ``flag`` (the choice that needs it)."""
    try:
        import tokamax
    except ImportError as e:
        raise ImportError(f"{flag} tokamax needs the tokamax package (pip install 'mlir-train[cuda]' or "
                          f"pip install 'tokamax>=0.0.12'); or choose another {flag}: {e}") from None
    from absl import flags

    # tokamax reads its options from absl flags, and parses sys.argv for them on first use if nobody
    # has: our (Megatron) command line is not absl's, and it aborts on the first unknown flag. Mark
    # absl's flags parsed with their defaults instead.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


def _check_gpu_device(flag: str):
    from jax.extend import backend

    device = backend.get_default_device()
    if platform_name(device) != "gpu":
        raise ValueError(
            f"{flag} tokamax: tracing on a {device.platform} default device; tokamax's GPU kernels need a GPU "
            "default device (a deviceless compile traces under mlir_train.runtime.platform_setup.compile_target(mesh))")


def _ragged_dot_implementation(name: str) -> str:
    """``name`` if this tokamax has that ragged-dot implementation, else an ImportError naming
    ``--moe-gemm-backend tokamax`` and what is missing (tokamax registers an implementation only
    where its imports succeed: ``mosaic_gpu`` needs jax's Mosaic GPU, ``triton`` from tokamax 0.0.17
    jax_triton and triton)."""
    if name == "xla":
        return name
    from tokamax._src.ops.ragged_dot import api

    if name in api.IMPLEMENTATIONS:
        return name
    from importlib import metadata

    try:
        version = metadata.version("tokamax")
    except metadata.PackageNotFoundError:
        version = "?"
    need = {"triton": "the jax-triton and triton packages (pip install jax-triton triton; tokamax >= 0.0.17's "
                      "'triton' ragged dot is a jax_triton kernel)",
            "mosaic_gpu": "jax's Mosaic GPU (jax.experimental.mosaic.gpu; a jaxlib with CUDA support)"}.get(
        name, "an implementation this tokamax does not have")
    raise ImportError(f"{MOE_FLAG} tokamax: tokamax {version} has no {name!r} ragged dot here "
                      f"(it has {', '.join(sorted(api.IMPLEMENTATIONS))}); it needs {need}, or choose another {MOE_FLAG}")


def tokamax_block_kernels(block_rows: int = 64, *, implementation: str | None = None,
                          implementation_t: str = "mosaic") -> BlockKernels:
    """``tokamax.ragged_dot`` on the block layout: expert ``e``'s group is its
    ``num_blocks_E[e] * block_rows`` rows. ``implementation`` None: Mosaic-GPU forward / input
    gradients, ``implementation_t`` weight gradients (GPU only; ``"mosaic"``, the Mosaic-GPU kernel, or
    ``"triton"``); ``"xla"``: tokamax's reference (XLA's ``ragged_dot``), which runs anywhere (the CPU
    tests compare it with our reference). A GPU implementation this tokamax lacks is an ImportError
    naming ``--moe-gemm-backend`` (:func:`_ragged_dot_implementation`), raised here, before tracing.
    Rows after the last group (spare blocks) are set to zero: the kernels leave them unwritten."""
    tokamax = require_tokamax(MOE_FLAG)
    # "mosaic" is tokamax's name for "the Mosaic kernel of the default device's kind": name the GPU one.
    matmul_impl, matmul_t_impl = ((implementation, implementation) if implementation
                                  else ("mosaic_gpu", "mosaic_gpu" if implementation_t == "mosaic" else implementation_t))
    matmul_impl, matmul_t_impl = _ragged_dot_implementation(matmul_impl), _ragged_dot_implementation(matmul_t_impl)
    contracting = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])

    def sizes(num_blocks_E):
        return (num_blocks_E * block_rows).astype(jnp.int32)

    def matmul(lhs_RK, rhs_EKN, expert_N, used, first_block_E, num_blocks_E):
        if implementation is None:
            _check_gpu_device(MOE_FLAG)
        out_RN = tokamax.ragged_dot(lhs_RK, rhs_EKN.astype(lhs_RK.dtype), sizes(num_blocks_E),
                                    implementation=matmul_impl)
        live_R = jnp.arange(lhs_RK.shape[0]) < used * block_rows
        out_RN = jnp.where(live_R[:, None], out_RN, 0).astype(lhs_RK.dtype)
        return common_vma(out_RN, lhs_RK, rhs_EKN)[0]

    def matmul_t(lhs_KR, rhs_RN, expert_N, used, first_block_E, num_blocks_E):
        if implementation is None:
            _check_gpu_device(MOE_FLAG)
        # tokamax's ragged-contracting form takes the rows leading on both sides ([R, K] x [R, N]).
        out = tokamax.ragged_dot_general(lhs_KR.T, rhs_RN.astype(lhs_KR.dtype), sizes(num_blocks_E), contracting,
                                         preferred_element_type=jnp.float32, implementation=matmul_t_impl)
        return common_vma(out, lhs_KR, rhs_RN)[0]

    name = "tokamax" if implementation is None else f"tokamax-{implementation}"
    return BlockKernels(name, block_rows, matmul, matmul_t)


def document_starts(segment_ids_BT: jax.Array) -> jax.Array:
    """``[B, T]``: the index where each position's run of equal segment ids begins, the first key a
    query of a packed document may see. Equal to :func:`~mlir_train.model.attention.attention_mask`'s
    documents when every segment id is one contiguous run (as packing lays them out); padding
    (segment 0) attends within its own run."""
    t = segment_ids_BT.shape[1]
    index_T = jnp.arange(t, dtype=jnp.int32)
    change_BT = jnp.concatenate([jnp.ones_like(segment_ids_BT[:, :1], bool),
                                 segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    return jax.lax.cummax(jnp.where(change_BT, index_T, 0), axis=1)


def tokamax_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, *, implementation: str = "mosaic_gpu"):
    """Causal GQA attention within packed documents (:func:`document_starts`) with tokamax's flash
    attention; ``implementation`` ``"mosaic_gpu"`` (GPU), or ``"xla"`` (tokamax's reference, any
    platform: the CPU tests). The same function as
    :func:`~mlir_train.model.attention.masked_attention` of ``attention_mask(segment_ids)`` for
    contiguous documents."""
    require_tokamax(ATTENTION_FLAG)
    from tokamax._src.ops.attention import api, base

    if implementation not in api.IMPLEMENTATIONS:
        raise ImportError(f"{ATTENTION_FLAG} tokamax: this tokamax has no {implementation!r} flash attention here "
                          f"(it has {', '.join(sorted(api.IMPLEMENTATIONS))}; 'mosaic_gpu' needs jax's Mosaic GPU); "
                          f"choose another {ATTENTION_FLAG}")
    if implementation != "xla":
        _check_gpu_device(ATTENTION_FLAG)
    h = q_BTNH.shape[-1]
    mask = base.Mask(k_start=document_starts(segment_ids_BT)[:, None, :], is_causal=True)
    return api.IMPLEMENTATIONS[implementation](q_BTNH, k_BSKH, v_BSKH, mask=mask, logits_scale=1.0 / math.sqrt(h))
