"""The pipelined step's program size against depth: does it stay flat with the period scan?

    python benchmarks/stage_program_size.py [--layers 8 16 32] [--virtual N] [--compile]

For each depth, a ``qwen3.5-moe-tiny`` (3:1 DeltaNet / attention, vocab 512) over two pipeline
stages (PP2, 1F1B; ``--virtual``: layers per virtual stage, interleaved) on two fake CPU
devices: the seconds to trace and lower the whole training step, the lowered StableHLO's lines
and ``scan`` count of the traced step (jaxpr, nested programs included) and, with
``--compile``, XLA:CPU's compile seconds. Run it with ``PYTHONPATH`` at a checkout to measure that
checkout (the before / after figures in benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import os
import time

from mlir_train.runtime.platform_setup import configure_platform

configure_platform(cpu_devices=2)

import jax  # noqa: E402
import jax.extend  # noqa: E402

from mlir_train.config.policies import LoadBalancing  # noqa: E402
from mlir_train.families import get_model_config  # noqa: E402
from mlir_train.train.build import build_trainer  # noqa: E402
from mlir_train.train.optim import make_optimizer  # noqa: E402
from mlir_train.train.pipeline import make_schedule  # noqa: E402
from mlir_train.train.trainer import StepConfig  # noqa: E402
from sharding.layout import Layout  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402

MICRO, ROWS, SEQ = 2, 1, 32


def count_scans(jaxpr) -> int:
    """``scan`` equations in ``jaxpr`` and every program inside it."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "scan"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += count_scans(sub)
    return n


def measure(layers: int, virtual: int | None, compile_too: bool) -> dict:
    cfg = get_model_config("qwen3.5-moe-tiny", vocab_size=512, num_layers=layers)
    parallel = Layout(pipeline=2, num_devices=2)
    step_cfg = StepConfig(num_micro_batches=MICRO, balancing=LoadBalancing.from_flags("aux_loss", 1e-2))
    opt = make_optimizer(lr_schedule=lambda _: 1e-4, weight_decay=0.1, clip_grad=1.0)
    trainer = build_trainer(cfg, step_cfg, opt, parallel, make_mesh(parallel, devices=jax.devices()[:2]),
                            schedule=make_schedule(layers, 2, num_micro_batches=MICRO, layers_per_virtual_stage=virtual))
    shape = jax.ShapeDtypeStruct((MICRO, ROWS, SEQ), jax.numpy.int32)
    batch = dict(input_ids=shape, labels=shape, segment_ids=shape, positions=shape,
                 loss_mask=jax.ShapeDtypeStruct(shape.shape, jax.numpy.float32))
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.sharding)
             for (k, v), s in zip(batch.items(), jax.tree.leaves(trainer.shard_batch(
                 {k: jax.numpy.zeros(v.shape, v.dtype) for k, v in batch.items()})))}
    start = time.perf_counter()
    traced, lowered = trainer.trace_train_step(trainer.abstract_state(), batch)
    out = dict(layers=layers, trace_lower_s=time.perf_counter() - start, lines=len(lowered.as_text().splitlines()),
               scans=count_scans(traced.jaxpr.jaxpr))
    if compile_too:
        start = time.perf_counter()
        lowered.compile()
        out["compile_s"] = time.perf_counter() - start
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--virtual", type=int, default=None, help="layers per virtual stage (interleaved 1F1B)")
    ap.add_argument("--compile", action="store_true", help="also time XLA:CPU's compile")
    args = ap.parse_args()
    import mlir_train
    print(f"qwen3.5-moe-tiny PP2 1F1B{' interleaved' if args.virtual else ''}, M={MICRO}, seq {SEQ}, "
          f"code at {os.path.dirname(mlir_train.__file__)}, jax {jax.__version__}")
    for layers in args.layers:
        row = measure(layers, args.virtual, args.compile)
        print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
