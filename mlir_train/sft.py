"""``python -m mlir_train.sft``: supervised fine-tuning with a Megatron/AIAK command line.

Reads top to bottom: flags -> model config -> mesh -> data -> state -> compile -> loop
(log, eval, checkpoint). With no arguments it fine-tunes ``qwen3-moe-tiny`` on the bundled
alpaca-format tasks and tokenizer on 8 fake CPU devices and shows the loss falling.
"""

from __future__ import annotations

import os
import sys

# Fake CPU devices must be requested before jax is imported. The flag only affects the host
# platform, so it is harmless where GPUs/TPUs exist; a user's own XLA_FLAGS win.
from mlir_train.cli import flag_value  # noqa: E402  (imports no jax)

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    _n = flag_value(sys.argv, "--cpu-devices") or "8"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}").strip()


def _accelerator_plugin_installed() -> bool:
    from importlib import metadata

    names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
    return any(n.startswith(("jax-cuda", "jax_cuda", "libtpu", "jax-rocm", "jax_rocm")) for n in names)


# XLA:CPU's all-reduce-promotion pass aborts the process ("Invalid binary instruction opcode
# copy") on the bf16 all-reduces an expert-parallel step has (seen with jax 0.10.2). CPU-only
# installs skip that pass; GPU/TPU compiles are left untouched.
if "all-reduce-promotion" not in os.environ.get("XLA_FLAGS", "") and not _accelerator_plugin_installed():
    os.environ["XLA_FLAGS"] += " --xla_disable_hlo_passes=all-reduce-promotion"

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from mlir_train import cli  # noqa: E402
from mlir_train.data.config import DEFAULT_DATA, DEFAULT_TOKENIZER  # noqa: E402

DEFAULT_ARGV = [
    "--model-name", "qwen3-moe-tiny",
    "--tokenizer-type", "HFTokenizer", "--hf-tokenizer-path", DEFAULT_TOKENIZER,
    "--data-path", DEFAULT_DATA, "--split", "98,2,0",
    "--chat-template", "alpaca", "--packing-sft-data", "--sft-num-preprocess-workers", "2",
    "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "16",
    "--train-iters", "40", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "4",
    "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
    "--moe-aux-loss-coeff", "1e-2",
    "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
    "--eval-interval", "20", "--eval-iters", "4", "--log-interval", "1",
]


def _fail(msg: str) -> "SystemExit":
    print(f"error: {msg}", file=sys.stderr)
    return SystemExit(2)


def _require(args, *names: str) -> None:
    for name in names:
        if getattr(args, name) is None:
            raise _fail(f"--{name.replace('_', '-')} is required")


def build_model_config(args, vocab_size: int | None):
    from mlir_train.config import get_model_config

    overrides = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_heads=args.num_attention_heads,
        num_kv_heads=args.num_query_groups, intermediate_size=args.ffn_hidden_size,
        num_experts=args.num_experts, moe_intermediate_size=args.moe_ffn_hidden_size,
        top_k=args.moe_router_topk, rope_theta=args.rotary_base,
        rope_scaling_factor=args.rotary_seq_len_interpolation_factor, rms_norm_eps=args.norm_epsilon,
        max_position_embeddings=args.max_position_embeddings, init_std=args.init_method_std,
        head_dim=args.kv_channels, vocab_size=vocab_size,
    )
    cfg = get_model_config(args.model_name, **overrides)
    if args.moe_layer_freq is not None:
        from mlir_train.config import layer_pattern_overrides, moe_layer_pattern

        try:
            cfg = cfg.replace(**layer_pattern_overrides(moe_layer_pattern(args.moe_layer_freq, cfg.num_layers)))
        except ValueError as e:
            raise _fail(str(e)) from None
    return cfg


