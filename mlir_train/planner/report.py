"""A plan (:class:`Plan`: one layout's figures and verdict) and its report: as text (:func:`format_plan`), as JSON
(:func:`write_json`). These are report lines (``print``), not the library's ``mlir-train:`` log."""

from __future__ import annotations

import dataclasses
import json

from mlir_train.planner.candidates import Candidate
from mlir_train.planner.hlo import Collective, format_collectives as fmt
from mlir_train.planner.targets import GIB, USABLE_FRACTION


# ----- one layout's plan: its figures and its verdict ---------------------------------------------
@dataclasses.dataclass
class Plan:
    candidate: Candidate
    name: str
    num_devices: int = 1
    # Analytic breakdown (exact sizes from the shardings; activations estimated).
    master_bytes: int = 0
    optimizer_bytes: int = 0
    compute_weight_bytes: int = 0
    frozen_base_bytes: int = 0               # LoRA: the frozen base, held in the compute dtype
    gradient_bytes: int = 0
    activation_bytes: int = 0
    batch_bytes: int = 0
    # The compiled step, per device: which compiler, its memory analysis and HLO audit.
    compiler: str | None = None              # "XLA:GPU h200 (deviceless)" | "XLA:CPU (...)"
    compiler_note: str | None = None         # why not XLA:GPU, where it is not
    compiled_for_target: bool = False        # True: the compiled figures decide the verdict
    moe_impl: str | None = None              # the MoE implementation the mesh's platform chose
    compiled_argument_bytes: int | None = None
    compiled_temp_bytes: int | None = None
    compiled_needed_bytes: int | None = None
    compiled_matmul_flops: float | None = None   # per device per step
    collectives: dict[str, dict[str, int]] | None = None  # kind -> {"count", "bytes"} per device
    conditionals: int = 0
    unknown_loops: int = 0                   # while loops without a known trip count (counted once)
    # With conditionals: the cheapest branches' figures (e.g. a dropless dispatcher's no-overflow path).
    compiled_matmul_flops_cheapest: float | None = None
    collectives_cheapest: dict[str, dict[str, int]] | None = None
    uncounted_custom_calls: dict[str, int] | None = None
    flops_per_step: float = 0.0              # Megatron's model FLOPs, all devices
    step_time_s: float | None = None         # from the model FLOPs at --assumed-mfu
    tokens_per_s: float | None = None
    compiled_step_time_s: float | None = None  # from the compiled matmul FLOPs at the same fraction of peak
    compiled_tokens_per_s: float | None = None
    # The communication audit, overlap and roofline (mlir_train.planner.comm / roofline).
    tokens_per_step: int = 0
    megatron_stage: int | None = None        # the pipeline stage whose device Megatron's volumes are for
    megatron_volumes: list[dict] | None = None  # comm.Volume rows
    collective_traffic: dict[str, dict[str, int]] | None = None  # ragged all-to-alls at their traffic
    comm_comparison: list[dict] | None = None    # kind, compiled_bytes, megatron_bytes, ratio
    collectives_by_axes: list[dict] | None = None  # kind, axes, count, bytes, overlapped, matmul_overlapped
    overlap: dict[str, dict[str, int]] | None = None  # kind -> executions (and bytes) overlapped
    megatron_executed_flops: float | None = None  # model FLOPs x (3 + recomputed share) / 3, all devices
    megatron_busiest_device_flops: float | None = None  # what one device of Megatron's busiest stage executes
    megatron_busiest_flops_stage: int | None = None
    collective_traffic_bound: dict[str, dict[str, int]] | None = None  # costliest branches (every overflow round)
    compiled_matmul_flops_balanced: float | None = None  # per device, block kernels at a balanced routing
    hbm_bytes: float | None = None
    roofline: dict | None = None
    published_reference: dict | None = None
    capacity_bytes: float = 0.0
    compile_s: float | None = None
    error: str | None = None

    @property
    def total_bytes(self) -> int:
        """The analytic estimate of what one device holds."""
        return (self.master_bytes + self.optimizer_bytes + self.compute_weight_bytes + self.frozen_base_bytes
                + self.gradient_bytes + self.activation_bytes + self.batch_bytes)

    @property
    def needed_bytes(self) -> int:
        """What decides the verdict: the target compiler's figure, else the analytic estimate."""
        if self.compiled_for_target and self.compiled_needed_bytes is not None:
            return self.compiled_needed_bytes
        return self.total_bytes

    @property
    def verdict_from(self) -> str:
        return "compiled" if self.compiled_for_target and self.compiled_needed_bytes is not None else "estimate"

    @property
    def fits(self) -> bool:
        return self.error is None and self.needed_bytes <= USABLE_FRACTION * self.capacity_bytes

    @property
    def flop_ratio(self) -> float | None:
        """Compiled matmul FLOPs (all devices) / Megatron's model FLOPs."""
        if self.compiled_matmul_flops is None or not self.flops_per_step:
            return None
        return self.compiled_matmul_flops * self.num_devices / self.flops_per_step

    @property
    def executed_flop_ratio(self) -> float | None:
        """Compiled matmul FLOPs per device at a balanced routing / what one device of Megatron's
        busiest pipeline stage executes (the stage that sets its step time; without a pipeline,
        every device). Our devices all run one SPMD program, so its per-device count is the
        busiest device's."""
        if self.compiled_matmul_flops_balanced is None or not self.megatron_busiest_device_flops:
            return None
        return self.compiled_matmul_flops_balanced / self.megatron_busiest_device_flops

    @property
    def executed_flop_ratio_average(self) -> float | None:
        """The same over Megatron's average device (all its executed FLOPs / devices)."""
        if self.compiled_matmul_flops_balanced is None or not self.megatron_executed_flops:
            return None
        return self.compiled_matmul_flops_balanced * self.num_devices / self.megatron_executed_flops

    def ranking_key(self) -> tuple[float, int]:
        speed = self.compiled_tokens_per_s if self.compiled_for_target and self.compiled_tokens_per_s else self.tokens_per_s
        return (-(speed or 0.0), self.needed_bytes)


