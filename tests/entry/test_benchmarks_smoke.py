"""Benchmarks stay runnable: each one's --quick mode in a subprocess, output checked for its ratios."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def _one_device_unoptimised_env() -> dict:
    """The environment without the fake device count (the script picks its own) and with LLVM's
    optimisation of the CPU code off: the steps are only run, not timed for a figure."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join([f for f in env.get("XLA_FLAGS", "").split()
                                 if not f.startswith("--xla_force_host_platform_device_count")]
                                + ["--xla_backend_optimization_level=0"])
    return env


def _h200(script: str, *args: str, env: dict | None = None, timeout: float = 180):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], cwd=ROOT,
                          env=env or _one_device_unoptimised_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script", ["gpu_h200.py", "gpu_kernels_h200.py"])
@pytest.mark.parametrize("platforms", ["cpu", None])
def test_h200_scripts_refuse_to_run_without_a_gpu(script, platforms):
    """No GPU (none here; or JAX_PLATFORMS naming another platform): one error line and exit status 2,
    never a run on CPU devices."""
    env = _one_device_unoptimised_env()
    env.pop("JAX_PLATFORMS", None)
    if platforms:
        env["JAX_PLATFORMS"] = platforms
    proc = _h200(script, env=env, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert len(err) == 1 and err[0].startswith("mlir-train: error: ") and "--cpu-rehearsal" in err[0], err


def test_gpu_h200_cpu_rehearsal():
    """gpu_h200.py's device and train phases (AOT compile + memory check, bf16 steps, tokens/s, MFU,
    the peak-memory row) at tiny sizes on one CPU device, said to be a rehearsal, ending in its table.

    Its steps are only run, not timed for a figure, so LLVM's optimisation of the CPU code is skipped: that
    halves the compile, which is most of this test's time.
    """
    proc = _h200("gpu_h200.py", "--cpu-rehearsal", "--skip", "self-check", "gpu-vs-xla", "kernels")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "qwen3-30b-a3b-shaped stack: 2 layers" in out and "bf16 compute" in out and "CPU REHEARSAL" in out
    assert re.search(r"^memory per device: .* GiB", out, re.MULTILINE), out
    assert re.search(r"^result: [\d,]+ tokens/s/device, \d+\.\d+ TFLOP/s/device, MFU n/a", out, re.MULTILINE), out
    assert "| phase | what | figure | verdict |" in out
    assert re.search(r"^\| train \| 2 layers, .* tokens/s, .* \| ok \|$", out, re.MULTILINE), out
    assert re.search(r"^\| memory \| measured peak vs compiled \| no memory_stats on cpu", out, re.MULTILINE), out
    assert "| self-check |  | skipped: --skip | - |" in out


@pytest.mark.slow  # 87 s on 2 cores; test_gpu_h200_cpu_rehearsal keeps a rehearsal in the default suite
def test_gpu_h200_cpu_rehearsal_checks():
    """gpu_h200.py's check phases on CPU: the start-up self-check of every GPU kernel at the run's widths
    (interpreted), and the GPU-path-vs-XLA-path step comparison (ragged_dot experts standing in), with
    the kernels read from the program."""
    proc = _h200("gpu_h200.py", "--cpu-rehearsal", "--skip", "train", "kernels", timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    from mlir_train.model.attention import pallas_mha_missing

    kernels = ["MoE expert matmuls \\(mosaic-interpret block kernels\\)", "document-skipping flash attention"]
    if pallas_mha_missing():  # jax 0.12 removed it: a row saying so
        assert re.search(r"^\| self-check \| flash attention \(Pallas-Triton mha\) \| --attention-kernel pallas-mha needs",
                         out, re.MULTILINE), out
    else:
        kernels.append("flash attention \\(Pallas-Triton mha\\)")
    for kernel in kernels:
        assert re.search(rf"^\| self-check \| {kernel}.* at T 128, D 64, F 64 \| max relative error .* \| ok \|$",
                         out, re.MULTILINE), (kernel, out)
    row = re.search(r"^\| gpu-vs-xla \| 2 layers, 2 steps, ragged experts \+ xla attention against padded experts "
                    r"\+ XLA attention \| lm loss (\S+), grad norm (\S+), .* \| ok \|$", out, re.MULTILINE)
    assert row and float(row.group(1)) < 1e-3, out
    assert re.search(r"^\| gpu-vs-xla \| the GPU program's kernels \(read from it\) \| XLA ragged_dot x\d+", out,
                     re.MULTILINE), out


TARGET_CONFIG = """
import gpu_common
gpu_common.setup(["--compile-only"])
from mlir_train.planner.targets import DEVICE_KINDS, compile_only_devices
import gpu_h200_checks as checks
text = checks.target_config_text(compile_only_devices("h200", 1)[0])
assert checks._fields(text) == checks._fields(DEVICE_KINDS["h200"].target_config()), text
print(sorted(checks._fields(text)))
"""


def test_gpu_h200_reads_the_target_config_xla_compiles_for():
    """The device phase's reading of XLA:GPU's GpuTargetConfigProto from a compile's dump, on a
    deviceless H200 (whose description is the planner's h200.txtpb: every key field read back)."""
    from mlir_train.planner.targets import gpu_compiler_missing

    if gpu_compiler_missing():
        pytest.skip(f"deviceless XLA:GPU: {gpu_compiler_missing()}")
    env = _one_device_unoptimised_env()
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "benchmarks"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", TARGET_CONFIG], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "'core_count'" in proc.stdout and "'device_memory_size'" in proc.stdout, proc.stdout


@pytest.mark.slow  # every phase: the kernels interpreted (minutes on 2 cores)
def test_gpu_h200_cpu_rehearsal_every_phase():
    proc = _h200("gpu_h200.py", "--cpu-rehearsal", timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for phase in ("device", "train", "memory", "self-check", "gpu-vs-xla", "kernels"):
        assert re.search(rf"^\| {phase} \| ", proc.stdout, re.MULTILINE), (phase, proc.stdout)


@pytest.mark.slow  # ~20 s; runs HF torch training beside ours
def test_vs_hf_quick():
    out = _run("vs_hf.py", "--quick")
    assert re.search(r"^ratio tiny: mlir-train \d+\.\d+x HF transformers train-step tokens/s", out, re.MULTILINE), out
    assert re.search(r"^ratio tiny GEMM bound: at most \d+\.\d+x HF .* XLA's GEMMs run at \d+\.\d+x torch's",
                     out, re.MULTILINE), out
    # Both sides trained the same model on the same data: equal first-step losses.
    first = re.search(r"^tiny .* (\d+\.\d+) / (\d+\.\d+) ", out, re.MULTILINE)
    assert first and first.group(1) == first.group(2), out


@pytest.mark.slow  # ~15 s; tests/planner/test_flops.py checks the same formulas
def test_flops_check_quick():
    out = _run("flops_check.py", "--quick")
    for case in ("dense", r"moe padded \(dropless\)", r"moe padded, cf 1\.0"):
        m = re.search(rf"^ratio {case}: XLA counts \d+\.\d+x our model FLOPs, (\d+\.\d+)x the predicted", out, re.MULTILINE)
        assert m and abs(float(m.group(1)) - 1) < 0.1, out  # the formula plus known overheads covers XLA's count


def test_checkpoint_benchmark_quick(tmp_path):
    out = _run("checkpoint.py", "--quick", "--dir", str(tmp_path))
    assert re.search(r"^ratio tiny: sync blocks \d+\.\d+x as long as async", out, re.MULTILINE), out
    assert re.search(r"^ratio tiny checksums: \d+\.\d+ of an async save's total", out, re.MULTILINE), out


@pytest.mark.slow
def test_layouts_benchmark_quick():  # ~100 s on 2 cores
    out = _run("layouts.py", "--quick", timeout=600)
    for layout in ("DP8", "TP2xDP4", "EP2xDP4", r"TP2xEP2xDP2\+distopt"):
        assert re.search(rf"^ratio tiny {layout}: \d+\.\d+x DP8 state bytes/device, \d+\.\d+x DP8 step time",
                         out, re.MULTILINE), out


@pytest.mark.slow
def test_pipeline_benchmark_quick():  # ~500 s on 2 cores
    out = _run("pipeline.py", "--quick", timeout=900)
    for schedule in ("1f1b", "gpipe", "1f1b-int4", "circular4"):
        assert re.search(rf"^ratio {schedule}: bubble at M=2 measured \d+\.\d+ \(theory \d+\.\d+\)", out, re.MULTILINE), out


@pytest.mark.slow
def test_gpu_compiled_benchmark_quick():  # ~30 s of CPU per layout; deviceless XLA:GPU
    from mlir_train.planner.targets import gpu_compiler_missing

    if gpu_compiler_missing():
        pytest.skip(f"deviceless XLA:GPU: {gpu_compiler_missing()}")
    out = _run("gpu_compiled.py", "--quick", "--layouts", "dp8,ep8", timeout=900)
    for layout in ("dp8", "ep8"):
        assert re.search(rf"^{layout}\s+\S+\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+yes\s+\d+\.\d+\s+\d+\.\d+x", out, re.MULTILINE), out
    assert "all-to-all" in out


@pytest.mark.slow  # 52 s on 2 cores; test_gpu_h200_cpu_rehearsal keeps a rehearsal in the default suite
def test_gpu_kernels_h200_cpu_rehearsal():
    """gpu_kernels_h200.py's whole path at tiny shapes on CPU (~15 s): every backend row (the Mosaic and
    Pallas kernels in their interpreters), within bf16 error of the float32 reference, repeats bit-identical."""
    proc = _h200("gpu_kernels_h200.py", "--cpu-rehearsal")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "CPU REHEARSAL" in out
    assert "| case | backend | fwd max abs | fwd rel | bwd max abs | bwd rel | bit-identical | fwd+bwd ms | TFLOP/s |" in out
    backends = ["mosaic blocks", "xla ragged_dot", "padded einsum", "pallas mha", "mlir docs-flash", "xla masked"]
    try:
        import tokamax  # noqa: F401
        backends += ["tokamax ragged_dot", "tokamax dot_product_attention"]
    except ImportError:
        assert "skipped: tokamax not importable" in out, out
    for name in backends:
        row = re.search(rf"^\| \w+ smoke \| {name} \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| yes \(2x\) \| [\d.]+ \| ",
                        out, re.MULTILINE)
        assert row, (name, out)
        assert float(row.group(2)) < 3e-2 and float(row.group(4)) < 3e-2, (name, row.group(0))


@pytest.mark.slow
def test_comm_audit_benchmark_quick():  # ~15-25 s of CPU per layout; deviceless XLA:GPU
    from mlir_train.planner.targets import gpu_compiler_missing

    if gpu_compiler_missing():
        pytest.skip(f"deviceless XLA:GPU: {gpu_compiler_missing()}")
    out = _run("comm_audit.py", "--quick", "--layouts", "seed,tp4ep8", timeout=900)
    for layout in ("seed", "tp4ep8"):
        assert re.search(rf"^ratio {layout} flops: \d+\.\d+x Megatron's executed FLOPs", out, re.MULTILINE), out
        assert re.search(rf"^ratio {layout} all-to-all: \d+\.\d+x Megatron's analytic volume", out, re.MULTILINE), out
        assert re.search(rf"^ratio {layout} memory: \d+\.\d+ GiB per device", out, re.MULTILINE), out
    assert re.search(r"overlapped with compute: EP all-to-all \d+/\d+", out), out
    assert "roofline (estimate)" in out and "Megatron-Bridge published: 299 per H100" in out
