"""``python -m mlir_train.plan``: will this layout fit, and how fast would it be, before renting it.

Takes the same flags as ``python -m mlir_train.sft`` plus::

    --num-devices N          accelerators of the target job (default 8)
    --device-kind KIND       h100 | h200 | b200 | p800 (mlir_train.planner.targets: memory, bf16 peak, source)
    --device-memory-gb G     overrides the kind's memory (GiB)
    --assumed-mfu F          model-FLOPs utilisation for the step-time estimate (default 0.4)
    --search [--search-top K]  try every layout instead of the one on the command line
    --xla-cpu                compile for XLA:CPU even where the XLA:GPU compiler is installed
    --hlo-dir DIR            write each compiled step's optimized HLO text to DIR

It builds the real :class:`~mlir_train.train.trainer.Trainer` for the full-size model and compiles its
training step ahead of time (``lower_train_step(abstract_state(), batch ShapeDtypeStructs)
.compile()``): nothing is allocated, no data or tokenizer is read (the vocabulary is the model
config's, padded as Megatron pads it).

The compiler is the target's: for h100/h200/b200 the step is compiled by XLA:GPU for N
compile-only devices of that kind (deviceless, :mod:`mlir_train.planner.targets`; no GPU needed, but
a jax CUDA plugin and ptxas must be installed: ``jax-cuda12-plugin``, ``jax-cuda12-pjrt`` and
``nvidia-cuda-nvcc-cu12`` for jax 0.10.2, ``jax-cuda13-plugin``, ``jax-cuda13-pjrt`` and
``nvidia-cuda-nvcc`` for jax 0.12.1; :func:`mlir_train.planner.targets.gpu_compiler_missing`),
with the GPU runtime settings ``mlir_train.sft`` uses there (:mod:`mlir_train.runtime.platform_setup`),
and with the MoE implementation the mesh's platform selects. Per device it reports:

* the compiled figures (XLA:GPU): arguments, temporaries and what the step needs in all
  (the compiler's peak where it gives one, else arguments + unaliased outputs + temp), which
  decide whether it FITS into the device memory times the allocator's fraction (95 %, the
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` ``sft`` sets; the rest is for the CUDA context, NCCL and
  cuBLAS);
* the collectives of the optimized HLO by kind with their bytes, and its matmul FLOPs (dots and
  GEMM custom calls, loops counted by their trip counts: :mod:`mlir_train.planner.hlo`) against
  Megatron's model FLOPs (:mod:`mlir_train.model.flops`) as a ratio (recomputation, padding and
  pipeline-bubble work make it exceed 1);
* beside them, labelled, the analytic breakdown: master weights (float32) and optimizer
  state (exact, from the state's shardings: they must equal the compiled argument bytes),
  the compute copy of the weights and the gradients (exact sizes from the shardings) and an
  activation estimate (below), with the difference to the compiled temporaries;
* step time and tokens/s at ``--assumed-mfu``: from Megatron's FLOPs (MFU as Megatron defines
  it; full recompute and the pipeline bubble added), and from the compiled matmul FLOPs at the
  same fraction of the peak. ``--search`` compiles the candidate layouts the analytic estimate
  says fit (the ``--search-top K`` best of them), drops those the compiled step says do not, and
  ranks the rest by the compiled figures (compiled step time, then compiled memory).

Exit status: 0 when the layout fits (with ``--search``: when some layout does), 3
(:data:`EXIT_DOES_NOT_FIT`) when it does not, 2 with one error line when the layout cannot exist
on the devices or a flag is bad: scripts can branch on it.

Without the GPU compiler installed the planner says so, compiles for XLA:CPU instead and
decides from the analytic estimate (labelled): XLA:CPU's temporaries are no GPU budget (below).
The Kunlun P800 has no XLA:GPU target: it is planned by memory only (CPU compile for the exact
state bytes, the analytic estimate for the verdict), labelled as such.

Why the compiled XLA:CPU temp bytes are not the GPU's, and what the estimate counts
----------------------------------------------------------------------------------
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
The analytic estimate computes the temporaries from what the step holds: the weight-shaped ones exactly from the
shardings (compute copy, micro-batch gradients, accumulator), and the activations per
micro-batch from the model's shapes for the recompute policy -- per decoder layer the
residual stream, q/k/v/o and the attention's float32 log-sum-exp (its custom gradient
recomputes the ``[heads, T, T]`` probabilities, so those live only while one layer runs),
the router logits and the ragged expert buffers (``EP x tokens x top_k`` rows, their upper
bound; with ``--expert-tensor-parallel-size`` below TP each tensor rank that is an expert rank
dispatches its own share of the tokens, above TP the expert-tensor ranks gather ``ETP / TP``
ranks' rows, and the expert width is split ``F / ETP``); ``none`` keeps all of it for every
layer; ``selective`` drops what its
``--recompute-modules`` recompute (core_attn: the attention output and log-sum-exp; layernorm:
the two norm outputs; moe_act: the expert activation; mlp / moe: the block's activations but
its input); ``full`` keeps only each recomputed layer's input (uniform: one per group of
``--recompute-num-layers``; block: the first N layers of a chunk, the others keep everything);
one layer's working set (with full recompute, that of a recomputed group and its gradients,
plus the float32 attention matrices) and the float32 logits twice (logits and their gradient)
come on top. The CPU temp figure is printed alongside, labelled, as a cross-check.

Pipeline parallelism: layouts with ``PP > 1`` are planned only where ``mlir_train.sft`` runs
them (otherwise they are reported as not implemented); a device then holds ``L / PP`` layers
(the largest stage's under ``--decoder-first/last-pipeline-num-layers``). Under 1F1B (the
default ``--pipeline-schedule``) it keeps the saved activations of ``2 R PP - 1`` chunk items,
whatever the micro-batch count; under GPipe / circular ``M`` (x R) times a stage's (chunk's)
saved activations. The step-time estimate counts the schedule's idle ticks
(``Schedule.step_factor``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import time
from typing import Any

from mlir_train.config.flags import RunConfig
from mlir_train.runtime.errors import ConfigError
from mlir_train.planner.candidates import Candidate, candidate, candidate_layouts  # noqa: F401 (the planner's API)
from mlir_train.planner.estimate import activation_bytes
from mlir_train.planner import predict
from mlir_train.planner.report import Plan, format_collectives, format_plan, write_json  # noqa: F401 (the planner's API)
from mlir_train.planner.targets import DEVICE_KINDS, GIB, USABLE_FRACTION, DeviceKind, choose_compiler  # noqa: F401


def _preset_devices(argv: list[str]) -> None:
    """A compile-only CPU host (fake CPU devices for the CPU fallback, the GPU runtime flags for
    deviceless XLA:GPU compiles), before jax is imported."""
    from mlir_train.config.cli import flag_value  # imports no jax
    from mlir_train.runtime.platform_setup import configure_platform

    n = flag_value(argv, "--num-devices")
    configure_platform(compile_only=True, cpu_devices=int(n) if n else None)


def _device_bytes(tree: Any) -> int:
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def _trainer(cfg: RunConfig, c: Candidate, num_devices: int, devices=None):
    """The Trainer ``sft`` would build for this candidate, over ``devices`` (compile-only XLA:GPU
    devices of the target) or the first ``num_devices`` of this process (fake CPU devices); the
    kernels (MoE experts, attention) are the ones the mesh's platform selects."""
    import jax

    from mlir_train import families
    from mlir_train.runtime.platform_setup import mesh_platform
    from mlir_train.train.build import resolve  # imports jax: not before _preset_devices
    from sharding.mesh import make_mesh

    lay, policy = c.layout, c.recompute
    cfg = cfg.replace(
        parallel=dict(tensor_model_parallel_size=lay.tensor, pipeline_model_parallel_size=lay.pipeline,
                      expert_model_parallel_size=lay.expert, expert_tensor_parallel_size=lay.expert_tensor,
                      sequence_parallel=lay.sequence_parallel, context_parallel_size=lay.context,
                      use_distributed_optimizer=lay.distributed_optimizer, use_torch_fsdp2=False,
                      data_parallel_sharding_strategy="no_shard",
                      # the pipeline's own flags mean nothing to (and are refused by) a PP1 layout
                      **({} if lay.pipeline > 1 else dict(num_layers_per_virtual_pipeline_stage=None,
                                                          num_virtual_stages_per_pipeline_rank=None,
                                                          decoder_first_pipeline_num_layers=None,
                                                          decoder_last_pipeline_num_layers=None,
                                                          pipeline_schedule=None))),
        training=dict(recompute_granularity=policy.granularity, recompute_method=policy.method,
                      recompute_num_layers=policy.num_layers,
                      recompute_modules=policy.modules or None, moe_layer_recompute=False,
                      recompute_activations=False, lr=cfg.training.lr or 1e-5,
                      train_iters=cfg.training.train_iters or 1))
    vocab = cfg.model.vocab_size or families.from_flags(cfg.model, None).vocab_size
    model_cfg = families.from_flags(cfg.model, cfg.model.padded_vocab_size(vocab, lay.tensor))
    platform = "cpu" if devices is None else mesh_platform(jax.sharding.Mesh(devices, ("all",)))
    run = resolve(cfg, model_cfg, num_devices=num_devices, platform=platform)
    mesh = make_mesh(run.parallel, devices=devices)
    return run.trainer(mesh), model_cfg, run.global_batch_size, run.num_micro_batches


