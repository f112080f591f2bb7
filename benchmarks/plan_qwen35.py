"""Will Qwen3.5 / Qwen3.6 / Qwen3-Next fit? The planner's answer on H200s, as one table.

    python benchmarks/plan_qwen35.py                       # 3 models x seq 4096, 32k x full SFT, LoRA on 8 x H200
    python benchmarks/plan_qwen35.py --models qwen3.5-35b-a3b --seqs 4096 --modes sft
    python benchmarks/plan_qwen35.py --quick               # a tiny model on 2 devices (the smoke test)
    python benchmarks/plan_qwen35.py --narrow --no-fewest-compile   # what fits in an afternoon on 2 cores

For each (model, sequence length, full SFT or LoRA) it runs ``python -m mlir_train.plan``'s search
(:func:`mlir_train.planner.plan.search`): every candidate layout the planner knows for the device
count is sized analytically, the ``--top`` best of those estimated to fit are compiled for the
target (deviceless XLA:GPU for H200s) and ranked by the compiled figures. The table row is the best
compiled layout: its compiled memory per device (arguments + unaliased outputs + temporaries), its
compiled matmul FLOPs over Megatron's model FLOPs for the same model and batch
(:func:`mlir_train.model.flops.num_floating_point_operations`, whose gated-DeltaNet layers count
Megatron-LM's ``gated_delta_net`` term), and the collective traffic of its optimized HLO per step
and device against Megatron's analytic volume, per kind (:func:`traffic`, as ``comm_audit``: a
ragged all-to-all at the rows it moves at a balanced routing, not its receive buffers). "Fewest" searches device counts (1, 2, 4, ... up to ``--max-devices``) for the smallest one
where a layout is estimated to fit, and compiles that layout to confirm it (``--no-fewest-compile``:
the estimate alone, labelled).

Depth: when every run of equal layers of the 3:1 DeltaNet/attention pattern was its own scanned
stack (20 for 40 layers) a full-depth compile cost about ten times a 4-layer one (over 25 minutes on
this 2-core machine); the decoder now scans over the pattern's periods (``model.periods``) and the
full-depth 35B-A3B 4k step compiles in about a minute (3-8 under load), so full depth is the
default to use; the extrapolation from the per-run program overstated memory up to 1.9x. ``--probe-layers P``
compiles each layout at P and 2P layers (one and two periods of the pattern) instead and
extrapolates memory, FLOPs (and Megatron's, beside them) and collective traffic (and Megatron's) linearly to the model's
depth (:func:`extrapolate`); the table marks those figures "(extrap.)". Without it every figure
is the full-depth compile. The layouts are chosen by the planner's own analytic estimate at full
depth (:func:`estimated_fits`), as ``--search`` chooses what to compile. Models with the same shapes
(Qwen3.6-35B-A3B is Qwen3.5-35B-A3B's architecture) are planned once and the row says so.
Full SFT is bf16 with fp32 master weights and Adam; LoRA is rank 16, alpha 32 on every linear
layer (the seed's LoRA job). Micro-batch 1, global batch 16 sequences, as the seed's job.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = ("qwen3.5-35b-a3b", "qwen3.6-35b-a3b", "qwen3-next-80b-a3b")
LORA_FLAGS = ("--lora-dim", "16", "--lora-alpha", "32")
GIB = 2**30


@dataclasses.dataclass
class Row:
    """One line of the table; figures per device, None where not compiled."""
    model: str
    seq: int
    mode: str                       # "sft" | "lora"
    num_devices: int
    layout: str | None = None
    needed_bytes: int | None = None
    verdict_from: str = "compiled"  # "compiled" | "estimate"
    flop_ratio: float | None = None
    collectives: dict[str, dict[str, int]] | None = None  # :func:`traffic`: per Megatron kind
    fewest: int | None = None
    fewest_layout: str | None = None
    fewest_from: str = "compiled"
    same_as: str | None = None      # a model with the same shapes, planned once
    note: str = ""

    def cells(self, memory_gib: float) -> list[str]:
        """The table's cells: memory in GiB and its share of the device, FLOPs as a ratio."""
        mem = "-" if self.needed_bytes is None else (
            f"{self.needed_bytes / GIB:.1f} GiB ({self.needed_bytes / GIB / memory_gib:.0%})" + SOURCE[self.verdict_from])
        flops = "-" if self.flop_ratio is None else f"{self.flop_ratio:.2f}x" + SOURCE[self.verdict_from]
        fewest = "-" if self.fewest is None else f"{self.fewest} ({self.fewest_layout})" + SOURCE[self.fewest_from]
        model = self.model + (f" (= {self.same_as})" if self.same_as else "")
        return [model, _seq(self.seq), "LoRA" if self.mode == "lora" else "full SFT", self.layout or self.note or "none fits",
                mem, flops, format_collectives(self.collectives), fewest]


