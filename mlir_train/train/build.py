"""The one builder: a run configuration in, a run out (the only way to get a Trainer).

:func:`resolve` takes a :class:`~mlir_train.config.flags.RunConfig` (the flags) and the model
config, validates the layout against the model and the devices, and derives every value that
needs them once, as a :class:`Run`: the layout, global batch and micro-batches, the pipeline
schedule, how the model is built (the platform's kernels, the router with its balancing groups),
the step's settings (the load balancing), the LR schedule, the optimizer and the loss scaler.
:meth:`Run.trainer` hands them to the :class:`~mlir_train.train.trainer.Trainer`, which builds
none of them again; callers that have no flags (tests, benchmarks, ``convert``) use
:func:`build_trainer`, which fills in what they leave out. ``sft``, ``plan``, ``convert``, the
benchmarks and the notebooks all get their Trainer here.
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from mlir_train.config.flags import RunConfig
from mlir_train.config.models import ModelConfig
from mlir_train.config.policies import RouterConfig
from mlir_train.config.sections import ParallelFlags, TrainingFlags
from mlir_train.families import family_of
from mlir_train.model import ModelOptions, kernel_options
from mlir_train.runtime import log
from mlir_train.runtime.platform_setup import platform_name
from mlir_train.runtime.errors import ConfigError
from mlir_train.train.optim import LossScaler, make_optimizer
from mlir_train.train.pipeline.schedule import Schedule, make_schedule
from mlir_train.train.schedule import megatron_lr_schedule
from mlir_train.train.state import model_dims
from mlir_train.train.step import StepConfig
from mlir_train.train.trainer import Trainer
from sharding.layout import Layout, LayoutError
from sharding.mesh import make_mesh, validate


# ----- what one flag section gives the trainer ------------------------------------------------------------
def layout_of(p: ParallelFlags, num_devices: int | None = None) -> Layout:
    """The layout of the parallel flags (``num_devices=None``: every device jax sees)."""
    return Layout(
        tensor=p.tensor_model_parallel_size, pipeline=p.pipeline_model_parallel_size,
        expert=p.expert_model_parallel_size, context=p.context_parallel_size,
        expert_tensor=p.expert_tensor_parallel_size, sequence_parallel=p.sequence_parallel, fsdp=p.fsdp,
        distributed_optimizer=p.distributed_optimizer, num_devices=num_devices,
    )


def lr_schedule_of(t: TrainingFlags, global_batch_size: int):
    """Megatron's LR schedule of the training flags (``OptimizerParamScheduler.get_lr``)."""
    if t.lr is None or t.train_iters is None:
        raise ConfigError("the LR schedule needs --lr and --train-iters")
    try:
        return megatron_lr_schedule(
            lr=t.lr, train_iters=t.train_iters, min_lr=t.min_lr, lr_decay_iters=t.lr_decay_iters,
            lr_decay_style=t.lr_decay_style, lr_warmup_iters=t.lr_warmup_iters,
            lr_warmup_fraction=t.lr_warmup_fraction, lr_warmup_init=t.lr_warmup_init,
            lr_wsd_decay_iters=t.lr_wsd_decay_iters, lr_wsd_decay_style=t.lr_wsd_decay_style,
            global_batch_size=global_batch_size,
        )
    except ValueError as e:  # Megatron's scheduler asserts, naming the flags
        raise ConfigError(str(e)) from None


def optimizer_of(t: TrainingFlags, schedule) -> optax.GradientTransformation:
    """The optimizer of the training flags, on ``schedule``."""
    return make_optimizer(lr_schedule=schedule, weight_decay=t.weight_decay, beta1=t.adam_beta1,
                          beta2=t.adam_beta2, eps=t.adam_eps, clip_grad=t.clip_grad,
                          optimizer=t.optimizer, sgd_momentum=t.sgd_momentum)


def loss_scaler_of(t: TrainingFlags) -> LossScaler | None:
    """Megatron's scaler for these flags: constant with ``--loss-scale`` (under --fp16 or
    --bf16), dynamic for ``--fp16``, none otherwise (bf16 and fp32 need no loss scaling)."""
    if t.loss_scale and (t.fp16 or t.bf16):
        return LossScaler(initial_scale=t.loss_scale, dynamic=False)
    if t.fp16:
        return LossScaler(initial_scale=t.initial_loss_scale, min_scale=t.min_loss_scale,
                          growth_interval=int(t.loss_scale_window), hysteresis=t.hysteresis)
    return None