def _gib(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:8.2f} GiB" if abs(n) >= GIB / 10 else f"{n / 2**20:8.2f} MiB"


def format_collectives(collectives: dict[str, dict[str, int]] | None) -> str:
    return fmt({k: Collective(v["count"], v["bytes"]) for k, v in (collectives or {}).items()})


def _compiled_lines(plan: Plan) -> list[str]:
    """The compiled figures of a plan: memory analysis, collectives, matmul FLOPs."""
    on_target = plan.compiled_for_target
    head = f"  compiled by {plan.compiler} in {plan.compile_s:.1f}s" + \
        (f" (MoE: {plan.moe_impl})" if plan.moe_impl else "") + ", per device"
    lines = [head + (f" ({plan.compiler_note})" if plan.compiler_note else "") + ":"]
    temp_label = "temporaries" if on_target else "temp (CPU, not a GPU budget)"
    lines += [f"    {'arguments (state + batch)':<46s} {_gib(plan.compiled_argument_bytes)}",
              f"    {temp_label:<46s} {_gib(plan.compiled_temp_bytes)}",
              f"    {'needed (args + unaliased outputs + temp)':<46s} {_gib(plan.compiled_needed_bytes)}"]
    more = f" (costliest branch of {plan.conditionals} conditionals)" if plan.conditionals else ""
    buffers = ("; buffer sizes: a ragged-all-to-all's are its receive buffers, not the rows it moves"
               if "ragged-all-to-all" in (plan.collectives or {}) else "")
    lines.append(f"    collectives{more}{buffers}: {format_collectives(plan.collectives)}")
    if plan.conditionals:
        lines.append(f"    collectives (cheapest branches): {format_collectives(plan.collectives_cheapest)}")
    if plan.flop_ratio is not None:
        lines.append(f"    matmul FLOPs{more} {plan.compiled_matmul_flops:.3e} per device = {plan.flop_ratio:.2f}x "
                     f"Megatron's model FLOPs ({plan.flops_per_step:.3e} over {plan.num_devices} devices)")
    if plan.conditionals and plan.flops_per_step:
        cheap = plan.compiled_matmul_flops_cheapest
        lines.append(f"    matmul FLOPs (cheapest branches) {cheap:.3e} per device = "
                     f"{cheap * plan.num_devices / plan.flops_per_step:.2f}x Megatron's model FLOPs")
    if plan.unknown_loops:
        lines.append(f"    ({plan.unknown_loops} while loops without a known trip count: their bodies counted once, "
                     "so FLOPs and collectives above are lower bounds)")
    if plan.uncounted_custom_calls:
        lines.append("    custom calls whose FLOPs the HLO does not show (not counted): "
                     + ", ".join(f"{t} x{n}" for t, n in plan.uncounted_custom_calls.items()))
    return lines + _audit_lines(plan)