# How a figure was obtained: the full-depth compile, compiles at two shallower depths extrapolated
# (--probe-layers), or the planner's analytic estimate alone.
SOURCE = {"compiled": "", "extrapolated": " (extrap.)", "estimate": " est."}
HEADER = ["model", "seq", "training", f"best layout on N x H200", "compiled memory / device", "FLOPs / Megatron",
          "collective traffic / step / device (vs Megatron)", "fewest H200s (layout)"]


def _seq(seq: int) -> str:
    return f"{seq // 1024}k" if seq % 1024 == 0 and seq >= 8192 else str(seq)


def traffic(plan) -> dict[str, dict[str, int]] | None:
    """A compiled plan's collectives per Megatron kind as ``comm_audit`` prints them: the bytes a
    device moves per step (ragged all-to-alls at the rows they carry at a balanced routing, not
    their receive buffers: ``Plan.comm_comparison``) beside Megatron's analytic volume."""
    if isinstance(plan, Probed):  # already per Megatron kind, extrapolated
        return plan.collectives
    if plan.comm_comparison is None:  # not compiled
        return None
    return {r["kind"]: {"bytes": r["compiled_bytes"], "megatron": r["megatron_bytes"]} for r in plan.comm_comparison}


def format_collectives(colls: dict[str, dict[str, int]] | None) -> str:
    """``all-to-all 60.0 GiB (1.00x)`` per kind, largest first: traffic per step and device, and
    its ratio to Megatron's volume (``Megatron: none`` where its count has none)."""
    if colls is None:
        return "-"
    def text(kind, c):
        mega = c.get("megatron", 0)
        return f"{kind} {c['bytes'] / GIB:.2f} GiB ({c['bytes'] / mega:.2f}x)" if mega else \
            f"{kind} {c['bytes'] / GIB:.2f} GiB (Megatron: none)"
    parts = [(c["bytes"], text(kind, c)) for kind, c in colls.items() if c["bytes"]]
    return ", ".join(t for _, t in sorted(parts, reverse=True)) or "none"


def format_table(rows: list[Row], device_kind: str, memory_gib: float) -> str:
    header = [h.replace("N x H200", f"{rows[0].num_devices} x {device_kind.upper()}") if rows else h for h in HEADER]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r.cells(memory_gib)) + " |" for r in rows]
    return "\n".join(lines)


def case_argv(model: str, seq: int, mode: str, num_devices: int, global_batch: int, extra=()) -> list[str]:
    """The sft flags of one case (the planner's own, the device kind, are passed beside them)."""
    argv = [*extra, "--model-name", model, "--seq-length", str(seq), "--micro-batch-size", "1",
            "--global-batch-size", str(global_batch), "--bf16", "--num-devices", str(num_devices),
            "--use-distributed-optimizer"]
    return argv + (list(LORA_FLAGS) if mode == "lora" else [])


def _setup(argv: list[str], device_kind: str, xla_cpu: bool):
    """The planner's run config and its compile settings (as ``python -m mlir_train.plan``)."""
    from mlir_train.config import cli
    from mlir_train.planner.plan import choose_compiler
    from mlir_train.planner.targets import DEVICE_KINDS

    cfg = cli.parse(argv)
    kind = DEVICE_KINDS[device_kind]
    target, note = choose_compiler(kind, force_cpu=xla_cpu)
    common = dict(memory_gb=kind.memory_bytes / GIB, peak_tflops=kind.bf16_tflops, assumed_mfu=0.4, target=target,
                  compiler_note=note, hlo_dir=None)
    return cfg, common


def plan_case(model: str, seq: int, mode: str, args) -> Row:
    """The planner's search on ``args.num_devices`` (``--estimate-only``: its analytic ranking
    alone, no compile), then the fewest devices."""
    row = Row(model, seq, mode, args.num_devices)
    argv = case_argv(model, seq, mode, args.num_devices, args.global_batch, args.flags)
    cfg, common = _setup(argv, args.device_kind, args.xla_cpu)
    fitting = [p for p in estimated_fits(cfg, args.num_devices, common, args.narrow, *_narrow_splits(args))
               if not {p.name, p.name.split(" ")[0]} & set(getattr(args, "skip", ()))]
    best = next(iter(fitting if args.estimate_only else compiled_fits(argv, args.num_devices, fitting[:args.top], args)),
                None)
    if best is not None:
        row.layout, row.needed_bytes, row.verdict_from = best.name, best.needed_bytes, best.verdict_from
        row.flop_ratio, row.collectives = best.flop_ratio, traffic(best)
    if args.fewest:
        fewest_devices(row, args)
    return row


def _narrow_splits(args) -> tuple[int, int]:
    return getattr(args, "narrow_pipeline", 1), getattr(args, "narrow_context", 1)