def build_trainer(model_cfg: ModelConfig, step: StepConfig | None = None,
                  optimizer: optax.GradientTransformation | None = None, layout: Layout | None = None,
                  mesh: jax.sharding.Mesh | None = None, *, schedule: Schedule | None = None,
                  loss_scaler: LossScaler | None = None, options: ModelOptions = ModelOptions()) -> Trainer:
    """The :class:`~mlir_train.train.trainer.Trainer` of ``model_cfg``: ``step`` (default one
    micro-batch, fp32, no router losses), ``optimizer`` (default ``optax.identity()``: no update,
    as for loading and converting weights), ``layout`` (default: one replica over every device),
    ``mesh`` (default: :func:`sharding.mesh.make_mesh` of the layout; a layout the devices cannot
    hold is a ConfigError naming the flags), ``schedule`` (default under pipeline stages:
    Megatron's 1F1B over even stages) and ``options``: how the model is built to run (an MoE
    router's balancing groups default to the step's micro-batches, :func:`with_balancing_rows`)."""
    step = step if step is not None else StepConfig()
    layout = layout if layout is not None else Layout()
    check_layout_for_model(layout, model_cfg)
    if schedule is None and layout.pipeline > 1:
        schedule = make_schedule(model_cfg.num_layers, layout.pipeline, num_micro_batches=step.num_micro_batches)
    options = with_balancing_rows(options, model_cfg, step.micro_batch_size)
    return Trainer(model_cfg, step, optimizer if optimizer is not None else optax.identity(), layout,
                   mesh if mesh is not None else _mesh_of(layout), schedule=schedule, loss_scaler=loss_scaler,
                   options=options)


def check_layout_for_model(layout: Layout, model_cfg: ModelConfig) -> None:
    """A split the model's family cannot run exactly yet (:attr:`Family.refused_layouts`) is a
    ConfigError naming its flag, before anything is built."""
    for fields, why in family_of(model_cfg).refused_layouts.items():
        if all(getattr(layout, f) > 1 for f in ((fields,) if isinstance(fields, str) else fields)):
            raise ConfigError(why)
    if model_cfg.mtp_num_layers and layout.pipeline > 1:
        raise ConfigError(f"--mtp-num-layers {model_cfg.mtp_num_layers} with --pipeline-model-parallel-size "
                          f"{layout.pipeline}: the MTP depths do not run in the pipeline schedules yet; train them "
                          "without pipeline parallelism (tensor, expert, context and data parallelism run them)")


def _mesh_of(layout: Layout) -> jax.sharding.Mesh:
    """:func:`sharding.mesh.make_mesh` of ``layout``; a layout the devices cannot hold is a
    ConfigError naming the flags."""
    try:
        return make_mesh(layout)
    except LayoutError as e:  # e.g. --num-devices above what this process sees
        raise ConfigError(str(e)) from None


def with_balancing_rows(options: ModelOptions, model_cfg: ModelConfig, micro_batch_size: int) -> ModelOptions:
    """``options`` whose MoE router forms its balancing statistics per ``micro_batch_size`` rows
    (one data-parallel rank's micro-batch, the rows the LM loss is normalised by: Megatron forms
    both per rank), unless it names its own groups."""
    if not model_cfg.is_moe or options.router is not None and options.router.balancing_rows is not None:
        return options
    router = options.router or RouterConfig()
    return options.replace(router=dataclasses.replace(router, balancing_rows=micro_batch_size))


# ----- the run ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Run:
    """A :class:`RunConfig` resolved for one model and device count: every derived value, once."""

    config: RunConfig
    model: ModelConfig
    parallel: Layout            # validated
    global_batch_size: int
    num_micro_batches: int
    platform: str               # the mesh devices' platform (cpu, gpu, tpu): picks the kernels
    schedule: Schedule | None   # the pipeline schedule (None without pipeline stages)
    options: ModelOptions       # how the model is built to run: kernels, recompute, LoRA, router
    step: StepConfig            # how a step computes: micro-batches, dtype, load balancing, loss

    @property
    def compute_dtype(self) -> str:
        return self.config.training.compute_dtype

    @property
    def recompute(self):
        return self.config.training.recompute

    @property
    def remat(self) -> str:
        return self.config.training.remat

    @property
    def micro_batch_size(self) -> int:
        return self.config.training.micro_batch_size

    @property
    def seq_length(self) -> int:
        return self.config.data.seq_length

    def lr_schedule(self):
        return lr_schedule_of(self.config.training, self.global_batch_size)

    def trainer(self, mesh=None, options: ModelOptions | None = None) -> Trainer:
        """The :class:`~mlir_train.train.trainer.Trainer` of this run on ``mesh`` (default: its own),
        built with ``options`` (default :attr:`options`)."""
        t = self.config.training
        optimizer, loss_scaler = optimizer_of(t, self.lr_schedule()), loss_scaler_of(t)
        return build_trainer(self.model, self.step, optimizer, self.parallel, mesh, schedule=self.schedule,
                             loss_scaler=loss_scaler, options=options or self.options)

    def base_trainer(self, trainer: Trainer) -> Trainer:
        """Under LoRA: the trainer that reads the base's weights, ``trainer``'s model without
        adapters on its mesh and kernels, with no optimizer state."""
        return build_trainer(self.model, self.step, None, self.parallel, trainer.mesh, schedule=self.schedule,
                             options=trainer.options.plain())


