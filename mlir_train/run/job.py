"""The whole job a run configuration describes, built once, each part from what came before it:
the starting point (what ``--load`` holds, the model it describes, the seed), the run resolved
from the flags and the model, its kernels checked, the data, the trainer, the state and the
loop's hooks.

:func:`build_job` is what ``python -m mlir_train.sft`` calls between reading its flags and
running the loop (:func:`mlir_train.run.loop.train`). Every part comes from the module that
owns it: the starting point from :func:`mlir_train.checkpoint.sources.detect` (one
:class:`~mlir_train.checkpoint.sources.Source` per format, so nothing here asks which kind it
holds), the trainer from :func:`mlir_train.train.build.resolve`, the data from
:mod:`mlir_train.data`, the hooks from ``metrics``, ``evaluation``, ``exits`` and
:mod:`mlir_train.checkpoint.saver`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax

from mlir_train.checkpoint import agree, saver, sources, whole
from mlir_train.config.flags import RunConfig
from mlir_train.data import BatchLoader, DataConfig, build_datasets, load_tokenizer
from mlir_train.model import flops as flops_lib
from mlir_train.runtime import distributed, log, paths
from mlir_train.runtime.errors import ConfigError
from mlir_train.train import exits, kernel_check
from mlir_train.train.build import Run, resolve
from mlir_train.train.evaluation import Evaluator
from mlir_train.train.metrics import ExchangeRounds, MetricsWriter, StepLogger, Timers


@dataclasses.dataclass
class Hooks:
    """What the loop calls besides the step: logging, evaluation, checkpoints, exit conditions."""

    log_dir: str
    writer: MetricsWriter
    timers: Timers
    logger: StepLogger
    evaluate: Evaluator
    saver: saver.Checkpointer | None
    stop: exits.ExitConditions


@dataclasses.dataclass
class Job:
    cfg: RunConfig
    run: Run
    source: sources.Source
    trainer: Any
    tokenizer: Any
    train_loader: BatchLoader
    state: dict[str, Any]
    start_iteration: int
    hooks: Hooks
    lora_base: str | None = None  # LoRA: the HF directory of the base (a PEFT export's base_model_name_or_path)
    hf_origin: str | None = None  # the HF directory the weights came from: what --save-hf carries over from it


def build_job(cfg: RunConfig, launched: float) -> Job:
    """``cfg`` as a job ready to train (``launched``: when the process started, for
    ``--exit-duration-in-mins``). Raises the :mod:`mlir_train.runtime.errors` family."""
    ck, lg = cfg.checkpoint, cfg.logging
    paths.check_output_dirs({"--save": ck.save, "--save-hf": ck.save_hf, "--save-peft": ck.save_peft,
                             "--tensorboard-dir": lg.tensorboard_dir, "--wandb-save-dir": lg.wandb_save_dir or None,
                             "--data-cache-path": cfg.data.data_cache_path})
    whole.check_destinations({"--save-hf": ck.save_hf, "--save-peft": ck.save_peft},
                             {"--save": ck.save, "--tensorboard-dir": lg.tensorboard_dir, "--load": ck.load})
    tokenizer = load_tokenizer(cfg.data.tokenizer_path)
    start = _starting_point(cfg, len(tokenizer))
    cfg, model_cfg = start.cfg, start.model
    # --num-devices: the first N devices; the kernels follow the platform of the mesh's devices.
    run = resolve(cfg, model_cfg, num_devices=cfg.extras.num_devices)
    # Before data or state: a kernel that fails may be swapped for its fallback.
    options = run.options if cfg.extras.no_kernel_self_check else kernel_check.checked_options(run)
    # Process 0 preprocesses the data first; the others then find its cache (or, on a host that does
    # not share the cache directory, build their own without racing it).
    if jax.process_index() != 0:
        distributed.barrier("data-cache")
    data = build_datasets(DataConfig.from_flags(cfg.data, cfg.training.seed), tokenizer)
    if jax.process_index() == 0:
        distributed.barrier("data-cache")
    loader = BatchLoader(data.train, run.global_batch_size, seed=cfg.training.seed, process_index=jax.process_index(),
                         process_count=jax.process_count())
    trainer = run.trainer(options=options)
    log.info(f"{jax.device_count()} {jax.devices()[0].platform} devices, mesh {dict(trainer.mesh.shape)}, "
             f"{model_cfg.name} ({model_cfg.num_params() / 1e6:.1f}M params), {run.compute_dtype}, global batch "
             f"{run.global_batch_size} = {run.num_micro_batches} micro-batches x {run.micro_batch_size} x "
             f"DP{run.parallel.data_parallel}")
    print(data.summary())
    if cfg.training.lora is None:
        state = start.source.initial_state(trainer, cfg, loader)
    else:  # the base read through the same layout without adapters or optimizer state
        state = sources.lora_initial_state(trainer, run.base_trainer(trainer), cfg, loader, start.base, start.adapters)
    if cfg.extras.print_sharding:
        from mlir_train.train.sharding_report import sharding_report

        print(sharding_report(trainer))  # compute layout, fp32 master weights and optimizer state
    lora = None if cfg.training.lora is None else sources.lora_record(cfg.training.lora, start.base, cfg.training.seed)
    recorded = ({"lora": lora} if lora else {}) | ({"hf_origin": start.base.hf_origin} if start.base.hf_origin else {})
    hooks = _hooks(cfg, run, trainer, data, loader, len(tokenizer), start.save_lock, launched, recorded)
    if jax.devices()[0].platform == "gpu":
        _predict_step_time(cfg, run, trainer, state, hooks.logger)
    lora_base = lora["base"]["path"] if lora and lora["base"]["kind"] == "hf" else None
    return Job(cfg, run, start.source, trainer, tokenizer, loader, state, start.iteration, hooks, lora_base,
               start.base.hf_origin)


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a run starts, read from ``--load`` once."""

    cfg: RunConfig                    # the flags, with the seed the run continues with
    source: sources.Source            # what --load holds
    base: sources.Source              # the model's weights (under LoRA: its base)
    adapters: sources.Source | None   # under LoRA: where the adapters resume from
    model: Any                        # the model config (mlir_train.config.models.ModelConfig)
    save_lock: Any                    # the --save lock (saver.claim_save_dir), or None

    @property
    def iteration(self) -> int:
        """The iteration the loop resumes after (0: a fresh start or --finetune)."""
        resumed = self.source if self.cfg.training.lora is None else self.adapters
        return 0 if self.cfg.checkpoint.finetune or resumed is None else resumed.iteration


