"""Qwen3-30B-A3B on one H200: what one GPU session must tell us, in one call of under ten minutes,
ending with one table.

    python benchmarks/gpu_h200.py --out DIR        # the H200 (JAX_PLATFORMS=cuda): under ten minutes
    python benchmarks/gpu_h200.py --cpu-rehearsal  # every phase on one CPU device, tiny, kernels interpreted
    python benchmarks/gpu_h200.py --compile-only   # XLA:GPU compile for one H200 on a CPU host: the audit only

Phases, each a row (or rows) of the final table, in this order (``--budget-s`` skips, and says so,
what would start after it is spent):

1. **device**: what jax sees (kind, compute capability, SMs, memory) and the device description
   XLA:GPU compiles for (its ``GpuTargetConfigProto``, from the dump of a real compile), written to
   ``--out`` as ``target_config_measured.txtpb`` (+ ``device.json``) for the planner
   (``mlir_train/planner/targets/``), its key figures compared with ``h200.txtpb``;
2. **train**: the Qwen3-30B-A3B layer (hidden 2048, 32/4 heads of 128, 128 experts of 768, top-8,
   vocab 151936) in ``--layers`` layers trained as ``mlir_train.sft`` would on one device (bf16,
   float32 master weights and AdamW, clipping, the aux loss, the GPU kernels the platform picks):
   compiled memory checked against the device first, then tokens/s and MFU (Megatron's FLOPs over
   989 TFLOP/s); then the device's measured peak (``memory_stats()["peak_bytes_in_use"]``, this
   phase runs first so the peak is its own) against the planner's compiled figure;
3. **self-check**: the start-up kernel check (``mlir_train.train.kernel_check``) of every GPU
   kernel (Pallas mha, our document-skipping flash attention ``--attention-kernel mlir``, our
   Mosaic-GPU MoE block kernels, tokamax's when it imports) at the run's widths and sequence;
4. **GPU path vs XLA path**: two layers of the same model, the whole train step with the GPU
   kernels against the same step with XLA attention and padded experts, on the same GPU, same
   weights and batch: loss, grad norm, the parameters' updates and Adam's moments
   (``mlir_train.run.certify``'s comparison and bf16 tolerances), and the kernels the GPU program
   holds, read from it (``mlir_train.planner.code_paths``);
5. **kernels**: every backend's error, determinism and TFLOP/s (``gpu_kernels_h200.py``'s rows) in
   what is left of the budget.

Without a GPU it stops with one ``mlir-train: error:`` line and exit status 2 (``gpu_common``): it
never trains on CPU devices unless ``--cpu-rehearsal`` asks for a rehearsal. Exit status 1 when a
check row fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import gpu_common  # noqa: E402  (imports no jax; puts the repository on sys.path)

REHEARSAL, SETUP = gpu_common.setup(sys.argv)
COMPILE_ONLY = "--compile-only" in sys.argv and not REHEARSAL
DEVICE = None if REHEARSAL or COMPILE_ONLY else gpu_common.the_gpu()  # no GPU: one error line, exit 2

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mlir_train.config.policies import LoadBalancing  # noqa: E402
from mlir_train.families import get_model_config  # noqa: E402
from mlir_train.model import flops, kernel_options  # noqa: E402
from mlir_train.planner import hlo as hlo_stats  # noqa: E402
from mlir_train.planner import plan  # noqa: E402
from mlir_train.planner.targets import DEVICE_KINDS  # noqa: E402
from mlir_train.runtime import platform_setup  # noqa: E402
from mlir_train.train.build import build_trainer  # noqa: E402
from mlir_train.train.optim import make_optimizer  # noqa: E402
from mlir_train.train.trainer import BATCH_KEYS, StepConfig  # noqa: E402
from sharding.layout import Layout  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402

import gpu_h200_checks as checks  # noqa: E402

H200_PEAK_BF16 = 989.0
GIB = 2**30


def model_config(layers: int | None, tiny: bool):
    if tiny:
        return get_model_config("qwen3-30b-a3b", num_layers=layers or 2, hidden_size=64, num_heads=4,
                                num_kv_heads=2, head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=64,
                                vocab_size=512)
    return get_model_config("qwen3-30b-a3b", num_layers=layers or 8)


def random_batch(cfg, rows: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (1, rows, seq + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (1, rows, seq)).copy()
    return {"input_ids": ids[..., :-1], "labels": ids[..., 1:], "loss_mask": np.ones((1, rows, seq), np.float32),
            "segment_ids": np.ones((1, rows, seq), np.int32), "positions": positions}


def trainer_for(cfg, device, options):
    """One device's trainer of ``cfg`` as sft builds it: bf16 compute, float32 AdamW, clipping, aux loss."""
    parallel = Layout(num_devices=1)
    return build_trainer(
        cfg, StepConfig(num_micro_batches=1, compute_dtype="bfloat16", balancing=LoadBalancing.from_flags("aux_loss", 1e-3)),
        make_optimizer(lr_schedule=1e-5, weight_decay=0.1, beta2=0.95, clip_grad=1.0), parallel,
        make_mesh(parallel, devices=[device]), options=options)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers to train (default 8; rehearsal 2)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="tokens per row (default 4096; rehearsal 128: tokamax needs a multiple of 128)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rows per step (default 1; rehearsal 1)")
    parser.add_argument("--iters", type=int, default=None, help="timed steps (default 10; rehearsal 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    parser.add_argument("--recompute", default="selective", choices=("none", "selective", "full"),
                        help="activation recomputation (Megatron's --recompute-granularity)")
    parser.add_argument("--moe-impl", default=None, choices=("grouped", "ragged", "padded", "dense"),
                        help="expert path (default: the device platform's, as sft picks it)")
    parser.add_argument("--attention-kernel", default="auto", choices=("auto", "pallas-mha", "mlir", "tokamax", "xla"),
                        help="attention of the train and GPU-path phases (sft's flag; auto: the platform's default)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for one H200 deviceless (XLA:GPU, no GPU needed), print the audit and stop")
    parser.add_argument(gpu_common.REHEARSAL, action="store_true", help=gpu_common.REHEARSAL_HELP)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="device bf16 peak for MFU (default: the device table; 989 on an H200)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="seconds after which no further phase starts (default 480: one 10-minute call)")
    parser.add_argument("--out", default=None, help="where the device description goes (default: a new temp dir)")
    parser.add_argument("--skip", nargs="*", default=(), choices=checks.PHASES, help="phases to leave out")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    started = time.perf_counter()
    tiny = REHEARSAL
    seq = args.seq_length or (128 if tiny else 4096)
    rows_per_step = args.micro_batch_size or 1
    if COMPILE_ONLY:
        from mlir_train.planner.targets import compile_only_devices

        device = compile_only_devices("h200", 1)[0]
    else:
        device = DEVICE or jax.devices()[0]
    cfg = model_config(args.layers, tiny)
    kernels = kernel_options(platform_setup.platform_name(device), is_moe=True, attention_backend=args.attention_kernel)
    options = kernels.replace(moe_impl=args.moe_impl or kernels.moe_impl, remat=args.recompute)
    print(f"{cfg.name}-shaped stack: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads}/{cfg.num_kv_heads} heads "
          f"x {cfg.head_dim}, {cfg.num_experts} experts top-{cfg.top_k} of width {cfg.moe_intermediate_size}, vocab "
          f"{cfg.vocab_size}: {cfg.num_params() / 1e9:.2f}B params")
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}; bf16 compute, float32 master "
          f"weights + AdamW; batch {rows_per_step} x {seq} tokens; moe_impl {options.moe_impl}, attention "
          f"{options.attention_impl}; recompute {args.recompute}" + ("; CPU REHEARSAL: no figure is a GPU's" if tiny else ""))
    print(SETUP.describe(), flush=True)
    table = checks.Table(started, args.budget_s, set(args.skip))
    if COMPILE_ONLY:
        _compile_and_check(trainer_for(cfg, device, options), cfg, random_batch(cfg, rows_per_step, seq), device, True)
        return 0
    out_dir = args.out or tempfile.mkdtemp(prefix="h200_")
    os.makedirs(out_dir, exist_ok=True)
    table.phase("device", lambda: checks.describe_device(device, out_dir, table))
    table.phase("train", lambda: _train(args, cfg, device, options, random_batch(cfg, rows_per_step, seq), table))
    table.phase("self-check", lambda: checks.self_check(cfg, seq, tiny, table))
    # A CPU rehearsal has no GPU kernels to compare: XLA's ragged_dot experts stand in for them.
    gpu_path = options.replace(moe_impl="ragged") if REHEARSAL and not args.moe_impl else options
    table.phase("gpu-vs-xla", lambda: checks.gpu_vs_xla(model_config(2, tiny), device, gpu_path,
                                                       random_batch(cfg, rows_per_step, seq), trainer_for, table))
    table.phase("kernels", lambda: checks.kernel_rows(table))
    print()
    table.print()
    print(f"\ntotal {time.perf_counter() - started:.0f}s; device description in {out_dir}")
    return 1 if table.failed() else 0


