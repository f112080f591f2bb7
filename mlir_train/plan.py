"""``python -m mlir_train.plan``: will this layout fit, and how fast would it be, before renting it.

Takes the same flags as ``python -m mlir_train.sft`` plus::

    --num-devices N          accelerators of the target job (fake CPU devices here)
    --device-kind KIND       h100 | h200 | p800: memory 80 / 141 / 96 GiB, bf16 peak 989 / 989 / ?
    --device-memory-gb G     overrides the kind's memory
    --assumed-mfu F          model-FLOPs utilisation for the step-time estimate (default 0.4)
    --search [--search-top K]  try every layout instead of the one on the command line

It builds the real :class:`~mlir_train.train.Trainer` for the full-size model on N fake CPU
devices and compiles its training step ahead of time (``lower_train_step(abstract_state(),
batch ShapeDtypeStructs).compile()``): nothing is allocated, no data or tokenizer is read (the
vocabulary is the model config's, padded as Megatron pads it). Per device it reports:

* master weights (float32) and optimizer state: exact, from the state's shardings, and checked
  against the compiled step's argument bytes;
* the compute copy of the weights (bf16/fp16, gathered to the compute layout for the
  forward/backward) and the gradients (one micro-batch's in the compute layout + the float32
  accumulator in the master layout): exact sizes from the shardings;
* activations: an analytic estimate (below);
* FLOPs per step (Megatron's formula, :mod:`mlir_train.flops`; full recompute adds a forward),
  and the step time / tokens per second that ``--assumed-mfu`` of the device's peak gives. The
  estimate is compute-only but for the pipeline bubble (``(M + PP - 1) / M`` for M
  micro-batches): communication is not modelled, so layouts that differ only in TP/EP tie and
  ``--search`` orders those by memory headroom;
* whether it fits: total <= 95 % of the device memory (the rest for the CUDA context, NCCL
  buffers and allocator fragmentation).

Why the compiled XLA:CPU temp bytes are not the GPU's, and what the planner does instead
------------------------------------------------------------------------------------------
``memory_analysis()`` of the CPU executable gives exact argument/output sizes (the state is
laid out identically on any backend), but its temp size is not a GPU budget:

1. XLA:CPU has no bf16 matmul: its ``float-normalization-bf16`` pass rewrites every bf16 dot
   to float32, materialising float32 copies of bf16 weights and activations, so temporaries
   of a bf16 step come out up to ~2x too big (an fp32 step's would be about right);
2. the buffers are those of CPU fusion decisions and CPU scheduling, which order work to
   minimise live memory; the GPU latency-hiding scheduler instead starts collectives early
   to overlap them with compute, which keeps more buffers alive at once;
3. expert parallelism compiles the CPU dispatcher (dense all-to-all into a capacity buffer,
   with a dropless fallback branch of ``C = tokens``) where GPUs run the ragged one.

So the planner does not scale the CPU temp figure (none of the three is a constant factor).
It computes the temporaries from what the step holds: the weight-shaped ones exactly from the
shardings (compute copy, micro-batch gradients, accumulator), and the activations per
micro-batch from the model's shapes for the recompute policy -- per decoder layer the
residual stream, q/k/v/o and the attention's float32 log-sum-exp (its custom gradient
recomputes the ``[heads, T, T]`` probabilities, so those live only while one layer runs),
the router logits and the ragged expert buffers (``EP x tokens x top_k`` rows, their upper
bound); ``none`` keeps all of it for every layer, ``selective`` the outputs of dots without
batch dimensions (projections, router, dense MLP: not the attention core or the experts),
``full`` only each layer's input; one layer's working set (twice its
activations when recomputing: the recomputed forward and its gradients, plus the float32
attention matrices) and the float32 logits twice (logits and their gradient) come on top. The CPU temp figure is printed alongside, labelled, as a cross-check.

Pipeline parallelism: layouts with ``PP > 1`` are planned only where ``mlir_train.sft`` runs
them (otherwise they are reported as not implemented); a device then holds ``L / PP`` layers
(the largest stage's under ``--decoder-first/last-pipeline-num-layers``). Under 1F1B (the
default ``--pipeline-schedule``) it keeps ``2 R PP - 1`` chunk inputs and one chunk's
activations while that chunk's backward recomputes it, whatever the micro-batch count; under
GPipe / circular ``M`` (x R) times a stage's (chunk's) saved activations. The step-time
estimate counts the schedule's idle ticks and 1F1B's recomputed chunk forward
(``Schedule.step_factor``).
"""

