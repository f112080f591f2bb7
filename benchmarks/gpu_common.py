"""What the H200 scripts share: they run on the GPU or not at all, unless asked for a CPU rehearsal.

``setup(argv)`` (before jax starts): with ``--cpu-rehearsal`` one CPU device, the kernels in their
interpreters, tiny shapes; with ``--compile-only`` a CPU host compiling for XLA:GPU (as the
planner); otherwise ``JAX_PLATFORMS=cuda`` (a ``JAX_PLATFORMS`` naming another platform is
refused), so jax never falls back to CPU devices. ``the_gpu()`` then starts the backend and
returns the first GPU, or ends the process with one ``mlir-train: error:`` line and exit status 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlir_train.runtime import log  # noqa: E402  (imports no jax)
from mlir_train.runtime.platform_setup import configure_platform, quiet_driverless_noise  # noqa: E402

REHEARSAL = "--cpu-rehearsal"
REHEARSAL_HELP = "a CPU rehearsal: one CPU device, tiny shapes, the kernels in their interpreters; no figure is a GPU's"


def fail(message: str) -> None:
    log.error(message, all_processes=True)
    raise SystemExit(2)


_SET_UP: list = []  # the setup() made, once it has run


def require_setup() -> None:
    """For a module the scripts import after :func:`setup`: refuse to go on (and import jax) before it."""
    if not _SET_UP:
        raise RuntimeError("gpu_common.setup(sys.argv) must run before this module is imported: it sets the "
                           "platform before jax starts")


def setup(argv: list[str]):
    """(whether this is a CPU rehearsal, the platform setup); call before jax is imported. Once per
    process: a second call (gpu_h200.py importing gpu_kernels_h200.py) returns the first's."""
    if not _SET_UP:
        _SET_UP.append(_setup(argv))
    return _SET_UP[0]


def _setup(argv: list[str]):
    if REHEARSAL in argv:
        return True, configure_platform("cpu", cpu_devices=1)
    if "--compile-only" in argv:
        return False, configure_platform(compile_only=True)
    requested = os.environ.get("JAX_PLATFORMS", "").strip()
    if requested and requested.split(",")[0].strip().lower() not in ("cuda", "gpu"):
        fail(f"JAX_PLATFORMS={requested}: this script measures the GPU (JAX_PLATFORMS=cuda); {REHEARSAL} runs "
             "it as a CPU rehearsal")
    os.environ["JAX_PLATFORMS"] = "cuda"
    return False, configure_platform()


def the_gpu():
    """The first GPU device, with jax's backend started now; no GPU: one error line, exit status 2.
    What the CUDA plugin prints on a machine without a driver is left out."""
    with quiet_driverless_noise() as control:
        try:
            import jax

            device, problem = jax.devices()[0], None
        except Exception as e:  # noqa: BLE001 - no backend, whatever the reason, is the one error below
            first = (str(e).strip().splitlines() or [""])[0]
            device, problem = None, f"{type(e).__name__}: {first}" if first else "its CUDA backend did not start"
        control["pass_on"] = problem is None and device.platform == "gpu"
    if control["pass_on"]:
        return device
    found = problem or f"its devices are {device.platform}"
    fail(f"no GPU: with JAX_PLATFORMS=cuda jax found none ({found[:200]}); run this on the GPU machine, or pass "
         f"{REHEARSAL} for a CPU rehearsal")