def estimated_fits(cfg, n: int, common: dict, narrow: bool = False, pipeline: int = 1, context: int = 1) -> list:
    """The planner's candidates on ``n`` devices (``narrow``: only PP ``pipeline``, CP ``context``
    (1, 1 unless asked) with full recompute and, where there are data ranks, the distributed
    optimizer) that its analytic estimate says fit, best first (no compile)."""
    from mlir_train.planner.plan import candidate_layouts, plan_layout
    from mlir_train.planner.report import Plan

    cands = [c for c in candidate_layouts(cfg, n) if not narrow or (
        c.pipeline == pipeline and c.context == context and c.recompute.name == "full"
        and (c.distributed_optimizer or n == c.tensor * c.pipeline * c.context))]  # ZeRO needs data ranks
    estimates = [plan_layout(cfg, c, n, compile_step=False, **common) for c in cands]
    return sorted((p for p in estimates if p.error is None and p.fits), key=Plan.ranking_key)


@dataclasses.dataclass
class Probed:
    """A layout's compiled figures at full depth, extrapolated linearly from two shallower compiles."""
    name: str
    needed_bytes: int
    flop_ratio: float
    collectives: dict[str, dict[str, int]]
    fits: bool
    matmul_flops: float
    verdict_from: str = "extrapolated"


def compiled_fits(argv: list[str], n: int, estimated: list, args) -> list:
    """``estimated`` compiled for the target (``--probe-layers P``: at P and 2P layers, extrapolated
    to the model's depth: :func:`extrapolate`), those that fit, fewest compiled FLOPs (the
    planner's compiled step time) then least memory first. A layout XLA refuses to compile is
    printed with its error and passed over (``--top N``: the next estimated layout stands in);
    ``--first-fit`` stops at the first that compiles and fits (the rest uncompiled)."""
    from mlir_train.planner.plan import plan_layout
    from mlir_train.planner.report import format_plan

    out = []
    for est in estimated:
        plans = []
        for layers in ((args.probe_layers, 2 * args.probe_layers) if args.probe_layers else (None,)):
            cfg, common = _setup(argv + ([] if layers is None else ["--num-layers", str(layers)]), args.device_kind,
                                 args.xla_cpu)
            plans.append(plan_layout(cfg, est.candidate, n, **common))
            print((f"[{layers} layers] " if layers else "") + format_plan(plans[-1], args.device_kind, 0.4), flush=True)
            if plans[-1].error is not None:  # the deeper probe would not compile either: not tried
                break
        if any(p.error is not None for p in plans):
            continue
        best = plans[0] if len(plans) == 1 else extrapolate(*plans, args.probe_layers, args.model_layers, args)
        if best.fits:
            out.append(best)
            if getattr(args, "first_fit", False):
                break
    key = lambda p: ((p.matmul_flops if isinstance(p, Probed) else p.compiled_matmul_flops) or 0, p.needed_bytes)
    return sorted(out, key=key)


def extrapolate(p1, p2, layers: int, model_layers: int, args) -> Probed:
    """Figures at ``model_layers`` from compiles at ``layers`` and ``2 * layers``: each is
    ``a + b * depth`` (the embedding, head and one layer's working set, plus per-layer state,
    checkpoints, FLOPs and collective traffic), so the difference of the two compiles is ``layers``
    layers' share. The analytic estimate and Megatron's FLOPs are linear in depth the same way."""
    from mlir_train.planner.targets import DEVICE_KINDS, USABLE_FRACTION

    scale = (model_layers - layers) / layers
    lin = lambda a, b: a + (b - a) * scale
    needed = int(lin(p1.needed_bytes, p2.needed_bytes))
    flops = lin(p1.compiled_matmul_flops, p2.compiled_matmul_flops)
    colls = {}
    t1, t2 = traffic(p1) or {}, traffic(p2) or {}
    for kind in sorted(set(t1) | set(t2)):
        c1, c2 = (t.get(kind, {"bytes": 0, "megatron": 0}) for t in (t1, t2))
        colls[kind] = {k: int(round(lin(c1[k], c2[k]))) for k in ("bytes", "megatron")}
    memory = DEVICE_KINDS[args.device_kind].memory_bytes
    return Probed(p1.name, needed, flops * p1.num_devices / lin(p1.flops_per_step, p2.flops_per_step), colls,
                  needed <= USABLE_FRACTION * memory, flops)


