"""Issue 24's targets, checked on the compiled program: matmul work, communication and memory per
device of the Qwen3-30B-A3B step against Megatron's for the same flags (deviceless XLA:GPU).

    python benchmarks/comm_audit.py [--layouts seed,folding,tp4ep8] [--recompute none|full]
                                    [--device-kind h200] [--hlo-dir DIR] [--json FILE] [--quick]
                                    [--global-batch-size N]

Each layout is compiled by the planner's code path (``mlir_train.planner.plan.plan_layout``: the
Trainer ``sft`` builds, the GPU runtime flags, the MoE path the GPU mesh selects) for 8
compile-only GPUs, with the seed's flags (seq 2048, micro-batch 1, global batch 128, bf16,
SP, distributed optimizer, top-8, aux_loss 1e-2):

* ``seed``     TP2 PP2 EP2 (ETP = TP), examples/qwen3_30b_a3b_sft.sh
* ``folding``  TP2 PP2 EP4 ETP1 (MoE parallel folding)
* ``tp4ep8``   TP4 PP1 EP8 ETP1

Per layout it prints the ratios the issue sets targets for:

* ``flops``: compiled matmul FLOPs per device at a balanced routing (the EP overflow rounds'
  no-overflow branch; the block kernels' static bound scaled to the rows an exactly balanced
  routing fills) over what one device of Megatron's busiest pipeline stage executes (its layers'
  model FLOPs x (3 + the recomputed share), and on the last stage the LM head's 3 passes):
  target <= 1.10; the ratio over Megatron's average device is printed beside;
* per collective kind, compiled bytes per device and step (ragged all-to-all at its traffic)
  over Megatron's analytic volume (:mod:`mlir_train.planner.comm`, its busiest stage): target
  <= 1.1, or explained in benchmarks/README.md;
* ``memory``: what the compiled step needs per device: target <= 120 GiB (stretch 96 GiB);

and how many EP all-to-alls, DP reduce-scatters and all-gathers the schedule overlaps with
compute, and the roofline estimate. ``--quick``: a 2-layer model at toy widths (smoke run).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlir_train.runtime.platform_setup import configure_platform  # noqa: E402  (imports no jax)

configure_platform(compile_only=True)

import argparse  # noqa: E402
import datetime  # noqa: E402

import jax  # noqa: E402

from mlir_train.config import cli  # noqa: E402
from mlir_train.planner import plan  # noqa: E402
from mlir_train.planner import targets  # noqa: E402
from mlir_train.planner.comm import gib  # noqa: E402
from mlir_train.planner.report import write_json  # noqa: E402

LAYOUTS = {
    "seed": dict(tensor=2, pipeline=2, expert=2),
    "folding": dict(tensor=2, pipeline=2, expert=4, expert_tensor=1),
    "tp4ep8": dict(tensor=4, expert=8, expert_tensor=1),
}
FLOP_TARGET, COMM_TARGET, MEMORY_TARGET, MEMORY_STRETCH = 1.10, 1.1, 120.0, 96.0


def _overlap(p: plan.Plan, kind: str, axes_filter) -> str:
    rows = [r for r in p.collectives_by_axes or [] if r["kind"] == kind and axes_filter(r["axes"])]
    n = sum(r["count"] for r in rows)
    return f"{sum(r['overlapped'] for r in rows)}/{n} ({sum(r['matmul_overlapped'] for r in rows)} with matmuls)" if n else "-"


def _print_layout(r: plan.Plan) -> None:
    """One layout's collectives against Megatron's, their overlap and the roofline."""
    if r.collective_traffic_bound:
        bound = sum(r.collective_traffic_bound.get(k, {}).get("bytes", 0) for k in ("all-to-all", "ragged-all-to-all"))
        print(f"  (collectives at a balanced routing: the EP overflow rounds' no-overflow branch; with every "
              f"overflow round taken the all-to-all traffic is {gib(bound)})")
    for row in r.comm_comparison:
        ratio = row["ratio"]
        mark = "" if ratio is None or ratio <= COMM_TARGET else "  (over 1.1x: see benchmarks/README.md)"
        print(f"  {row['kind']:<15s} compiled {gib(row['compiled_bytes']):>11s}  Megatron {gib(row['megatron_bytes']):>11s}"
              f"  {'-' if ratio is None else f'{ratio:.2f}x'}{mark}")
    print(f"  overlapped with compute: EP all-to-all {_overlap(r, 'ragged-all-to-all', lambda x: 'expert' in x)}, "
          f"reduce-scatter {_overlap(r, 'reduce-scatter', lambda x: True)}, all-gather {_overlap(r, 'all-gather', lambda x: True)}")
    if r.roofline:
        rf = r.roofline
        print(f"  roofline (estimate): matmul {rf['compute_s']:.2f}s, HBM {rf['memory_s']:.2f}s, exposed collectives "
              f"{rf['comm_s']:.2f}s -> step {rf['step_s']:.2f}s, {rf['model_tflops_per_device']:.0f} model TFLOP/s per "
              "device" + (f" (Megatron-Bridge published: {r.published_reference['tflops_per_device']:.0f} per "
                          f"{r.published_reference['device']})" if r.published_reference else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--device-kind", default="h200", choices=[k for k, v in targets.DEVICE_KINDS.items()
                                                             if v.compiles_for_gpu])
    p.add_argument("--hlo-dir", default=None, help="also write each layout's optimized HLO text there")
    p.add_argument("--json", default=None, help="also write the plans as JSON (the planner's rows)")
    p.add_argument("--quick", action="store_true", help="2 layers at toy widths (smoke run)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="instead of the seed's 128 (16 with --quick): memory should not grow with it")
    a = p.parse_args(argv)
    missing = targets.gpu_compiler_missing()
    if missing:
        print(f"cannot compile for XLA:GPU here: {missing}")
        return 2
    kind = targets.DEVICE_KINDS[a.device_kind]
    model = ["--model-name", "qwen3-30b-a3b"]
    if a.quick:
        model += ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--num-query-groups", "2",
                  "--kv-channels", "64", "--num-experts", "16", "--moe-ffn-hidden-size", "128", "--vocab-size", "4096"]
    seq, gbs = (256, 16) if a.quick else (2048, 128)
    gbs = a.global_batch_size or gbs
    args = cli.parse(model + ["--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size", str(gbs),
                              "--bf16", "--moe-router-topk", "8", "--moe-router-load-balancing-type", "aux_loss",
                              "--moe-aux-loss-coeff", "1e-2"])
    print(f"Qwen3-30B-A3B{' (2 layers, toy widths)' if a.quick else ''}, seq {seq}, micro-batch 1, global batch {gbs}, "
          f"bf16, SP, distributed optimizer, recompute {a.recompute}; XLA:GPU for 8 x {kind.description}, deviceless; "
          f"jax {jax.__version__}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    plans = []
    for name in a.layouts.split(","):
        c = plan.candidate(a.recompute, sequence_parallel=True, distributed_optimizer=True, **LAYOUTS[name])
        r = plan.plan_layout(args, c, 8, memory_gb=kind.memory_bytes / plan.GIB, peak_tflops=kind.bf16_tflops,
                             assumed_mfu=0.4, target=kind.name, hlo_dir=a.hlo_dir)
        print(f"\n{name}: {r.name}" + (f" -- {r.error}" if r.error else f", compiled in {r.compile_s:.0f}s"), flush=True)
        if r.error:
            continue
        plans.append((name, r))
        _print_layout(r)
    print()
    for name, r in plans:
        need = r.compiled_needed_bytes / plan.GIB
        print(f"ratio {name} flops: {r.executed_flop_ratio:.2f}x what a device of Megatron's busiest stage executes "
              f"(target <= {FLOP_TARGET:.2f}: {'met' if r.executed_flop_ratio <= FLOP_TARGET else 'NOT met'}; "
              f"{r.executed_flop_ratio_average:.2f}x its average device)")
        for row in r.comm_comparison:
            if row["ratio"] is not None:
                print(f"ratio {name} {row['kind']}: {row['ratio']:.2f}x Megatron's analytic volume "
                      f"({'met' if row['ratio'] <= COMM_TARGET else 'over: explained in benchmarks/README.md'})")
            else:
                print(f"ratio {name} {row['kind']}: {gib(row['compiled_bytes'])} where Megatron moves none")
        print(f"ratio {name} memory: {need:.2f} GiB per device (target <= {MEMORY_TARGET:.0f}: "
              f"{'met' if need <= MEMORY_TARGET else 'NOT met'}; stretch {MEMORY_STRETCH:.0f}: "
              f"{'met' if need <= MEMORY_STRETCH else 'not met'})")
    write_json(a.json, [r for _, r in plans])
    return 0


if __name__ == "__main__":
    sys.exit(main())
