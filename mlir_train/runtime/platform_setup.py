"""Process-wide platform setup: which backend this process runs on, and the XLA settings for it.

Call :func:`configure_platform` first in every entry point (``sft``, ``plan``, ``convert``, the
benchmarks, ``tests/conftest.py``), before anything imports jax: ``XLA_FLAGS`` and
``JAX_PLATFORMS`` are read once, when the first backend initialises. This module imports no jax at import time.

The platform is decided from what the process will run on, never from which packages are
installed: a CPU-only machine with ``jax-cuda12-plugin`` installed (for deviceless XLA:GPU
compiles, see :mod:`mlir_train.planner.targets`) must behave exactly as one without it.

* ``JAX_PLATFORMS`` set: its first entry decides (``cuda``/``rocm``/``gpu`` -> ``gpu``).
* Otherwise an accelerator counts only if its plugin is installed *and* the machine has one:
  a loadable CUDA driver (``libcuda.so.1``) and an ``/dev/nvidia<N>`` device for CUDA,
  ``/dev/kfd`` for ROCm, ``/dev/accel*`` or ``/dev/vfio/<N>`` for TPU.
* No accelerator: ``JAX_PLATFORMS=cpu`` is set, so an installed GPU plugin is never
  initialised (it would print a "Unable to load CUDA" traceback and then fall back to CPU).
  With a CUDA plugin installed (the test extra's, for deviceless compiles), its discovery is
  done here, once, with the lines the plugin's libraries print when no driver is found
  filtered out of stderr (:func:`_quiet_plugin_discovery`): a CPU run prints no plugin noise,
  and the platform line says what was found.

What each platform gets (a setting the user already has in ``XLA_FLAGS`` or the environment
is kept as the user wrote it, and reported as kept):

* CPU: ``--xla_force_host_platform_device_count=N`` (fake devices, default 8) and
  ``--xla_disable_hlo_passes=all-reduce-promotion``: XLA:CPU's all-reduce-promotion pass
  aborts the process ("Invalid binary instruction opcode copy") on the bf16 all-reduces an
  expert-parallel step has (jax 0.10.2). With ``callback_threads`` (``--code-paths gpu``, whose
  Mosaic-GPU kernels run in JAX's interpreter from host callbacks, one device's at a time:
  ``model/kernels/mosaic_moe.py``) also ``PJRT_NPROC`` = 4 x the device count, the size of
  XLA:CPU's thread pools (8 threads here otherwise): a callback holds a pool thread while it
  waits for its turn, and each callback's ``device_put`` of its operands needs a free one. With
  the interpreter inside the step, EP4 x TP2 deadlocked on the default pools with every pool
  thread blocked (gdb: 6 in ``BlockUntilReady`` of a callback operand, 2 in the interpreter's
  end-of-kernel barrier), the class of issue 39's LAPACK hang. And XLA:CPU's collective timeouts
  raised (:data:`CALLBACK_XLA_FLAGS`): peers wait at collectives while the kernels take turns.
* GPU: :data:`GPU_XLA_FLAGS` and :data:`GPU_ENV`, the settings JAX-on-GPU trainers run with
  (JAX's "GPU performance tips", NVIDIA JAX-Toolbox's "GPU performance" page, MaxText's GPU
  configs): the latency-hiding scheduler (collectives overlap compute instead of running in
  program order), collective combining up to 128 MiB per op (fewer, larger NCCL calls), the
  pipelined reduce-scatter / all-reduce of scanned layers, but not the pipelined all-gather (it
  duplicated the forward of the gradient-accumulation loop's micro-batch), up to 4 collectives in flight at once (the scheduler's default is
  one), a high-priority stream for collectives, and the BFC pool at 95 % of
  device memory (JAX's default is 75 %; the planner's usable fraction is the same 95 %).
* Compile-only (the planner): CPU, plus the GPU flags (so the deviceless XLA:GPU compile is the
  program ``sft`` would run) and no LLVM optimisation (nothing compiled there ever runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import glob
import os
import sys

# JAX-on-GPU users expect these; each is an XLA flag of jaxlib 0.10.2. An unknown flag name aborts
# the process, so one the installed jaxlib lacks is left out, and said so (_unknown_to_jaxlib).
GPU_XLA_FLAGS: dict[str, str] = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_highest_priority_async_stream": "true",
    "xla_gpu_all_reduce_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_all_gather_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(128 * 2**20),
    # Off: XLA's collective pipeliner, moving the distributed optimizer's per-micro-batch
    # parameter all-gathers into the previous iteration of the accumulation loop, cloned the
    # micro-batch's whole forward layer scan (optimized HLO: two forward while loops per backward
    # one), so the step ran 4 passes where Megatron runs 3: TP4 EP8 compiled 1.53x Megatron's
    # executed FLOPs and 6.77x its EP all-to-all bytes, 1.15x and 4.75x without it, and 108.7 ->
    # 93.1 GiB (benchmarks/README.md, communication audit; tests/planner/test_gpu_plan.py).
    "xla_gpu_enable_pipelined_all_gather": "false",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    # Up to 4 async collectives in flight at once (XLA's default: 1): the latency-hiding
    # scheduler then overlaps the per-tick gradient all-reduces with the next matmuls as well as
    # the SP gathers (seed layout: 4619 of 4819 expert-axis all-reduces have matmul work between
    # start and done instead of 198; +0.5 GiB of buffers; benchmarks/README.md, comm audit).
    "xla_gpu_experimental_parallel_collective_overlap_limit": "4",
}
# Fraction of device memory JAX's allocator takes up front; the rest is for the CUDA context,
# NCCL buffers and cuBLAS workspaces. The planner fits a step into the same fraction.
GPU_MEM_FRACTION = 0.95
GPU_ENV: dict[str, str] = {"XLA_PYTHON_CLIENT_MEM_FRACTION": str(GPU_MEM_FRACTION)}
CPU_XLA_FLAGS: dict[str, str] = {"xla_disable_hlo_passes": "all-reduce-promotion"}
# Nothing the planner compiles runs: skip LLVM's optimisation (buffer sizes come from HLO).
COMPILE_ONLY_XLA_FLAGS: dict[str, str] = {
    "xla_backend_optimization_level": "0", "xla_llvm_disable_expensive_passes": "true"}
DEFAULT_CPU_DEVICES = 8
# XLA:CPU's thread pools per fake device under ``callback_threads`` (module docstring).
CALLBACK_THREADS_PER_DEVICE = 4
# Under ``callback_threads`` the devices take turns in the interpreter, so a device can wait at a
# collective for minutes while its peers' kernels run: XLA:CPU's rendezvous would warn after 20 s
# and abort the process after 40 s (seen on the seed layout).
CALLBACK_XLA_FLAGS: dict[str, str] = {"xla_cpu_collective_call_warn_stuck_timeout_seconds": "600",
                                      "xla_cpu_collective_call_terminate_timeout_seconds": "3600",
                                      "xla_cpu_collective_timeout_seconds": "3600"}


@dataclasses.dataclass(frozen=True)
class PlatformSetup:
    platform: str                      # "cpu" | "gpu" | "tpu": what this process runs on
    reason: str                        # how that was decided
    applied: tuple[str, ...] = ()      # settings this module added ("--flag=value", "VAR=value")
    kept: tuple[str, ...] = ()         # settings of ours the user had already set: theirs win
    compile_only: bool = False
    skipped: tuple[str, ...] = ()      # our GPU flags this jaxlib does not define (left out)

    def describe(self) -> str:
        """One line for the log: the platform and every setting added or left to the user."""
        parts = [f"platform {self.platform} ({self.reason})"]
        if self.applied:
            parts.append("applied " + " ".join(self.applied))
        if self.kept:
            parts.append("kept the user's " + " ".join(self.kept))
        if self.skipped:
            parts.append("left out (unknown to this jaxlib) " + " ".join(self.skipped))
        return "; ".join(parts)


_CURRENT: PlatformSetup | None = None


def current() -> PlatformSetup | None:
    """What :func:`configure_platform` decided in this process (None if it was not called)."""
    return _CURRENT


def _flag_names(xla_flags: str) -> set[str]:
    return {f.lstrip("-").split("=", 1)[0] for f in xla_flags.split()}


def _has_cuda_device() -> bool:
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _unknown_to_jaxlib(names) -> set[str]:
    """Which XLA flag names the installed jaxlib does not define (an unknown name in XLA_FLAGS
    aborts the process, and flags come and go between XLA versions): their names are looked for
    in jaxlib's shared libraries, without importing it. Empty if jaxlib cannot be read."""
    import importlib.util
    import mmap

    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return set()
    missing = set(names)
    libraries = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.so")),
                       key=os.path.getsize, reverse=True)
    try:
        for path in libraries:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                missing = {n for n in missing if m.find(n.encode()) < 0}
            if not missing:
                break
    except (OSError, ValueError):
        return set()
    return missing