def _starting_point(cfg: RunConfig, tokenizer_size: int) -> Start:
    """What ``--load`` holds, checked against the flags; the ``--save`` lock, taken now rather
    than after loading (resuming into the directory it loaded from, the steps after the one
    resumed, a corrupt one skipped, are set aside); the model it describes; the seed the run
    continues with (the checkpoint's, unless --no-load-rng or --finetune keeps the flag's)."""
    ck = cfg.checkpoint
    source = sources.detect(ck.load, step=ck.ckpt_step, exit_on_missing=ck.exit_on_missing_checkpoint)
    source.check_resume(cfg)  # Megatron's rule: what the checkpoint lacks, the flags must waive
    save_lock = saver.claim_save_dir(ck.save, resume_step=source.resume_step_in(ck.save, cfg)) if ck.save else None
    sources.check_lora_resume(cfg, source)
    # LoRA: the model is its base's; --load may hold only adapters (sources.lora_sources).
    base, adapters = sources.lora_sources(cfg, source) if cfg.training.lora is not None else (source, None)
    model_cfg = agree.run_model_config(cfg, base, tokenizer_size)
    if ck.save_hf and base.hf_origin and os.path.realpath(ck.save_hf) == os.path.realpath(base.hf_origin):
        raise ConfigError(f"--save-hf {ck.save_hf} is the HF directory the model is read from, whose files the "
                          "export copies: give another directory")
    if source.seed is not None and not (ck.no_load_rng or ck.finetune) and source.seed != cfg.training.seed:
        log.info(f"--seed {cfg.training.seed} replaced by the checkpoint's {source.seed} (--no-load-rng keeps yours)")
        cfg = cfg.replace(training={"seed": source.seed})
    return Start(cfg, source, base, adapters, model_cfg, save_lock)


