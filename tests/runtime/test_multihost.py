"""Multi-host: two real JAX processes (4 CPU devices each, gloo collectives) train like one,
and save and resume their checkpoint.

Both runs below are ``python -m mlir_train.sft`` subprocesses with the same flags; the
two-process one gets torchrun-style variables (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK).
Each process reads only its half of every global batch, and the mesh spans both processes'
devices, so the losses and gradient norms must match the single-process 8-device run.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from mlir_train.data.config import DEFAULT_DATA, DEFAULT_TOKENIZER
from mlir_train.runtime.distributed import DistributedEnvError, layout_from_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(tmp_path, name: str, cpu_devices: int) -> list[str]:
    return [
        sys.executable, "-m", "mlir_train.sft",
        "--model-name", "qwen3-moe-tiny", "--tokenizer-type", "HFTokenizer", "--hf-tokenizer-path", DEFAULT_TOKENIZER,
        "--data-path", DEFAULT_DATA, "--split", "100,0,0", "--chat-template", "alpaca", "--packing-sft-data",
        "--seq-length", "64", "--global-batch-size", "8", "--micro-batch-size", "1", "--train-iters", "3",
        "--eval-interval", "0", "--lr", "3e-3", "--lr-warmup-iters", "1", "--log-interval", "1",
        "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
        "--cpu-devices", str(cpu_devices),
        "--data-cache-path", str(tmp_path / name / "cache"), "--tensorboard-dir", str(tmp_path / name / "tb"),
    ]


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "WORLD_SIZE", "RANK", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **extra)
    return env


def _metrics(tmp_path, name: str) -> list[dict]:
    return [r for r in map(json.loads, open(tmp_path / name / "tb" / "metrics.jsonl")) if "lm loss" in r]


def _launch(runs) -> list[str]:
    """Run the (argv, env) processes at once; their stdouts, after checking they all exit 0."""
    procs = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, env in runs]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=400))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
    return [out for out, _ in outs]


def _two_processes(tmp_path, name: str, *extra: str):
    port = str(_free_port())
    return [(_argv(tmp_path, name, 4) + list(extra),
             _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(r))) for r in range(2)]


@pytest.mark.slow  # ~90 s: two JAX processes train, save and resume; the other tests here and
# tests/checkpoint/test_checkpoint_integrity.py keep two-process runs in the default suite
def test_two_processes_match_one_and_resume_from_their_checkpoint(tmp_path):
    """The 2-process job runs 2 iterations and stops (--exit-interval 2), saving a checkpoint
    both processes write their shards of; a second 2-process job resumes it for iteration 3.
    Together they match the uninterrupted 1-process run."""
    ckpt = str(tmp_path / "ckpt")
    # The 1-process reference runs beside the first 2-process job.
    outs = _launch([(_argv(tmp_path, "single", 8), _env())]
                   + _two_processes(tmp_path, "multi", "--save", ckpt, "--exit-interval", "2"))
    rank0, rank1 = outs[1:]
    assert "8 cpu devices" in rank0 and "iteration        2/       3" in rank0
    assert "stopped by --exit-interval 2 after iteration 2" in rank0
    # Only process 0 prints (gloo's own connection lines come from C++, on every process).
    assert "mlir-train" not in rank1 and "iteration" not in rank1, rank1
    assert sorted(os.listdir(ckpt)) == ["2"]
    rank0 = _launch(_two_processes(tmp_path, "resumed", "--load", ckpt, "--save", ckpt))[0]
    assert "loading full state from checkpoint" in rank0 and "iteration        3/       3" in rank0
    assert sorted(os.listdir(ckpt)) == ["2", "3"]

    one = _metrics(tmp_path, "single")
    two = _metrics(tmp_path, "multi") + _metrics(tmp_path, "resumed")
    # Process 1's writer is off: one line per iteration in the shared log directory.
    assert [r["iteration"] for r in one] == [r["iteration"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert b["lm loss"] == pytest.approx(a["lm loss"], rel=1e-5), (a, b)
        assert b["grad-norm"] == pytest.approx(a["grad-norm"], rel=1e-4), (a, b)


@pytest.mark.parametrize("env, match", [
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h"}, r"RANK=2 is out of range for WORLD_SIZE=2"),
    ({"NNODES": "4", "NODE_RANK": "1"}, r"MASTER_ADDR is not set"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "h"}, r"RANK is not set"),
    ({"WORLD_SIZE": "16", "RANK": "3", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "h"}, r"one process per host"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, r"JAX_PROCESS_ID not set"),
    ({"WORLD_SIZE": "two"}, r"not an integer"),
])
def test_inconsistent_launcher_env_is_refused(env, match):
    with pytest.raises(DistributedEnvError, match=match):
        layout_from_env(env)


def test_launcher_env_layouts():
    seed = {"NNODES": "4", "NODE_RANK": "3", "WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "6000"}
    layout = layout_from_env(seed)
    assert (layout.num_processes, layout.process_id, layout.coordinator) == (4, 3, "10.0.0.1:6000")
    assert layout_from_env({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "a"}).coordinator == "a:29500"
    jax_env = {"JAX_COORDINATOR_ADDRESS": "c:7", "JAX_NUM_PROCESSES": "8", "JAX_PROCESS_ID": "5", "WORLD_SIZE": "1"}
    assert layout_from_env(jax_env).process_id == 5
    slurm = layout_from_env({"SLURM_NTASKS": "2", "SLURM_PROCID": "1"})
    assert (slurm.num_processes, slurm.process_id, slurm.coordinator) == (2, 1, None)
    assert layout_from_env({"WORLD_SIZE": "1", "RANK": "0"}).num_processes == 1
    assert layout_from_env({}).num_processes == 1
