"""The ported seed script runs, in its CPU-sized variant, end to end."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_example(script: str, tmp_path, iters: int = 2, **env_extra) -> subprocess.CompletedProcess:
    """``examples/<script>`` in its CPU smoke variant, ``iters`` iterations, its files under ``tmp_path``."""
    env = dict(os.environ, CPU_SMOKE="1", SMOKE_ITERS=str(iters), PREPROCESS_WORKERS="1", SMOKE_DIR=str(tmp_path),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""), **env_extra)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", script)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"iteration {iters:8d}/{iters:8d}" in proc.stdout
    return proc


@pytest.mark.slow
def test_seed_script_cpu_variant(tmp_path):
    proc = _run_example("qwen3_30b_a3b_sft.sh", tmp_path)
    assert "ignoring flags that mean nothing under JAX/XLA: --distributed-backend" in proc.stdout
    assert os.path.exists(tmp_path / "tb" / "metrics.jsonl")


@pytest.mark.slow
def test_lora_variant_cpu(tmp_path):
    """The seed job as a LoRA fine-tune on the demo's trained base (an HF directory): its loss
    falls within the smoke run; adapter-only checkpoints recording their base, a PEFT export."""
    proc = _run_example("qwen3_30b_a3b_lora.sh", tmp_path, iters=10, BASE_ITERS="20")
    losses = [float(m) for m in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", proc.stdout)]
    assert len(losses) == 20 + 10  # the base's lines, then the LoRA run's
    lora = losses[20:]
    assert lora[-1] < lora[0] - 0.2 and sum(lora[-3:]) < sum(lora[:3]) and max(lora) < lora[0] + 0.3, lora
    meta = json.load(open(tmp_path / "save" / "10" / "meta" / "metadata"))
    assert meta["lora"]["dim"] == 16 and meta["lora"]["base"]["kind"] == "hf"
    assert os.path.exists(tmp_path / "peft_adapter" / "adapter_model.safetensors")
