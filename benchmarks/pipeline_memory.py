"""Compiled memory of the pipelined MoE step, per schedule and micro-batch count (nothing runs).

    python benchmarks/pipeline_memory.py [--micro 4,16,64] [--schedules 1f1b,gpipe] [--dtype float32]
                                         [--recompute full] [--dump DIR]

The seed's layout (TP2 PP2 EP2, sequence parallel, distributed optimizer, 8 fake CPU devices)
for a scaled-down Qwen3-MoE (8 layers, hidden 256, 16 experts top-4, vocab 8192, seq 256, one
row per micro-batch and data rank). For each schedule and M it prints the per-device argument
and temp bytes of ``trainer.lower_train_step(abstract_state, batch shapes).compile()``'s
``memory_analysis()``. With ``--dump`` it also dumps each compile (``--xla_dump_to``) and prints
the buffers live at the peak (``benchmarks/peak_buffers.py``). XLA:CPU upcasts bf16 dots to
float32 (JAX_NOTES), so ``--dtype float32`` (the default) gives the cleaner breakdown.
"""

from __future__ import annotations

import argparse
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--micro", default="4,16,64")
ap.add_argument("--schedules", default="1f1b,gpipe")
ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
ap.add_argument("--recompute", default="full", choices=["none", "selective", "full"])
ap.add_argument("--dump", default=None, help="dump each compile under DIR/<schedule>-M<m> and list its peak buffers")
ap.add_argument("--top", type=int, default=12)
args = ap.parse_args()

flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_disable_hlo_passes=all-reduce-promotion"
os.environ["XLA_FLAGS"] = flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from mlir_train.model import ModelOptions  # noqa: E402
from mlir_train.runtime.platform_setup import configure_platform  # noqa: E402

configure_platform(cpu_devices=8)  # before jax starts: the platform's XLA settings; a quiet CPU host with a GPU plugin installed

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peak_buffers import peak_buffers  # noqa: E402

from mlir_train.families import get_model_config  # noqa: E402
from mlir_train.train.optim import make_optimizer  # noqa: E402
from mlir_train.config.policies import LoadBalancing  # noqa: E402
from mlir_train.train.trainer import BATCH_KEYS, StepConfig, model_dims  # noqa: E402
from mlir_train.train.build import build_trainer  # noqa: E402
from mlir_train.train.pipeline import make_schedule  # noqa: E402
from sharding.mesh import make_mesh, validate
from sharding.layout import Layout  # noqa: E402

CFG = get_model_config("qwen3-moe-tiny", vocab_size=8192, num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2,
                       head_dim=64, num_experts=16, top_k=4, moe_intermediate_size=128)
SEQ = 256


def compile_step(schedule: str, micro: int, dump: str | None):
    parallel = validate(Layout(tensor=2, pipeline=2, expert=2, sequence_parallel=True,
                                       distributed_optimizer=True), model_dims(CFG), seq_length=SEQ)
    trainer = build_trainer(CFG, StepConfig(num_micro_batches=micro, compute_dtype=args.dtype,
                                            balancing=LoadBalancing.from_flags("aux_loss", 1e-2)),
                            make_optimizer(lr_schedule=lambda _: 1e-3, weight_decay=0.0), parallel, make_mesh(parallel),
                            options=ModelOptions(remat=args.recompute),
                            schedule=make_schedule(CFG.num_layers, parallel.pipeline, kind=schedule, num_micro_batches=micro))
    batch = {k: jax.ShapeDtypeStruct((micro, parallel.data_parallel, SEQ), jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=trainer.batch_sharding) for k in BATCH_KEYS}
    options = {"xla_backend_optimization_level": 0}
    if dump:
        options.update(xla_dump_to=dump, xla_dump_hlo_as_text=True, xla_dump_hlo_module_re="jit__step")
    return trainer.lower_train_step(trainer.abstract_state(), batch).compile(options).memory_analysis()


print(f"TP2 PP2 EP2 SP distopt, {CFG.num_layers}-layer MoE (hidden {CFG.hidden_size}, {CFG.num_experts} experts "
      f"top-{CFG.top_k}, vocab {CFG.vocab_size}), seq {SEQ}, {args.dtype}, recompute {args.recompute}, jax {jax.__version__}")
print(f"{'schedule':9} {'M':>3} {'args MiB':>9} {'temp MiB':>9}")
first = {}
for schedule in args.schedules.split(","):
    for m in map(int, args.micro.split(",")):
        dump = os.path.join(args.dump, f"{schedule}-M{m}") if args.dump else None
        ma = compile_step(schedule, m, dump)
        temp = ma.temp_size_in_bytes / 2**20
        first.setdefault(schedule, temp)
        print(f"{schedule:9} {m:3d} {ma.argument_size_in_bytes / 2**20:9.1f} {temp:9.1f}", flush=True)
        if dump:
            buffers = peak_buffers(dump)
            print(f"  peak: {len(buffers)} buffers, {sum(b[1] for b in buffers) / 2**20:.1f} MiB; largest:")
            for name, size, shape, op in sorted(buffers, key=lambda b: -b[1])[:args.top]:
                print(f"    {size / 2**20:7.2f} MiB  {shape[:40]:40} {op[-70:] or name}")
    print(f"ratio {schedule}: temp at M={m} vs M={args.micro.split(',')[0]}: {temp / first[schedule]:.2f}x", flush=True)
