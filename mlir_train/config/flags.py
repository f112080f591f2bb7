"""The run configuration: the flag sections (:mod:`mlir_train.config.sections`) as one frozen
:class:`RunConfig`, built once from the parsed flags and checked.

The command-line parser (:mod:`mlir_train.config.cli`), its ``--help`` grouping and README's
"what each flag does" table (:mod:`mlir_train.config.flag_table`) are generated from the
sections' field metadata. :func:`build` turns parsed flags into a :class:`RunConfig` and holds
the cross-flag checks that need no model or devices (Megatron's ``validate_args`` on flags
alone, the recompute checks, the refusals). What needs the model, the device count or the
platform is derived once by :func:`mlir_train.train.build.resolve`. Changes at resume time are
:func:`dataclasses.replace`, never mutation.

This module (like the whole config layer) imports no jax, so entry points can read flags first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlir_train.config.flag_table import REFUSED
from mlir_train.config.policies import ABSENT_MODULES
from mlir_train.config.sections import (
    SECTIONS, CheckpointFlags, DataFlags, ExtraFlags, LoggingFlags, ModelFlags, MoEFlags, ParallelFlags, TrainingFlags,
    _flag_names,
)
from mlir_train.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelFlags = dataclasses.field(default_factory=ModelFlags)
    data: DataFlags = dataclasses.field(default_factory=DataFlags)
    training: TrainingFlags = dataclasses.field(default_factory=TrainingFlags)
    moe: MoEFlags = dataclasses.field(default_factory=MoEFlags)
    parallel: ParallelFlags = dataclasses.field(default_factory=ParallelFlags)
    logging: LoggingFlags = dataclasses.field(default_factory=LoggingFlags)
    checkpoint: CheckpointFlags = dataclasses.field(default_factory=CheckpointFlags)
    extras: ExtraFlags = dataclasses.field(default_factory=ExtraFlags)
    ignored_flags: tuple[str, ...] = ()  # accepted no-op flags the user gave, in order

    def replace(self, **sections: dict[str, Any]) -> "RunConfig":
        """``cfg.replace(checkpoint={"load": None})``: new sections with some fields changed."""
        return dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), **fields)
                                            for name, fields in sections.items()})

    def flat(self) -> dict[str, Any]:
        """Every field by its Megatron dest name (for the run's config.json and checkpoints)."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out


def build(values: dict[str, Any], ignored: tuple[str, ...] = ()) -> RunConfig:
    """A :class:`RunConfig` from parsed values keyed by dest name (the parser's output), with
    Megatron's ``validate_args`` checks on flags alone and the refusals. Raises ConfigError."""
    sections = {}
    for name, cls in SECTIONS.items():
        fields = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}
        for key in ("data_path", "sft_dataset"):  # nargs lists, kept as tuples
            if fields.get(key) is not None:
                fields[key] = tuple(fields[key])
        sections[name] = cls(**fields)
    cfg = RunConfig(**sections, ignored_flags=tuple(ignored))
    check(cfg)
    return cfg


