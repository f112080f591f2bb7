"""Benchmarks stay runnable: each one's --quick mode in a subprocess, output checked for its ratios."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str, timeout: float = 120) -> str:
    env = dict(os.environ)
    # Benchmarks run on the real devices, not the 8 fake CPU devices conftest sets for tests.
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_moe_benchmark_quick():
    out = _run("moe.py", "--quick")
    assert "matmul peak" in out
    for impl in ("dense", "padded", "ragged"):
        assert re.search(rf"^ratio tiny {impl}: \d+\.\d+x dense reference tokens/s, \d+\.\d+ of matmul peak$",
                         out, re.MULTILINE), out


def test_gpu_h200_smoke():
    """gpu_h200.py's whole path (AOT compile + memory check, bf16 steps, tokens/s, MFU line) at tiny sizes on CPU.

    Its steps are only run, not timed for a figure, so LLVM's optimisation of the CPU code is skipped: that
    halves the compile, which is most of this test's time.
    """
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join([f for f in env.get("XLA_FLAGS", "").split()
                                 if not f.startswith("--xla_force_host_platform_device_count")]
                                + ["--xla_backend_optimization_level=0"])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_h200.py"), "--smoke"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "qwen3-30b-a3b-shaped stack: 2 layers" in proc.stdout and "bf16 compute" in proc.stdout
    assert re.search(r"^memory per device: .* GiB", proc.stdout, re.MULTILINE), proc.stdout
    assert re.search(r"^result: [\d,]+ tokens/s/device, \d+\.\d+ TFLOP/s/device, MFU n/a", proc.stdout, re.MULTILINE), proc.stdout