def _audit_lines(plan: Plan) -> list[str]:
    """The communication audit, the overlap counts and the roofline of a compiled plan."""
    from mlir_train.planner.comm import gib

    lines = []
    if plan.executed_flop_ratio is not None:
        lines.append(f"    matmul FLOPs at a balanced routing {plan.compiled_matmul_flops_balanced:.3e} per device = "
                     f"{plan.executed_flop_ratio:.2f}x what a device of Megatron's busiest stage "
                     f"({plan.megatron_busiest_flops_stage}) executes ({plan.megatron_busiest_device_flops:.3e}: "
                     f"model FLOPs with its recompute), {plan.executed_flop_ratio_average:.2f}x its average device "
                     f"({plan.megatron_executed_flops / plan.num_devices:.3e})")
    if plan.comm_comparison:
        lines.append(f"  communication TRAFFIC per device per step: compiled vs Megatron's analytic volume "
                     f"(mlir_train.planner.comm; Megatron's busiest stage, {plan.megatron_stage}; "
                     "all-to-all includes the ragged ones at the rows they move, not their buffers):")
        for row in plan.comm_comparison:
            ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "(Megatron: none)"
            lines.append(f"    {row['kind']:<15s} compiled {gib(row['compiled_bytes']):>11s}  Megatron "
                         f"{gib(row['megatron_bytes']):>11s}  {ratio}")
        if plan.collective_traffic_bound:
            lines.append("    (compiled: a balanced routing, the overflow rounds' no-overflow branch; every overflow "
                         "round taken: " + format_collectives(plan.collective_traffic_bound) + ")")
    if plan.collectives_by_axes:
        lines.append("  compiled collectives by mesh axes, buffer sizes (executions overlapped with compute / with "
                     "matmuls):")
        for row in plan.collectives_by_axes:
            if row["bytes"] >= 2**20:
                lines.append(f"    {row['kind']:<19s} {row['axes']:<24s} {row['count']:6d}x {gib(row['bytes']):>11s}  "
                             f"overlapped {row['overlapped']}/{row['count']}, with matmuls {row['matmul_overlapped']}")
    if plan.roofline:
        r, k = plan.roofline, plan.roofline["constants"]
        lines.append(f"  roofline (an ESTIMATE, per device): matmul {r['compute_s']:.2f}s at {k['peak_flops'] / 1e12:.0f} "
                     f"TFLOP/s, HBM {r['memory_s']:.2f}s at {k['hbm_bytes_per_s'] / 1e12:.2f} TB/s "
                     f"({plan.hbm_bytes / 1e12:.1f} TB), exposed collectives {r['comm_s']:.2f}s at "
                     f"{k['link_bytes_per_s'] / 1e9:.0f} GB/s ({gib(r['exposed_bytes'])}): step {r['step_s']:.2f}s "
                     f"({r['bound']}-bound), {r['tokens_per_s']:,.0f} tokens/s, "
                     f"{r['model_tflops_per_device']:.0f} model TFLOP/s per device")
        if r.get("step_s_at_imbalance"):
            lines.append("    natural routing (busiest EP rank's rows / mean -> step, an ESTIMATE): " + ", ".join(
                f"{float(f):g}x -> {t:.2f}s" for f, t in r["step_s_at_imbalance"].items()))
        lines.append("    constants: " + "; ".join(f"{n}: {s}" for n, s in k["sources"].items()))
        if plan.published_reference:
            ref = plan.published_reference
            lines.append(f"    published: {ref['tflops_per_device']:.0f} model TFLOP/s per {ref['device']} "
                         f"({ref['precision']}; {ref['source']})")
    return lines


def step_time_line(plan: Plan, assumed_mfu: float) -> str:
    """The one step time a plan leads with (the figure ``--search`` ranks by) and where it comes from."""
    if plan.compiled_for_target and plan.compiled_step_time_s is not None:
        peak = plan.compiled_matmul_flops / plan.compiled_step_time_s / assumed_mfu / 1e12
        branch = " (every overflow round taken)" if plan.conditionals else ""
        return (f"  step time {plan.compiled_step_time_s:.2f}s, {plan.compiled_tokens_per_s:,.0f} tokens/s: the compiled "
                f"program's matmul FLOPs{branch} at {assumed_mfu:.0%} of the {peak:.0f} TFLOP/s peak (--assumed-mfu); "
                "the roofline and Megatron-FLOPs times below are cross-checks")
    if plan.step_time_s is not None:
        return (f"  step time {plan.step_time_s:.2f}s, {plan.tokens_per_s:,.0f} tokens/s: Megatron's model FLOPs at "
                f"{assumed_mfu:.0%} of peak (--assumed-mfu), an estimate: no program was compiled for this target")
    return "  step time: unknown peak for this device; pass --peak-tflops"


