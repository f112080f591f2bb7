"""Which kernels a model compiled for a platform runs: the one place that decides.

The defaults by platform are the tables beside the code they pick from
(:data:`~mlir_train.model.attention.DEFAULT_ATTENTION_IMPL`,
:data:`~mlir_train.model.moe.dispatch.DEFAULT_MOE_IMPL`); ``--attention-kernel`` and
``--moe-gemm-backend`` override them here, and :func:`kernel_options` turns the choice into the
model's :class:`~mlir_train.model.options.ModelOptions`. The trainer, the planner, the kernel
self-check and the benchmarks all ask this function; nothing else maps a platform to a kernel.
The platform itself is named by :func:`mlir_train.runtime.platform_setup.platform_name`.
"""

from __future__ import annotations

from mlir_train.model.attention import DEFAULT_ATTENTION_IMPL, pallas_mha_missing
from mlir_train.model.moe.dispatch import DEFAULT_MOE_IMPL, ragged_all_to_all_dense
from mlir_train.model.options import ModelOptions

# --moe-gemm-backend / --attention-kernel (mlir_train.config.flags) -> what the model runs.
MOE_BACKENDS = ("auto", "mosaic", "tokamax", "padded")
ATTENTION_BACKENDS = {"auto": None, "tokamax": "tokamax", "pallas-mha": "flash", "mlir": "docs-flash", "xla": "xla"}
GPU_ONLY = {"mosaic", "tokamax", "pallas-mha", "mlir"}
# --code-paths: "gpu" on CPU runs the GPU program's paths with its kernels interpreted, tiled for
# this compute capability (Hopper: H100, H200).
CODE_PATHS = ("auto", "gpu")
GPU_CODE_PATHS_CAPABILITY = "9.0"
OFF_GPU = {"--attention-kernel": "xla", "--moe-gemm-backend": "padded"}  # each flag's own choice for any platform


def kernel_options(platform: str, *, is_moe: bool, context_parallel: int = 1, moe_backend: str = "auto",
                   attention_backend: str = "auto", base: ModelOptions | None = None,
                   code_paths: str = "auto") -> ModelOptions:
    """``base`` (default :class:`ModelOptions`) with the kernels a model compiled for ``platform``
    ("cpu", "gpu", "tpu") runs: attention (``attention_backend``, ``--attention-kernel``: "auto" is
    :data:`~mlir_train.model.attention.DEFAULT_ATTENTION_IMPL`) and, for MoE models, the experts
    (``moe_backend``, ``--moe-gemm-backend``: "auto" is :data:`~mlir_train.model.moe.dispatch.DEFAULT_MOE_IMPL`,
    with our Mosaic-GPU block kernels under "grouped"; "tokamax" the same dropless block layout on
    tokamax's kernels; "padded" the capacity / padded batched matmul).

    With the sequence split over ``context_parallel`` > 1 ranks attention is the "xla" path
    on every platform: the kernels mask causally from position 0 of one sequence shared
    by queries and keys, which the load-balanced layout's two chunks per rank are not
    (:func:`~mlir_train.model.attention.context_parallel_attention`); naming a kernel there is refused.
    A GPU kernel named off GPU is refused (ValueError naming the flag), never replaced, and so is
    ``--attention-kernel pallas-mha`` on a jax that no longer ships it (:func:`pallas_mha_missing`).

    ``code_paths`` (``--code-paths``) "gpu" on CPU: the options a GPU run gets, with the kernels
    in the Pallas / Mosaic-GPU interpreters tiled for compute capability 9.0 and the ragged
    all-to-all by its stand-in (:func:`gpu_code_paths_on_cpu`)."""
    if code_paths not in CODE_PATHS:
        raise ValueError(f"--code-paths {code_paths!r}: choose one of {', '.join(CODE_PATHS)}")
    if code_paths == "gpu" and platform == "cpu":
        return gpu_code_paths_on_cpu(is_moe=is_moe, context_parallel=context_parallel, moe_backend=moe_backend,
                                     attention_backend=attention_backend, base=base)
    if code_paths == "gpu" and platform != "gpu":
        raise ValueError(f"--code-paths gpu runs the GPU program on CPU devices (interpreted kernels); this run "
                         f"compiles for {platform}: use --code-paths auto")
    if moe_backend not in MOE_BACKENDS:
        raise ValueError(f"--moe-gemm-backend {moe_backend!r}: choose one of {', '.join(MOE_BACKENDS)}")
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-kernel {attention_backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    for flag, choice in (("--attention-kernel", attention_backend), ("--moe-gemm-backend", moe_backend)):
        if choice in GPU_ONLY and platform != "gpu":
            raise ValueError(f"{flag} {choice}: a GPU kernel, and this run compiles for {platform}; "
                             f"use {flag} auto or {flag} {OFF_GPU[flag]}"
                             + (" (or --code-paths gpu: the GPU kernels interpreted on CPU)" if platform == "cpu" else ""))
    if attention_backend == "pallas-mha" and pallas_mha_missing():
        raise ValueError(pallas_mha_missing())
    if context_parallel > 1:
        if attention_backend not in ("auto", "xla"):
            raise ValueError(f"--attention-kernel {attention_backend} does not run with --context-parallel-size "
                             f"{context_parallel} (the kernels cannot mask the load-balanced chunks by their original "
                             "positions); use --attention-kernel xla or auto")
        impl = "xla"
    else:
        impl = ATTENTION_BACKENDS[attention_backend] or DEFAULT_ATTENTION_IMPL.get(platform, "xla")
    options = (base or ModelOptions()).replace(attention_impl=impl)
    if is_moe:
        moe_impl = "padded" if moe_backend == "padded" else (
            "grouped" if moe_backend in ("mosaic", "tokamax") else DEFAULT_MOE_IMPL.get(platform, "padded"))
        options = options.replace(moe_impl=moe_impl, moe_platform=platform,
                                  moe_kernels="tokamax" if moe_backend == "tokamax" else None)
    return options


def gpu_code_paths_on_cpu(*, is_moe: bool, context_parallel: int = 1, moe_backend: str = "auto",
                          attention_backend: str = "auto", base: ModelOptions | None = None) -> ModelOptions:
    """``--code-paths gpu`` on CPU: :func:`kernel_options` of a GPU run, its kernels in the
    interpreters (``kernel_interpret``) with Hopper's tiles (``compute_capability`` 9.0), the
    Mosaic-GPU block kernels interpreted, and the ragged EP exchange on
    :func:`~mlir_train.model.moe.dispatch.ragged_all_to_all_dense` (typed as the real op; XLA:CPU
    has no ragged all-to-all). tokamax's kernels have no interpreter here: refused, naming the flag."""
    for flag, choice in (("--attention-kernel", attention_backend), ("--moe-gemm-backend", moe_backend)):
        if choice == "tokamax":
            raise ValueError(f"{flag} tokamax does not run under --code-paths gpu on CPU (tokamax's kernels "
                             "have no interpreter here); use --code-paths auto, or another kernel")
    options = kernel_options("gpu", is_moe=is_moe, context_parallel=context_parallel, moe_backend=moe_backend,
                             attention_backend=attention_backend, base=base)
    options = options.replace(kernel_interpret=True, compute_capability=GPU_CODE_PATHS_CAPABILITY)
    if is_moe and options.moe_impl == "grouped":
        options = options.replace(moe_kernels="mosaic-interpret", ragged_all_to_all=ragged_all_to_all_dense)
    return options
