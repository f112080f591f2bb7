"""Per-device memory and step time of every parallel layout, against DP8 in the same run.

    python benchmarks/layouts.py [--quick] [--iters N] [--models tiny,small]

For each model and each layout of issue 5 (plus a 1-device mesh) it builds the
:class:`~mlir_train.train.trainer.Trainer`, compiles the train step ahead of time and reads:

* the training state per device from the state shardings (float32 master weights and Adam
  state, i.e. what ``--use-distributed-optimizer`` and TP/EP split), checked against the bytes
  of the shards the initialised state really holds on its fullest device;
* XLA's ``memory_analysis()`` of the compiled step: argument bytes (state + batch) and temp
  bytes per device (XLA:CPU figures: argument sizes are exact, temp is not a GPU budget);
* step time: after one warmup step each, the layouts' compiled steps are called round-robin
  (one step each per round, waiting for each), so load on the machine falls on all of them
  alike; the median over ``--iters`` rounds.

Each figure is printed as a ratio against DP8 (pure data parallelism, no distributed
optimizer) of the same model, measured in the same run. On the 8 fake CPU devices of one host
all "devices" share the same cores: step-time ratios show what a layout's partitioning and
collectives cost on top of the same total work, not the speed-up real devices would give.

Models: "tiny" is ``qwen3-moe-tiny`` (hidden 128, 4 layers, 8 experts); "small" is the same
architecture at hidden 256, 4 layers, 16 experts of width 128, 8 heads, vocab 8192.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from mlir_train.runtime.platform_setup import configure_platform  # noqa: E402

configure_platform(cpu_devices=8)  # before jax starts: the platform's XLA settings; a quiet CPU host with a GPU plugin installed

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mlir_train.config.models import ModelConfig
from mlir_train.families import get_model_config  # noqa: E402
from mlir_train.train.optim import make_optimizer  # noqa: E402
from mlir_train.train.schedule import megatron_lr_schedule  # noqa: E402
from mlir_train.config.policies import LoadBalancing  # noqa: E402
from mlir_train.train.trainer import StepConfig, model_dims  # noqa: E402
from mlir_train.train.build import build_trainer  # noqa: E402
from sharding.table import held_bytes  # noqa: E402
from sharding.mesh import make_mesh, validate
from sharding.layout import Layout  # noqa: E402

PEER = "DP8"
LAYOUTS = {
    "1 device": Layout(num_devices=1),
    "DP8": Layout(),
    "TP2xDP4": Layout(tensor=2),
    "TP2xDP4+SP": Layout(tensor=2, sequence_parallel=True),
    "EP2xDP4": Layout(expert=2),
    "EP4xTP2": Layout(tensor=2, expert=4),
    "TP2xEP2xDP2+distopt": Layout(tensor=2, expert=2, distributed_optimizer=True),
}


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    model: ModelConfig
    seq: int
    rows: int  # global batch rows, split into MICRO micro-batches
    micro: int = 2


def sizes(quick: bool) -> dict[str, Size]:
    tiny = get_model_config("qwen3-moe-tiny", vocab_size=2048)
    small = get_model_config("qwen3-moe-tiny", hidden_size=256, num_heads=8, num_kv_heads=4, num_experts=16,
                             moe_intermediate_size=128, intermediate_size=512, vocab_size=8192).replace(name="small")
    if quick:
        return {"tiny": Size("tiny", tiny.replace(num_layers=2, vocab_size=512), seq=32, rows=16)}
    return {"tiny": Size("tiny", tiny, seq=128, rows=16), "small": Size("small", small, seq=256, rows=16)}


def random_batch(size: Size) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (size.micro, size.rows // size.micro, size.seq)
    ids = rng.integers(0, size.model.vocab_size, shape).astype(np.int32)
    return dict(input_ids=ids, labels=np.roll(ids, -1, axis=-1), loss_mask=np.ones(shape, np.int32),
                segment_ids=np.ones(shape, np.int32),
                positions=np.broadcast_to(np.arange(size.seq, dtype=np.int32), shape).copy())


def shard_bytes(shapes, shardings) -> int:
    """Bytes per device of a tree laid out by ``shardings`` (largest shard of each array)."""
    return sum(math.prod(sh.shard_shape(s.shape)) * np.dtype(s.dtype).itemsize
               for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)))


def build(size: Size, layout: str):
    cfg = size.model
    if layout == "1 device":
        parallel = LAYOUTS[layout]
        mesh = make_mesh(parallel, devices=jax.devices()[:1])
    else:
        parallel = validate(LAYOUTS[layout], model_dims(cfg), seq_length=size.seq)
        mesh = make_mesh(parallel)
    optimizer = make_optimizer(lr_schedule=megatron_lr_schedule(lr=1e-4, train_iters=1000, lr_decay_style="constant"),
                               weight_decay=0.1)
    step_cfg = StepConfig(num_micro_batches=size.micro, balancing=LoadBalancing.from_flags("aux_loss", 1e-2))
    trainer = build_trainer(cfg, step_cfg, optimizer, parallel, mesh)
    state = trainer.init_state(0)
    master = shard_bytes(trainer.param_shapes, trainer.state_shardings["params"])
    opt = shard_bytes(jax.eval_shape(optimizer.init, trainer.param_shapes), trainer.state_shardings["opt_state"])
    assert held_bytes(state["params"]) == master and held_bytes(state["opt_state"]) == opt, layout
    batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in random_batch(size).items()}
    start = time.perf_counter()
    compiled = trainer.lower_train_step(state, batch).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    row = dict(model=size.name, layout=layout, mesh="x".join(f"{a[0]}{n}" for a, n in mesh.shape.items() if n > 1) or "-",
               master=master, opt=opt, args=mem.argument_size_in_bytes, temp=mem.temp_size_in_bytes, compile_s=compile_s)
    return row, compiled, state, batch


def time_round_robin(programs: dict, iters: int) -> dict[str, float]:
    """Median seconds per step of each ``name -> [compiled, state, batch]`` (state updated in place)."""
    times = {name: [] for name in programs}
    for round_ in range(iters + 1):  # round 0 is the warmup
        for name, prog in programs.items():
            compiled, state, batch = prog
            start = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready((state, metrics))
            prog[1] = state
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 layers, seq 32: a smoke run")
    parser.add_argument("--iters", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--models", default=None, help="comma list of: tiny,small")
    args = parser.parse_args()
    todo = sizes(args.quick)
    if args.models:
        todo = {k: todo[k] for k in args.models.split(",")}
    print(f"train step (2 micro-batches, Adam, float32) per layout, {jax.device_count()} {jax.devices()[0].platform} "
          f"devices, {os.cpu_count()} CPU cores, jax {jax.__version__}; ratios against {PEER} of the same model")
    header = (f"{'model':<6} {'layout':<20} {'mesh':<9} {'params M':>8} {'tokens':>6} {'master':>7} {'optim':>7} "
              f"{'state':>7} {'st/DP8':>6} {'XLA args':>8} {'XLA temp':>8} {'compile':>7} {'step ms':>8} "
              f"{'tok/s':>8} {'t/DP8':>6}")
    lines, ratios = [header, "-" * len(header)], []
    for size in todo.values():
        rows, programs = {}, {}
        for layout in LAYOUTS:
            row, compiled, state, batch = build(size, layout)
            rows[layout], programs[layout] = row, [compiled, state, batch]
        step_s = time_round_robin(programs, args.iters)
        peer = rows[PEER]
        tokens = size.rows * size.seq
        for layout, r in rows.items():
            state_ratio = (r["master"] + r["opt"]) / (peer["master"] + peer["opt"])
            time_ratio = step_s[layout] / step_s[PEER]
            lines.append(
                f"{size.name:<6} {layout:<20} {r['mesh']:<9} {size.model.num_params() / 1e6:>8.2f} {tokens:>6} "
                f"{mib(r['master']):>7} {mib(r['opt']):>7} {mib(r['master'] + r['opt']):>7} {state_ratio:>5.2f}x "
                f"{mib(r['args']):>8} {mib(r['temp']):>8} {r['compile_s']:>6.1f}s {step_s[layout] * 1e3:>8.1f} "
                f"{tokens / step_s[layout]:>8,.0f} {time_ratio:>5.2f}x")
            ratios.append(f"ratio {size.name} {layout}: {state_ratio:.2f}x {PEER} state bytes/device, "
                          f"{time_ratio:.2f}x {PEER} step time")
    print("memory columns: MiB per device (master = float32 weights, optim = Adam moments, state = both; "
          "XLA args/temp from memory_analysis()); st/DP8 and t/DP8: state bytes and step time against DP8; "
          f"step: median of {args.iters} interleaved rounds after 1 warmup\n")
    print("\n".join(lines))
    print()
    print("\n".join(ratios))


if __name__ == "__main__":
    main()