def check(cfg: RunConfig) -> None:
    """The cross-flag checks that need neither the model nor the devices."""
    t, p, m = cfg.training, cfg.parallel, cfg.moe
    if t.bf16 and t.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    if t.lr_warmup_fraction is not None and t.lr_warmup_iters != 0:
        raise ConfigError("give only one of --lr-warmup-fraction and --lr-warmup-iters")
    if t.lr_decay_style == "WSD" and t.lr_wsd_decay_iters is None:
        raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters")
    if t.attention_dropout or t.hidden_dropout:
        raise ConfigError("dropout is not implemented: use --attention-dropout 0 --hidden-dropout 0")
    if t.micro_batch_size is not None and t.global_batch_size is not None and t.global_batch_size % t.micro_batch_size:
        raise ConfigError(f"--global-batch-size {t.global_batch_size} is not a multiple of "
                          f"--micro-batch-size {t.micro_batch_size}")
    if p.fsdp and p.pipeline_model_parallel_size > 1:
        raise ConfigError("FSDP (--use-torch-fsdp2 / --data-parallel-sharding-strategy optim_grads_params) is not "
                          "implemented with pipeline parallelism; use --use-distributed-optimizer with "
                          "--pipeline-model-parallel-size > 1")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (as in Megatron)")
    m.load_balancing()  # the types and their coefficients pair up (names the flags otherwise)
    check_recompute(t)
    if t.lora is None and (cfg.checkpoint.pretrained_checkpoint or cfg.checkpoint.save_peft):
        flag = "--pretrained-checkpoint" if cfg.checkpoint.pretrained_checkpoint else "--save-peft"
        raise ConfigError(f"{flag} is for LoRA runs: add --lora-dim R (or drop {flag})")
    if cfg.checkpoint.lora_export_format and not cfg.checkpoint.save_peft:
        raise ConfigError(f"--lora-export-format {cfg.checkpoint.lora_export_format} is the layout of --save-peft's "
                          "adapters: add --save-peft DIR (or drop it)")
    if t.lora is not None and m.moe_router_enable_expert_bias:
        raise ConfigError("--moe-router-enable-expert-bias with --lora-dim: the expert bias is state of the frozen "
                          "base, which a LoRA run neither updates nor saves; drop one of the two")
    names = _flag_names()
    for flag_name, refusal in REFUSED.items():
        section, field = names[flag_name]
        value = getattr(getattr(cfg, section), field)
        if not refusal.accepted(value, cfg):
            raise ConfigError(f"{flag_name} {_show(value)}: {refusal.message}")


def check_recompute(t: TrainingFlags) -> None:
    """megatron-core 0.16's checks of the recompute flags (``TransformerConfig.__post_init__``
    and ``validate_args``), naming the flags; where it silently ignores or overrides one (a
    method without a granularity, --recompute-activations over full) we refuse instead."""
    g, method, n = t.recompute_granularity, t.recompute_method, t.recompute_num_layers
    if t.recompute_activations and g == "full":
        raise ConfigError("--recompute-activations is Megatron's --recompute-granularity selective, which it would "
                          "silently put in place of --recompute-granularity full: give only one")
    if t.moe_layer_recompute and g == "full":
        raise ConfigError("--moe-layer-recompute with --recompute-granularity full: megatron-core refuses it "
                          "(\"Do not set --moe-layer-recompute with full recompute granularity\"); drop one")
    selective = g == "selective" or t.recompute_activations or t.moe_layer_recompute
    if method is not None and g != "full":
        raise ConfigError(f"--recompute-method {method} needs --recompute-granularity full (megatron-core: "
                          "\"recompute method is not yet supported for selective recomputing granularity\"; "
                          "without a granularity it is ignored)")
    if n is not None and method is None:
        raise ConfigError(f"--recompute-num-layers {n} needs --recompute-granularity full and --recompute-method "
                          "uniform|block (megatron-core: recompute_num_layers must be None for selective)")
    if method is not None and n is None:
        raise ConfigError(f"--recompute-method {method} needs --recompute-num-layers (megatron-core: between 1 "
                          "and the layers per pipeline stage)")
    if n is not None and n < 1:
        raise ConfigError(f"--recompute-num-layers {n}: must be at least 1")
    if t.recompute_modules and not selective:
        raise ConfigError("--recompute-modules applies to --recompute-granularity selective only "
                          f"(got {g or 'no --recompute-granularity'})")
    for m in t.recompute_modules or ():
        if m in ABSENT_MODULES:
            raise ConfigError(f"--recompute-modules {m}: {ABSENT_MODULES[m]}; drop it")


def _show(value: Any) -> str:
    return "" if value is True else str(value)


def require(cfg: RunConfig, *flags: str) -> None:
    names = _flag_names()
    for flag_name in flags:
        section, field = names[flag_name]
        if getattr(getattr(cfg, section), field) is None:
            if flag_name == "--hf-tokenizer-path" and cfg.data.tokenizer_model:
                continue
            raise ConfigError(f"{flag_name} is required")