def plan_layout(cfg: RunConfig, c: Candidate, num_devices: int, *, memory_gb: float, peak_tflops: float | None,
                assumed_mfu: float, compile_step: bool = True, target: str | None = None,
                compiler_note: str | None = None, hlo_dir: str | None = None) -> Plan:
    """Sizes (and, with ``compile_step``, the AOT-compiled step) of one candidate. ``target``: a
    device kind to compile for with XLA:GPU (deviceless); None compiles for this process's CPU
    devices, and ``compiler_note`` says why (printed with the figures)."""
    from mlir_train.planner.targets import compile_only_devices

    plan = Plan(c, c.name(num_devices), num_devices=num_devices, capacity_bytes=memory_gb * GIB)
    devices = compile_only_devices(target, num_devices) if target and compile_step else None
    try:
        trainer, model_cfg, gbs, num_micro = _trainer(cfg, c, num_devices, devices)
    except Exception as e:  # an invalid layout for this model / device count
        plan.error = str(e).splitlines()[0]
        return plan
    cfg = cfg.replace(training=dict(global_batch_size=gbs))  # resolved (Megatron's default: micro x DP)
    plan.moe_impl = trainer.options.moe_impl if model_cfg.is_moe else None
    state, batch = _estimate(plan, cfg, trainer, model_cfg, gbs, num_micro, peak_tflops, assumed_mfu)
    if compile_step:
        plan.compiler = f"XLA:GPU {target} (deviceless)" if devices is not None else "XLA:CPU"
        plan.compiler_note = compiler_note
        step = _compile_and_audit(plan, trainer, state, batch, hlo_dir)
        if plan.error is not None:
            return plan
        plan.compiled_for_target = devices is not None
        _audit_communication(plan, step, model_cfg, trainer, cfg, num_micro, target)
        if peak_tflops and plan.compiled_matmul_flops:
            plan.compiled_step_time_s = plan.compiled_matmul_flops / (peak_tflops * 1e12 * assumed_mfu)
            plan.compiled_tokens_per_s = gbs * cfg.data.seq_length / plan.compiled_step_time_s
    return plan


