"""``python -m mlir_train.sft``: supervised fine-tuning with a Megatron/AIAK command line.

Reads top to bottom: flags -> the starting point (HF directory, our checkpoint, scratch) ->
the run (mesh, trainer, state, loaders) -> the loop (hooks: logging, evaluation, checkpoints,
exit conditions, each in the module that owns it) -> one typed result. With no arguments it
fine-tunes ``qwen3-moe-tiny`` on the bundled alpaca-format tasks and tokenizer on 8 fake CPU
devices and shows the loss falling.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

from mlir_train.config import cli
from mlir_train.runtime import platform_setup
from mlir_train.data.config import DEFAULT_DATA, DEFAULT_TOKENIZER
from mlir_train.config.flags import ConfigError, RunConfig, require, resolve

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


@dataclasses.dataclass
class RunResult:
    """What a run leaves: the loss history (``{"lm loss": [(it, loss)], "valid": [...]}``),
    where its logs are, its final state and trainer, and why it stopped early (or None)."""

    history: dict[str, list]
    log_dir: str
    state: Any
    trainer: Any
    tokenizer: Any
    stopped: str | None = None


def _fail(msg: str) -> SystemExit:
    print(f"error: {msg}", file=sys.stderr)
    return SystemExit(2)


def main(argv: list[str] | None = None) -> RunResult:
    launched = time.perf_counter()  # --exit-duration-in-mins counts from here, as Megatron's from its start
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = cli.parse(argv or DEFAULT_ARGV)
    platform_setup.configure_platform(cpu_devices=cfg.extras.cpu_devices)
    if not argv:
        print("mlir-train: no arguments given; running the embedded default SFT "
              "(qwen3-moe-tiny on the bundled alpaca tasks, 8 fake CPU devices).")
    if cfg.ignored_flags:
        print(f"mlir-train: ignoring flags that mean nothing under JAX/XLA: {' '.join(cfg.ignored_flags)}")
    from mlir_train.checkpoint import orbax as checkpoint
    from mlir_train.runtime import distributed
    from mlir_train.data import DataError
    from mlir_train.train.metrics import NonFiniteLoss

    try:
        require(cfg, "--train-iters", "--lr", "--seq-length", "--micro-batch-size", "--data-path", "--hf-tokenizer-path")
        processes = distributed.initialize_from_env(cpu_devices=cfg.extras.cpu_devices)  # before any device use
        try:
            return _train(cfg, launched)
        finally:
            distributed.shutdown(processes)
    except NonFiniteLoss as e:
        raise SystemExit(f"error: {e}") from None
    except (ConfigError, DataError, checkpoint.CheckpointError, distributed.DistributedEnvError) as e:
        raise _fail(str(e)) from None


def _train(cfg: RunConfig, launched: float) -> RunResult:
    import jax

    from mlir_train.checkpoint import orbax as checkpoint
    from mlir_train.train import exits
    from mlir_train.train import kernel_check
    from mlir_train.planner import flops as flops_lib
    from mlir_train.data import BatchLoader, build_datasets, load_tokenizer
    from mlir_train.train.evaluation import Evaluator
    from mlir_train.train.metrics import MetricsWriter, StepLogger, Timers

    if jax.process_index() != 0:
        sys.stdout = open(os.devnull, "w")  # console lines from process 0 only, as Megatron's rank 0
    print(platform_setup.current().describe())
    if cfg.extras.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cfg.extras.compilation_cache_dir)

    # ----- the starting point ---------------------------------------------------------------
    tokenizer = load_tokenizer(cfg.data.tokenizer_path)
    ck = cfg.checkpoint
    start = checkpoint.resolve_start(ck.load, step=ck.ckpt_step, exit_on_missing=ck.exit_on_missing_checkpoint)
    if start.kind == "ours":  # Megatron's rule: what the checkpoint lacks, the flags must waive
        checkpoint.resume_check(start.meta, start.describe(), load_optim=not ck.no_load_optim,
                                load_rng=not ck.no_load_rng, finetune=ck.finetune)
    # --save: one job per directory, refused now rather than after loading; resuming into the
    # directory it loaded from, the steps after the one resumed (a corrupt one skipped) are set aside.
    same_dir = (start.kind == "ours" and not ck.finetune
                and os.path.realpath(ck.save or "") == os.path.realpath(start.path))
    save_lock = checkpoint.claim_save_dir(ck.save, resume_step=start.step if same_dir else None) if ck.save else None
    if start.seed is not None and not (ck.no_load_rng or ck.finetune) and start.seed != cfg.training.seed:
        print(f"mlir-train: --seed {cfg.training.seed} replaced by the checkpoint's {start.seed} (--no-load-rng keeps yours)")
        cfg = cfg.replace(training={"seed": start.seed})
    model_cfg = _model_config(cfg, start, len(tokenizer))

    # ----- the run: mesh, trainer, data, state ------------------------------------------------
    # --num-devices: the first N devices; the kernels follow the platform of the mesh's devices.
    run = resolve(cfg, model_cfg, num_devices=cfg.extras.num_devices)
    trainer = run.trainer()
    if not cfg.extras.no_kernel_self_check:  # before any state: a kernel that fails may be swapped for its fallback
        trainer = kernel_check.checked_trainer(run, trainer)
    gbs, num_micro, parallel = run.global_batch_size, run.num_micro_batches, run.parallel
    print(f"mlir-train: {jax.device_count()} {jax.devices()[0].platform} devices, mesh {dict(trainer.mesh.shape)}, "
          f"{model_cfg.name} ({model_cfg.num_params() / 1e6:.1f}M params), {run.compute_dtype}, "
          f"global batch {gbs} = {num_micro} micro-batches x {run.micro_batch_size} x DP{parallel.data_parallel}")
    data = _datasets(cfg, tokenizer, build_datasets)
    print(data.summary())
    pid, nproc = jax.process_index(), jax.process_count()
    seed = cfg.training.seed
    train_loader = BatchLoader(data.train, gbs, seed=seed, process_index=pid, process_count=nproc)
    state = _initial_state(cfg, start, trainer, train_loader)
    start_iteration = 0 if ck.finetune else start.iteration
    if cfg.extras.print_sharding:
        from mlir_train.train.sharding_report import sharding_report

        print(sharding_report(trainer))  # compute layout, fp32 master weights and optimizer state

    # ----- the loop's hooks -------------------------------------------------------------------
    t, lg = cfg.training, cfg.logging
    log_dir = lg.tensorboard_dir or os.path.join("runs", f"{model_cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    writer = MetricsWriter(log_dir, enabled=pid == 0, wandb_project=lg.wandb_project, wandb_name=lg.wandb_exp_name,
                           wandb_dir=lg.wandb_save_dir, config=cfg.flat() | {"model": dataclasses.asdict(model_cfg)})
    timers = Timers()
    schedule = run.lr_schedule()
    logger = StepLogger(
        writer, train_iters=t.train_iters, log_interval=lg.log_interval,
        tensorboard_log_interval=lg.tensorboard_log_interval, check_nan=t.check_for_nan_in_loss_and_grad,
        global_batch_size=gbs, seq_length=run.seq_length, lr_at=schedule.lr_at,
        flops_per_step=flops_lib.num_floating_point_operations(model_cfg, run.seq_length, gbs,
                                                               recompute_full=run.recompute.recomputed_fraction(
                                                                   model_cfg.num_layers // run.parallel.pipeline)),
        num_devices=jax.device_count(), peak_tflops=flops_lib.device_peak_tflops(
            "bf16" if run.compute_dtype != "float32" else "fp32", cfg.extras.peak_tflops),
        log_timers=lg.log_timers_to_tensorboard, timers=timers, model_cfg=model_cfg,
        per_layer_router=cfg.moe.moe_per_layer_logging)
    evaluate = Evaluator(trainer, data.valid if data.valid.num_rows else None, global_batch_size=gbs,
                         eval_iters=t.eval_iters, seed=seed, split=cfg.data.split, process_index=pid,
                         process_count=nproc, logger=logger, timers=timers)
    saver = None if not ck.save else checkpoint.Checkpointer(
        ck.save, save_interval=ck.save_interval, retain=ck.save_retain, save_optim=not ck.no_save_optim,
        save_rng=not ck.no_save_rng, claimed=True, lock=save_lock,
        meta=lambda it: checkpoint.run_json(iteration=it, global_batch_size=gbs, loader=train_loader, seed=seed,
                                            model_cfg=model_cfg, tokenizer_size=len(tokenizer), parallel=parallel,
                                            flags=cfg.flat()))
    stop = exits.ExitConditions(exit_interval=t.exit_interval, exit_duration_in_mins=t.exit_duration_in_mins,
                                launched=launched)

    def save(iteration: int) -> None:
        logger.flush()  # the NaN check must pass before this state is written
        timers.start("save-checkpoint")
        saver.save(iteration, state)
        timers.stop("save-checkpoint")

    # ----- the loop ---------------------------------------------------------------------------
    print("mlir-train: compiling the training step ...", flush=True)
    t0 = time.perf_counter()
    iteration, stopped = start_iteration, None
    try:
        for iteration in range(start_iteration + 1, t.train_iters + 1):
            timers.start("data-wait")
            batch = trainer.global_batch(next(train_loader))
            timers.stop("data-wait")
            timers.start("step-dispatch")
            state, metrics = trainer.train_step(state, batch)
            timers.stop("step-dispatch")
            first = iteration == start_iteration + 1
            logger.step_done(iteration, metrics, first=first, started=t0)
            if first:
                print(f"mlir-train: first step (compile + run) took {time.perf_counter() - t0:.1f}s", flush=True)
            if t.eval_interval and iteration % t.eval_interval == 0:
                logger.flush()
                evaluate(iteration, state["params"])
            stopped = stop.reason(iteration)
            if saver is not None and (saver.should_save(iteration) or stopped):
                save(iteration)
            if stopped:
                break
        logger.flush()
        if saver is not None:
            save(iteration)  # no-op if this iteration is already saved
            saver.close()
    finally:
        stop.close()
        if saver is not None:
            saver.release()  # the --save lock, however the loop ended
    if not stopped and not (t.eval_interval and t.train_iters % t.eval_interval == 0):
        evaluate(t.train_iters, state["params"])
    if not stopped and ck.save_hf:
        from mlir_train.checkpoint.hf import save_pretrained

        save_pretrained(trainer.model(state["params"]), ck.save_hf)
        print(f"mlir-train: wrote the HF model to {ck.save_hf}")
    writer.close()
    history = logger.history
    if stopped:
        where = f"checkpoint of iteration {iteration} in {ck.save}" if saver else "nothing saved (no --save)"
        print(f"mlir-train: stopped by {stopped} after iteration {iteration}; {where}")
    elif not history["lm loss"]:
        print(f"mlir-train: nothing to train: the checkpoint is at iteration {start_iteration} >= --train-iters")
    else:
        first, last = history["lm loss"][0][1], history["lm loss"][-1][1]
        print(f"mlir-train: done. lm loss {first:.4f} -> {last:.4f} over {t.train_iters} iterations; "
              f"logs and metrics.jsonl in {log_dir}")
    return RunResult(history, log_dir, state, trainer, tokenizer, stopped)


def _model_config(cfg: RunConfig, start, tokenizer_size: int):
    """The model: the starting point's own config (HF config.json, our checkpoint's, or a
    Megatron checkpoint's args), which ``--model-name`` (if given) and the architecture
    overrides must agree with; else the named one with the vocabulary padded as Megatron pads it."""
    from mlir_train.checkpoint import orbax as checkpoint
    from mlir_train.checkpoint.megatron import read as megatron_checkpoint
    from mlir_train.config.models import ModelConfig

    m = cfg.model
    if start.kind == "scratch":
        return m.model_config(m.padded_vocab_size(tokenizer_size, cfg.parallel.tensor_model_parallel_size))
    shape_fields = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "num_experts", "top_k")
    if start.kind == "megatron":
        named = m.model_config(None) if m.model_name else None
        ckpt = start.megatron
        vocab = megatron_checkpoint.unpadded_vocab(ckpt, [named.vocab_size if named else None, tokenizer_size])
        model_cfg = megatron_checkpoint.model_config(
            ckpt, name=named.name if named else os.path.basename(ckpt.root.rstrip("/")), vocab_size=vocab,
            fallback=named)
        shape_fields += ("head_dim", "intermediate_size", "moe_intermediate_size")
    else:
        model_cfg = ModelConfig.from_hf_json(start.path) if start.kind == "hf" else checkpoint.model_config(start.meta)
    saved_tokens = (start.meta or {}).get("tokenizer_size")
    if tokenizer_size > model_cfg.vocab_size or (start.kind == "ours" and not cfg.checkpoint.finetune
                                                 and saved_tokens not in (None, tokenizer_size)):
        trained = f" (trained with a {saved_tokens}-token tokenizer)" if saved_tokens else ""
        raise ConfigError(f"tokenizer {cfg.data.tokenizer_path} has {tokenizer_size} tokens but the checkpoint "
                          f"{start.describe()} has a vocab of {model_cfg.vocab_size}{trained}")
    # Named: --model-name must be the checkpoint's model; not named: the flags' overrides must agree.
    named = m.model_config(model_cfg.vocab_size, base=None if m.model_name else model_cfg)
    who = f"--model-name {m.model_name} (with overrides)" if m.model_name else "a model flag"
    for field in shape_fields:
        if getattr(named, field) != getattr(model_cfg, field):
            raise ConfigError(f"{who} has {field}={getattr(named, field)} but the checkpoint {start.describe()} "
                              f"has {getattr(model_cfg, field)}")
    if m.moe_layer_freq is not None and model_cfg.is_moe and \
            m.moe_layer_pattern(model_cfg.num_layers) != model_cfg.layer_kinds():
        raise ConfigError(f"--moe-layer-freq {m.moe_layer_freq} differs from the checkpoint {start.describe()}'s "
                          f"MoE layers {[int(k) for k in model_cfg.layer_kinds()]}")
    return model_cfg


def _datasets(cfg: RunConfig, tokenizer, build_datasets):
    """Process 0 preprocesses first; the others then find its cache (or, on a host that does not
    share the cache directory, build their own without racing it)."""
    import jax

    from mlir_train.runtime import distributed

    if jax.process_index() != 0:
        distributed.barrier("data-cache")
    data = build_datasets(cfg.data.data_config(cfg.training.seed), tokenizer)
    if jax.process_index() == 0:
        distributed.barrier("data-cache")
    return data


def _initial_state(cfg: RunConfig, start, trainer, train_loader):
    from mlir_train.checkpoint import orbax as checkpoint

    ck = cfg.checkpoint
    if start.kind == "hf":
        import numpy as np
        from flax import nnx

        from mlir_train.checkpoint.hf import load_pretrained

        print(f"mlir-train: loading HF weights from {start.path}")
        model = load_pretrained(start.path, dtype=np.float32, mesh=trainer.mesh, rules=trainer.rules,
                                **trainer.model_kwargs)
        return trainer.state_from_params(nnx.to_pure_dict(nnx.state(model)))
    if start.kind == "megatron":
        import jax
        import numpy as np

        from mlir_train.checkpoint.megatron import read as megatron_checkpoint

        ckpt = start.megatron
        print(f"mlir-train: loading weights from {ckpt.describe()}")
        for note in megatron_checkpoint.resume_notes(ckpt, finetune=ck.finetune, load_optim=not ck.no_load_optim,
                                                     load_rng=not ck.no_load_rng):
            print(f"mlir-train: note: {note}")
        state = trainer.state_from_params(megatron_checkpoint.load_params(
            ckpt, trainer.model_cfg, trainer.param_shapes, trainer.master_shardings))
        state["iteration"] = jax.device_put(np.int32(0 if ck.finetune else ckpt.iteration),
                                            trainer.state_shardings["iteration"])
        return state
    if start.kind == "ours":
        what = "weights only, iteration 0 (--finetune)" if ck.finetune else "weights" if ck.no_load_optim else "full state"
        print(f"mlir-train: loading {what} from checkpoint {start.path} (iteration {start.iteration})")
        if not ck.finetune and "opt_state" not in start.meta["items"] and start.iteration:
            print(f"mlir-train: checkpoint {start.describe()} holds no optimizer state (--no-save-optim): resuming "
                  "with a fresh optimizer (zero Adam moments, the LR schedule's step count from 0)")
        state, meta = checkpoint.load_state(start.path, trainer, load_optim=not ck.no_load_optim,
                                            finetune=ck.finetune, step=start.step, verify=False)
        if not ck.finetune:
            checkpoint.restore_loader(train_loader, meta, exact=start.seed == cfg.training.seed)
        return state
    return trainer.init_state(cfg.training.seed)


if __name__ == "__main__":
    main()
