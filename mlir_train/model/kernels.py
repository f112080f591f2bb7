"""Which kernels a model compiled for a platform runs: the one place that decides.

The defaults by platform are the tables beside the code they pick from
(:data:`~mlir_train.model.attention.DEFAULT_ATTENTION_IMPL`,
:data:`~mlir_train.model.moe.dispatch.DEFAULT_MOE_IMPL`); ``--attention-kernel`` and
``--moe-gemm-backend`` override them here, and :func:`platform_model_kwargs` turns the choice
into the model's constructor arguments. The trainer, the planner, the kernel self-check and
the benchmarks all ask this function; nothing else maps a platform to a kernel.
"""

from __future__ import annotations

from typing import Any

from mlir_train.model.attention import DEFAULT_ATTENTION_IMPL
from mlir_train.model.moe.dispatch import DEFAULT_MOE_IMPL

# --moe-gemm-backend / --attention-kernel (mlir_train.config.flags) -> what the model runs.
MOE_BACKENDS = ("auto", "mosaic", "tokamax", "padded")
ATTENTION_BACKENDS = {"auto": None, "tokamax": "tokamax", "pallas-mha": "flash", "mlir": "docs-flash", "xla": "xla"}
GPU_ONLY = {"mosaic", "tokamax", "pallas-mha", "mlir"}


def platform_model_kwargs(platform: str, *, is_moe: bool, context_parallel: int = 1, moe_backend: str = "auto",
                          attention_backend: str = "auto") -> dict[str, Any]:
    """The kernels a model compiled for ``platform`` ("cpu", "gpu", "tpu": the mesh devices'
    ``.platform``) runs: attention (``attention_backend``, ``--attention-kernel``: "auto" is
    :data:`~mlir_train.model.attention.DEFAULT_ATTENTION_IMPL`) and, for MoE models, the experts
    (``moe_backend``, ``--moe-gemm-backend``: "auto" is :data:`~mlir_train.model.moe.block.DEFAULT_MOE_IMPL`,
    with our Mosaic-GPU block kernels under "grouped"; "tokamax" the same dropless block layout on
    tokamax's kernels; "padded" the capacity / padded batched matmul).

    With the sequence split over ``context_parallel`` > 1 ranks attention is the "xla" path
    on every platform: the kernels mask causally from position 0 of one sequence shared
    by queries and keys, which the load-balanced layout's two chunks per rank are not
    (:func:`~mlir_train.model.attention.context_parallel_attention`); naming a kernel there is refused.
    A GPU kernel named off GPU is refused (ValueError naming the flag), never replaced."""
    if moe_backend not in MOE_BACKENDS:
        raise ValueError(f"--moe-gemm-backend {moe_backend!r}: choose one of {', '.join(MOE_BACKENDS)}")
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-kernel {attention_backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    for flag, choice in (("--attention-kernel", attention_backend), ("--moe-gemm-backend", moe_backend)):
        if choice in GPU_ONLY and platform != "gpu":
            raise ValueError(f"{flag} {choice}: a GPU kernel, and this run compiles for {platform}; "
                             f"use {flag} auto (or xla / padded)")
    if context_parallel > 1:
        if attention_backend not in ("auto", "xla"):
            raise ValueError(f"--attention-kernel {attention_backend} does not run with --context-parallel-size "
                             f"{context_parallel} (the kernels cannot mask the load-balanced chunks by their original "
                             "positions); use --attention-kernel xla or auto")
        impl = "xla"
    else:
        impl = ATTENTION_BACKENDS[attention_backend] or DEFAULT_ATTENTION_IMPL.get(platform, "xla")
    kwargs: dict[str, Any] = {"attention_impl": impl}
    if is_moe:
        moe_impl = "padded" if moe_backend == "padded" else (
            "grouped" if moe_backend in ("mosaic", "tokamax") else DEFAULT_MOE_IMPL.get(platform, "padded"))
        kwargs |= {"moe_impl": moe_impl, "moe_platform": platform}
        if moe_backend == "tokamax":
            kwargs["moe_kernels"] = "tokamax"
    return kwargs