def resolve(cfg: RunConfig, model_cfg: ModelConfig, *, num_devices: int | None = None,
            platform: str | None = None) -> Run:
    """Validate the layout against ``model_cfg`` and the device count (``platform``: the
    devices'; None: the default devices') and derive the batch split, the pipeline schedule,
    the model's options and the step's settings. Raises ConfigError."""
    parallel, gbs, num_micro = _batch_split(cfg, model_cfg, num_devices)
    check_layout_for_model(parallel, model_cfg)
    schedule = _pipeline_schedule(cfg.parallel, parallel, model_cfg, num_micro)
    platform = platform or platform_name()
    options = _model_options(cfg, model_cfg, parallel, schedule, platform)
    return Run(cfg, model_cfg, parallel, gbs, num_micro, platform, schedule, options, _step_config(cfg, num_micro))


def _batch_split(cfg: RunConfig, model_cfg: ModelConfig, num_devices: int | None) -> tuple[Layout, int, int]:
    """The validated layout, the global batch size and the micro-batches of one step."""
    t, p = cfg.training, cfg.parallel
    parallel = layout_of(p, num_devices)
    gbs = t.global_batch_size or t.micro_batch_size * parallel.data_parallel
    uneven = p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None
    if uneven and parallel.pipeline == 1:
        raise ConfigError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
    if p.pipeline_schedule and parallel.pipeline == 1:
        log.info(f"--pipeline-schedule {p.pipeline_schedule} has no effect without "
                 "--pipeline-model-parallel-size > 1")
    # Uneven stages: make_schedule checks the layer split (validate's would ask L % PP == 0).
    dims = {k: v for k, v in model_dims(model_cfg).items() if not (uneven and k == "num_layers")}
    try:
        parallel = validate(parallel, dims, global_batch_size=gbs,
                            micro_batch_size=t.micro_batch_size, seq_length=cfg.data.seq_length)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    return parallel, gbs, gbs // (t.micro_batch_size * parallel.data_parallel)


def _pipeline_schedule(p: ParallelFlags, parallel: Layout, model_cfg: ModelConfig, num_micro: int) -> Schedule | None:
    """The schedule the pipeline flags ask for (None without pipeline stages)."""
    if parallel.pipeline == 1:
        return None
    try:
        return make_schedule(model_cfg.num_layers, parallel.pipeline, kind=p.pipeline_schedule or "1f1b",
                             layers_per_virtual_stage=p.layers_per_virtual_stage(model_cfg.num_layers),
                             first_stage_layers=p.decoder_first_pipeline_num_layers,
                             last_stage_layers=p.decoder_last_pipeline_num_layers, num_micro_batches=num_micro)
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def _check_recompute(recompute, model_cfg: ModelConfig, schedule: Schedule | None) -> None:
    """The recompute policy against the pipeline chunks (megatron-core's recompute unit)."""
    chunks = [model_cfg.num_layers] if schedule is None else \
        [len(c) for stage in schedule.chunk_layers(model_cfg.num_layers) for c in stage]
    try:
        recompute.check_chunks(chunks, "model (no pipeline)" if schedule is None else "pipeline chunk")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not model_cfg.is_moe and any(recompute.recomputes(m) for m in ("moe", "moe_act")):
        log.info("--recompute-modules moe/moe_act (or --moe-layer-recompute) have no effect: the model has "
                 "no MoE layers")


