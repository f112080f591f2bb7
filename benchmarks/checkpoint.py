"""How long a checkpoint save blocks training: Orbax async vs synchronous, tiny and medium model.

    python benchmarks/checkpoint.py [--quick] [--rounds 3] [--dir DIR]
    python benchmarks/checkpoint.py --processes 2 --gb 2 [--rounds 2] [--dir DIR]

For each model the full training state (float32 master weights + AdamW moments, the trainer's
own shardings on all local devices, distributed optimizer) is saved through
``mlir_train.checkpoint.orbax.CheckpointManager`` with ``async_save=True`` and ``False``. Reported per
mode, median over rounds after one warm-up save (the first save compiles Orbax's per-shard copy
programs): *blocked* = the time ``save()`` takes to return, i.e. how long the training loop
cannot dispatch its next step; *total* = until the files are committed and their checksums
written (``wait()``); *sums* = hashing every file into ``checksums.json`` (part of *total*, in
the background thread); *verify* = re-hashing the step as a load does. The ratio lines are sync
blocked / async blocked (> 1: async blocks the step that much less) and checksum time / total.

``--processes N`` runs N JAX processes on this machine (``--cpu-devices`` 8/N each, gloo, as
tests/runtime/test_multihost.py) saving one state of ``--gb`` GB of float32 arrays sharded over
all 8 devices, so every process writes its share: *total* is ``save()`` + ``wait()`` (files,
checksums, commit) on every process, *verify* is ``orbax.verified_step`` (what ``--load`` runs:
the checksums checked, the step agreed on by all processes); the slowest process's time counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from mlir_train.runtime.platform_setup import configure_platform  # (imports no jax)

# Before jax starts: the platform's XLA settings (a --processes worker: its share of 8 CPU devices).
configure_platform(cpu_devices=8 // int(os.environ["WORLD_SIZE"]) if "--worker" in sys.argv else None)

import jax
import optax

from mlir_train.checkpoint import orbax as checkpoint
from mlir_train.checkpoint import integrity
from mlir_train.families import get_model_config
from mlir_train.train.trainer import StepConfig, Trainer, model_dims
from mlir_train.train.build import build_trainer
from sharding.mesh import make_mesh, validate
from sharding.layout import Layout

SIZES = {
    "tiny": dict(),  # qwen3-moe-tiny: 1.4M params
    # ~95M params: 8 layers, D 512, 16 experts of F 256, vocab 32768; state ~1.1 GB in float32
    "medium": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, num_experts=16,
                   moe_intermediate_size=256, top_k=4, vocab_size=32768),
}


def build(size: str) -> tuple[Trainer, dict]:
    cfg = get_model_config("qwen3-moe-tiny", **SIZES[size])
    parallel = validate(Layout(distributed_optimizer=True), model_dims(cfg))
    trainer = build_trainer(cfg, StepConfig(), optax.adamw(1e-4), parallel, make_mesh(parallel))
    state = trainer.init_state(0)
    jax.block_until_ready(state)
    return trainer, state


def time_saves(root: str, trainer: Trainer, state: dict, async_save: bool,
               rounds: int) -> tuple[float, float, float, float]:
    path = os.path.join(root, f"{'async' if async_save else 'sync'}")
    mgr = checkpoint.CheckpointManager(path, max_to_keep=1, async_save=async_save)
    meta = {"model": dataclasses.asdict(trainer.model_cfg)}
    blocked, total, sums, verify = [], [], [], []
    for step in range(rounds + 1):
        t0 = time.perf_counter()
        mgr.save(step, state, meta, force=True)
        t1 = time.perf_counter()
        mgr.wait()
        t2 = time.perf_counter()
        if step:  # step 0 is the warm-up
            blocked.append(t1 - t0)
            total.append(t2 - t0)
            sums.append(mgr.last_manifest_seconds)
            t3 = time.perf_counter()
            assert integrity.verify_step(os.path.join(path, str(step))).status == "ok"
            verify.append(time.perf_counter() - t3)
    mgr.close()
    shutil.rmtree(path)
    return tuple(statistics.median(x) for x in (blocked, total, sums, verify))


def multiprocess_worker(root: str, gb: float, rounds: int) -> None:
    """One of the ``--processes`` JAX processes (its layout from the launcher variables)."""
    import numpy as np

    from mlir_train.runtime import distributed

    n = int(os.environ["WORLD_SIZE"])
    layout = distributed.initialize_from_env(cpu_devices=8 // n)
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    leaves, cols = 16, 4096
    rows = int(gb * 2**30 / leaves / cols / 4) // jax.device_count() * jax.device_count()

    def shard(index, leaf):
        lo = index[0].start or 0
        rng = np.random.default_rng(leaf * 1_000_003 + lo)  # incompressible, as trained weights are
        return rng.standard_normal((rows // jax.device_count(), cols), dtype=np.float32)

    params = {f"w{i:02d}": jax.make_array_from_callback((rows, cols), sharding, lambda idx, i=i: shard(idx, i))
              for i in range(leaves)}
    state = {"params": params, "opt_state": None, "loss_scale": None}
    nbytes = sum(x.nbytes for x in params.values())
    path = os.path.join(root, "multi")
    mgr = checkpoint.CheckpointManager(path, max_to_keep=1)
    total, verify = [], []
    for step in range(rounds + 1):
        distributed.barrier(f"bench-save-{step}")
        t0 = time.perf_counter()
        mgr.save(step, state, {"model": {}}, force=True)
        mgr.wait()
        t1 = time.perf_counter()
        distributed.barrier(f"bench-verify-{step}")
        t2 = time.perf_counter()
        assert checkpoint.verified_step(path, step) == step
        t3 = time.perf_counter()
        if step:  # step 0 is the warm-up
            total.append(t1 - t0)
            verify.append(t3 - t2)
    mgr.close()
    by_process = {}
    with open(os.path.join(path, str(rounds), integrity.MANIFEST)) as f:
        for entry in json.load(f)["files"].values():
            by_process[entry.get("process", 0)] = by_process.get(entry.get("process", 0), 0) + entry["size"]
    hashed = ", ".join(f"process {p} {b / 1e9:.2f} GB" for p, b in sorted(by_process.items()))
    print(f"RESULT process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} devices, "
          f"state {nbytes / 1e9:.2f} GB, save+wait {statistics.median(total):.2f} s, "
          f"verify {statistics.median(verify):.2f} s; the manifest's files hashed by: {hashed}", flush=True)
    distributed.shutdown(layout)


def multiprocess(root: str, processes: int, gb: float, rounds: int) -> None:
    import re
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "WORLD_SIZE", "RANK")}
    env.update(JAX_PLATFORMS="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(processes),
               PYTHONPATH=os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")]))
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--dir", root, "--gb", str(gb),
            "--rounds", str(rounds)]
    print(f"checkpoint save + verify, {processes} processes x {8 // processes} cpu devices, {os.cpu_count()} CPU "
          f"cores, jax {jax.__version__}, {gb} GB state, median of {rounds} after 1 warm-up, in {root}", flush=True)
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(processes)]
    outs = [p.communicate()[0] for p in procs]
    rows = []
    for p, out in zip(procs, outs):
        found = [line for line in out.splitlines() if line.startswith("RESULT")]
        if p.returncode or not found:
            raise SystemExit(f"a benchmark process failed (status {p.returncode}):\n{out[-4000:]}")
        rows.append(tuple(float(x) for x in re.findall(r"save\+wait ([0-9.]+) s, verify ([0-9.]+) s", found[0])[0]))
        print(found[0])
    save, verify = max(r[0] for r in rows), max(r[1] for r in rows)
    print(f"ratio {processes} processes: save+wait {save:.2f} s, verify {verify:.2f} s (slowest process); "
          f"verify / save {verify / save:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 1 round (smoke run)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir; put it on the real disk)")
    p.add_argument("--processes", type=int, default=1, help="N > 1: N JAX processes save and verify one state")
    p.add_argument("--gb", type=float, default=2.0, help="with --processes: the state's size in GB")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return multiprocess_worker(args.dir, args.gb, args.rounds)
    if args.processes > 1:
        root = tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir)
        try:
            return multiprocess(root, args.processes, args.gb, args.rounds)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    sizes, rounds = (["tiny"], 1) if args.quick else (list(SIZES), args.rounds)
    root = tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir)
    print(f"checkpoint save, {jax.device_count()} {jax.devices()[0].platform} device(s), {os.cpu_count()} CPU cores, "
          f"jax {jax.__version__}, median of {rounds} after 1 warm-up, in {root}")
    print(f"{'size':<8}{'params':>10}{'state MB':>10}{'mode':>7}{'blocked ms':>12}{'total ms':>10}{'MB/s':>8}"
          f"{'sums ms':>9}{'verify ms':>11}")
    results = {}
    try:
        for size in sizes:
            trainer, state = build(size)
            nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
            for async_save in (True, False):
                blocked, total, sums, verify = time_saves(root, trainer, state, async_save, rounds)
                mode = "async" if async_save else "sync"
                results[size, mode] = blocked
                results[size, mode, "sums"] = (sums, total, verify)
                print(f"{size:<8}{trainer.model_cfg.num_params() / 1e6:>9.1f}M{nbytes / 1e6:>10.1f}{mode:>7}"
                      f"{blocked * 1e3:>12.1f}{total * 1e3:>10.1f}{nbytes / 1e6 / total:>8.0f}"
                      f"{sums * 1e3:>9.1f}{verify * 1e3:>11.1f}")
            del state
        for size in sizes:
            print(f"ratio {size}: sync blocks {results[size, 'sync'] / results[size, 'async']:.2f}x as long as async "
                  f"({results[size, 'async'] * 1e3:.1f} ms vs {results[size, 'sync'] * 1e3:.1f} ms)")
            sums, total, verify = results[size, "async", "sums"]
            print(f"ratio {size} checksums: {sums / total:.2f} of an async save's total ({sums * 1e3:.1f} ms of "
                  f"{total * 1e3:.1f} ms, none of it blocking); verify on load {verify * 1e3:.1f} ms")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
