"""Process-wide platform settings, applied once by every entry point before any JAX backend
starts (``sft``, ``plan``, ``convert``, ``preprocess``, the notebooks, ``tests/conftest.py``)."""

from __future__ import annotations

import os


def _add_xla_flag(flag: str, unless: str) -> None:
    """Append ``flag`` to XLA_FLAGS unless the user's own flags already set ``unless``."""
    current = os.environ.get("XLA_FLAGS", "")
    if unless not in current:
        os.environ["XLA_FLAGS"] = (current + " " + flag).strip()


def configure_platform(*, cpu_devices: int | None = 8) -> None:
    """Fake CPU devices (``--cpu-devices``; the flag only affects the host platform, so it is
    harmless where GPUs/TPUs exist) and XLA:CPU's workarounds. A user's own XLA_FLAGS win.
    Must run before jax initialises a backend (importing jax is fine)."""
    if cpu_devices:
        _add_xla_flag(f"--xla_force_host_platform_device_count={cpu_devices}", "--xla_force_host_platform_device_count")
    # XLA:CPU's all-reduce-promotion pass aborts the process ("Invalid binary instruction
    # opcode copy") on the bf16 all-reduces an expert-parallel step has (jax 0.10.2). CPU-only
    # installs skip that pass; GPU/TPU compiles are left untouched.
    if not _accelerator_plugin_installed():
        _add_xla_flag("--xla_disable_hlo_passes=all-reduce-promotion", "all-reduce-promotion")


def _accelerator_plugin_installed() -> bool:
    from importlib import metadata

    names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
    return any(n.startswith(("jax-cuda", "jax_cuda", "libtpu", "jax-rocm", "jax_rocm")) for n in names)