def _check_lora_layers(lora, model_cfg: ModelConfig) -> None:
    """Every target the user named adapts some layer of this model, not only of its family (a
    dense MLP's fc1 in a model whose layers are all MoE would train nothing: grad norm 0)."""
    table, kinds = family_of(model_cfg).params, set(model_cfg.layer_kinds())
    present = {r.lora.module for kind in kinds for r in table.layer_rows(kind) if r.lora is not None}
    for target in lora.targets:
        one = dataclasses.replace(lora, targets=(target,))
        if not any(table.lora_weights(one, kind) for kind in kinds):
            raise ConfigError(f"--lora-target-modules {target}: no layer of {model_cfg.name} has it (its layers "
                              f"have {', '.join(m for m in table.lora_modules() if m in present)}); adapt those")


def _model_options(cfg: RunConfig, model_cfg: ModelConfig, parallel: Layout, schedule: Schedule | None,
                   platform: str) -> ModelOptions:
    """How the model is built to run: the platform's kernels (attention, MoE experts), the
    recompute policy (checked against the pipeline chunks), LoRA and, for MoE, the capacity, drop
    policy, router (Megatron's checks, before anything compiles; balancing per micro-batch) and
    EP buffers. Refuses a kernel choice this platform or layout cannot run."""
    _check_recompute(cfg.training.recompute, model_cfg, schedule)
    lora = cfg.training.lora
    if lora is not None and model_cfg.mtp_num_layers:
        raise ConfigError(f"--mtp-num-layers {model_cfg.mtp_num_layers} with LoRA: adapters on the MTP head are not "
                          "built yet; train the head with full fine-tuning, or leave it carried under LoRA")
    if lora is not None:  # the patterns against the model's own modules (its family's parameter table)
        problem = family_of(model_cfg).params.check_lora_targets(lora.patterns())
        if problem:
            raise ConfigError(f"--lora-target-modules {problem}")
        _check_lora_layers(lora, model_cfg)
    m, extras = cfg.moe, cfg.extras
    router = m.router(model_cfg, parallel.expert)
    if router is not None and router.dtype == "fp64" and platform == "tpu":
        raise ConfigError("--moe-router-dtype fp64: TPUs have no float64; use --moe-router-dtype fp32 (the default)")
    if model_cfg.is_moe and m.moe_router_num_groups and not m.moe_router_group_topk:
        log.info("--moe-router-num-groups without --moe-router-group-topk routes without groups (as in Megatron)")
    if parallel.context > 1 and platform == "gpu" and extras.attention_kernel == "auto":
        log.info(f"--context-parallel-size {parallel.context}: attention runs as XLA ops "
                 "(mlir_train.model.attention.blocked_attention: each rank's queries against the gathered row, one key "
                 "block at a time), not the flash kernel, which cannot mask the load-balanced chunks by their "
                 "original positions")
    backend = extras.moe_gemm_backend
    if extras.code_paths == "gpu" and platform == "cpu":
        log.info("--code-paths gpu: the GPU program's dispatch and kernels, interpreted on CPU (slow); the "
                 "xla_gpu_* XLA flags mean nothing to XLA:CPU and are not set")
    if model_cfg.is_moe and backend in ("mosaic", "tokamax") and m.moe_expert_capacity_factor is not None:
        raise ConfigError(f"--moe-gemm-backend {backend} runs the dropless block kernels; with "
                          "--moe-expert-capacity-factor use --moe-gemm-backend padded (or auto)")
    options = ModelOptions(remat=cfg.training.recompute, lora=lora)
    if model_cfg.is_moe:
        if not extras.moe_ep_buffer_factor > 0:
            raise ConfigError(f"--moe-ep-buffer-factor must be positive, got {extras.moe_ep_buffer_factor}")
        options = with_balancing_rows(options.replace(
            capacity_factor=m.moe_expert_capacity_factor, drop_policy=m.moe_token_drop_policy, router=router,
            ep_buffer_factor=extras.moe_ep_buffer_factor), model_cfg, cfg.training.micro_batch_size)
    try:
        return kernel_options(platform, is_moe=model_cfg.is_moe, context_parallel=parallel.context,
                              moe_backend=backend, attention_backend=extras.attention_kernel, base=options,
                              code_paths=extras.code_paths)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _step_config(cfg: RunConfig, num_micro: int) -> StepConfig:
    t, m = cfg.training, cfg.moe
    return StepConfig(num_micro_batches=num_micro, compute_dtype=t.compute_dtype, balancing=m.load_balancing(),
                      expert_bias_update_rate=m.moe_router_bias_update_rate, micro_batch_size=t.micro_batch_size,
                      per_token_loss=t.calculate_per_token_loss, mtp_loss_scaling_factor=cfg.model.mtp_loss_scaling_factor,
                      lm_loss_report="objective" if t.training_phase == "sft" else "token-mean")