def _train(args, cfg, device, options, batch_np, table) -> None:
    trainer = trainer_for(cfg, device, options)
    step = _compile_and_check(trainer, cfg, batch_np, device, False)
    iters = args.iters or (2 if REHEARSAL else 10)
    step_s, loss = _timed_steps(trainer, batch_np, args.warmup, iters)
    peak = flops.device_peak_tflops("bf16", args.peak_tflops)
    if peak is None and "h200" in device.device_kind.lower():
        peak = H200_PEAK_BF16
    _, rows, seq = batch_np["input_ids"].shape  # [micro, rows, seq]
    model_flops = flops.num_floating_point_operations(cfg, seq, rows)
    tokens = rows * seq
    tflops = flops.tflops_per_device(model_flops, step_s, 1)
    mfu = flops.mfu(model_flops, step_s, 1, peak)
    print(f"\nmedian step {step_s * 1e3:.1f} ms over {iters} steps: {tokens / step_s:,.0f} tokens/s, "
          f"{model_flops / tokens / 1e9:.2f} GFLOP/token (Megatron's formula), {tflops:.1f} TFLOP/s")
    print(f"result: {tokens / step_s:,.0f} tokens/s/device, {tflops:.2f} TFLOP/s/device, MFU "
          + (f"{100 * mfu:.1f}% of {peak:.0f} TFLOP/s bf16" if mfu is not None else "n/a (no peak known for this device; pass --peak-tflops)"))
    table.add("train", f"{cfg.num_layers} layers, {rows} x {seq} tokens, {options.moe_impl} experts, "
              f"{options.attention_impl} attention", f"{tokens / step_s:,.0f} tokens/s, {tflops:.1f} TFLOP/s, MFU "
              + (f"{100 * mfu:.1f}%" if mfu is not None else "n/a") + f"; lm loss {loss:.3f}",
              "ok" if np.isfinite(loss) else "FAIL")
    checks.peak_memory(device, step.needed_bytes, table)


