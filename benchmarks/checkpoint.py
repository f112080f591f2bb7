"""How long a checkpoint save blocks training: Orbax async vs synchronous, tiny and medium model.

    python benchmarks/checkpoint.py [--quick] [--rounds 3] [--dir DIR]

For each model the full training state (float32 master weights + AdamW moments, the trainer's
own shardings on all local devices, distributed optimizer) is saved through
``mlir_train.checkpoint.orbax.CheckpointManager`` with ``async_save=True`` and ``False``. Reported per
mode, median over rounds after one warm-up save (the first save compiles Orbax's per-shard copy
programs): *blocked* = the time ``save()`` takes to return, i.e. how long the training loop
cannot dispatch its next step; *total* = until the files are committed and their checksums
written (``wait()``); *sums* = hashing every file into ``checksums.json`` (part of *total*, in
the background thread); *verify* = re-hashing the step as a load does. The ratio lines are sync
blocked / async blocked (> 1: async blocks the step that much less) and checksum time / total.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time

from mlir_train.runtime.platform_setup import configure_platform  # (imports no jax)

configure_platform()  # before jax starts: the platform's XLA settings; a quiet CPU host with a GPU plugin installed

import jax
import optax

from mlir_train.checkpoint import orbax as checkpoint
from mlir_train.checkpoint import integrity
from mlir_train.config.models import get_model_config
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 1 round (smoke run)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir; put it on the real disk)")
    args = p.parse_args()
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