def format_plan(plan: Plan, kind: str, assumed_mfu: float) -> str:
    lines = [f"layout {plan.name}"]
    if plan.error:
        return lines[0] + f"\n  NOT PLANNED: {plan.error}"
    lines.append(step_time_line(plan, assumed_mfu))
    on_target = plan.compiled_for_target
    if plan.compiled_argument_bytes is not None:
        lines += _compiled_lines(plan)
    rows = [
        ("master weights (fp32)", plan.master_bytes),
        ("optimizer state", plan.optimizer_bytes),
        ("compute weights (gathered)", plan.compute_weight_bytes),
        *((("LoRA frozen base (compute dtype)", plan.frozen_base_bytes),) if plan.frozen_base_bytes else ()),
        ("gradients (micro + fp32 accumulator)", plan.gradient_bytes),
        (f"activations (estimate, recompute={plan.candidate.recompute.name})", plan.activation_bytes),
        ("batch", plan.batch_bytes),
        ("total per device", plan.total_bytes),
    ]
    lines.append("  analytic breakdown (exact state sizes from the shardings, activations estimated):")
    lines += [f"    {label:<46s} {_gib(value)}" for label, value in rows]
    if plan.compiled_argument_bytes is not None:
        args_est = plan.master_bytes + plan.optimizer_bytes + plan.frozen_base_bytes + plan.batch_bytes
        temp_est = plan.total_bytes - args_est
        lines.append(f"  compiled vs analytic: arguments {plan.compiled_argument_bytes / GIB:.2f} vs {args_est / GIB:.2f} "
                     f"GiB ({'equal' if abs(plan.compiled_argument_bytes - args_est) <= 1e-6 * args_est + 64 else 'DIFFER'}: "
                     f"the same state and batch); temporaries {plan.compiled_temp_bytes / GIB:.2f} vs {temp_est / GIB:.2f} "
                     f"GiB ({(plan.compiled_temp_bytes - temp_est) / GIB:+.2f} GiB: "
                     + ("the compiler's buffers are what this program allocates -- fusion outputs, collective "
                        "buffers kept live to overlap them, loop carries -- where the estimate counts the "
                        "tensors the step must hold" if on_target else
                        "XLA:CPU's float32 copies of bf16 operands and CPU scheduling; the estimate decides") + ")")
    lines.append(f"  FLOPs per step (model): {plan.flops_per_step:.3e}")
    if plan.step_time_s is not None and plan.compiled_for_target and plan.compiled_step_time_s is not None:
        lines.append(f"  cross-check: Megatron's model FLOPs at MFU {assumed_mfu:.0%}: step {plan.step_time_s:.2f}s, "
                     f"{plan.tokens_per_s:,.0f} tokens/s")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    source = (f"compiled by {plan.compiler}" if plan.verdict_from == "compiled"
              else "analytic estimate" + (f"; {plan.compiler_note}" if plan.compiler_note else ""))
    lines.append(f"  {verdict} in {plan.capacity_bytes / GIB:.0f} GiB ({kind}; {USABLE_FRACTION:.0%} usable): "
                 f"{plan.needed_bytes / GIB:.1f} GiB needed ({source})")
    return "\n".join(lines)


def write_json(path: str | None, plans: list[Plan]) -> None:
    """The plans as JSON rows: every field (the candidate as its layout's sizes and the recompute
    policy's name) and the derived figures."""
    if path:
        rows = []
        for p in plans:
            row = dataclasses.asdict(p)
            del row["candidate"]
            rows.append({"layout": dataclasses.asdict(p.candidate.layout) | {"recompute": p.candidate.recompute.name}}
                        | row | {"total_bytes": p.total_bytes, "needed_bytes": p.needed_bytes,
                               "verdict_from": p.verdict_from, "flop_ratio": p.flop_ratio, "fits": p.fits,
                               "executed_flop_ratio": p.executed_flop_ratio,
                               "executed_flop_ratio_average": p.executed_flop_ratio_average})
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