def _hooks(cfg: RunConfig, run: Run, trainer, data, loader: BatchLoader, tokenizer_size: int, save_lock,
           launched: float, recorded: dict | None = None) -> Hooks:
    """The loop's hooks; ``recorded``: what the checkpoints record besides the run (the LoRA
    policy and base, the HF directory the weights came from)."""
    t, lg, ck, model_cfg = cfg.training, cfg.logging, cfg.checkpoint, run.model
    pid, gbs = jax.process_index(), run.global_batch_size
    log_dir = lg.tensorboard_dir or os.path.join("runs", f"{model_cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    writer = MetricsWriter(log_dir, enabled=pid == 0, wandb_project=lg.wandb_project, wandb_name=lg.wandb_exp_name,
                           wandb_dir=lg.wandb_save_dir, config=cfg.flat() | {"model": model_cfg.as_dict()})
    timers = Timers()
    flops_per_step = flops_lib.num_floating_point_operations(
        model_cfg, run.seq_length, gbs,
        recompute_full=run.recompute.recomputed_fraction(model_cfg.num_layers // run.parallel.pipeline))
    logger = StepLogger(
        writer, train_iters=t.train_iters, log_interval=lg.log_interval,
        tensorboard_log_interval=lg.tensorboard_log_interval, check_nan=t.check_for_nan_in_loss_and_grad,
        global_batch_size=gbs, seq_length=run.seq_length, lr_at=run.lr_schedule().lr_at,
        flops_per_step=flops_per_step, num_devices=jax.device_count(),
        peak_tflops=flops_lib.device_peak_tflops("bf16" if run.compute_dtype != "float32" else "fp32",
                                                 cfg.extras.peak_tflops),
        log_timers=lg.log_timers_to_tensorboard, timers=timers, model_cfg=model_cfg,
        per_layer_router=cfg.moe.moe_per_layer_logging, expert_parallel=run.parallel.expert,
        exchange=ExchangeRounds(sum(model_cfg.moe_layers()) * run.num_micro_batches, cfg.extras.moe_ep_buffer_factor))
    evaluate = Evaluator(trainer, data.valid if data.valid.num_rows else None, global_batch_size=gbs,
                         eval_iters=t.eval_iters, seed=cfg.training.seed, split=cfg.data.split, process_index=pid,
                         process_count=jax.process_count(), logger=logger, timers=timers)
    checkpointer = None if not ck.save else saver.Checkpointer(
        ck.save, save_interval=ck.save_interval, retain=ck.save_retain, save_optim=not ck.no_save_optim,
        save_rng=not ck.no_save_rng, claimed=True, lock=save_lock,
        meta=lambda it: saver.run_json(iteration=it, global_batch_size=gbs, loader=loader, seed=cfg.training.seed,
                                       model_cfg=model_cfg, tokenizer_size=tokenizer_size, parallel=run.parallel,
                                       flags=cfg.flat()) | (recorded or {}))
    stop = exits.ExitConditions(exit_interval=t.exit_interval, exit_duration_in_mins=t.exit_duration_in_mins,
                                launched=launched)
    return Hooks(log_dir, writer, timers, logger, evaluate, checkpointer, stop)


def _predict_step_time(cfg: RunConfig, run: Run, trainer, state, logger: StepLogger) -> None:
    """On a GPU: the planner's roofline of this run's own compiled step (one extra compile),
    printed in the run's first lines and logged beside each measured step time."""
    import jax.numpy as jnp

    from mlir_train.data.dataset import BATCH_KEYS
    from mlir_train.planner import hlo, predict

    device = jax.devices()[0].device_kind
    kind = predict.kind_of(device)
    if kind is None:
        log.info(f"no predicted step time: the planner has no XLA:GPU target for {device}")
        return
    m = run.num_micro_batches
    batch = {k: jax.ShapeDtypeStruct((m, run.global_batch_size // m, run.seq_length),
                                     jnp.float32 if k == "loss_mask" else jnp.int32, sharding=trainer.batch_sharding)
             for k in BATCH_KEYS}
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    try:
        step = hlo.audit_compiled(trainer.lower_train_step(shapes, batch).compile())
    except Exception as e:  # the run itself compiles the step again; only the prediction is lost
        log.info(f"no predicted step time: the step's audit failed ({str(e).splitlines()[0]})")
        return
    r, at = predict.predicted(step, kind, run.parallel, run.model, cfg.extras.moe_ep_buffer_factor,
                              model_flops_per_device=logger.flops_per_step / jax.device_count(),
                              tokens_per_step=run.global_batch_size * run.seq_length)
    logger.predicted_step_s = r.step_s
    log.info(predict.summary(r, at, f"{kind.name} x {jax.device_count()}, mesh {dict(trainer.mesh.shape)}"))
