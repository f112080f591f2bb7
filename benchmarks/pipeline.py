"""Pipeline schedules: measured bubble and peak activation memory per device.

    python benchmarks/pipeline.py [--quick] [--stages P] [--iters N] [--seq T]

For P stages (the rest of the 8 devices data-parallel) and M in {P, 2P, 4P, 8P} micro-batches,
runs the full training step of an 8-layer ``qwen3-moe-tiny`` under each schedule: 1F1B, GPipe,
interleaved 1F1B and circular (the last two with one layer per virtual stage, R = 8 / P chunks
per stage), and reports:

* ``step ms``: median wall time of ``--iters`` steps after a warm-up;
* ``ideal ms``: the no-bubble ideal, the same global batch (M micro-batches of one row per
  data-parallel rank, ``M * 8 / P`` rows) through the non-pipelined step on the same 8 devices
  (DP8, ``M / P`` micro-batches of one row per rank): the same useful work, every device busy
  all the time;
* ``bubble``: ``1 - ideal / step`` measured, next to the schedule's theoretical
  idle fraction (``mlir_train.train.pipeline.schedule``): ``(P - 1) / (M * R + P - 1)`` for every
  schedule (1F1B's warm-up ticks run forwards only and its cool-down ticks backwards only, so a
  stage computes ``M * R + P - 1`` of each half, as GPipe's; its backward applies the residuals
  its forward kept: the same work per item as the other schedules);
* ``temp MB``: XLA's temporary buffer size per device from the ahead-of-time compile
  (``trainer.lower_train_step(abstract_state, batch_shapes).compile().memory_analysis()``),
  i.e. the activations kept for the backward plus scratch, next to the non-pipelined step's.

On the fake-CPU mesh every device shares the machine's cores, so a bubble tick, which computes on
zeros in this SPMD program, costs as much wall time as a useful one: the measured bubble is the
fraction of compute spent on bubble ticks. On real accelerators it is idle time instead; the
ratios are the same quantity.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from mlir_train.runtime.platform_setup import configure_platform  # noqa: E402

configure_platform(cpu_devices=8)  # before jax starts: the platform's XLA settings; a quiet CPU host with a GPU plugin installed

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mlir_train.families import get_model_config  # noqa: E402
from mlir_train.train.optim import make_optimizer  # noqa: E402
from mlir_train.config.policies import LoadBalancing  # noqa: E402
from mlir_train.train.trainer import StepConfig, Trainer  # noqa: E402
from mlir_train.train.build import build_trainer  # noqa: E402
from mlir_train.train.pipeline import make_schedule  # noqa: E402
from sharding.mesh import make_mesh
from sharding.layout import Layout  # noqa: E402

LAYERS = 8


def _trainer(stages: int, micro: int, virtual: bool, devices: int, schedule: str = "1f1b") -> Trainer:
    cfg = get_model_config("qwen3-moe-tiny", vocab_size=512, num_layers=LAYERS)
    parallel = Layout(pipeline=stages, num_devices=devices)
    step_cfg = StepConfig(num_micro_batches=micro, balancing=LoadBalancing.from_flags("aux_loss", 1e-2))
    opt = make_optimizer(lr_schedule=lambda _: 1e-4, weight_decay=0.1, clip_grad=1.0)
    pipeline = None if stages == 1 else make_schedule(LAYERS, stages, kind=schedule, num_micro_batches=micro,
                                                      layers_per_virtual_stage=1 if virtual else None)
    return build_trainer(cfg, step_cfg, opt, parallel, make_mesh(parallel, devices=jax.devices()[:devices]),
                         schedule=pipeline)


def _batch(trainer: Trainer, micro: int, rows: int, seq: int) -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 512, (micro, rows, seq)).astype(np.int32)
    host = dict(input_ids=ids, labels=np.roll(ids, -1, -1), loss_mask=np.ones(ids.shape, np.float32),
                segment_ids=np.ones_like(ids), positions=np.broadcast_to(np.arange(seq, dtype=np.int32), ids.shape).copy())
    return trainer.shard_batch(host)


def prepare(stages: int, micro: int, virtual: bool, *, devices: int, seq: int, schedule: str = "1f1b"):
    """A compiled step with its state and batch, and its temp MB per device from the AOT compile."""
    trainer = _trainer(stages, micro, virtual, devices, schedule)
    batch = _batch(trainer, micro, trainer.parallel.data_parallel, seq)
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in batch.items()}
    compiled = trainer.lower_train_step(trainer.abstract_state(), shapes).compile()
    temp_mb = compiled.memory_analysis().temp_size_in_bytes / 2**20
    return {"trainer": trainer, "compiled": compiled, "state": trainer.init_state(seed=0), "batch": batch,
            "temp_mb": temp_mb, "times": []}


def time_round_robin(runs: list[dict], iters: int) -> None:
    """One step of each program per round (the first round is a warm-up), so a machine shared with
    other work slows them alike; each program's median lands in its ``"step_s"``."""
    for i in range(iters + 1):
        for run in runs:
            with jax.set_mesh(run["trainer"].mesh):
                t0 = time.perf_counter()
                run["state"], metrics = run["compiled"](run["state"], run["batch"])
                jax.block_until_ready(metrics)
            if i:
                run["times"].append(time.perf_counter() - t0)
            assert np.isfinite(float(metrics["lm loss"]))
    for run in runs:
        run["step_s"] = statistics.median(run["times"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="P=2, seq 32, 2 timed steps")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    p = 2 if args.quick else args.stages
    seq = 32 if args.quick else args.seq
    iters = 2 if args.quick else args.iters
    devices = min(8, len(jax.devices()))
    ms = [p, 2 * p, 4 * p, 8 * p]
    print(f"pipeline schedules, {LAYERS}-layer qwen3-moe-tiny, seq {seq}, {devices} {jax.devices()[0].platform} "
          f"devices (PP{p} x DP{devices // p}), {os.cpu_count()} CPU cores, jax {jax.__version__}, "
          f"median of {iters} steps")
    print(f"{'schedule':10} {'M':>3} {'step ms':>9} {'ideal ms':>9} {'bubble':>7} {'theory':>7} {'temp MB':>8} {'PP1 temp MB':>11}")
    r_max = LAYERS // p
    schedules = {"1f1b": ("1f1b", False), "gpipe": ("gpipe", False),
                 f"1f1b-int{r_max}": ("1f1b", True), f"circular{r_max}": ("circular", True)}
    ideal = {m: prepare(1, m // p, False, devices=devices, seq=seq) for m in ms}
    piped = {(name, m): prepare(p, m, virtual, devices=devices, seq=seq, schedule=kind)
             for name, (kind, virtual) in schedules.items() for m in ms}
    time_round_robin(list(ideal.values()) + list(piped.values()), iters)
    for name, (kind, virtual) in schedules.items():
        r = r_max if virtual else 1
        theory = {m: (p - 1) / (m * r + p - 1) for m in ms}
        bubble = {m: 1 - ideal[m]["step_s"] / piped[name, m]["step_s"] for m in ms}
        for m in ms:
            run, flat = piped[name, m], ideal[m]
            print(f"{name:10} {m:3d} {run['step_s'] * 1e3:9.1f} {flat['step_s'] * 1e3:9.1f} {bubble[m]:7.2f} "
                  f"{theory[m]:7.2f} {run['temp_mb']:8.1f} {flat['temp_mb']:11.1f}")
        print(f"ratio {name}: bubble at M={p} measured {bubble[p]:.2f} (theory {theory[p]:.2f}), at M={ms[-1]} "
              f"{bubble[ms[-1]]:.2f} (theory {theory[ms[-1]]:.2f}); temp memory M={ms[-1]} vs M={p}: "
              f"{piped[name, ms[-1]]['temp_mb'] / piped[name, p]['temp_mb']:.2f}x")


if __name__ == "__main__":
    main()
