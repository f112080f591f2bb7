"""The Qwen3-30B-A3B training step as XLA:GPU compiles it for 8 x H200, deviceless.

    python benchmarks/gpu_compiled.py [--layers 48] [--seq-length 2048] [--global-batch-size 128]
                                      [--layouts dp8,ep8,tp2ep4,seed] [--device-kind h200]

For each layout it compiles the real training step (``mlir_train.planner.plan.plan_layout``: the
planner's code path, the Trainer ``sft`` builds, the GPU runtime flags ``sft`` sets on GPU, the
MoE implementation the GPU mesh selects) and prints per device: the compiled arguments,
temporaries and total need; the matmul FLOPs read from the optimized HLO as a ratio to
Megatron's model FLOPs; the collectives by kind. Layouts (bf16, micro-batch 1, recompute as
given, distributed optimizer where the seed has it):

* ``dp8``     data parallel over 8
* ``ep8``     expert parallel 8 (EP carved out of DP8)
* ``tp2ep4``  tensor parallel 2 (+ sequence parallel), expert parallel 4
* ``seed``    the seed job: TP2 PP2 EP2 + SP, distributed optimizer, recompute full

Needs jax-cuda12-plugin / jax-cuda12-pjrt / nvidia-cuda-nvcc-cu12; without them it says so and
exits. ``--quick``: 1 layer at toy widths, for a smoke run.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlir_train.runtime.platform_setup import configure_platform  # noqa: E402  (imports no jax)

configure_platform(compile_only=True)

import argparse  # noqa: E402
import datetime  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from mlir_train.config import cli
from mlir_train.planner import plan
from mlir_train.planner import targets  # noqa: E402

LAYOUTS = {
    "dp8": plan.candidate(),
    "ep8": plan.candidate(expert=8),
    "tp2ep4": plan.candidate(tensor=2, expert=4, sequence_parallel=True),
    "seed": plan.candidate("full", tensor=2, pipeline=2, expert=2, distributed_optimizer=True, sequence_parallel=True),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48, help="decoder layers (the full model's 48 by default)")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--global-batch-size", type=int, default=128, help="the seed job's 128")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                   help="for every layout but the seed (which has full)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--device-kind", default="h200", choices=[k for k, v in targets.DEVICE_KINDS.items()
                                                             if v.compiles_for_gpu])
    p.add_argument("--assumed-mfu", type=float, default=0.4)
    p.add_argument("--quick", action="store_true", help="1 layer at toy widths (smoke run)")
    p.add_argument("--hlo-dir", default=None, help="also write each layout's optimized HLO text there")
    a = p.parse_args(argv)
    missing = targets.gpu_compiler_missing()
    if missing:
        print(f"cannot compile for XLA:GPU here: {missing}")
        return 2
    kind = targets.DEVICE_KINDS[a.device_kind]
    model = ["--model-name", "qwen3-30b-a3b", "--num-layers", str(1 if a.quick else a.layers)]
    if a.quick:
        model += ["--hidden-size", "256", "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels",
                  "64", "--num-experts", "16", "--moe-ffn-hidden-size", "128", "--vocab-size", "4096"]
    seq = 256 if a.quick else a.seq_length
    args = cli.parse(model + ["--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size",
                                      str(a.global_batch_size), "--bf16", "--moe-router-topk", "8"])
    print(f"Qwen3-30B-A3B layer stack ({1 if a.quick else a.layers} layers{', toy widths' if a.quick else ''}), seq {seq}, "
          f"micro-batch 1, global batch {a.global_batch_size}, bf16; XLA:GPU for 8 x {kind.description}, deviceless; "
          f"jax {jax.__version__}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    rows = []
    for name in a.layouts.split(","):
        layout = LAYOUTS[name]
        if name != "seed" and a.recompute != "none":
            layout = plan.Candidate(layout.layout, a.recompute)
        t0 = time.perf_counter()
        result = plan.plan_layout(args, layout, 8, memory_gb=kind.memory_bytes / plan.GIB,
                                  peak_tflops=kind.bf16_tflops, assumed_mfu=a.assumed_mfu, target=kind.name,
                                  hlo_dir=a.hlo_dir)
        print(f"  {name}: {result.name}: compiled in {time.perf_counter() - t0:.0f}s"
              + (f" -- {result.error}" if result.error else ""), flush=True)
        rows.append((name, result))
    g = plan.GIB
    print(f"\n{'layout':<8s} {'MoE':<7s} {'args GiB':>9s} {'temp GiB':>9s} {'need GiB':>9s} {'fits':>5s} "
          f"{'matmul TFLOP':>12s} {'vs model':>8s}  collectives per device per step")
    for name, r in rows:
        if r.error:
            print(f"{name:<8s} {r.error}")
            continue
        print(f"{name:<8s} {r.moe_impl or '-':<7s} {r.compiled_argument_bytes / g:9.2f} {r.compiled_temp_bytes / g:9.2f} "
              f"{r.compiled_needed_bytes / g:9.2f} {'yes' if r.fits else 'NO':>5s} "
              f"{r.compiled_matmul_flops / 1e12:12.2f} {r.flop_ratio:7.2f}x  {plan.format_collectives(r.collectives)}"
              + (f"  [{r.conditionals} conditionals, costliest branches; cheapest: "
                 f"{r.compiled_matmul_flops_cheapest * 8 / r.flops_per_step:.2f}x, "
                 f"{plan.format_collectives(r.collectives_cheapest)}]" if r.conditionals else ""))
    print(f"\nratio: compiled matmul FLOPs / Megatron's model FLOPs (mlir_train.model.flops); need = arguments + "
          f"unaliased outputs + temp; fits = need <= {plan.USABLE_FRACTION:.0%} of {kind.memory_bytes / g:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