def _installed_plugins() -> set[str]:
    from importlib import metadata

    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions()}
    kinds = set()
    if any(n.startswith("jax-cuda") for n in names):
        kinds.add("cuda")
    if any(n.startswith("jax-rocm") for n in names):
        kinds.add("rocm")
    if any(n.startswith("libtpu") for n in names):
        kinds.add("tpu")
    return kinds


def detect_platform(env: os._Environ | dict | None = None) -> tuple[str, str]:
    """(platform, reason) this process will run on, decided without starting a backend."""
    env = os.environ if env is None else env
    requested = env.get("JAX_PLATFORMS", "").strip()
    if requested:
        first = requested.split(",")[0].strip().lower()
        platform = "gpu" if first in ("cuda", "rocm", "gpu") else first
        return platform, f"JAX_PLATFORMS={requested}"
    plugins = _installed_plugins()
    if "cuda" in plugins and _has_cuda_device():
        return "gpu", "CUDA plugin and an NVIDIA device"
    if "rocm" in plugins and os.path.exists("/dev/kfd"):
        return "gpu", "ROCm plugin and an AMD device"
    if "tpu" in plugins and (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
        return "tpu", "libtpu and a TPU device"
    if plugins:
        return "cpu", f"{'/'.join(sorted(plugins))} plugin installed but no such device here"
    return "cpu", "no accelerator plugin installed"


def configure_platform(platform: str | None = None, *, cpu_devices: int | None = None,
                       compile_only: bool = False, gpu_flags: bool = False,
                       callback_threads: bool = False) -> PlatformSetup:
    """Decide the platform and set ``XLA_FLAGS`` / the environment for it; call before jax starts.

    ``platform`` forces one (``"cpu"`` for the tests and the planner); None detects it
    (:func:`detect_platform`). ``cpu_devices`` is the fake CPU device count (default 8).
    ``compile_only`` (the planner): CPU host, plus the GPU flags for deviceless XLA:GPU compiles
    and no LLVM optimisation. ``gpu_flags``: the GPU flags too, on any platform (the tests: their
    in-process deviceless XLA:GPU compiles get what a GPU run gets; XLA:CPU ignores them).
    ``callback_threads`` (``--code-paths gpu`` on CPU): XLA:CPU's pools sized for the Mosaic-GPU
    interpreter's blocking callbacks. The first call decides for the process: later calls return its result.
    """
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT  # the first call decides (e.g. conftest's, before an entry point's import)
    if "jax._src.xla_bridge" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():  # too late to change anything: say so
            import jax

            _CURRENT = PlatformSetup(jax.default_backend(), "a JAX backend had already started; "
                                     "XLA_FLAGS left as they were", compile_only=compile_only)
            return _CURRENT
    _CURRENT = apply_platform_settings(os.environ, platform, cpu_devices=cpu_devices, compile_only=compile_only,
                                       gpu_flags=gpu_flags, callback_threads=callback_threads)
    if _CURRENT.platform == "cpu" and "cuda" in _installed_plugins():
        _quiet_plugin_discovery()
    return _CURRENT


# What the CUDA plugin's libraries print, each with its own absl, when loaded on a machine without
# a driver (jax 0.10.2): expected on a CPU host, and nothing a user can act on.
_DRIVERLESS_NOISE = ("All log messages before absl::InitializeLog() is called are written to STDERR",
                     "Could not find cuda drivers on your machine, GPU will not be used.")


def _quiet_plugin_discovery() -> None:
    """Import jax and register its PJRT plugins now (no backend starts: ``XLA_FLAGS`` and the
    CPU device count are still read later, when the first backend does), with file descriptor 2
    redirected, then pass on every captured line except :data:`_DRIVERLESS_NOISE`. Registration
    is jax's own, done once per process; should its private entry point move, plain discovery
    happens later as before, and only the noise comes back."""
    with quiet_driverless_noise():
        try:
            import jax  # noqa: F401 - its import loads the plugin's libraries
            from jax._src import xla_bridge

            getattr(xla_bridge, "_discover_and_register_pjrt_plugins", lambda: None)()
        except Exception:  # noqa: BLE001 - discovery then happens at first use, as without us
            pass


@contextlib.contextmanager
def quiet_driverless_noise():
    """File descriptor 2 captured while the block runs (what C++ libraries print too); then every
    captured line except :data:`_DRIVERLESS_NOISE` is passed on to stderr, unless the block sets
    the yielded dict's ``"pass_on"`` to False (it reports the failure its own way)."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        control = {"pass_on": True}
        try:
            yield control
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = drop_driverless_noise(captured.read().decode(errors="replace"))
            if kept and control["pass_on"]:
                sys.stderr.write(kept)


def drop_driverless_noise(text: str) -> str:
    """``text`` without the lines of :data:`_DRIVERLESS_NOISE`; every other line kept."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not any(noise in line for noise in _DRIVERLESS_NOISE))


def apply_platform_settings(env, platform: str | None = None, *, cpu_devices: int | None = None,
                            compile_only: bool = False, gpu_flags: bool = False,
                            callback_threads: bool = False) -> PlatformSetup:
    """The work of :func:`configure_platform` on an environment mapping (``os.environ`` or a
    dict, for tests): decide the platform, add our settings the user has not set, say which."""
    if compile_only:
        platform = "cpu"
    if platform is None:
        platform, reason = detect_platform(env)
    else:
        reason = "compile-only host" if compile_only else "requested"
    flags = env.get("XLA_FLAGS", "")
    present = _flag_names(flags)
    wanted: dict[str, str] = {}
    env_wanted: dict[str, str] = {}
    if platform == "cpu":
        env.setdefault("JAX_PLATFORMS", "cpu")  # an installed GPU plugin stays asleep
        wanted["xla_force_host_platform_device_count"] = str(cpu_devices or DEFAULT_CPU_DEVICES)
        wanted.update(CPU_XLA_FLAGS)
        if callback_threads:
            env_wanted["PJRT_NPROC"] = str(CALLBACK_THREADS_PER_DEVICE * (cpu_devices or DEFAULT_CPU_DEVICES))
            wanted.update(CALLBACK_XLA_FLAGS)
    if platform == "gpu" or compile_only or gpu_flags:
        wanted.update(GPU_XLA_FLAGS)
    if platform == "gpu":
        env_wanted.update(GPU_ENV)
    if compile_only:
        wanted.update(COMPILE_ONLY_XLA_FLAGS)
    applied, kept, skipped = [], [], []
    unknown = _unknown_to_jaxlib([n for n in wanted if n in GPU_XLA_FLAGS])
    for name, value in wanted.items():
        if name in unknown:
            skipped.append(f"--{name}")
            continue
        if name == "xla_disable_hlo_passes" and name in present:  # a list: add ours to the user's
            theirs = [f for f in flags.split() if f.lstrip("-").startswith(name + "=")][-1]
            passes = theirs.split("=", 1)[1].split(",")
            if value not in passes:
                flags = flags.replace(theirs, f"--{name}={','.join(passes + [value])}")
                applied.append(f"--{name}+={value}")
            continue
        if name in present:
            kept.append(f"--{name}")
            continue
        flags += f" --{name}={value}"
        applied.append(f"--{name}={value}")
    env["XLA_FLAGS"] = flags.strip()
    for name, value in env_wanted.items():
        if name in env:
            kept.append(name)
        else:
            env[name] = value
            applied.append(f"{name}={value}")
    return PlatformSetup(platform, reason, tuple(applied), tuple(kept), compile_only, tuple(skipped))


def platform_name(devices=None) -> str:
    """The one name of a platform: "cpu", "gpu" or "tpu", for ``devices`` (a device, a mesh, or
    devices; None: JAX's default devices). CUDA and ROCm devices are "gpu". A mesh of compile-only
    XLA:GPU devices built on a CPU host (:mod:`mlir_train.planner.targets`) is "gpu": what the
    program is compiled for, not ``jax.default_backend()``."""
    if devices is None:
        import jax

        devices = jax.devices()[:1]
    elif hasattr(devices, "devices") and hasattr(devices, "axis_names"):  # a mesh
        devices = devices.devices.flat
    elif hasattr(devices, "platform"):  # one device
        devices = [devices]
    platforms = {d.platform for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"devices of several platforms: {sorted(platforms)}")
    platform = platforms.pop()
    return "gpu" if platform in ("cuda", "rocm") else platform


def mesh_platform(mesh) -> str:
    """The platform a mesh's devices compile for (:func:`platform_name` of the mesh)."""
    return platform_name(mesh)


def compile_target(mesh):
    """A context to trace and compile a program for ``mesh`` in: ``jax.default_device`` of its
    first device when it is a GPU mesh, else nothing. Kernel libraries that pick their kernel from
    the default device at trace time (tokamax) then pick the GPU one for a mesh of compile-only
    XLA:GPU devices built on a CPU host too (deviceless H200 compiles), not XLA's dense path."""
    import contextlib

    import jax

    if mesh is None or mesh_platform(mesh) != "gpu":
        return contextlib.nullcontext()
    return jax.default_device(mesh.devices.flat[0])

