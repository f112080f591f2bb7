"""Every test runs on 8 fake CPU devices; XLA_FLAGS must be set before jax is imported."""

import os

from mlir_train.runtime.platform_setup import COMPILE_ONLY_XLA_FLAGS, configure_platform

# LLVM -O0 for every XLA:CPU program the suite compiles, in this process and the entry points it
# starts (they inherit XLA_FLAGS): code generation only, the optimized HLO the tests read is the
# same. Compiles are most of the suite's time on 2 cores (tests/train/test_train.py: 131 -> 96 s
# cold, 2026-12-08); tests/helpers.COMPILER_OPTIONS did this per compile for the step tests.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + [
    f"--{k}={v}" for k, v in COMPILE_ONLY_XLA_FLAGS.items() if f"--{k}" not in os.environ.get("XLA_FLAGS", "")]).strip()
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


def _slow_tier() -> dict[str, float]:
    """tests/slow_tier.txt: node id -> its measured seconds."""
    tier = {}
    with open(os.path.join(os.path.dirname(__file__), "slow_tier.txt"), encoding="utf-8") as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                seconds, node = line.split(maxsplit=1)
                tier[node.strip()] = float(seconds.rstrip("s"))
    return tier


def pytest_collection_modifyitems(config, items):
    """Mark the measured slow tier (tests/slow_tier.txt) ``slow``, keeping in each file its cheapest
    listed test where the tier would otherwise leave the file no default test."""
    tier = _slow_tier()
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    for tests in by_file.values():
        listed = [(tier[i.nodeid], i) for i in tests if i.nodeid in tier and not i.get_closest_marker("slow")]
        others = [i for i in tests if i.nodeid not in tier and not i.get_closest_marker("slow")]
        if listed and not others:
            listed.remove(min(listed, key=lambda t: t[0]))
        for _, item in listed:
            item.add_marker(pytest.mark.slow)