def padded_vocab_size(tokenizer_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's ``_vocab_size_with_padding``: round up to divisible_by * TP."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(tokenizer_size / multiple) * multiple)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    launched = time.perf_counter()  # --exit-duration-in-mins counts from here, as Megatron's from its start
    argv = list(sys.argv[1:] if argv is None else argv)
    embedded_default = not argv
    args, ignored = cli.parse_args(DEFAULT_ARGV if embedded_default else argv)
    if embedded_default:
        print("mlir-train: no arguments given; running the embedded default SFT "
              "(qwen3-moe-tiny on the bundled alpaca tasks, 8 fake CPU devices).")
    if ignored:
        print(f"mlir-train: ignoring flags that mean nothing under JAX/XLA: {' '.join(ignored)}")
    _require(args, "train_iters", "lr", "seq_length", "micro_batch_size", "data_path", "hf_tokenizer_path")

    import jax

    from mlir_train import distributed

    try:
        processes = distributed.initialize_from_env(args)  # before anything touches a device
    except distributed.DistributedEnvError as e:
        raise _fail(str(e)) from None
    if jax.process_index() != 0:
        sys.stdout = open(os.devnull, "w")  # console lines from process 0 only, as Megatron's rank 0
    if args.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
    from mlir_train import checkpoint
    from mlir_train import flops as flops_lib
    from mlir_train.data import BatchLoader, DataError, build_datasets, load_tokenizer
    from mlir_train.metrics import MetricsWriter, Timers, console_line
    from mlir_train.optim import loss_scaler_from_args, optimizer_from_args
    from mlir_train.schedule import schedule_from_args
    from mlir_train.train import StepConfig, Trainer, model_dims
    from sharding.mesh import ParallelConfig, ParallelConfigError, make_mesh, validate

    # ----- config ---------------------------------------------------------------------------
    try:
        tokenizer = load_tokenizer(args.hf_tokenizer_path)
    except DataError as e:
        raise _fail(str(e)) from None
    tp = args.tensor_model_parallel_size
    hf_load = args.load if args.load and os.path.exists(os.path.join(args.load, "config.json")) else None
    ckpt_meta = None  # an mlir-train (Orbax) checkpoint to resume or fine-tune from
    saved = _checkpoints_at(args.load, checkpoint) if args.load and not hf_load else None
    if args.load and not hf_load and saved is None:
        # Megatron's behaviour, which lets one script both start and resume a job (--load and
        # --save naming the same directory): warn and start from scratch, unless told to stop.
        msg = f"--load {args.load}: no complete checkpoint there, nor an HF model directory (no config.json)"
        if args.exit_on_missing_checkpoint:
            raise _fail(f"{msg}; --exit-on-missing-checkpoint is set. Check the path, or drop the flag to start "
                        "from scratch")
        print(f"mlir-train: WARNING: {msg}; starting from random initialisation at iteration 0 "
              "(--exit-on-missing-checkpoint makes this an error)")
        args.load = None
    if saved is not None:
        try:
            ckpt_meta = saved.read_meta()
        except checkpoint.CheckpointError as e:
            raise _fail(f"--load {args.load}: {e} (nor is it an HF model directory: no config.json)") from None
        ckpt_seed = ckpt_meta.get("rng", {}).get("seed", args.seed)  # none in a converted HF model
        if not (args.no_load_rng or args.finetune) and ckpt_seed != args.seed:
            print(f"mlir-train: --seed {args.seed} replaced by the checkpoint's {ckpt_seed} (--no-load-rng keeps yours)")
            args.seed = ckpt_seed
    if hf_load or ckpt_meta:
        from mlir_train.config import ModelConfig

        src = f"{hf_load}/config.json" if hf_load else f"{args.load} (iteration {ckpt_meta['iteration']})"
        model_cfg = ModelConfig.from_hf_json(hf_load) if hf_load else checkpoint.model_config(ckpt_meta)
        ckpt_vocab = model_cfg.vocab_size
        if len(tokenizer) > ckpt_vocab or (ckpt_meta and not args.finetune
                                           and ckpt_meta.get("tokenizer_size") not in (None, len(tokenizer))):
            saved = f" (trained with a {ckpt_meta['tokenizer_size']}-token tokenizer)" if ckpt_meta and ckpt_meta.get("tokenizer_size") else ""
            raise _fail(f"tokenizer {args.hf_tokenizer_path} has {len(tokenizer)} tokens but the checkpoint "
                        f"{src} has a vocab of {ckpt_vocab}{saved}")
        named = build_model_config(args, ckpt_vocab) if args.model_name else None
        for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "num_experts", "top_k"):
            if named is not None and getattr(named, field) != getattr(model_cfg, field):
                raise _fail(f"--model-name {args.model_name} (with overrides) has {field}={getattr(named, field)} "
                            f"but the checkpoint {src} has {getattr(model_cfg, field)}")
    else:
        model_cfg = build_model_config(args, padded_vocab_size(len(tokenizer), args.make_vocab_size_divisible_by, tp))
    strategy = args.data_parallel_sharding_strategy
    fsdp = args.use_torch_fsdp2 or strategy == "optim_grads_params"
    if fsdp and args.pipeline_model_parallel_size > 1:
        raise _fail("FSDP (--use-torch-fsdp2 / --data-parallel-sharding-strategy optim_grads_params) is not "
                    "implemented with pipeline parallelism; use --use-distributed-optimizer with "
                    "--pipeline-model-parallel-size > 1")
    parallel = ParallelConfig(
        tensor=tp, pipeline=args.pipeline_model_parallel_size, expert=args.expert_model_parallel_size,
        sequence_parallel=args.sequence_parallel, fsdp=fsdp,
        distributed_optimizer=args.use_distributed_optimizer or strategy in ("optim", "optim_grads"),
    )
    gbs = args.global_batch_size or args.micro_batch_size * parallel.data_parallel
    if args.moe_layer_freq is not None:
        from mlir_train.config import moe_layer_pattern

        try:
            pattern = moe_layer_pattern(args.moe_layer_freq, model_cfg.num_layers)
        except ValueError as e:
            raise _fail(str(e)) from None
        if model_cfg.is_moe and pattern != model_cfg.layer_kinds():
            raise _fail(f"--moe-layer-freq {args.moe_layer_freq} differs from the loaded model's MoE layers "
                        f"{[int(k) for k in model_cfg.layer_kinds()]}")
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    if uneven and parallel.pipeline == 1:
        raise _fail("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
    dims = {k: v for k, v in model_dims(model_cfg).items() if not (uneven and k == "num_layers")}
    if args.pipeline_schedule and parallel.pipeline == 1:
        print(f"mlir-train: --pipeline-schedule {args.pipeline_schedule} has no effect without "
              "--pipeline-model-parallel-size > 1")
    try:
        parallel = validate(parallel, dims, global_batch_size=gbs,
                            micro_batch_size=args.micro_batch_size, seq_length=args.seq_length)
    except ParallelConfigError as e:
        raise _fail(str(e)) from None
    num_micro = gbs // (args.micro_batch_size * parallel.data_parallel)
    if parallel.pipeline > 1:
        from mlir_train.pipeline import make_schedule

        try:
            make_schedule(model_cfg.num_layers, parallel.pipeline, kind=args.pipeline_schedule or "1f1b",
                          layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
                          first_stage_layers=args.decoder_first_pipeline_num_layers,
                          last_stage_layers=args.decoder_last_pipeline_num_layers, num_micro_batches=num_micro)
        except ParallelConfigError as e:
            raise _fail(str(e)) from None
    compute_dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
    remat = {None: "none", "full": "full", "selective": "selective"}[args.recompute_granularity]
    model_kwargs = dict(
        moe_impl="padded" if jax.default_backend() == "cpu" else "ragged",
        capacity_factor=args.moe_expert_capacity_factor, drop_policy=args.moe_token_drop_policy, remat=remat,
    ) if model_cfg.is_moe else dict(remat=remat)

    # ----- mesh -----------------------------------------------------------------------------
    mesh = make_mesh(parallel)
    print(f"mlir-train: {jax.device_count()} {jax.devices()[0].platform} devices, mesh {dict(mesh.shape)}, "
          f"{model_cfg.name} ({model_cfg.num_params() / 1e6:.1f}M params), {compute_dtype}, "
          f"global batch {gbs} = {num_micro} micro-batches x {args.micro_batch_size} x DP{parallel.data_parallel}")

    # ----- data -----------------------------------------------------------------------------
    data_cfg = cli.data_config(args)
    try:
        # Process 0 preprocesses first; the others then find its cache (or, on a host that does
        # not share the cache directory, build their own without racing it).
        if jax.process_index() != 0:
            distributed.barrier("data-cache")
        data = build_datasets(data_cfg, tokenizer)
        if jax.process_index() == 0:
            distributed.barrier("data-cache")
    except DataError as e:
        raise _fail(str(e)) from None
    print(data.summary())
    pid, nproc = jax.process_index(), jax.process_count()
    train_loader = BatchLoader(data.train, gbs, seed=args.seed, process_index=pid, process_count=nproc)
    valid = data.valid if data.valid.num_rows else None

    # ----- state ----------------------------------------------------------------------------
    try:
        schedule = schedule_from_args(_with_gbs(args, gbs))
    except ValueError as e:
        raise _fail(str(e)) from None
    trainer = Trainer(
        model_cfg,
        StepConfig(num_micro_batches=num_micro, compute_dtype=compute_dtype,
                   aux_loss_coeff=args.moe_aux_loss_coeff or 0.0, z_loss_coeff=args.moe_z_loss_coeff or 0.0,
                   layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
                   pipeline_schedule=args.pipeline_schedule or "1f1b",
                   first_stage_layers=args.decoder_first_pipeline_num_layers,
                   last_stage_layers=args.decoder_last_pipeline_num_layers),
        optimizer_from_args(args, schedule), parallel, mesh,
        loss_scaler=loss_scaler_from_args(args), model_kwargs=model_kwargs,
    )
    if hf_load:
        from mlir_train.hf import load_pretrained
        from flax import nnx

        print(f"mlir-train: loading HF weights from {hf_load}")
        model = load_pretrained(hf_load, dtype=np.float32, mesh=mesh, rules=trainer.rules, **model_kwargs)
        state = trainer.state_from_params(nnx.to_pure_dict(nnx.state(model)))
        del model
    elif ckpt_meta:
        what = "weights only, iteration 0 (--finetune)" if args.finetune else "weights" if args.no_load_optim else "full state"
        print(f"mlir-train: loading {what} from checkpoint {args.load} (iteration {ckpt_meta['iteration']})")
        try:
            state, ckpt_meta = checkpoint.load_state(args.load, trainer, load_optim=not args.no_load_optim,
                                                     finetune=args.finetune, step=ckpt_meta["iteration"])
        except checkpoint.CheckpointError as e:
            raise _fail(str(e)) from None
        if not args.finetune:
            checkpoint.restore_loader(train_loader, ckpt_meta, exact=ckpt_seed == args.seed)
    else:
        state = trainer.init_state(args.seed)
    start_iteration = 0 if args.finetune or not ckpt_meta else ckpt_meta["iteration"]
    saver = None if not args.save else checkpoint.CheckpointManager(
        args.save, max_to_keep=args.save_retain, save_interval=args.save_interval)
    if args.print_sharding:
        from mlir_train.inspect import sharding_report

        print(sharding_report(trainer))  # compute layout, fp32 master weights and optimizer state

    # ----- loop -----------------------------------------------------------------------------
    log_dir = args.tensorboard_dir or os.path.join("runs", f"{model_cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    writer = MetricsWriter(log_dir, enabled=pid == 0, wandb_project=args.wandb_project,
                           wandb_name=args.wandb_exp_name, config=vars(args) | {"model": dataclasses.asdict(model_cfg)})
    timers = Timers()
    flops_per_step = flops_lib.num_floating_point_operations(model_cfg, args.seq_length, gbs,
                                                             recompute_full=remat == "full")
    peak = flops_lib.device_peak_tflops("bf16" if compute_dtype != "float32" else "fp32", args.peak_tflops)
    rows_local = gbs // nproc

    def global_batch(loader):
        """The loader's next rows for this process, as the step's ``[micro, rows, seq]`` batch."""
        host = {k: v.reshape(num_micro, rows_local // num_micro, *v.shape[1:]) for k, v in next(loader).items()}
        return trainer.shard_batch(host)

    def next_batch():
        timers.start("data-wait")
        batch = global_batch(train_loader)
        timers.stop("data-wait")
        return batch

    def evaluate(iteration: int) -> None:
        if valid is None:
            print(f" validation at iteration {iteration}: the valid split is empty (--split {args.split}); skipped")
            return
        timers.start("eval")
        # As Megatron: each of --eval-iters iterations is one global batch, in the training step's
        # micro-batches, forward only (pipelined under PP); at most one pass over the valid split.
        loader = BatchLoader(valid, gbs, seed=args.seed, process_index=pid, process_count=nproc)
        total, count = 0.0, 0.0
        for _ in range(min(args.eval_iters, max(1, math.ceil(valid.num_rows / gbs)))):
            out = trainer.eval_step(state["params"], global_batch(loader))
            total, count = total + float(out["ce_sum"]), count + float(out["loss_tokens"])
        loss = total / max(count, 1.0)
        timers.stop("eval")
        ppl = math.exp(min(loss, 20.0))
        print(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |")
        writer.write(iteration, {"lm loss validation": loss, "lm loss validation ppl": ppl})
        history["valid"].append((iteration, loss))

    history: dict[str, list] = {"lm loss": [], "valid": []}
    skipped = 0
    last_done = time.perf_counter()
    start_time = last_done
    pending = None  # (iteration, device metrics): read one step late so the host never stalls the device

    def finish(iteration: int, metrics_dev) -> None:
        nonlocal skipped, last_done
        m = jax.device_get(metrics_dev)
        now = time.perf_counter()
        step_time, last_done = now - last_done, now
        lm_loss, grad_norm = float(m["lm loss"]), float(m["grad-norm"])
        skipped += int(m["skipped"])
        if args.check_for_nan_in_loss_and_grad and not int(m["skipped"]) and not (
                math.isfinite(lm_loss) and math.isfinite(grad_norm)):
            writer.close()
            raise SystemExit(f"error: iteration {iteration}: lm loss {lm_loss} / grad norm {grad_norm} is not finite; "
                             "stopping before any checkpoint of this state is written "
                             "(--no-check-for-nan-in-loss-and-grad disables the check)")
        history["lm loss"].append((iteration, lm_loss))
        tokens = gbs * args.seq_length
        scalars = {
            "lm loss": lm_loss, "grad-norm": grad_norm, "learning-rate": schedule.lr_at(iteration),
            "batch-size": gbs, "consumed samples": iteration * gbs, "iteration-time": step_time,
            "loss-scale": float(m["loss-scale"]), "skipped iterations": skipped,
            "tokens-per-sec": tokens / step_time,
            "throughput": flops_lib.tflops_per_device(flops_per_step, step_time, jax.device_count()),
            "mfu": flops_lib.mfu(flops_per_step, step_time, jax.device_count(), peak),
            "loss tokens": float(m["loss tokens"]),
        }
        arrays = {}
        if "load_balancing_loss" in m:
            scalars["load_balancing_loss"] = float(m["load_balancing_loss"])
            scalars["z_loss"] = float(m["z_loss"])
            scalars["dropped tokens"] = float(m["dropped_tokens"])
            arrays["expert-load"] = np.asarray(m["tokens_per_expert"]).sum(axis=0)
        if args.log_timers_to_tensorboard:
            totals = timers.pop_all()
            scalars |= {f"timers/{k}": totals.get(k, 0.0) for k in ("data-wait", "step-dispatch", "eval")}
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            done = iteration
            eta = (time.perf_counter() - start_time) / max(done, 1) * (args.train_iters - done)
            print(console_line(iteration, args.train_iters, scalars, eta), flush=True)
            writer.write(iteration, scalars, arrays)

    def save_checkpoint(iteration: int) -> None:
        nonlocal pending
        if pending is not None:  # the NaN check in finish() must pass before this state is written
            finish(*pending)
            pending = None
        timers.start("save-checkpoint")
        try:  # e.g. a full disk: a clear message; the previous checkpoint stays the newest
            saver.save(iteration, state, checkpoint.run_json(
                iteration=iteration, global_batch_size=gbs, loader=train_loader, seed=args.seed, model_cfg=model_cfg,
                tokenizer_size=len(tokenizer), parallel=parallel, args=args), force=True)
        except checkpoint.CheckpointError as e:
            raise _fail(str(e)) from None
        timers.stop("save-checkpoint")

    stop = checkpoint.StopOnSignal()
    print("mlir-train: compiling the training step ...", flush=True)
    t0 = time.perf_counter()
    iteration, stopped = start_iteration, None
    for iteration in range(start_iteration + 1, args.train_iters + 1):
        batch = next_batch()
        timers.start("step-dispatch")
        state, metrics = trainer.train_step(state, batch)
        timers.stop("step-dispatch")
        if iteration == start_iteration + 1:
            jax.block_until_ready(metrics)
            print(f"mlir-train: first step (compile + run) took {time.perf_counter() - t0:.1f}s", flush=True)
            last_done = t0  # Megatron's first iteration time includes its warm-up too
            finish(iteration, metrics)
            start_time = time.perf_counter()
        else:
            if pending is not None:
                finish(*pending)
            pending = (iteration, metrics)
        if args.eval_interval and iteration % args.eval_interval == 0:
            if pending is not None:
                finish(*pending)
                pending = None
            evaluate(iteration)
        stopped = _exit_reason(args, iteration, stop, launched)
        if saver is not None and (saver.should_save(iteration) or stopped):
            save_checkpoint(iteration)
        if stopped:
            break
    stop.restore()
    if pending is not None:
        finish(*pending)
        pending = None
    if saver is not None:
        save_checkpoint(iteration)  # no-op if this iteration is already saved
        try:
            saver.close()  # waits for the background writes
        except checkpoint.CheckpointError as e:
            raise _fail(str(e)) from None
    if stopped:
        writer.close()
        where = f"checkpoint of iteration {iteration} in {args.save}" if saver else "nothing saved (no --save)"
        print(f"mlir-train: stopped by {stopped} after iteration {iteration}; {where}")
        distributed.shutdown(processes)
        return {"history": history, "log_dir": log_dir, "state": state, "trainer": trainer, "tokenizer": tokenizer,
                "stopped": stopped}
    if not (args.eval_interval and args.train_iters % args.eval_interval == 0):
        evaluate(args.train_iters)
    if args.save_hf:
        from mlir_train.hf import save_pretrained

        save_pretrained(trainer.model(state["params"]), args.save_hf)
        print(f"mlir-train: wrote the HF model to {args.save_hf}")
    writer.close()
    if not history["lm loss"]:
        print(f"mlir-train: nothing to train: the checkpoint is at iteration {start_iteration} >= --train-iters")
        distributed.shutdown(processes)
        return {"history": history, "log_dir": log_dir, "state": state, "trainer": trainer, "tokenizer": tokenizer}
    first, last = history["lm loss"][0][1], history["lm loss"][-1][1]
    print(f"mlir-train: done. lm loss {first:.4f} -> {last:.4f} over {args.train_iters} iterations; "
          f"logs and metrics.jsonl in {log_dir}")
    distributed.shutdown(processes)
    return {"history": history, "log_dir": log_dir, "state": state, "trainer": trainer, "tokenizer": tokenizer}


def _exit_reason(args, iteration: int, stop, launched: float) -> str | None:
    """Why the loop stops after ``iteration`` (then saving with --save and exiting 0), or None:
    a SIGTERM/SIGINT, ``--exit-interval`` or ``--exit-duration-in-mins``. With several processes
    they agree first (any one's signal or clock stops all), as Megatron's all-reduce of its
    exit flags: a process saving alone would wait forever in the checkpoint's collectives."""
    import jax

    interval = bool(args.exit_interval) and iteration % args.exit_interval == 0
    minutes = (time.perf_counter() - launched) / 60
    late = args.exit_duration_in_mins is not None and minutes >= args.exit_duration_in_mins
    signalled = stop.requested
    if jax.process_count() > 1:  # a host round trip per iteration, only for multi-process jobs
        from jax.experimental import multihost_utils

        flags = np.asarray(multihost_utils.process_allgather(np.array([bool(signalled), late], np.int32)))
        flags = flags.reshape(-1, 2).max(axis=0)
        signalled = signalled or ("a signal on another process" if flags[0] else None)
        late = bool(flags[1])
    if signalled:
        return signalled
    if interval:
        return f"--exit-interval {args.exit_interval}"
    if late:
        return f"--exit-duration-in-mins {args.exit_duration_in_mins:g} ({minutes:.1f} min since start)"
    return None


def _checkpoints_at(path: str, checkpoint):
    """A read-only manager of ``path``, or None when it is missing or holds no complete checkpoint
    (partial writes do not count)."""
    try:
        saved = checkpoint.CheckpointManager(path, read_only=True)
    except checkpoint.CheckpointError:  # no such directory
        return None
    return saved if saved.latest_step() is not None else None


def _with_gbs(args, gbs: int):
    import argparse

    return argparse.Namespace(**(vars(args) | {"global_batch_size": gbs}))


if __name__ == "__main__":
    main()
