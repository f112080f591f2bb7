"""Qwen3-30B-A3B-shaped training on one H200: tokens/s and MFU as Megatron counts them.

    python benchmarks/gpu_h200.py [--layers 8] [--seq-length 4096] [--micro-batch-size 1] [--iters 10]
                                  [--recompute selective] [--moe-impl grouped] [--peak-tflops 989]
    python benchmarks/gpu_h200.py --smoke      # tiny sizes on CPU: checks the script still runs
    python benchmarks/gpu_h200.py --compile-only  # XLA:GPU compile for one H200 on a CPU host, audit only

The model is Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 kv heads of 128, 128 experts of
width 768, top-8, vocab 151936) with as many layers as fit one device (``--layers``; the full
model has 48). It trains with :class:`mlir_train.train.trainer.Trainer` on a 1-device mesh exactly as
``mlir_train.sft`` would: bf16 forward/backward, float32 master weights and AdamW moments,
gradient clipping, the MoE aux loss; experts by ``jax.lax.ragged_dot`` (``--moe-impl ragged``,
the GPU path; ``padded`` on CPU). The batch is random tokens, ``micro-batch-size x seq-length``.

Before anything is allocated the step is compiled ahead of time and XLA's memory analysis is
checked against the device's memory, so a too-large ``--layers`` fails in seconds with a hint.
Then after ``--warmup`` steps, ``--iters`` steps are timed one by one (each waited for);
the median gives tokens/s and

    MFU = num_floating_point_operations(cfg, seq, batch) / (step time * peak)

with Megatron's FLOPs formula (``mlir_train.model.flops``: model FLOPs, recomputation not counted)
and the bf16 dense peak of the device (989 TFLOP/s for an H200; ``--peak-tflops`` overrides).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlir_train.runtime.platform_setup import configure_platform  # noqa: E402  (imports no jax)

# As sft: the platform from the machine, the GPU runtime settings on GPU (printed below);
# --compile-only: a CPU host compiling for XLA:GPU with those settings, as the planner does.
SETUP = configure_platform(compile_only="--compile-only" in sys.argv)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mlir_train.model import flops
from mlir_train.planner import hlo as hlo_stats
from mlir_train.planner import plan  # noqa: E402
from mlir_train.runtime import platform_setup  # noqa: E402
from mlir_train.model import kernel_options  # noqa: E402
from mlir_train.families import get_model_config  # noqa: E402
from mlir_train.train.optim import make_optimizer  # noqa: E402
from mlir_train.train.trainer import BATCH_KEYS, StepConfig  # noqa: E402
from mlir_train.train.build import build_trainer  # noqa: E402
from sharding.mesh import make_mesh
from sharding.layout import Layout  # noqa: E402

H200_PEAK_BF16 = 989.0


def model_config(args):
    if args.smoke:
        return get_model_config("qwen3-30b-a3b", num_layers=args.layers or 2, hidden_size=64, num_heads=4,
                                num_kv_heads=2, head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=32,
                                vocab_size=512)
    return get_model_config("qwen3-30b-a3b", num_layers=args.layers or 8)


def random_batch(cfg, rows: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (1, rows, seq + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (1, rows, seq)).copy()
    return {"input_ids": ids[..., :-1], "labels": ids[..., 1:], "loss_mask": np.ones((1, rows, seq), np.float32),
            "segment_ids": np.ones((1, rows, seq), np.int32), "positions": positions}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; smoke 2)")
    parser.add_argument("--seq-length", type=int, default=None, help="tokens per row (default 4096; smoke 64)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rows per step (default 1; smoke 2)")
    parser.add_argument("--iters", type=int, default=None, help="timed steps (default 10; smoke 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    parser.add_argument("--recompute", default="selective", choices=("none", "selective", "full"),
                        help="activation recomputation (Megatron's --recompute-granularity)")
    parser.add_argument("--moe-impl", default=None, choices=("grouped", "ragged", "padded", "dense"),
                        help="expert path (default: the device platform's, mlir_train.model.moe.block.DEFAULT_MOE_IMPL)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for one H200 deviceless (XLA:GPU, no GPU needed), print the audit and stop")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="device bf16 peak for MFU (default: the device table; 989 on an H200)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, runs anywhere in seconds (CPU test)")
    args = parser.parse_args(argv)
    seq = args.seq_length or (64 if args.smoke else 4096)
    rows = args.micro_batch_size or (2 if args.smoke else 1)
    iters = args.iters or (2 if args.smoke else 10)

    if args.compile_only:
        from mlir_train.planner.targets import compile_only_devices

        device = compile_only_devices("h200", 1)[0]
    else:
        device = jax.devices()[0]
    parallel = Layout(num_devices=1)
    mesh = make_mesh(parallel, devices=[device])
    kernels = kernel_options(platform_setup.mesh_platform(mesh), is_moe=True)  # as sft picks them
    moe_impl = args.moe_impl or kernels.moe_impl
    cfg = model_config(args)
    peak = flops.device_peak_tflops("bf16", args.peak_tflops)
    if peak is None and "h200" in device.device_kind.lower():
        peak = H200_PEAK_BF16
    print(f"{cfg.name}-shaped stack: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads}/{cfg.num_kv_heads} heads "
          f"x {cfg.head_dim}, {cfg.num_experts} experts top-{cfg.top_k} of width {cfg.moe_intermediate_size}, vocab "
          f"{cfg.vocab_size}: {cfg.num_params() / 1e9:.2f}B params")
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}; bf16 compute, float32 master "
          f"weights + AdamW; batch {rows} x {seq} tokens; moe_impl {moe_impl}; recompute {args.recompute}")

    print(SETUP.describe())
    trainer = build_trainer(
        cfg, StepConfig(num_micro_batches=1, compute_dtype="bfloat16", aux_loss_coeff=1e-3),
        make_optimizer(lr_schedule=1e-5, weight_decay=0.1, beta2=0.95, clip_grad=1.0), parallel, mesh,
        options=kernels.replace(moe_impl=moe_impl, remat=args.recompute),
    )

    # ----- compile ahead of time and check the memory before allocating anything ------------
    batch_np = random_batch(cfg, rows, seq)
    batch_shapes = {k: jax.ShapeDtypeStruct(batch_np[k].shape, batch_np[k].dtype, sharding=trainer.batch_sharding)
                    for k in BATCH_KEYS}
    start = time.perf_counter()
    compiled = trainer.lower_train_step(trainer.abstract_state(), batch_shapes).compile()
    print(f"compiled in {time.perf_counter() - start:.1f}s")
    # The planner's audit of the compiled step (mlir_train.planner.hlo): memory analysis, matmul
    # FLOPs and collectives from the optimized HLO, as `python -m mlir_train.plan` reports them.
    step = hlo_stats.audit_compiled(compiled)
    need = step.needed_bytes
    if args.compile_only:  # a compile-only device has no allocator: the description's memory
        from mlir_train.planner.targets import DEVICE_KINDS

        limit = DEVICE_KINDS["h200"].memory_bytes * platform_setup.GPU_MEM_FRACTION
    else:
        limit = (device.memory_stats() or {}).get("bytes_limit") if device.platform != "cpu" else None
    model_flops = flops.num_floating_point_operations(cfg, seq, rows)
    print(f"memory per device: state+batch {step.argument_bytes / 2**30:.2f} GiB, temp "
          f"{step.temp_bytes / 2**30:.2f} GiB, total {need / 2**30:.2f} GiB"
          + (f" of {limit / 2**30:.1f} GiB" if limit else ""))
    print(f"compiled matmul FLOPs {step.stats.matmul_flops:.3e} = {step.stats.matmul_flops / model_flops:.2f}x "
          f"Megatron's model FLOPs; collectives: {plan.format_collectives({k: vars(c) for k, c in step.stats.collectives.items()})}")
    if limit and need > limit:
        raise SystemExit(f"error: the step needs {need / 2**30:.1f} GiB but the device has {limit / 2**30:.1f} GiB: "
                         f"lower --layers (now {cfg.num_layers}) or --seq-length, or use --recompute full")

    if args.compile_only:
        return

    # ----- run --------------------------------------------------------------------------------
    state = trainer.init_state(seed=0)
    batch = trainer.shard_batch({k: v for k, v in batch_np.items()})
    times = []
    for i in range(args.warmup + iters):
        start = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        loss = float(jax.block_until_ready(metrics["lm loss"]))
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times.append(elapsed)
        print(f"  step {i + 1}: {elapsed * 1e3:.1f} ms, lm loss {loss:.4f}" + ("  (warm-up)" if i < args.warmup else ""))
    if not np.isfinite(loss):
        raise SystemExit(f"error: lm loss is {loss}")

    step_s = statistics.median(times)
    tokens = rows * seq
    tflops = flops.tflops_per_device(model_flops, step_s, 1)
    mfu = flops.mfu(model_flops, step_s, 1, peak)
    print(f"\nmedian step {step_s * 1e3:.1f} ms over {iters} steps: {tokens / step_s:,.0f} tokens/s, "
          f"{model_flops / tokens / 1e9:.2f} GFLOP/token (Megatron's formula), {tflops:.1f} TFLOP/s")
    print(f"result: {tokens / step_s:,.0f} tokens/s/device, {tflops:.2f} TFLOP/s/device, MFU "
          + (f"{100 * mfu:.1f}% of {peak:.0f} TFLOP/s bf16" if mfu is not None else "n/a (no peak known for this device; pass --peak-tflops)"))


if __name__ == "__main__":
    main()