def _estimate(plan: Plan, cfg: RunConfig, trainer, model_cfg, gbs: int, num_micro: int, peak_tflops: float | None,
              assumed_mfu: float):
    """Fill in the analytic breakdown (exact state sizes from the shardings, the activation
    estimate) and Megatron's FLOPs with the step time they give; returns the abstract state and
    batch to compile with."""
    import jax
    import jax.numpy as jnp

    from mlir_train.model import flops as flops_lib
    from mlir_train.train.trainer import BATCH_KEYS, DTYPES

    c = plan.candidate
    state = trainer.abstract_state()
    rows = gbs // num_micro
    batch = {k: jax.ShapeDtypeStruct((num_micro, rows, cfg.data.seq_length),
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
    if "base" in state:  # LoRA: the frozen base, held in the compute dtype (no master, moments or gradient)
        plan.frozen_base_bytes = _device_bytes(state["base"])
    plan.gradient_bytes = _device_bytes(compute) + plan.master_bytes
    plan.batch_bytes = _device_bytes(batch)
    plan.activation_bytes = activation_bytes(model_cfg, c, micro_batch=cfg.training.micro_batch_size,
                                             seq=cfg.data.seq_length, dtype_bytes=jnp.dtype(dtype).itemsize,
                                             num_micro=num_micro, schedule=trainer.schedule)
    plan.flops_per_step = flops_lib.num_floating_point_operations(model_cfg, cfg.data.seq_length, gbs)
    plan.tokens_per_step = gbs * cfg.data.seq_length
    if peak_tflops:
        per_stage = model_cfg.num_layers // c.layout.pipeline
        hardware = plan.flops_per_step * (3 + c.recompute.recomputed_fraction(per_stage)) / 3
        if trainer.schedule is not None:  # the pipeline bubble
            hardware *= trainer.schedule.step_factor(num_micro)
        plan.step_time_s = hardware / (plan.num_devices * peak_tflops * 1e12 * assumed_mfu)
        plan.tokens_per_s = gbs * cfg.data.seq_length / plan.step_time_s
    return state, batch


def _compile_and_audit(plan: Plan, trainer, state, batch, hlo_dir: str | None):
    """Compile the step and fill in its memory analysis and HLO audit (:mod:`mlir_train.planner.hlo`),
    or ``plan.error`` where it does not compile; returns the audit (``hlo.CompiledStep``)."""
    from mlir_train.planner import hlo

    t0 = time.perf_counter()
    try:
        compiled = trainer.lower_train_step(state, batch).compile()
        step = hlo.audit_compiled(compiled)
        if hlo_dir:  # the optimized HLO the figures come from, to see where they come from
            os.makedirs(hlo_dir, exist_ok=True)
            with open(os.path.join(hlo_dir, re.sub(r"[^\w.+-]+", "_", plan.name) + ".hlo.txt"), "w") as f:
                f.write(compiled.as_text())
    except Exception as e:
        plan.error = f"does not compile ({plan.compiler}): {str(e).splitlines()[0]}"
        return None
    plan.compile_s = time.perf_counter() - t0
    plan.compiled_argument_bytes = step.argument_bytes
    plan.compiled_temp_bytes = step.temp_bytes
    plan.compiled_needed_bytes = step.needed_bytes
    plan.compiled_matmul_flops = step.stats.matmul_flops
    plan.collectives = {k: {"count": c.count, "bytes": c.bytes} for k, c in step.stats.collectives.items()}
    plan.conditionals = step.stats.conditionals
    plan.unknown_loops = step.stats.unknown_loops
    if plan.conditionals:
        plan.compiled_matmul_flops_cheapest = step.stats_cheapest.matmul_flops
        plan.collectives_cheapest = {k: {"count": c.count, "bytes": c.bytes}
                                     for k, c in step.stats_cheapest.collectives.items()}
    plan.uncounted_custom_calls = step.stats.uncounted_custom_calls or None
    return step


def _audit_communication(plan: Plan, step, model_cfg, trainer, cfg: RunConfig, num_micro: int,
                         target: str | None) -> None:
    """The communication audit (:mod:`mlir_train.planner.comm`: compiled bytes per kind against
    Megatron's analytic volumes for the same layout, bytes by mesh axes, what the schedule
    overlaps), the matmul FLOPs at a balanced routing, and the roofline
    (:mod:`mlir_train.planner.roofline`) where the step was compiled for a GPU target."""
    from mlir_train.planner import comm

    c = plan.candidate
    stats = step.stats
    lay = comm.CommLayout.of(c.layout, plan.num_devices)
    per_stage = model_cfg.num_layers // c.layout.pipeline
    plan.megatron_stage, volumes = comm.megatron_volumes(
        model_cfg, lay, seq=cfg.data.seq_length, micro_batch=cfg.training.micro_batch_size, num_micro=num_micro,
        recompute_fraction=c.recompute.recomputed_fraction(per_stage), balancing=trainer.step_cfg.balancing,
        act_bytes=2 if trainer.step_cfg.compute_dtype in ("bf16", "bfloat16", "fp16", "float16") else 4)
    plan.megatron_volumes = [dataclasses.asdict(v) for v in volumes]
    # What a balanced routing moves: the overflow rounds' no-overflow branch (the costliest
    # branches, every overflow round, stay in ``collectives`` and ``collective_traffic_bound``).
    balanced_stats = step.stats_balanced or stats
    plan.collective_traffic = balanced_stats.traffic()
    plan.collective_traffic_bound = stats.traffic() if stats.conditionals else None
    plan.comm_comparison = [dict(kind=k.kind, compiled_bytes=k.compiled_bytes, megatron_bytes=k.megatron_bytes,
                                 ratio=k.ratio) for k in comm.compare(plan.collective_traffic, volumes)]
    plan.collectives_by_axes = _collectives_by_axes(stats, dict(trainer.mesh.shape))
    plan.overlap = stats.overlap()
    _audit_megatron_flops(plan, model_cfg, cfg, per_stage)
    plan.compiled_matmul_flops_balanced = predict.balanced_matmul_flops(balanced_stats, c.layout, model_cfg,
                                                                        cfg.extras.moe_ep_buffer_factor)
    plan.hbm_bytes = stats.hbm_bytes
    kind = DEVICE_KINDS.get(target) if target else None
    if kind is not None and kind.compiles_for_gpu:
        _audit_roofline(plan, stats, balanced_stats, model_cfg, cfg, kind)


def _collectives_by_axes(stats, mesh_shape: dict[str, int]) -> list[dict]:
    """The compiled collectives by kind and the mesh axes their device groups span (a permute's
    by the axes of its pairs), most bytes first, with how many the schedule overlaps."""
    from mlir_train.planner import comm

    rows: dict[tuple[str, str], dict[str, int]] = {}
    for g, col in stats.collective_groups.items():
        axes = comm.group_axes(g.group, mesh_shape) if not g.pairs else \
            "+".join(sorted({comm.group_axes((a, b), mesh_shape) for a, b in g.pairs if a != b}))
        row = rows.setdefault((g.kind, axes), dict(count=0, bytes=0, overlapped=0, matmul_overlapped=0))
        row["count"] += col.count
        row["bytes"] += col.bytes
        row["overlapped"] += col.count if g.overlapped else 0
        row["matmul_overlapped"] += col.count if g.matmul_overlapped else 0
    return [dict(kind=k, axes=a, **v) for (k, a), v in sorted(rows.items(), key=lambda x: -x[1]["bytes"])]


def _audit_megatron_flops(plan: Plan, model_cfg, cfg: RunConfig, per_stage: int) -> None:
    """What Megatron executes per step (its recompute included) and per device of its busiest stage."""
    from mlir_train.model import flops as flops_lib
    from mlir_train.planner import comm

    c = plan.candidate
    per_step = (3 + c.recompute.recomputed_fraction(per_stage)) / 3
    plan.megatron_executed_flops = plan.flops_per_step * per_step
    # Per device, Megatron's busiest stage (its last: the LM head) executes more than the average;
    # every device of our SPMD program runs one program, so its count is set beside that stage's.
    stages = comm.stage_layers(model_cfg.num_layers, c.layout.pipeline)
    by_stage = [flops_lib.stage_floating_point_operations(
        model_cfg, cfg.data.seq_length, cfg.training.global_batch_size, layers, head=i == len(stages) - 1,
        recompute_fraction=c.recompute.recomputed_fraction(len(layers))) for i, layers in enumerate(stages)]
    plan.megatron_busiest_flops_stage = max(range(len(by_stage)), key=by_stage.__getitem__)
    plan.megatron_busiest_device_flops = by_stage[plan.megatron_busiest_flops_stage] * len(stages) / plan.num_devices


def _audit_roofline(plan: Plan, stats, balanced_stats, model_cfg, cfg: RunConfig, kind) -> None:
    """The roofline step time on a GPU ``kind`` (balanced, and at ``roofline.IMBALANCES``), and the model's published figure."""
    from mlir_train.planner import roofline

    consts = roofline.device_constants(kind)
    r = roofline.roofline(plan.compiled_matmul_flops_balanced, stats.hbm_bytes,
                          roofline.exposed_collectives(stats.collective_groups), consts,
                          model_flops_per_device=plan.flops_per_step / plan.num_devices,
                          tokens_per_step=plan.tokens_per_step)
    # Natural routing: the step time when the busiest EP rank gets ``f`` x the mean's rows.
    experts = predict.balanced_expert_flops(balanced_stats, plan.candidate.layout, model_cfg,
                                            cfg.extras.moe_ep_buffer_factor)
    a2a_s = predict.exposed_all_to_all_s(stats, consts)
    plan.roofline = dataclasses.asdict(r) | dict(model_tflops_per_device=r.model_tflops_per_device,
                                                 tokens_per_s=r.tokens_per_s, bound=r.bound,
                                                 constants=dataclasses.asdict(consts),
                                                 step_s_at_imbalance={f: roofline.at_imbalance(r, f, experts, a2a_s, consts)
                                                                      for f in roofline.IMBALANCES})
    ref = roofline.MEGATRON_BRIDGE_REFERENCE.get(model_cfg.name)
    plan.published_reference = dict(zip(("tflops_per_device", "device", "precision", "source"), ref)) if ref else None


def _planner_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlir_train.plan", add_help=False)
    p.add_argument("--device-kind", choices=sorted(DEVICE_KINDS), default="h200")
    p.add_argument("--device-memory-gb", type=float, default=None)
    p.add_argument("--assumed-mfu", type=float, default=0.4)
    p.add_argument("--search", action="store_true")
    p.add_argument("--search-top", type=int, default=None,
                   help="compile only the K layouts with the best estimates (default: every one that fits)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the plans as JSON")
    p.add_argument("--hlo-dir", default=None, metavar="DIR",
                   help="write each compiled step's optimized HLO text there (<layout>.hlo.txt)")
    p.add_argument("--xla-cpu", action="store_true",
                   help="compile for XLA:CPU even where the XLA:GPU compiler is installed (verdict from the estimate)")
    return p


def main(argv: list[str] | None = None) -> list[Plan]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return []
    _preset_devices(argv)
    own, rest = _planner_parser().parse_known_args(argv)
    from mlir_train.config import cli

    cfg = cli.parse(rest)
    t, par = cfg.training, cfg.parallel
    if cfg.data.seq_length is None or t.micro_batch_size is None:
        raise ConfigError("--seq-length and --micro-batch-size are required")
    import jax

    from mlir_train import families

    num_devices = cfg.extras.num_devices or jax.device_count()
    kind = DEVICE_KINDS[own.device_kind]
    memory_gb = own.device_memory_gb or kind.memory_bytes / GIB
    # fp32 matmuls run as TF32 on these GPUs: half the bf16 peak.
    peak = cfg.extras.peak_tflops or (kind.bf16_tflops and kind.bf16_tflops * (1.0 if t.bf16 or t.fp16 else 0.5))
    target, note = choose_compiler(kind, force_cpu=own.xla_cpu)
    if target:  # a compile-only executable cannot be stored or reloaded by JAX's persistent cache
        jax.config.update("jax_enable_compilation_cache", False)
    if target is None and num_devices > jax.device_count():  # the XLA:CPU compile needs fake devices
        raise ConfigError(f"--num-devices {num_devices} but this process has {jax.device_count()} devices "
                          "(run it as python -m mlir_train.plan, which creates them)")
    common = dict(memory_gb=memory_gb, peak_tflops=peak, assumed_mfu=own.assumed_mfu, target=target, compiler_note=note,
                  hlo_dir=own.hlo_dir)
    print(f"mlir-train plan: {families.from_flags(cfg.model, None).name} on {num_devices} x {own.device_kind} ({memory_gb:.1f} GiB; "
          f"{kind.description}), seq {cfg.data.seq_length}, micro-batch {t.micro_batch_size}, global batch "
          f"{t.global_batch_size or 'micro x DP'}, {t.compute_dtype}")
    print(f"compiler: {f'XLA:GPU for {kind.description}, deviceless' if target else 'XLA:CPU'}"
          + (f" -- {note}" if note else ""))
    if not own.search:
        c = candidate(t.recompute, tensor=par.tensor_model_parallel_size, expert=par.expert_model_parallel_size,
                      pipeline=par.pipeline_model_parallel_size, distributed_optimizer=par.distributed_optimizer,
                      sequence_parallel=par.sequence_parallel, expert_tensor=par.expert_tensor_parallel_size,
                      context=par.context_parallel_size)
        plan = plan_layout(cfg, c, num_devices, **common)
        print(format_plan(plan, own.device_kind, own.assumed_mfu))
        write_json(own.json, [plan])
        if plan.error:  # the one layout asked for has no plan: an error (exit 2), not a report
            raise ConfigError(f"no plan for {plan.name} on {num_devices} devices: {plan.error}")
        return [plan]
    ranked = search(cfg, num_devices, common, device_kind=own.device_kind, top=own.search_top)
    write_json(own.json, ranked)
    return ranked


def search(cfg: RunConfig, num_devices: int, common: dict, *, device_kind: str, top: int | None) -> list[Plan]:
    """``--search``: estimate every candidate, compile the ``top`` best that the estimate says fit
    (all of them for None), and rank those the compiled step says fit; prints as it goes."""
    memory_gb, assumed_mfu = common["memory_gb"], common["assumed_mfu"]
    estimates = [plan_layout(cfg, c, num_devices, compile_step=False, **common) for c in candidate_layouts(cfg, num_devices)]
    valid = [p for p in estimates if p.error is None]
    fitting = sorted((p for p in valid if p.fits), key=Plan.ranking_key)
    if top is not None:
        fitting = fitting[:top]
    print(f"{len(estimates)} layouts, {len(valid)} valid for this model, {len(fitting)} to compile "
          f"(estimated to fit{'' if top is None else f', best {top}'})")
    for p in estimates:
        if p.error is None and not p.fits:
            print(f"  does not fit (estimate): {p.name}: {p.total_bytes / GIB:.1f} GiB > "
                  f"{USABLE_FRACTION * memory_gb:.0f} GiB usable")
        elif p.error is not None:
            print(f"  not planned: {p.name}: {p.error}")
    ranked = []
    for p in fitting:
        compiled = plan_layout(cfg, p.candidate, num_devices, **common)
        print(format_plan(compiled, device_kind, assumed_mfu), flush=True)
        if compiled.error is None and compiled.fits:
            ranked.append(compiled)
    ranked.sort(key=Plan.ranking_key)
    by = "compiled step time, then compiled memory" if common["target"] else "estimated throughput, then memory"
    print(f"\nranking ({by}):" if ranked else
          "\nno layout fits: more devices, --recompute-granularity full, a shorter --seq-length or a smaller "
          "--micro-batch-size")
    for i, p in enumerate(ranked, 1):
        speed = p.compiled_tokens_per_s if p.compiled_for_target and p.compiled_tokens_per_s else p.tokens_per_s
        ratio = f"  FLOPs {p.flop_ratio:.2f}x model" if p.flop_ratio is not None else ""
        print(f"  {i:2d}. {p.name:<48s} {p.needed_bytes / GIB:7.1f} GiB  "
              + (f"{speed:,.0f} tokens/s" if speed else "speed unknown") + ratio)
    return ranked


EXIT_DOES_NOT_FIT = 3  # the layout asked for (with --search: every layout) does not fit the devices


def exit_status(argv: list[str] | None = None) -> int:
    """``python -m mlir_train.plan``'s status: 0 when the layout fits (with ``--search``: some
    layout does), :data:`EXIT_DOES_NOT_FIT` when it does not, 2 (one error line) when it cannot
    exist or a flag is bad."""
    from mlir_train.runtime.errors import exit_on_user_error

    with exit_on_user_error():
        argv = list(sys.argv[1:] if argv is None else argv)
        plans = main(argv)
        asked_help = "-h" in argv or "--help" in argv
        return 0 if asked_help or any(p.error is None and p.fits for p in plans) else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(exit_status())