from __future__ import annotations

import os
import sys


def _preset_devices(argv: list[str]) -> None:
    """Fake CPU devices and CPU-only XLA settings, before jax is imported."""
    from mlir_train.cli import flag_value  # imports no jax

    n = flag_value(argv, "--num-devices")
    flags = os.environ.get("XLA_FLAGS", "")
    if n and "--xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={n}"
    # XLA:CPU's all-reduce promotion (bf16 -> f32) aborts on the reducers Shardy emits for the
    # expert-parallel weight gradients in bf16; the planner never runs the program, and the
    # float-normalization pass still makes the all-reduces float32.
    if "all-reduce-promotion" not in flags:
        flags += " --xla_disable_hlo_passes=all-reduce-promotion"
    # Nothing compiled here ever runs: skip LLVM's optimisation (buffer sizes come from HLO).
    if "xla_backend_optimization_level" not in flags:
        flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    os.environ["XLA_FLAGS"] = flags.strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
    _preset_devices(sys.argv[1:])

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

GIB = 2**30
USABLE_FRACTION = 0.95
# name -> (memory GiB, dense bf16 peak TFLOP/s or None). The Kunlun P800's peak is not
# published in a form we could confirm: pass --peak-tflops for step-time estimates.
DEVICE_KINDS: dict[str, tuple[float, float | None]] = {"h100": (80.0, 989.0), "h200": (141.0, 989.0), "p800": (96.0, None)}


@dataclasses.dataclass(frozen=True)
class Layout:
    tensor: int = 1
    expert: int = 1
    pipeline: int = 1
    distributed_optimizer: bool = False
    recompute: str = "none"  # none | selective | full
    sequence_parallel: bool = False

    def name(self, num_devices: int) -> str:
        dp = num_devices // (self.tensor * self.pipeline)
        parts = [f"TP{self.tensor}", f"PP{self.pipeline}", f"EP{self.expert}", f"DP{dp}"]
        extra = (["SP"] if self.sequence_parallel else []) + (["distopt"] if self.distributed_optimizer else [])
        return "x".join(parts) + "".join("+" + e for e in extra) + f" recompute={self.recompute}"


@dataclasses.dataclass
class Plan:
    layout: Layout
    name: str
    master_bytes: int = 0
    optimizer_bytes: int = 0
    compute_weight_bytes: int = 0
    gradient_bytes: int = 0
    activation_bytes: int = 0
    batch_bytes: int = 0
    cpu_argument_bytes: int | None = None
    cpu_temp_bytes: int | None = None
    flops_per_step: float = 0.0
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    capacity_bytes: float = 0.0
    compile_s: float | None = None
    error: str | None = None

    @property
    def total_bytes(self) -> int:
        return (self.master_bytes + self.optimizer_bytes + self.compute_weight_bytes + self.gradient_bytes
                + self.activation_bytes + self.batch_bytes)

    @property
    def fits(self) -> bool:
        return self.error is None and self.total_bytes <= USABLE_FRACTION * self.capacity_bytes


def _pipeline_supported() -> bool:
    from mlir_train import sft

    return "pipeline-model-parallel-size > 1 is not implemented" not in inspect.getsource(sft)