def fewest_devices(row: Row, args) -> None:
    """The smallest device count (powers of two from ``--min-devices`` up to ``--max-devices``)
    where a layout is estimated to fit; its best layouts compiled to confirm (the next count if no
    compiled step fits), or the estimate alone (``--no-fewest-compile``, ``--estimate-only``:
    labelled est.)."""
    compile_it = args.fewest_compile and not args.estimate_only
    n = args.min_devices
    while n <= args.max_devices:
        argv = case_argv(row.model, row.seq, row.mode, n, args.global_batch, args.flags)
        cfg, common = _setup(argv, args.device_kind, args.xla_cpu)
        fitting = estimated_fits(cfg, n, common, args.narrow, *_narrow_splits(args))[:args.top]
        best = next(iter(compiled_fits(argv, n, fitting, args) if compile_it else fitting), None)
        if best is not None:
            row.fewest, row.fewest_layout, row.fewest_from = n, best.name, best.verdict_from
            return
        n *= 2


def same_shapes(a: str, b: str) -> bool:
    from mlir_train.families import get_model_config

    ca, cb = get_model_config(a), get_model_config(b)
    return dataclasses.replace(ca, name=cb.name) == cb if hasattr(ca, "name") else ca == cb


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--seqs", nargs="+", type=int, default=[4096, 32768])
    p.add_argument("--modes", nargs="+", choices=("sft", "lora"), default=["sft", "lora"])
    p.add_argument("--num-devices", type=int, default=8)
    p.add_argument("--device-kind", default="h200")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--top", type=int, default=1, help="estimated-best layouts compiled per case (default 1)")
    p.add_argument("--first-fit", action="store_true",
                   help="compile the --top estimated layouts in the estimate's order only until one compiles and fits")
    p.add_argument("--skip", nargs="+", default=[], metavar="LAYOUT",
                   help="layouts not compiled on --num-devices, as the table names them, with or without the "
                        "' recompute=...' (e.g. one XLA is known to refuse)")
    p.add_argument("--max-devices", type=int, default=64)
    p.add_argument("--no-fewest", dest="fewest", action="store_false", help="skip the fewest-devices search")
    p.add_argument("--no-fewest-compile", dest="fewest_compile", action="store_false",
                   help="the fewest devices from the estimate alone (labelled est.)")
    p.add_argument("--narrow", action="store_true",
                   help="only PP1 CP1 layouts with the distributed optimizer and full recompute (faster)")
    p.add_argument("--narrow-pipeline", type=int, default=1, metavar="PP",
                   help="--narrow's pipeline size (default 1): the layouts with PP stages instead")
    p.add_argument("--narrow-context", type=int, default=1, metavar="CP",
                   help="--narrow's context-parallel size (default 1): the layouts with CP ranks instead")
    p.add_argument("--probe-layers", type=int, default=0,
                   help="compile at P and 2P layers and extrapolate to the model's depth (0: full depth)")
    p.add_argument("--min-devices", type=int, default=1, help="where the fewest-devices search starts")
    p.add_argument("--estimate-only", action="store_true",
                   help="rank and size layouts by the planner's analytic estimate alone (no compile; labelled est.)")
    p.add_argument("--xla-cpu", action="store_true", help="compile for XLA:CPU (no GPU verdict: estimates)")
    p.add_argument("--quick", action="store_true", help="qwen3.5-moe-tiny, seq 256, 2 devices, --narrow, padded experts (the smoke test)")
    return p


def main(argv: list[str] | None = None) -> list[Row]:
    args = _parser().parse_args(argv)
    args.flags = []
    if args.quick:  # the tiny model's 32-wide experts are below the Mosaic kernels' 64-row blocks
        args.models, args.seqs, args.num_devices, args.max_devices, args.global_batch, args.narrow = (
            ["qwen3.5-moe-tiny"], [256], 2, 2, 2, True)
        args.flags = ["--moe-gemm-backend", "padded"]
    from mlir_train.runtime.platform_setup import configure_platform

    configure_platform(compile_only=True, cpu_devices=max(args.num_devices, args.max_devices))
    from mlir_train.families import get_model_config
    from mlir_train.planner.targets import DEVICE_KINDS

    memory_gib = DEVICE_KINDS[args.device_kind].memory_bytes / GIB
    rows, start = [], time.time()
    for model in args.models:
        twin = next((r.model for r in rows if r.same_as is None and same_shapes(r.model, model)), None)
        for seq in args.seqs:
            for mode in args.modes:
                if twin is not None:
                    done = next(r for r in rows if (r.model, r.seq, r.mode) == (twin, seq, mode))
                    rows.append(dataclasses.replace(done, model=model, same_as=twin))
                    continue
                args.model_layers = get_model_config(model).num_layers
                print(f"\n=== {model}, seq {seq}, {mode} on {args.num_devices} x {args.device_kind} "
                      f"({time.time() - start:.0f}s)", flush=True)
                rows.append(plan_case(model, seq, mode, args))
                print(format_table(rows[-1:], args.device_kind, memory_gib), flush=True)  # a row as soon as it is known
    print(f"\n{format_table(rows, args.device_kind, memory_gib)}\n\n({time.time() - start:.0f}s)")
    return rows


if __name__ == "__main__":
    main()
