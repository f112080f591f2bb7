"""Accelerator kinds the planner knows, and compile-only XLA:GPU devices for them.

Each NVIDIA kind has a device description under ``mlir_train/targets/<kind>.txtpb`` (a text
``GpuTargetConfigProto``: SM count, clocks, memory, compute capability, cuDNN version), taken
from openxla/xla ``xla/backends/gpu/target_config/specs/`` (file, commit and the one field
jaxlib 0.10.2 refuses are noted at the top of each file). With a jax CUDA plugin installed
(``jax-cuda12-plugin`` + ``jax-cuda12-pjrt`` + ``nvidia-cuda-nvcc-cu12`` for jax 0.10.2,
``jax-cuda13-plugin`` + ``jax-cuda13-pjrt`` + CUDA 13's ``nvidia-cuda-nvcc`` for jax 0.12.1;
:func:`cuda_plugin`, :func:`ptxas_path`), jax compiles for such a device on a CPU-only machine: :func:`compile_only_devices` returns N of them, to build a
``Mesh`` from and ``jit(...).lower(...).compile()`` against. ``JAX_PLATFORMS=cpu`` must be set
before any backend starts (:func:`mlir_train.runtime.platform_setup.configure_platform` does it), or
the plugin tries to find a real GPU.

Memory is the description's ``device_memory_size``: what the driver reports as total memory
(H100 80GB HBM3: 79.1 GiB; H200: 141.0 GiB; B200: 178.4 GiB). Peaks are NVIDIA's dense
(no-sparsity) bf16 tensor-core figures for the SXM parts: H100 and H200 989 TFLOP/s (H100 /
H200 datasheets, 1,979 "with sparsity"), B200 2,250 TFLOP/s (HGX B200 datasheet, 4.5 PFLOPS
sparse); :func:`spec_bf16_tflops` recomputes them from the description's matrix-unit rates as a
cross-check (989 / 989 / 2,225). The Kunlun P800 (96 GB) has no XLA:GPU target: the planner
reports it by memory only, and its peak is not published in a form we could confirm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import re
import shutil
import sys
import tempfile

from mlir_train.runtime.platform_setup import GPU_MEM_FRACTION

GIB = 2**30
# What JAX's allocator may use of a GPU (XLA_PYTHON_CLIENT_MEM_FRACTION, as sft sets it): a plan
# fits when it needs at most this fraction of the device memory.
USABLE_FRACTION = GPU_MEM_FRACTION
_SPEC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    name: str                    # the --device-kind value
    description: str             # the device's own name
    memory_bytes: int            # total device memory
    bf16_tflops: float | None    # dense bf16 peak, None where unknown
    spec_file: str | None        # GpuTargetConfigProto text under mlir_train/targets/, None: no XLA:GPU target
    source: str                  # where memory and peak come from

    @property
    def compiles_for_gpu(self) -> bool:
        return self.spec_file is not None

    def target_config(self) -> str:
        if self.spec_file is None:
            raise ValueError(f"--device-kind {self.name}: {self.description} has no XLA:GPU target description")
        with open(os.path.join(_SPEC_DIR, self.spec_file)) as f:
            return f.read()


DEVICE_KINDS: dict[str, DeviceKind] = {
    "h100": DeviceKind("h100", "NVIDIA H100 80GB HBM3 (SXM)", 84942979072, 989.0, "h100.txtpb",
                       "memory: openxla h100_sxm.txtpb device_memory_size; peak: NVIDIA H100 datasheet, bf16 dense"),
    "h200": DeviceKind("h200", "NVIDIA H200 141GB HBM3e (SXM)", 151397597184, 989.0, "h200.txtpb",
                       "memory: openxla h200.txtpb device_memory_size; peak: NVIDIA H200 datasheet, bf16 dense"),
    "b200": DeviceKind("b200", "NVIDIA B200 (HGX)", 191514411008, 2250.0, "b200.txtpb",
                       "memory: openxla b200.txtpb device_memory_size; peak: NVIDIA HGX B200 datasheet, bf16 dense"),
    "p800": DeviceKind("p800", "Kunlun P800 (96 GB)", 96 * 10**9, None, None,
                       "memory: Kunlunxin's 96 GB; no XLA:GPU target, no confirmed peak (pass --peak-tflops)"),
}


def device_kind(name: str) -> DeviceKind:
    try:
        return DEVICE_KINDS[name.lower()]
    except KeyError:
        raise ValueError(f"--device-kind {name}: unknown; known kinds: {', '.join(DEVICE_KINDS)}") from None


def spec_bf16_tflops(kind: DeviceKind) -> float:
    """Dense bf16 peak from the description: SMs x tensor units per SM x bf16 ops per clock x
    clock x 2 (an op is a multiply-add). XLA's key for bf16 in ``rate_infos`` is its
    PrimitiveType number, BF16 = 16."""
    text = kind.target_config()
    cores = int(re.search(r"core_count:\s*(\d+)", text).group(1))
    matrix = text[text.index("matrix_unit_description"):]
    block = re.search(r"key:\s*16\s*value\s*\{([^}]*)\}", matrix).group(1)
    clock = float(re.search(r"clock_rate_ghz:\s*([\d.]+)", block).group(1))
    units = int(re.search(r"units_per_core:\s*(\d+)", block).group(1))
    ops = int(re.search(r"ops_per_clock:\s*(\d+)", block).group(1))
    return 2 * cores * units * ops * clock / 1e3


# The CUDA plugin's module per CUDA major version (jax-cuda12-plugin, published up to jax 0.12.0.1: the
# project's jax 0.10.2 set; jax-cuda13-plugin, from jax 0.7.2 on: the only one for jax 0.12.1), and the directories where the nvcc wheels put
# ``ptxas``: nvidia-cuda-nvcc-cu12 in ``nvidia/cuda_nvcc/bin``, CUDA 13's nvidia-cuda-nvcc in
# ``nvidia/cu13/bin``.
CUDA_PLUGINS = ("xla_cuda13", "xla_cuda12")
_PTXAS_PACKAGES = ("nvidia.cu13", "nvidia.cuda_nvcc")


def cuda_plugin() -> str | None:
    """The installed jax CUDA plugin's module under ``jax_plugins`` (``xla_cuda13`` or
    ``xla_cuda12``), or None."""
    if importlib.util.find_spec("jax_plugins") is None:
        return None
    for name in CUDA_PLUGINS:
        if importlib.util.find_spec(f"jax_plugins.{name}") is not None:
            return name
    return None


def ptxas_path() -> str | None:
    """``ptxas`` from an nvidia nvcc wheel (CUDA 13's ``nvidia-cuda-nvcc`` or
    ``nvidia-cuda-nvcc-cu12``), else from PATH; None where there is none."""
    for package in _PTXAS_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except ImportError:  # "nvidia" itself absent
            spec = None
        for root in (spec.submodule_search_locations or []) if spec else []:
            if os.path.exists(os.path.join(root, "bin", "ptxas")):
                return os.path.join(root, "bin", "ptxas")
    return shutil.which("ptxas")


def _install_hint() -> str:
    """What to pip install for deviceless compiles with the installed jax: the CUDA 12 set up to
    jax 0.10 (as the test extra pins it), the CUDA 13 set after."""
    try:
        from importlib import metadata

        version = metadata.version("jax")
    except Exception:  # noqa: BLE001 - no jax metadata: name the newer set
        version = "0.12"
    major_minor = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if major_minor and major_minor <= (0, 10):
        return f"jax-cuda12-plugin=={version} jax-cuda12-pjrt=={version} nvidia-cuda-nvcc-cu12"
    return f"jax-cuda13-plugin=={version} jax-cuda13-pjrt=={version} nvidia-cuda-nvcc"


def gpu_compiler_missing() -> str | None:
    """Why deviceless XLA:GPU compiles cannot run here, or None when they can."""
    if cuda_plugin() is None:
        return f"no jax CUDA plugin is installed (jax-cuda13-plugin or jax-cuda12-plugin; pip install {_install_hint()})"
    if ptxas_path() is None:
        return ("ptxas not found (pip install nvidia-cuda-nvcc for CUDA 13 or nvidia-cuda-nvcc-cu12 for CUDA 12, "
                "or put CUDA's bin directory on PATH)")
    return None


@contextlib.contextmanager
def _quiet_stderr():
    """Hide what the CUDA plugin prints on a machine without a driver ("Could not find cuda
    drivers ...", at C++ level, so redirected by file descriptor); replayed if the call fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def topology_name(num_devices: int, devices_per_host: int = 8) -> str:
    """``slices x hosts x devices per host`` for N GPUs in hosts of 8 (fewer on one host)."""
    if num_devices <= devices_per_host:
        return f"1x1x{num_devices}"
    if num_devices % devices_per_host:
        raise ValueError(f"{num_devices} GPUs do not fill hosts of {devices_per_host}")
    return f"1x{num_devices // devices_per_host}x{devices_per_host}"


@functools.lru_cache(maxsize=None)
def compile_only_devices(kind: str, num_devices: int) -> tuple:
    """``num_devices`` compile-only XLA:GPU devices of ``kind`` (hosts of 8), for a ``Mesh`` whose
    programs are compiled, never run. Needs the GPU compiler (:func:`gpu_compiler_missing`)."""
    spec = device_kind(kind)
    missing = gpu_compiler_missing()
    if missing:
        raise RuntimeError(f"cannot compile for {spec.description}: {missing}")
    from jax.experimental import topologies

    with _quiet_stderr():
        topo = topologies.get_topology_desc(platform="cuda", target_config=spec.target_config(),
                                            topology=topology_name(num_devices))
    devices = tuple(topo.devices)
    if len(devices) != num_devices:
        raise RuntimeError(f"asked XLA for {num_devices} {kind} devices and got {len(devices)}")
    return devices


def choose_compiler(kind: DeviceKind, *, force_cpu: bool = False) -> tuple[str | None, str | None]:
    """(XLA:GPU target kind or None for XLA:CPU, the note saying why not XLA:GPU)."""
    if not kind.compiles_for_gpu:
        return None, (f"{kind.description} has no XLA:GPU target: planned by memory only (exact state bytes from an "
                      "XLA:CPU compile, the analytic estimate for the verdict)")
    if force_cpu:
        return None, "--xla-cpu: XLA:CPU compile, verdict from the analytic estimate"
    missing = gpu_compiler_missing()
    if missing:
        return None, f"the XLA:GPU compiler is not available ({missing}): XLA:CPU compile, verdict from the analytic estimate"
    return kind.name, None