def _device_bytes(tree: Any) -> int:
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def activation_bytes(cfg, layout: Layout, *, micro_batch: int, seq: int, dtype_bytes: int, num_micro: int = 1,
                     schedule=None) -> int:
    """Per-device activation memory of the forward/backward (see the module doc): one
    micro-batch's, or under pipeline parallelism a stage's layers for every micro-batch in
    flight (GPipe / circular keep all of them until their backward), or under 1F1B
    (``schedule``, a :class:`mlir_train.pipeline.Schedule`) its ``2 R P - 1`` saved chunk
    inputs plus one chunk's activations while its backward recomputes it."""
    from sharding.mesh import kv_heads_replicated

    a, b, t, d, tp = dtype_bytes, micro_batch, seq, cfg.hidden_size, layout.tensor
    sp = tp if layout.sequence_parallel else 1
    heads = cfg.num_heads // tp
    kv = cfg.num_kv_heads if kv_heads_replicated(tp, cfg.num_kv_heads) else max(1, cfg.num_kv_heads // tp)
    hd = cfg.head_dim
    rows = b * t
    residual = 2 * a * rows * d // sp
    # The attention's custom gradient keeps q, k, v, its output and a float32 log-sum-exp per
    # row; the [T, T] matrices (float32 scores/probabilities, their gradients) exist only
    # while one layer runs, so they count in the working set, not per layer.
    attn_core = a * rows * heads * hd + 4 * b * heads * t  # output + log-sum-exp
    attn = a * rows * (d + (heads + 2 * kv) * hd + (heads + kv) * hd) + attn_core
    attn_matrices = 3 * 4 * b * heads * t * t
    kinds = cfg.layer_kinds()
    if cfg.is_moe:
        s, k = rows // sp, cfg.top_k
        local = cfg.num_experts // layout.expert
        m = layout.expert * s * min(k, local)
        f = cfg.moe_intermediate_size // tp
        router = a * rows * d + 2 * 4 * s * cfg.num_experts
        experts = 2 * a * s * k * d + (a * m * d if layout.expert > 1 else 0) + 3 * a * m * f + a * m * d
    else:
        router = experts = 0
    moe = router + experts
    dense = a * rows * (d + 3 * cfg.intermediate_size // tp)
    per_layer = [residual + attn + (moe if is_moe else dense) for is_moe in kinds]
    chunks = schedule.virtual if schedule is not None else 1
    n = max(schedule.stage_layers) if schedule is not None and schedule.stage_layers else len(per_layer) // (layout.pipeline * chunks)
    per_layer = per_layer[:max(1, n)]  # the (largest) stage's, or one chunk's, layers
    if layout.recompute == "none":
        saved = sum(per_layer)
    elif layout.recompute == "selective":
        # Only dots without batch dimensions are kept (projections, router, dense MLP): the
        # attention core and the expert matmuls (batched, looped or ragged) are recomputed.
        saved = sum(per_layer) - len(per_layer) * attn_core - sum(kinds[:len(per_layer)]) * experts
    else:
        saved = len(per_layer) * a * rows * d // sp
    working = (1 if layout.recompute == "none" else 2) * max(per_layer) + attn_matrices
    logits = 2 * 4 * rows * (cfg.vocab_size // tp)
    if layout.pipeline > 1 and schedule is not None and schedule.saved_inputs() is not None:
        return int(schedule.saved_inputs() * a * rows * d // sp + saved + working + logits)
    in_flight = num_micro * chunks if layout.pipeline > 1 else 1
    return int(in_flight * saved + working + logits)


def _trainer(args, layout: Layout, num_devices: int):
    from mlir_train import sft
    from mlir_train.config import get_model_config
    from mlir_train.optim import loss_scaler_from_args, optimizer_from_args
    from mlir_train.schedule import schedule_from_args
    from mlir_train.train import StepConfig, Trainer, model_dims
    from sharding.mesh import ParallelConfig, make_mesh, validate

    vocab = args.vocab_size or get_model_config(args.model_name).vocab_size
    model_cfg = sft.build_model_config(
        args, sft.padded_vocab_size(vocab, args.make_vocab_size_divisible_by, layout.tensor))
    parallel = ParallelConfig(tensor=layout.tensor, pipeline=layout.pipeline, expert=layout.expert,
                              sequence_parallel=layout.sequence_parallel,
                              distributed_optimizer=layout.distributed_optimizer, num_devices=num_devices)
    gbs = args.global_batch_size or args.micro_batch_size * parallel.data_parallel
    parallel = validate(parallel, model_dims(model_cfg), global_batch_size=gbs,
                        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length)
    num_micro = gbs // (args.micro_batch_size * parallel.data_parallel)
    compute_dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
    # The GPU dispatcher (ragged); under EP on CPU the model falls back to the dense one.
    model_kwargs = dict(moe_impl="ragged", capacity_factor=args.moe_expert_capacity_factor,
                        drop_policy=args.moe_token_drop_policy, remat=layout.recompute) \
        if model_cfg.is_moe else dict(remat=layout.recompute)
    sched_args = argparse.Namespace(**(vars(args) | {"global_batch_size": gbs, "lr": args.lr or 1e-5,
                                                     "train_iters": args.train_iters or 1}))
    trainer = Trainer(
        model_cfg,
        StepConfig(num_micro_batches=num_micro, compute_dtype=compute_dtype,
                   aux_loss_coeff=args.moe_aux_loss_coeff or 0.0, z_loss_coeff=args.moe_z_loss_coeff or 0.0,
                   pipeline_schedule=args.pipeline_schedule or "1f1b",
                   layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage if layout.pipeline > 1 else None,
                   first_stage_layers=args.decoder_first_pipeline_num_layers if layout.pipeline > 1 else None,
                   last_stage_layers=args.decoder_last_pipeline_num_layers if layout.pipeline > 1 else None),
        optimizer_from_args(sched_args, schedule_from_args(sched_args)), parallel, make_mesh(parallel),
        loss_scaler=loss_scaler_from_args(args), model_kwargs=model_kwargs,
    )
    return trainer, model_cfg, gbs, num_micro


def plan_layout(args, layout: Layout, num_devices: int, *, memory_gb: float, peak_tflops: float | None,
                assumed_mfu: float, compile_step: bool = True) -> Plan:
    """Sizes (and, with ``compile_step``, the AOT-compiled step) of one layout."""
    import jax
    import jax.numpy as jnp

    from mlir_train import flops as flops_lib
    from mlir_train.train import BATCH_KEYS, DTYPES

    plan = Plan(layout, layout.name(num_devices), capacity_bytes=memory_gb * GIB)
    if layout.pipeline > 1 and not _pipeline_supported():
        plan.error = "pipeline parallelism is not implemented in mlir_train.sft yet"
        return plan
    try:
        trainer, model_cfg, gbs, num_micro = _trainer(args, layout, num_devices)
    except Exception as e:  # an invalid layout for this model / device count
        plan.error = str(e).splitlines()[0]
        return plan
    state = trainer.abstract_state()
    rows = gbs // num_micro
    batch = {k: jax.ShapeDtypeStruct((num_micro, rows, args.seq_length),
                                     jnp.float32 if k == "loss_mask" else jnp.int32, sharding=trainer.batch_sharding)
             for k in BATCH_KEYS}
    dtype = DTYPES[trainer.step_cfg.compute_dtype]
    plan.master_bytes = _device_bytes(state["params"])
    plan.optimizer_bytes = _device_bytes(state["opt_state"]) + _device_bytes(state["loss_scale"])
    compute = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh),
                           trainer.param_shapes, trainer.compute_shardings)
    master_specs = jax.tree.map(lambda s: s.sharding.spec, state["params"])
    compute_specs = jax.tree.map(lambda s: s.sharding.spec, compute)
    needs_copy = dtype != jnp.float32 or jax.tree.leaves(master_specs) != jax.tree.leaves(compute_specs)
    plan.compute_weight_bytes = _device_bytes(compute) if needs_copy else 0
    plan.gradient_bytes = _device_bytes(compute) + plan.master_bytes
    plan.batch_bytes = _device_bytes(batch)
    plan.activation_bytes = activation_bytes(model_cfg, layout, micro_batch=args.micro_batch_size,
                                             seq=args.seq_length, dtype_bytes=jnp.dtype(dtype).itemsize,
                                             num_micro=num_micro, schedule=trainer.schedule)
    plan.flops_per_step = flops_lib.num_floating_point_operations(model_cfg, args.seq_length, gbs)
    if peak_tflops:
        hardware = plan.flops_per_step * (4 / 3 if layout.recompute == "full" else 1.0)
        if trainer.schedule is not None:  # the pipeline bubble (and 1F1B's recomputed chunk forward)
            hardware *= trainer.schedule.step_factor(num_micro, layout.recompute)
        plan.step_time_s = hardware / (num_devices * peak_tflops * 1e12 * assumed_mfu)
        plan.tokens_per_s = gbs * args.seq_length / plan.step_time_s
    if compile_step:
        t0 = time.perf_counter()
        try:
            compiled = trainer.lower_train_step(state, batch).compile()
        except Exception as e:
            plan.error = f"does not compile: {str(e).splitlines()[0]}"
            return plan
        plan.compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        if mem is not None:
            plan.cpu_argument_bytes = int(mem.argument_size_in_bytes)
            plan.cpu_temp_bytes = int(mem.temp_size_in_bytes)
    return plan


def candidate_layouts(args, num_devices: int) -> list[Layout]:
    """TP (within one 8-device node), EP, PP that divide the model, distributed optimizer on/off,
    recompute none/full; DP is what is left."""
    from mlir_train.config import get_model_config

    cfg = get_model_config(args.model_name)
    divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
    pipelines = [p for p in divisors if cfg.num_layers % p == 0] if _pipeline_supported() else [1]
    out = []
    for pp in pipelines:
        for tp in (d for d in divisors if d <= 8 and num_devices % (d * pp) == 0):
            dp = num_devices // (tp * pp)
            experts = [e for e in divisors if dp % e == 0 and cfg.is_moe and cfg.num_experts % e == 0] or [1]
            for ep in experts:
                for distopt in ((True, False) if dp > 1 else (False,)):  # ZeRO needs data ranks
                    for recompute in ("none", "full"):
                        out.append(Layout(tp, ep, pp, distopt, recompute, args.sequence_parallel and tp > 1))
    return out


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:8.2f} GiB"


def format_plan(plan: Plan, kind: str, assumed_mfu: float) -> str:
    lines = [f"layout {plan.name}"]
    if plan.error:
        return lines[0] + f"\n  NOT PLANNED: {plan.error}"
    rows = [
        ("master weights (fp32)", plan.master_bytes),
        ("optimizer state", plan.optimizer_bytes),
        ("compute weights (gathered)", plan.compute_weight_bytes),
        ("gradients (micro + fp32 accumulator)", plan.gradient_bytes),
        (f"activations (estimate, recompute={plan.layout.recompute})", plan.activation_bytes),
        ("batch", plan.batch_bytes),
        ("total per device", plan.total_bytes),
    ]
    lines += [f"  {label:<44s} {_gib(value)}" for label, value in rows]
    if plan.cpu_argument_bytes is not None:
        lines.append(f"  {'XLA:CPU compiled: arguments (exact)':<44s} {_gib(plan.cpu_argument_bytes)}")
        lines.append(f"  {'XLA:CPU compiled: temp (CPU, not a GPU budget)':<44s} {_gib(plan.cpu_temp_bytes)}"
                     f"   (compiled in {plan.compile_s:.1f}s)")
    lines.append(f"  FLOPs per step (model): {plan.flops_per_step:.3e}")
    if plan.step_time_s is not None:
        lines.append(f"  at MFU {assumed_mfu:.0%}: step {plan.step_time_s:.2f}s, {plan.tokens_per_s:,.0f} tokens/s")
    else:
        lines.append("  step time: unknown peak for this device; pass --peak-tflops")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines.append(f"  {verdict} in {plan.capacity_bytes / GIB:.0f} GiB ({kind}; {USABLE_FRACTION:.0%} usable): "
                 f"{plan.total_bytes / GIB:.1f} GiB needed")
    return "\n".join(lines)


def _planner_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlir_train.plan", add_help=False)
    p.add_argument("--device-kind", choices=sorted(DEVICE_KINDS), default="h200")
    p.add_argument("--device-memory-gb", type=float, default=None)
    p.add_argument("--assumed-mfu", type=float, default=0.4)
    p.add_argument("--search", action="store_true")
    p.add_argument("--search-top", type=int, default=None,
                   help="compile only the K layouts with the best estimates (default: every one that fits)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the plans as JSON")
    return p


def main(argv: list[str] | None = None) -> list[Plan]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return []
    own, rest = _planner_parser().parse_known_args(argv)
    from mlir_train import cli

    args, _ = cli.parse_args(rest)
    if args.seq_length is None or args.micro_batch_size is None:
        raise SystemExit("error: --seq-length and --micro-batch-size are required")
    import jax

    num_devices = args.num_devices or jax.device_count()
    if num_devices > jax.device_count():
        raise SystemExit(f"error: --num-devices {num_devices} but this process has {jax.device_count()} devices "
                         "(run it as python -m mlir_train.plan, which creates them)")
    memory_gb = own.device_memory_gb or DEVICE_KINDS[own.device_kind][0]
    kind_peak = DEVICE_KINDS[own.device_kind][1]
    # fp32 matmuls run as TF32 on these GPUs: half the bf16 peak.
    peak = args.peak_tflops or (kind_peak and kind_peak * (1.0 if args.bf16 or args.fp16 else 0.5))
    common = dict(memory_gb=memory_gb, peak_tflops=peak, assumed_mfu=own.assumed_mfu)
    print(f"mlir-train plan: {args.model_name} on {num_devices} x {own.device_kind} ({memory_gb:.0f} GiB), "
          f"seq {args.seq_length}, micro-batch {args.micro_batch_size}, global batch "
          f"{args.global_batch_size or 'micro x DP'}, {'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}")
    if not own.search:
        remat = {None: "none", "full": "full", "selective": "selective"}[args.recompute_granularity]
        layout = Layout(args.tensor_model_parallel_size, args.expert_model_parallel_size,
                        args.pipeline_model_parallel_size, args.use_distributed_optimizer, remat,
                        args.sequence_parallel)
        plan = plan_layout(args, layout, num_devices, **common)
        print(format_plan(plan, own.device_kind, own.assumed_mfu))
        _write_json(own.json, [plan])
        return [plan]

    estimates = [plan_layout(args, l, num_devices, compile_step=False, **common) for l in candidate_layouts(args, num_devices)]
    valid = [p for p in estimates if p.error is None]
    fitting = sorted((p for p in valid if p.fits), key=lambda p: (-(p.tokens_per_s or 0), p.total_bytes))
    if own.search_top is not None:
        fitting = fitting[:own.search_top]
    print(f"{len(estimates)} layouts, {len(valid)} valid for this model, {len(fitting)} to compile "
          f"(estimated to fit{'' if own.search_top is None else f', best {own.search_top}'})")
    for p in estimates:
        if p.error is None and not p.fits:
            print(f"  does not fit: {p.name}: {p.total_bytes / GIB:.1f} GiB > "
                  f"{USABLE_FRACTION * memory_gb:.0f} GiB usable")
        elif p.error is not None:
            print(f"  not planned: {p.name}: {p.error}")
    ranked = []
    for p in fitting:
        compiled = plan_layout(args, p.layout, num_devices, **common)
        print(format_plan(compiled, own.device_kind, own.assumed_mfu), flush=True)
        if compiled.error is None:
            ranked.append(compiled)
    ranked.sort(key=lambda p: (-(p.tokens_per_s or 0), p.total_bytes))
    print("\nranking (estimated throughput, then memory):" if ranked else
          "\nno layout fits: more devices, --recompute-granularity full, a shorter --seq-length or a smaller "
          "--micro-batch-size")
    for i, p in enumerate(ranked, 1):
        speed = f"{p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else "speed unknown"
        print(f"  {i:2d}. {p.name:<48s} {p.total_bytes / GIB:7.1f} GiB  {speed}")
    _write_json(own.json, ranked)
    return ranked


def _write_json(path: str | None, plans: list[Plan]) -> None:
    if path:
        import json

        rows = [dataclasses.asdict(p) | {"total_bytes": p.total_bytes, "fits": p.fits} for p in plans]
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