def _compile_and_check(trainer, cfg, batch_np, device, compile_only: bool):
    """Compile ahead of time and check the memory before allocating anything; the planner's audit."""
    batch_shapes = {k: jax.ShapeDtypeStruct(batch_np[k].shape, batch_np[k].dtype, sharding=trainer.batch_sharding)
                    for k in BATCH_KEYS}
    start = time.perf_counter()
    compiled = trainer.lower_train_step(trainer.abstract_state(), batch_shapes).compile()
    print(f"compiled in {time.perf_counter() - start:.1f}s")
    # The planner's audit of the compiled step (mlir_train.planner.hlo): memory analysis, matmul
    # FLOPs and collectives from the optimized HLO, as `python -m mlir_train.plan` reports them.
    step = hlo_stats.audit_compiled(compiled)
    need = step.needed_bytes
    if compile_only:  # a compile-only device has no allocator: the description's memory
        limit = DEVICE_KINDS["h200"].memory_bytes * platform_setup.GPU_MEM_FRACTION
    else:
        limit = (device.memory_stats() or {}).get("bytes_limit") if device.platform != "cpu" else None
    _, rows, seq = batch_np["input_ids"].shape  # [micro, rows, seq]
    model_flops = flops.num_floating_point_operations(cfg, seq, rows)
    print(f"memory per device: state+batch {step.argument_bytes / GIB:.2f} GiB, temp "
          f"{step.temp_bytes / GIB:.2f} GiB, total {need / GIB:.2f} GiB" + (f" of {limit / GIB:.1f} GiB" if limit else ""))
    print(f"compiled matmul FLOPs {step.stats.matmul_flops:.3e} = {step.stats.matmul_flops / model_flops:.2f}x "
          f"Megatron's model FLOPs; collectives: {plan.format_collectives({k: vars(c) for k, c in step.stats.collectives.items()})}")
    if limit and need > limit:
        raise SystemExit(f"error: the step needs {need / GIB:.1f} GiB but the device has {limit / GIB:.1f} GiB: "
                         f"lower --layers (now {cfg.num_layers}) or --seq-length, or use --recompute full")
    return step


def _timed_steps(trainer, batch_np, warmup: int, iters: int) -> tuple[float, float]:
    """``warmup`` untimed then ``iters`` timed steps: the median step time and the last loss."""
    state = trainer.init_state(seed=0)
    batch = trainer.shard_batch(dict(batch_np))
    times = []
    for i in range(warmup + iters):
        start = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        loss = float(jax.block_until_ready(metrics["lm loss"]))
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
        print(f"  step {i + 1}: {elapsed * 1e3:.1f} ms, lm loss {loss:.4f}" + ("  (warm-up)" if i < warmup else ""))
    del state
    return statistics.median(times), loss


if __name__ == "__main__":
    sys.exit(main())
