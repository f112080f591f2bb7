"""The ported seed script runs, in its CPU-sized variant, end to end."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_seed_script_cpu_variant(tmp_path):
    env = dict(os.environ, CPU_SMOKE="1", SMOKE_ITERS="2", PREPROCESS_WORKERS="1", SMOKE_DIR=str(tmp_path),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "qwen3_30b_a3b_sft.sh")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "iteration        2/       2" in proc.stdout
    assert "ignoring flags that mean nothing under JAX/XLA: --distributed-backend" in proc.stdout
    assert os.path.exists(tmp_path / "tb" / "metrics.jsonl")
