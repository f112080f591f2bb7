"""Every test runs on 8 fake CPU devices; XLA_FLAGS must be set before jax is imported."""

import os

from mlir_train.runtime.platform_setup import configure_platform

# As every entry point does, first: fake CPU devices and the XLA:CPU workaround (its
# all-reduce-promotion pass aborts on bf16 EP steps), JAX_PLATFORMS=cpu so an installed GPU
# plugin (for the deviceless XLA:GPU tests) stays asleep; and the project's GPU XLA flags, so that
# the in-process deviceless XLA:GPU compiles are those a GPU run gets (XLA:CPU ignores them).
configure_platform("cpu", cpu_devices=8, gpu_flags=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

import tempfile  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Many tests compile the same programs (a Trainer per test); XLA:CPU compiles dominate the
# suite's time on 2 cores, so share them through JAX's persistent compilation cache.
jax.config.update("jax_compilation_cache_dir", os.environ.get("MLIR_TRAIN_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "mlir_train_test_jax_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def h200_devices():
    """8 compile-only XLA:GPU devices of an H200 topology (mlir_train/targets/h200.txtpb), or
    a skip naming what to install where the deviceless GPU compiler is absent."""
    from mlir_train.planner.moe_audit import gpu_topology_devices
    from mlir_train.planner.targets import DEVICE_KINDS

    try:
        return gpu_topology_devices(DEVICE_KINDS["h200"].target_config())
    except Exception as e:  # noqa: BLE001 - any failure to build the topology means no GPU compiler here
        from mlir_train.planner.targets import gpu_compiler_missing

        pytest.skip(f"no deviceless XLA:GPU compiler ({gpu_compiler_missing() or 'the topology failed'}): "
                    f"{type(e).__name__}: {str(e)[:200]}")
