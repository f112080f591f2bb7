"""The run configuration: every Megatron/AIAK flag as a typed field, built once.

Each section is a frozen dataclass whose fields carry the flag they come from as metadata
(:func:`flag`): the command-line parser (:mod:`mlir_train.config.cli`), its ``--help`` grouping and
the "what each flag does" table (:func:`flag_table`) are all generated from these classes.
Field names are Megatron's argparse ``dest`` names, so a Megatron user can read them.

Every accepted flag is in exactly one of three groups (``tests/config/test_cli.py`` walks the parser):

* **honoured**: a field below, doing what Megatron does;
* **no-op under XLA** (:data:`NOOP_FLAGS`, :data:`ARCH_IMPLIED_FLAGS`): accepted with
  Megatron's arity and printed once at start-up as meaning nothing here;
* **refused** (:data:`REFUSED`): a field whose non-default value we do not implement; the run
  stops at start-up naming the flag and saying what to use instead.

:func:`build` turns parsed flags into a :class:`RunConfig` and holds the cross-flag checks
that need no model or devices; :func:`resolve` adds what needs them (the model config, the
device count, the mesh's platform) and computes every derived value once (global batch,
micro-batches, compute dtype, recompute policy, FSDP, distributed optimizer, MoE
implementation) as a :class:`Run`, which builds the trainer, optimizer and schedule.
Changes at resume time are :func:`dataclasses.replace`, never mutation.

This module imports no jax at import time, so entry points can read flags first.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Callable, ClassVar

from mlir_train.runtime.errors import ConfigError

# --help group titles, in order. The first seven are the seed script's bash arrays.
SEED_GROUPS = ("model", "data", "sft", "training", "moe", "model-parallel", "logging")
GROUP_TITLES = {
    "model": "model (MODEL_ARGS)",
    "data": "data (DATA_ARGS)",
    "sft": "sft (SFT_ARGS)",
    "training": "training (TRAINING_ARGS)",
    "moe": "moe (MOE_ARGS)",
    "model-parallel": "model-parallel (MODEL_PARALLEL_ARGS)",
    "logging": "logging (LOGGING_ARGS)",
    "checkpointing": "checkpointing",
    "mlir-train": "mlir-train extras (no Megatron equivalent)",
    "ignored": "accepted for Megatron compatibility, no effect under JAX (reported once as ignored)",
    "refused": "Megatron features not implemented here (the run stops naming the flag)",
}




@dataclasses.dataclass(frozen=True)
class Flag:
    """How one field is spelled on the command line (argparse keyword arguments)."""

    names: tuple[str, ...]            # "--lr", or several spellings of one flag
    group: str | None = None          # --help group; None: the section's
    kwargs: dict = dataclasses.field(default_factory=dict)  # type, choices, action, nargs, help, metavar

    @property
    def name(self) -> str:
        return self.names[0]


def flag(*names: str, default: Any = None, group: str | None = None, **kwargs) -> Any:
    """A dataclass field spelled ``names`` on the command line."""
    return dataclasses.field(default=default, metadata={"flag": Flag(tuple(names), group, kwargs)})


class OneOrList(argparse.Action):
    """``nargs="+"`` that stores one value as itself and several as a list (Megatron's reading of
    ``--moe-router-load-balancing-type`` and ``--moe-aux-loss-coeff``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values[0] if len(values) == 1 else list(values))


def switch(*names: str, help: str = "", group: str | None = None, default: bool = False) -> Any:
    return flag(*names, default=default, group=group, action="store_true", help=help)


# ----- sections -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelFlags:
    """Architecture. ``None`` = take it from ``--model-name`` (where Megatron would use its own
    built-in default, e.g. ``--moe-router-topk 2``, ``--rotary-base 10000``: AIAK fills these
    from the model name too, and a Megatron default overriding the release values would be a bug)."""

    GROUP: ClassVar[str] = "model"
    model_name: str | None = flag("--model-name",
                                  help="registry name (qwen3-30b-a3b, qwen3-moe-tiny, ...) or a path to an HF "
                                       "config.json / model directory (default: the --load checkpoint's own model, "
                                       "else qwen3-moe-tiny)")
    rotary_base: int | None = flag("--rotary-base", type=int, help="RoPE theta (default: from --model-name)")
    rotary_seq_len_interpolation_factor: int | None = flag(
        "--rotary-seq-len-interpolation-factor", type=int,
        help="linear RoPE position interpolation factor (default: from --model-name)")
    num_layers: int | None = flag("--num-layers", type=int, help="default: from --model-name")
    hidden_size: int | None = flag("--hidden-size", type=int, help="default: from --model-name")
    ffn_hidden_size: int | None = flag("--ffn-hidden-size", type=int,
                                       help="dense SwiGLU width (default: from --model-name)")
    num_attention_heads: int | None = flag("--num-attention-heads", type=int, help="default: from --model-name")
    num_query_groups: int | None = flag("--num-query-groups", type=int,
                                        help="number of KV heads (default: from --model-name)")
    kv_channels: int | None = flag("--kv-channels", type=int, help="head dim (default: from --model-name)")
    num_experts: int | None = flag("--num-experts", type=int, help="default: from --model-name")
    moe_ffn_hidden_size: int | None = flag("--moe-ffn-hidden-size", type=int,
                                           help="per-expert SwiGLU width (default: from --model-name)")
    untie_embeddings_and_output_weights: bool = switch(
        "--untie-embeddings-and-output-weights",
        help="a separate LM head even where --model-name ties it to the embedding")
    vocab_size: int | None = flag("--vocab-size", type=int, help="unpadded vocab size (default: the tokenizer's)")
    make_vocab_size_divisible_by: int = flag(
        "--make-vocab-size-divisible-by", default=128, type=int,
        help="pad the vocab to a multiple of this (times the TP size, as Megatron)")
    max_position_embeddings: int | None = flag("--max-position-embeddings", type=int, group="training",
                                               help="default: from --model-name")
    init_method_std: float | None = flag("--init-method-std", type=float, group="training",
                                         help="init std for fresh weights (default: from --model-name, 0.02)")
    norm_epsilon: float | None = flag("--norm-epsilon", type=float, group="training",
                                      help="RMSNorm eps (default: from --model-name)")
    moe_router_topk: int | None = flag("--moe-router-topk", type=int, group="moe", help="default: from --model-name")
    moe_layer_freq: str | None = flag(
        "--moe-layer-freq", group="moe", metavar="N|LIST",
        help="which decoder layers are MoE: every N-th from layer 0, or a 0/1 list expression such as "
             "([0]*3+[1]*45) (default: from --model-name / the checkpoint)")

    def model_config(self, vocab_size: int | None, base=None):
        """The registry config of ``--model-name`` (or ``base``, e.g. a checkpoint's own) with these
        flags' overrides."""
        from mlir_train.config.models import get_model_config

        try:
            cfg = self._overridden(get_model_config, self.model_name or DEFAULT_MODEL if base is None else base, vocab_size)
        except ValueError as e:  # an unknown --model-name, with the closest one
            raise ConfigError(str(e)) from None
        if self.moe_layer_freq is not None:
            from mlir_train.config.models import layer_pattern_overrides

            cfg = cfg.replace(**layer_pattern_overrides(self.moe_layer_pattern(cfg.num_layers)))
        return cfg.replace(tie_word_embeddings=False) if self.untie_embeddings_and_output_weights else cfg

    def _overridden(self, get_model_config, source, vocab_size):
        return get_model_config(
            source, num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads, num_kv_heads=self.num_query_groups,
            intermediate_size=self.ffn_hidden_size, num_experts=self.num_experts,
            moe_intermediate_size=self.moe_ffn_hidden_size, top_k=self.moe_router_topk,
            rope_theta=self.rotary_base, rope_scaling_factor=self.rotary_seq_len_interpolation_factor,
            rms_norm_eps=self.norm_epsilon, max_position_embeddings=self.max_position_embeddings,
            init_std=self.init_method_std, head_dim=self.kv_channels, vocab_size=vocab_size,
        )

    def moe_layer_pattern(self, num_layers: int) -> tuple[bool, ...]:
        """``--moe-layer-freq`` read as megatron-core reads it: MoE or not, per layer."""
        from mlir_train.config.models import moe_layer_pattern

        try:
            return moe_layer_pattern(self.moe_layer_freq, num_layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def padded_vocab_size(self, tokenizer_size: int, tensor_parallel: int) -> int:
        return padded_vocab_size(tokenizer_size, self.make_vocab_size_divisible_by, tensor_parallel)


DEFAULT_MODEL = "qwen3-moe-tiny"  # --model-name when neither it nor a --load model names one


def padded_vocab_size(tokenizer_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's ``_vocab_size_with_padding``: round up to divisible_by * TP."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(tokenizer_size / multiple) * multiple)


@dataclasses.dataclass(frozen=True)
class DataFlags:
    GROUP: ClassVar[str] = "data"
    tokenizer_type: str | None = flag("--tokenizer-type", choices=["HFTokenizer", "HuggingFaceTokenizer"],
                                      help="only Hugging Face tokenizers (default: the bundled tokenizer)")
    hf_tokenizer_path: str | None = flag("--hf-tokenizer-path", help="HF tokenizer directory (AIAK)")
    tokenizer_model: str | None = flag(
        "--tokenizer-model", help="Megatron's spelling of the HF tokenizer directory (HuggingFaceTokenizer); "
                                  "used when --hf-tokenizer-path is not given")
    data_path: tuple[str, ...] | None = flag(
        "--data-path", nargs="+", help="data files; Megatron blend syntax 'W1 PATH1 W2 PATH2 ...' allowed "
                                       "(default: the bundled alpaca data)")
    split: str = flag("--split", default="969, 30, 1", help="train,valid,test proportions (Megatron's fallback default)")
    data_cache_path: str | None = flag("--data-cache-path", help="where tokenized/packed data is cached")
    seq_length: int | None = flag("--seq-length", type=int, group="training", help="tokens per sample row")
    chat_template: str | None = flag("--chat-template", group="sft",
                                     help="prompt template name, e.g. alpaca, qwen (default: the data's)")
    sft_num_preprocess_workers: int | None = flag("--sft-num-preprocess-workers", type=int, group="sft",
                                                  help="processes for tokenizing the SFT data")
    packing_sft_data: bool = switch("--packing-sft-data", group="sft",
                                    help="pack several samples into one --seq-length row (attention kept per sample)")
    sft_dataset_config: str | None = flag("--sft-dataset-config", group="sft",
                                          help="JSON describing the SFT data formats (AIAK)")
    train_on_prompt: bool = switch("--train-on-prompt", group="sft",
                                   help="compute the loss on prompt tokens too (default: responses only)")
    sft_skip_bad_records: bool = switch("--sft-skip-bad-records", group="sft",
                                        help="skip malformed records with a warning instead of failing")
    drop_long_samples: bool = switch("--drop-long-samples", "--sft-drop-long-samples", group="sft",
                                     help="drop samples longer than --seq-length instead of truncating them")

    @property
    def tokenizer_path(self) -> str | None:
        return self.hf_tokenizer_path or self.tokenizer_model

    def data_config(self, seed: int):
        """The data pipeline's :class:`~mlir_train.data.DataConfig` (sft and preprocess share it,
        so both find the same cache)."""
        from mlir_train.data import DataConfig

        return DataConfig(
            data_path=tuple(self.data_path), tokenizer_path=self.tokenizer_path,
            tokenizer_type=self.tokenizer_type or "HFTokenizer", chat_template=self.chat_template or "alpaca",
            seq_length=self.seq_length, packing=self.packing_sft_data,
            num_workers=self.sft_num_preprocess_workers or 1, cache_path=self.data_cache_path,
            dataset_config=self.sft_dataset_config, split=self.split, train_on_prompt=self.train_on_prompt,
            drop_long=self.drop_long_samples, skip_bad_records=self.sft_skip_bad_records, seed=seed,
        )


@dataclasses.dataclass(frozen=True)
class TrainingFlags:
    """The loop, precision, optimizer and LR schedule."""

    GROUP: ClassVar[str] = "training"
    training_phase: str = flag("--training-phase", default="sft", choices=["sft", "pretrain"],
                               help="sft: lm loss logged as AIAK's SFT phase (the normalised objective); "
                                    "pretrain: as Megatron-LM (global token mean)")
    micro_batch_size: int | None = flag("--micro-batch-size", type=int, help="rows per data-parallel rank per micro-step")
    global_batch_size: int | None = flag("--global-batch-size", type=int, help="rows per optimizer step")
    calculate_per_token_loss: bool = switch(
        "--calculate-per-token-loss",
        help="normalise the loss by all loss tokens of the global batch (default, as Megatron: each data-parallel "
             "micro-batch's loss by its own loss tokens, then averaged)")
    train_iters: int | None = flag("--train-iters", type=int)
    seed: int = flag("--seed", default=1234, type=int)
    lr: float | None = flag("--lr", type=float, help="peak learning rate")
    min_lr: float = flag("--min-lr", default=0.0, type=float)
    lr_decay_style: str = flag("--lr-decay-style", default="linear",
                               choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    lr_decay_iters: int | None = flag("--lr-decay-iters", type=int, help="default: --train-iters")
    lr_warmup_fraction: float | None = flag("--lr-warmup-fraction", type=float,
                                            help="warmup as a fraction of --lr-decay-iters")
    lr_warmup_iters: int = flag("--lr-warmup-iters", default=0, type=int)
    lr_warmup_init: float = flag("--lr-warmup-init", default=0.0, type=float)
    lr_wsd_decay_style: str = flag("--lr-wsd-decay-style", default="exponential",
                                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    lr_wsd_decay_iters: int | None = flag("--lr-wsd-decay-iters", type=int, help="annealing iterations of WSD")
    clip_grad: float = flag("--clip-grad", default=1.0, type=float, help="global L2 grad-norm clip (0: off)")
    weight_decay: float = flag("--weight-decay", default=0.01, type=float)
    optimizer: str = flag("--optimizer", default="adam", choices=["adam", "sgd"])
    adam_beta1: float = flag("--adam-beta1", default=0.9, type=float)
    adam_beta2: float = flag("--adam-beta2", default=0.999, type=float)
    adam_eps: float = flag("--adam-eps", default=1e-08, type=float)
    sgd_momentum: float = flag("--sgd-momentum", default=0.9, type=float)
    bf16: bool = switch("--bf16", help="bfloat16 compute, float32 master weights")
    fp16: bool = switch("--fp16", help="float16 compute with dynamic loss scaling")
    initial_loss_scale: float = flag("--initial-loss-scale", default=2.0**32, type=float, help="fp16 only")
    min_loss_scale: float = flag("--min-loss-scale", default=1.0, type=float)
    loss_scale_window: float = flag("--loss-scale-window", default=1000, type=float)
    hysteresis: int = flag("--hysteresis", default=2, type=int)
    loss_scale: float | None = flag("--loss-scale", type=float, help="static loss scale (fp16)")
    attention_dropout: float = flag("--attention-dropout", default=0.0, type=float, help="only 0 is supported")
    hidden_dropout: float = flag("--hidden-dropout", default=0.0, type=float, help="only 0 is supported")
    recompute_granularity: str | None = flag(
        "--recompute-granularity", choices=["full", "selective"],
        help="full: whole decoder layers (every layer unless --recompute-method says which; megatron-core "
             "requires the method); selective: the --recompute-modules submodules")
    recompute_method: str | None = flag(
        "--recompute-method", choices=["uniform", "block"],
        help="with --recompute-granularity full: uniform checkpoints groups of --recompute-num-layers layers "
             "(which must divide each pipeline chunk's layers); block only the first --recompute-num-layers "
             "layers of each pipeline chunk")
    recompute_num_layers: int | None = flag("--recompute-num-layers", type=int,
                                            help="layers per group (uniform) or per chunk (block)")
    recompute_modules: tuple[str, ...] | None = flag(
        "--recompute-modules", nargs="+", metavar="MODULE",
        choices=["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"],
        help="with --recompute-granularity selective (default: core_attn): core_attn (the softmax(qk)v core; "
             "our attention keeps only its output and log-sum-exp already, so this saves little, as for "
             "megatron-core's fused attention), moe_act (the expert activation: only fc1's outputs kept; the "
             "dropless CPU/GPU expert kernels do that already), layernorm (the input and pre-MLP norms' outputs "
             "recomputed), mlp (dense layers' MLP), moe (the whole MoE layer); mla_up_proj and shared_experts "
             "are refused (Qwen3 has no MLA or shared experts); moe_act needs no --moe-grouped-gemm here")
    moe_layer_recompute: bool = switch(
        "--moe-layer-recompute", group="moe",
        help="Megatron's deprecated spelling of --recompute-granularity selective --recompute-modules ... moe "
             "(added to the modules, core_attn by default)")
    recompute_activations: bool = switch("--recompute-activations",
                                         help="Megatron's alias of --recompute-granularity selective")
    eval_interval: int = flag("--eval-interval", default=1000, type=int)
    eval_iters: int = flag("--eval-iters", default=100, type=int)
    check_for_nan_in_loss_and_grad: bool = flag(
        "--no-check-for-nan-in-loss-and-grad", default=True, group="sft", action="store_false",
        help="do not stop on NaN/Inf loss or grad norm")
    exit_signal_handler: bool = switch(
        "--exit-signal-handler", help="always on here: SIGTERM/SIGINT finish the iteration, save (with --save) and exit 0")
    exit_interval: int | None = flag("--exit-interval", type=int,
                                     help="save (with --save) and exit 0 after an iteration divisible by this")
    exit_duration_in_mins: float | None = flag(
        "--exit-duration-in-mins", type=float,
        help="save (with --save) and exit 0 after the iteration that ends this many minutes in")

    @property
    def compute_dtype(self) -> str:
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"

    @property
    def recompute(self):
        """The :class:`~mlir_train.config.policies.RecomputePolicy` of these flags, as megatron-core
        0.16 reads them (``--recompute-activations`` and ``--moe-layer-recompute`` make the
        granularity selective; the modules default to core_attn; ``--moe-layer-recompute`` adds
        moe). :func:`check` has refused the combinations it would not run."""
        from mlir_train.config.policies import RecomputePolicy

        selective = self.recompute_activations or self.moe_layer_recompute
        granularity = "selective" if selective else self.recompute_granularity
        if granularity != "selective":
            return RecomputePolicy(granularity, self.recompute_method, self.recompute_num_layers)
        modules = tuple(self.recompute_modules or ("core_attn",))
        if self.moe_layer_recompute and "moe" not in modules:
            modules += ("moe",)
        return RecomputePolicy("selective", modules=modules)

    @property
    def remat(self) -> str:
        """The recompute granularity: "none" | "full" | "selective"."""
        return self.recompute.kind

    def lr_schedule(self, global_batch_size: int):
        from mlir_train.train.schedule import megatron_lr_schedule

        if self.lr is None or self.train_iters is None:
            raise ConfigError("the LR schedule needs --lr and --train-iters")
        try:
            return megatron_lr_schedule(
                lr=self.lr, train_iters=self.train_iters, min_lr=self.min_lr, lr_decay_iters=self.lr_decay_iters,
                lr_decay_style=self.lr_decay_style, lr_warmup_iters=self.lr_warmup_iters,
                lr_warmup_fraction=self.lr_warmup_fraction, lr_warmup_init=self.lr_warmup_init,
                lr_wsd_decay_iters=self.lr_wsd_decay_iters, lr_wsd_decay_style=self.lr_wsd_decay_style,
                global_batch_size=global_batch_size,
            )
        except ValueError as e:  # Megatron's scheduler asserts, naming the flags
            raise ConfigError(str(e)) from None

    def optimizer_for(self, lr_schedule):
        from mlir_train.train.optim import make_optimizer

        return make_optimizer(lr_schedule=lr_schedule, weight_decay=self.weight_decay, beta1=self.adam_beta1,
                              beta2=self.adam_beta2, eps=self.adam_eps, clip_grad=self.clip_grad,
                              optimizer=self.optimizer, sgd_momentum=self.sgd_momentum)

    def loss_scaler(self):
        """Megatron's scaler for these flags: constant with ``--loss-scale`` (under --fp16 or
        --bf16), dynamic for ``--fp16``, none otherwise (bf16 and fp32 need no loss scaling)."""
        from mlir_train.train.optim import LossScaler

        if self.loss_scale and (self.fp16 or self.bf16):
            return LossScaler(initial_scale=self.loss_scale, dynamic=False)
        if self.fp16:
            return LossScaler(initial_scale=self.initial_loss_scale, min_scale=self.min_loss_scale,
                              growth_interval=int(self.loss_scale_window), hysteresis=self.hysteresis)
        return None


@dataclasses.dataclass(frozen=True)
class MoEFlags:
    GROUP: ClassVar[str] = "moe"
    moe_router_load_balancing_type: str | list = flag(
        "--moe-router-load-balancing-type", default="aux_loss", nargs="+", action=OneOrList,
        choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
        help="one type, or a list combined with one --moe-aux-loss-coeff each; sinkhorn (S-BASE, alone, no aux "
             "loss) balances the top-k choice by Sinkhorn in training (default: aux_loss)")
    moe_aux_loss_coeff: float | list = flag("--moe-aux-loss-coeff", default=0.0, type=float, nargs="+", action=OneOrList,
                                            help="one coefficient, or one per --moe-router-load-balancing-type "
                                                 "(default: 0.0)")
    moe_z_loss_coeff: float | None = flag("--moe-z-loss-coeff", type=float)
    moe_router_score_function: str = flag("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool | None = flag(
        "--moe-router-pre-softmax", action="store_true",
        help="softmax before the top-k, weights not renormalised (default: from --model-name's norm_topk_prob: "
             "Qwen3-MoE renormalises, which is Megatron's default)")
    moe_router_topk_scaling_factor: float | None = flag("--moe-router-topk-scaling-factor", type=float,
                                                        help="multiply the top-k routing weights by this")
    moe_router_num_groups: int | None = flag("--moe-router-num-groups", type=int,
                                             help="expert groups for group-limited (device-limited) routing")
    moe_router_group_topk: int | None = flag("--moe-router-group-topk", type=int,
                                             help="groups each token may route to (with --moe-router-num-groups)")
    moe_router_topk_limited_devices: int | None = flag(
        "--moe-router-topk-limited-devices", type=int,
        help="deprecated Megatron spelling of --moe-router-group-topk N with --moe-router-num-groups = "
             "--expert-model-parallel-size")
    moe_router_enable_expert_bias: bool = switch(
        "--moe-router-enable-expert-bias",
        help="aux-loss-free balancing (DeepSeek-V3): a per-expert bias, updated from each step's load, picks the "
             "experts (needs --moe-router-score-function sigmoid)")
    moe_router_bias_update_rate: float = flag("--moe-router-bias-update-rate", default=1e-3, type=float)
    moe_router_dtype: str | None = flag("--moe-router-dtype", choices=["fp32", "fp64"],
                                        help="the router's gating matmul, scores, top-k and statistics in fp32 "
                                             "(default) or fp64 (CPU/GPU; not on TPU)")
    moe_per_layer_logging: bool = switch(
        "--moe-per-layer-logging", help="also log each MoE layer's aux / z losses to TensorBoard (moe/<name>_layer_<i>)")
    moe_expert_capacity_factor: float | None = flag(
        "--moe-expert-capacity-factor", type=float,
        help="tokens per expert = factor * tokens * topk / experts (default: no dropping)")
    moe_token_drop_policy: str = flag("--moe-token-drop-policy", default="probs", choices=["probs", "position"])
    moe_pad_expert_input_to_capacity: bool = switch(
        "--moe-pad-expert-input-to-capacity",
        help="needs --moe-expert-capacity-factor; our capacity buffers are always padded to capacity, so "
             "it changes nothing else (as in Megatron, where it only pads)")

    def load_balancing(self):
        """The router losses and their coefficients (``mlir_train.config.policies.LoadBalancing``)."""
        from mlir_train.config.policies import LoadBalancing, LoadBalancingError

        try:
            return LoadBalancing.from_flags(self.moe_router_load_balancing_type, self.moe_aux_loss_coeff,
                                            self.moe_z_loss_coeff)
        except LoadBalancingError as e:
            raise ConfigError(str(e)) from None

    def router(self, model_cfg, expert_parallel: int):
        """The router's settings (``mlir_train.config.policies.RouterConfig``), checked as Megatron
        checks them, or None for a dense model."""
        from mlir_train.config.policies import RouterConfig, RouterConfigError

        if not model_cfg.is_moe:
            return None
        num_groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if self.moe_router_topk_limited_devices:
            if group_topk:
                raise ConfigError("--moe-router-topk-limited-devices is the deprecated spelling of "
                                  "--moe-router-group-topk with --moe-router-num-groups: give only the new flags")
            # Megatron's translation: device-limited routing over the expert-parallel ranks.
            num_groups, group_topk = expert_parallel, self.moe_router_topk_limited_devices
        balancing = self.load_balancing()
        router = RouterConfig(
            score_function=self.moe_router_score_function, pre_softmax=self.moe_router_pre_softmax,
            topk_scaling_factor=self.moe_router_topk_scaling_factor, num_groups=num_groups, group_topk=group_topk,
            enable_expert_bias=self.moe_router_enable_expert_bias,
            per_sequence_stats=balancing.per_sequence, sinkhorn=balancing.sinkhorn,
            dtype=self.moe_router_dtype or "fp32",
        )
        try:
            router.check(model_cfg.num_experts, model_cfg.top_k, model_cfg.norm_topk_prob)
        except RouterConfigError as e:
            raise ConfigError(str(e)) from None
        return router


@dataclasses.dataclass(frozen=True)
class ParallelFlags:
    GROUP: ClassVar[str] = "model-parallel"
    tensor_model_parallel_size: int = flag("--tensor-model-parallel-size", default=1, type=int)
    pipeline_model_parallel_size: int = flag("--pipeline-model-parallel-size", default=1, type=int)
    expert_model_parallel_size: int = flag("--expert-model-parallel-size", default=1, type=int)
    expert_tensor_parallel_size: int | None = flag(
        "--expert-tensor-parallel-size", type=int,
        help="the routed experts' width split over its own ranks, independent of TP (Megatron's MoE parallel "
             "folding: e.g. attention TP4, experts ETP1 x EP8 on the same 8 ranks) (default: "
             "--tensor-model-parallel-size)")
    context_parallel_size: int = flag(
        "--context-parallel-size", default=1, type=int,
        help="split each row's sequence over N ranks (Megatron's load-balanced 2N-chunk layout; K/V all-gathered "
             "in attention); --seq-length must be divisible by 2N (and by N x TP with --sequence-parallel)")
    sequence_parallel: bool = switch("--sequence-parallel")
    use_distributed_optimizer: bool = switch("--use-distributed-optimizer",
                                             help="shard optimizer state over data-parallel ranks (ZeRO-1)")
    use_torch_fsdp2: bool = switch(
        "--use-torch-fsdp2", help="FSDP: shard the parameters too over the data-parallel ranks, gathered for "
                                  "compute (same as --data-parallel-sharding-strategy optim_grads_params)")
    data_parallel_sharding_strategy: str = flag(
        "--data-parallel-sharding-strategy", default="no_shard",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
        help="Megatron-FSDP's ZeRO stage: optim / optim_grads shard the optimizer state "
             "(= --use-distributed-optimizer), optim_grads_params the parameters too (FSDP)")
    use_megatron_fsdp: bool = switch(
        "--use-megatron-fsdp", "--use-custom-fsdp",
        help="accepted for Megatron-FSDP scripts; the sharding follows --data-parallel-sharding-strategy")
    num_layers_per_virtual_pipeline_stage: int | None = flag("--num-layers-per-virtual-pipeline-stage", type=int)
    num_virtual_stages_per_pipeline_rank: int | None = flag(
        "--num-virtual-stages-per-pipeline-rank", type=int,
        help="interleaved 1F1B with this many model chunks per stage (the other spelling of "
             "--num-layers-per-virtual-pipeline-stage = layers / (PP x this))")
    decoder_first_pipeline_num_layers: int | None = flag("--decoder-first-pipeline-num-layers", type=int)
    decoder_last_pipeline_num_layers: int | None = flag("--decoder-last-pipeline-num-layers", type=int)
    pipeline_schedule: str | None = flag(
        "--pipeline-schedule", group="mlir-train", choices=["1f1b", "gpipe", "circular"],
        help="with --pipeline-model-parallel-size > 1: 1f1b (default, as Megatron; interleaved with "
             "--num-layers-per-virtual-pipeline-stage; activations of at most ~2 x stages micro-batches), "
             "gpipe, or circular (needs --num-layers-per-virtual-pipeline-stage; both keep every "
             "micro-batch's activations)")

    def layers_per_virtual_stage(self, num_layers: int) -> int | None:
        """Layers per virtual pipeline stage, from either of Megatron's two spellings."""
        v, per = self.num_virtual_stages_per_pipeline_rank, self.num_layers_per_virtual_pipeline_stage
        if v is None:
            return per
        if per is not None:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                              "are mutually exclusive (as in Megatron): give one")
        pp = self.pipeline_model_parallel_size
        if v < 1 or num_layers % (pp * v):
            raise ConfigError(f"--num-virtual-stages-per-pipeline-rank {v}: the {num_layers} layers do not split into "
                              f"{pp} stages x {v} chunks of equal size")
        if self.decoder_first_pipeline_num_layers or self.decoder_last_pipeline_num_layers:
            raise ConfigError("--num-virtual-stages-per-pipeline-rank with uneven stages (--decoder-first/last-"
                              "pipeline-num-layers) is not implemented; drop one of them")
        return None if v == 1 else num_layers // (pp * v)

    @property
    def fsdp(self) -> bool:
        return self.use_torch_fsdp2 or self.data_parallel_sharding_strategy == "optim_grads_params"

    @property
    def distributed_optimizer(self) -> bool:
        return self.use_distributed_optimizer or self.data_parallel_sharding_strategy in ("optim", "optim_grads")

    def parallel_config(self, num_devices: int | None = None):
        from sharding.layout import Layout

        return Layout(
            tensor=self.tensor_model_parallel_size, pipeline=self.pipeline_model_parallel_size,
            expert=self.expert_model_parallel_size, context=self.context_parallel_size,
            expert_tensor=self.expert_tensor_parallel_size, sequence_parallel=self.sequence_parallel, fsdp=self.fsdp,
            distributed_optimizer=self.distributed_optimizer, num_devices=num_devices,
        )


@dataclasses.dataclass(frozen=True)
class LoggingFlags:
    GROUP: ClassVar[str] = "logging"
    log_interval: int = flag("--log-interval", default=100, type=int)
    tensorboard_dir: str | None = flag("--tensorboard-dir")
    tensorboard_log_interval: int = flag("--tensorboard-log-interval", default=1, type=int,
                                         help="write TensorBoard/metrics.jsonl every N iterations")
    log_timers_to_tensorboard: bool = switch("--log-timers-to-tensorboard")
    wandb_project: str = flag("--wandb-project", default="")
    wandb_exp_name: str = flag("--wandb-exp-name", default="")
    wandb_save_dir: str = flag("--wandb-save-dir", default="", help="wandb's local directory (default: the log dir)")


@dataclasses.dataclass(frozen=True)
class CheckpointFlags:
    GROUP: ClassVar[str] = "checkpointing"
    load: str | None = flag("--load", group="training", help="checkpoint or HF model directory to start from")
    save: str | None = flag("--save", group="training", help="checkpoint directory to write")
    save_interval: int | None = flag("--save-interval", type=int, group="training")
    no_load_optim: bool = switch("--no-load-optim", group="training")
    no_load_rng: bool = switch("--no-load-rng", group="training")
    exit_on_missing_checkpoint: bool = switch(
        "--exit-on-missing-checkpoint", group="training",
        help="an error if --load holds no checkpoint (default: warn and start from scratch, as Megatron)")
    finetune: bool = switch("--finetune", help="load weights only and restart the iteration count at 0")
    ckpt_step: int | None = flag("--ckpt-step", type=int, metavar="N",
                                 help="load iteration N of --load instead of the newest (no fallback if it is corrupt)")
    no_save_optim: bool = switch("--no-save-optim", help="weights-only checkpoints: no optimizer or loss-scaler "
                                 "state; resuming one needs --no-load-optim")
    no_save_rng: bool = switch("--no-save-rng", help="no seed (so no data order) in checkpoints, the data position "
                               "kept; resuming one needs --no-load-rng")
    save_retain: int | None = flag("--save-retain", type=int, metavar="K",
                                   help="keep only the newest K checkpoints in --save (default: keep all)")
    save_hf: str | None = flag("--save-hf", metavar="DIR", help="at the end, also write the weights as an HF model directory")


@dataclasses.dataclass(frozen=True)
class ExtraFlags:
    GROUP: ClassVar[str] = "mlir-train"
    config: str | None = flag("--config", metavar="FILE",
                              help="YAML/JSON file of flags (keys with dashes or underscores); the command line overrides it")
    num_devices: int | None = flag("--num-devices", type=int, help="use only the first N devices")
    cpu_devices: int | None = flag("--cpu-devices", type=int,
                                   help="fake CPU device count set in XLA_FLAGS before jax starts")
    compilation_cache_dir: str | None = flag("--compilation-cache-dir", help="persistent XLA compilation cache")
    print_sharding: bool = switch("--print-sharding", help="print every parameter's sharding")
    no_kernel_self_check: bool = switch(
        "--no-kernel-self-check",
        help="skip the start-up check of the selected GPU kernels (MoE expert matmuls, fused attention) "
             "against their XLA references, forward and backward at the run's widths")
    peak_tflops: float | None = flag("--peak-tflops", type=float,
                                     help="per-device peak TFLOP/s for MFU (default: from the device kind)")
    moe_gemm_backend: str = flag("--moe-gemm-backend", default="auto", choices=("auto", "mosaic", "tokamax", "padded"),
                                 help="MoE expert matmuls: mosaic (our Mosaic-GPU block kernels, dropless), tokamax "
                                      "(tokamax's ragged-dot kernels on the same layout; needs tokamax), padded "
                                      "(sorted, padded batched matmul; capacity einsum with a capacity factor); auto: "
                                      "the platform's default (GPU mosaic, CPU padded, TPU ragged_dot)")
    attention_kernel: str = flag("--attention-kernel", default="auto",
                                 choices=("auto", "tokamax", "pallas-mha", "mlir", "xla"),
                                 help="attention: mlir (our Pallas-Triton flash attention, mlir_train.model.docs_flash: "
                                      "skips other documents' tiles forward and backward), tokamax (tokamax's "
                                      "Mosaic-GPU flash attention, skips other documents' key blocks in the forward; needs tokamax), pallas-mha (JAX's Pallas "
                                      "Triton flash attention), xla (masked / blocked XLA ops); auto: the platform's "
                                      "default (GPU pallas-mha, else xla; xla under context parallelism). "
                                      "(Megatron's --attention-backend is accepted as a no-op)")


SECTIONS: dict[str, type] = {
    "model": ModelFlags, "data": DataFlags, "training": TrainingFlags, "moe": MoEFlags,
    "parallel": ParallelFlags, "logging": LoggingFlags, "checkpoint": CheckpointFlags, "extras": ExtraFlags,
}


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


def section_fields():
    """(section name, dataclass field, Flag) for every flag-carrying field, in parser order."""
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                yield name, cls, f, f.metadata["flag"]


# ----- flags that mean nothing under XLA, and flags refused -------------------------------------------
# flag -> (number of values Megatron gives it, why it means nothing here)
NOOP_FLAGS: dict[str, tuple[int, str]] = {
    # kernels and fusions: XLA fuses on its own
    **{f: (n, "kernel/fusion choice: XLA fuses and picks kernels itself") for f, n in {
        "--use-flash-attn": 0, "--attention-backend": 1, "--transformer-impl": 1,
        "--no-masked-softmax-fusion": 0, "--masked-softmax-fusion": 0, "--no-bias-gelu-fusion": 0,
        "--no-bias-swiglu-fusion": 0, "--no-bias-dropout-fusion": 0, "--no-rope-fusion": 0,
        "--no-persist-layer-norm": 0, "--no-gradient-accumulation-fusion": 0, "--cross-entropy-loss-fusion": 0,
        "--apply-query-key-layer-scaling": 0, "--moe-grouped-gemm": 0, "--moe-permute-fusion": 0,
        "--moe-use-legacy-grouped-gemm": 0, "--moe-token-dispatcher-type": 1}.items()},
    "--attention-softmax-in-fp32": (0, "the attention softmax is always float32 here"),
    "--cp-comm-type": ("+", "context parallelism exchanges K/V by one all-gather over the context ranks whatever "
                          "the type (p2p, a2a, allgather): the attention computed is the same"),
    "--moe-router-fusion": (0, "Transformer Engine's fused top-k / aux-loss kernels: XLA fuses the same ops"),
    # torch.distributed / NCCL / DDP plumbing: XLA inserts and schedules the collectives
    **{f: (n, "torch.distributed/NCCL plumbing: XLA inserts and schedules the collectives") for f, n in {
        "--distributed-backend": 1, "--distributed-timeout-minutes": 1, "--overlap-grad-reduce": 0,
        "--overlap-param-gather": 0, "--accumulate-allreduce-grads-in-fp32": 0, "--ddp-average-in-collective": 0,
        "--no-async-tensor-model-parallel-allreduce": 0, "--tp-comm-overlap": 0,
        "--num-distributed-optimizer-instances": 1, "--use-precision-aware-optimizer": 0, "--local-rank": 1,
        "--lazy-mpu-init": 0, "--use-mpi": 0, "--use-cpu-initialization": 0, "--empty-unused-memory-level": 1,
        "--manual-gc": 0, "--manual-gc-interval": 1}.items()},
    "--use-mcore-models": (0, "there is one model implementation"),
    "--use-legacy-models": (0, "there is one model implementation"),
    "--num-workers": (1, "the loader reads preprocessed arrays in-process"),
    "--dataloader-type": (1, "the loader reads preprocessed arrays in-process"),
    "--no-create-attention-mask-in-dataloader": (0, "masks are built inside the compiled step"),
    # checkpoint formats (we always write Orbax) and scheduler state (our schedule is a pure
    # function of the iteration: no stored scheduler state to use or override)
    **{f: (n, "checkpoint format/scheduler-state plumbing: we write Orbax; the LR schedule is a pure "
              "function of the iteration") for f, n in {
        "--ckpt-format": 1, "--use-dist-ckpt": 0, "--auto-detect-ckpt-format": 0, "--async-save": 0,
        "--use-checkpoint-args": 0, "--use-checkpoint-opt_param-scheduler": 0,
        "--override-opt_param-scheduler": 0}.items()},
    # logging we always do, or do not have
    **{f: (n, "logging we always do or do not have") for f, n in {
        "--log-throughput": 0, "--log-progress": 0, "--log-params-norm": 0, "--log-num-zeros-in-grad": 0,
        "--log-memory-to-tensorboard": 0, "--log-validation-ppl-to-tensorboard": 0,
        "--log-world-size-to-tensorboard": 0, "--timing-log-level": 1, "--timing-log-option": 1,
        "--tensorboard-queue-size": 1}.items()},
    # Megatron's MoE / parallelism tuning of its own communication and kernels
    **{f: (n, "communication/kernel tuning of Megatron's own collectives and dispatchers: XLA inserts, "
              "fuses and overlaps the collectives (see platform_setup's GPU flags)") for f, n in {
        "--create-all-gather-group": 0, "--ddp-bucket-size": 1, "--ddp-num-buckets": 1,
        "--ddp-pad-buckets-for-high-nccl-busbw": 0, "--disable-symmetric-registration": 0,
        "--distributed-timeout-seconds-after-init": 1, "--fsdp-double-buffer": 0, "--fsdp-manual-registration": 0,
        "--nccl-communicator-config-path": 1, "--no-align-grad-reduce": 0, "--no-align-param-gather": 0,
        "--no-gradient-reduce-div-fusion": 0, "--no-overlap-p2p-communication": 0,
        "--no-scatter-gather-tensors-in-pipeline": 0, "--no-tp-comm-bulk-dgrad": 0, "--disable-tp-comm-bulk-dgrad": 0,
        "--no-tp-comm-bulk-wgrad": 0, "--disable-tp-comm-bulk-wgrad": 0, "--no-tp-comm-overlap-ag": 0,
        "--disable-tp-comm-overlap-ag": 0, "--no-tp-comm-overlap-rs": 0, "--disable-tp-comm-overlap-rs": 0,
        "--no-tp-comm-split-ag": 0, "--disable-tp-comm-split-ag": 0, "--no-tp-comm-split-rs": 0,
        "--disable-tp-comm-split-rs": 0, "--tp-comm-overlap-rs-dgrad": 0, "--tp-comm-bootstrap-backend": 1,
        "--overlap-moe-expert-parallel-comm": 0, "--overlap-p2p-communication-warmup-flush": 0,
        "--overlap-param-gather-with-optimizer-step": 0, "--pipeline-model-parallel-comm-backend": 1,
        "--sharp-enabled-group": 1, "--use-sharp": 0, "--suggested-communication-unit-size": 1, "--use-nccl-ub": 0,
        "--ep-overlap-early-attn-memory-release": 0, "--moe-enable-deepep": 0, "--moe-deepep-num-sms": 1,
        "--moe-flex-dispatcher-backend": 1, "--moe-hybridep-num-sms": 1, "--torch-fsdp2-no-reshard-after-forward": 0,
        "--fake-process-group": 0}.items()},
    "--ddp-reduce-scatter-with-fp32-accumulation": (0, "gradients are reduced in float32 here already"),
    "--microbatch-group-size-per-virtual-pipeline-stage": (
        1, "the interleaved schedule's micro-batch grouping changes Megatron's issue order, not the numbers; "
           "our 1F1B is one compiled program"),
    "--keep-fp8-transpose-cache": (0, "FP8 is not used here"),
    "--moe-router-padding-for-fp8": (0, "FP8 is not used here"),
    "--moe-router-padding-for-quantization": (0, "FP8/FP4 is not used here"),
    "--inference-fuse-tp-communication": (0, "inference only"),
    "--moe-pad-experts-for-cuda-graph-inference": (0, "inference (CUDA graphs) only"),
    "--mtp-loss-scaling-factor": (1, "only with --mtp-num-layers, which is refused (Qwen3 has no MTP head)"),
}

# Megatron flags of features we do not implement: accepted by the parser only to stop the run
# naming the flag and saying why / what to use. flag -> (arity, why).
NOT_IMPLEMENTED_FLAGS: dict[str, tuple[int | str, str]] = {
    "--account-for-embedding-in-pipeline-split": (0, "not implemented: use --decoder-first-pipeline-num-layers / "
                                                     "--decoder-last-pipeline-num-layers for an uneven split"),
    "--account-for-loss-in-pipeline-split": (0, "not implemented: use --decoder-first-pipeline-num-layers / "
                                                "--decoder-last-pipeline-num-layers for an uneven split"),
    "--pipeline-model-parallel-layout": (1, "custom layout strings are not implemented: use "
                                            "--decoder-first/last-pipeline-num-layers and "
                                            "--num-layers-per-virtual-pipeline-stage"),
    "--use-tp-pp-dp-mapping": (0, "the mesh numbers ranks in Megatron's default tp-cp-ep-dp-pp order only"),
    "--enable-full-sharding-in-hsdp": (0, "hybrid-sharded FSDP (HSDP) is not implemented: use "
                                          "--use-torch-fsdp2 or --use-distributed-optimizer"),
    "--outer-dp-sharding-strategy": (1, "hybrid-sharded FSDP (HSDP) is not implemented: use "
                                        "--use-torch-fsdp2 or --use-distributed-optimizer"),
    "--model-parallel-size": (1, "Megatron's deprecated spelling: use --tensor-model-parallel-size"),
    "--moe-extended-tp": (0, "Megatron's deprecated spelling: use --expert-tensor-parallel-size"),
    "--hierarchical-context-parallel-sizes": ("+", "hierarchical (a2a+p2p) context parallelism is not implemented: "
                                                   "use --context-parallel-size alone"),
    "--hybrid-context-parallel": (0, "hybrid (dynamic) context parallelism is not implemented: use "
                                     "--context-parallel-size"),
    "--max-seqlen-per-dp-cp-rank": (1, "belongs to hybrid context parallelism, which is not implemented"),
    "--moe-apply-probs-on-input": (0, "not implemented: the routing weights scale the expert outputs"),
    "--moe-enable-routing-replay": (0, "routing replay is not implemented"),
    "--moe-input-jitter-eps": (1, "router input jitter is not implemented (it is random noise on the router input; "
                                  "drop the flag)"),
    "--moe-latent-size": (1, "latent MoE projections are not part of Qwen3-MoE"),
    "--moe-router-force-load-balancing": (0, "Megatron's benchmarking mode (random router logits) is not "
                                             "implemented"),
    "--moe-shared-expert-intermediate-size": (1, "Qwen3-MoE has no shared experts"),
    "--moe-shared-expert-gate": (0, "Qwen3-MoE has no shared experts"),
    "--moe-shared-expert-overlap": (0, "Qwen3-MoE has no shared experts"),
    "--moe-use-upcycling": (0, "dense-to-MoE upcycling is not implemented: start from an MoE checkpoint"),
    "--moe-upcycling-granularity": (1, "dense-to-MoE upcycling is not implemented: start from an MoE checkpoint"),
    "--mtp-num-layers": (1, "multi-token prediction is not part of Qwen3"),
    "--mtp-standalone": (0, "multi-token prediction is not part of Qwen3"),
}


# --help group of a no-op flag the seed script puts in one of its arrays (default: "ignored").
NOOP_FLAG_GROUPS = {"--distributed-backend": "model-parallel"}

# Flags that restate the Qwen3 architecture: flag -> (arity, accepted values or None).
ARCH_IMPLIED_FLAGS: dict[str, tuple[int, tuple[str, ...] | None]] = {
    "--swiglu": (0, None),
    "--disable-bias-linear": (0, None),
    "--qk-layernorm": (0, None),
    "--group-query-attention": (0, None),
    "--no-position-embedding": (0, None),
    "--use-rotary-position-embeddings": (0, None),
    "--normalization": (1, ("RMSNorm",)),
    "--position-embedding-type": (1, ("rope",)),
    "--rotary-percent": (1, ("1", "1.0")),
}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A field whose value ``accepted(value, cfg)`` allows; anything else stops the run."""

    accepted: Callable[[Any, "RunConfig"], bool]
    message: str  # what is not implemented and what to use instead


# flag -> Refusal. Each is a feature Megatron has and we do not (yet): the run stops at
# start-up naming the flag instead of silently training without it.
REFUSED: dict[str, Refusal] = {
}


def _flag_names() -> dict[str, tuple[str, str]]:
    """Every field's primary flag -> (section, field name)."""
    return {fl.name: (sec, f.name) for sec, _, f, fl in section_fields()}


def flag_table() -> list[tuple[str, str, str]]:
    """(flag, group, what it does here) for every accepted flag: "same as Megatron", "no-op under
    XLA: why", or "refused: why" (refused beyond its accepted values)."""
    rows = []
    for _, cls, f, fl in section_fields():
        help_text = fl.kwargs.get("help", "")
        if fl.name in REFUSED:
            what = f"refused beyond its default: {REFUSED[fl.name].message}"
        else:
            own = (fl.group or cls.GROUP) == "mlir-train" or fl.name == "--save-hf" or fl.name == "--save-retain"
            what = ("mlir-train's own" if own else "as Megatron") + (
                f" ({help_text})" if help_text and "%(" not in help_text else "")
        rows.append((fl.name, fl.group or cls.GROUP, what))
    rows += [(name, "ignored", f"no-op under XLA: {why}") for name, (_, why) in NOOP_FLAGS.items()]
    rows += [(name, "refused", f"refused: {why}") for name, (_, why) in NOT_IMPLEMENTED_FLAGS.items()]
    rows += [(name, "model", "accepted: the Qwen3 architecture implies it"
              + (f" (only {'/'.join(ok)})" if ok else "")) for name, (_, ok) in ARCH_IMPLIED_FLAGS.items()]
    return rows


def flag_table_markdown() -> str:
    """:func:`flag_table` as the Markdown table README.md carries (tests keep the two equal)."""
    rows = ["| flag | group | here |", "|---|---|---|"]
    rows += [f"| `{name}` | {group} | {what.replace('|', '/')} |" for name, group, what in flag_table()]
    return "\n".join(rows)


# ----- build and resolve --------------------------------------------------------------------------------
def build(values: dict[str, Any], ignored: tuple[str, ...] = ()) -> RunConfig:
    """A :class:`RunConfig` from parsed values keyed by dest name (the parser's output), with
    Megatron's ``validate_args`` checks on flags alone and the refusals. Raises ConfigError."""
    sections = {}
    for name, cls in SECTIONS.items():
        fields = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}
        if "data_path" in fields and fields["data_path"] is not None:
            fields["data_path"] = tuple(fields["data_path"])
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
    from mlir_train.config.policies import ABSENT_MODULES

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


@dataclasses.dataclass(frozen=True)
class Run:
    """A :class:`RunConfig` resolved for one model and device count: every derived value, once."""

    config: RunConfig
    model: Any                  # mlir_train.config.models.ModelConfig
    parallel: Any               # sharding.mesh.Layout, validated
    global_batch_size: int
    num_micro_batches: int
    platform: str               # the mesh devices' platform (cpu, gpu, tpu): picks the kernels

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

    def model_kwargs(self) -> dict[str, Any]:
        """The model's constructor arguments: the platform's kernels (attention, MoE experts),
        the recompute policy and, for MoE, the capacity and drop policy."""
        from mlir_train.model import platform_model_kwargs

        extras = self.config.extras
        try:
            kwargs = platform_model_kwargs(self.platform, is_moe=self.model.is_moe, context_parallel=self.parallel.context,
                                           moe_backend=extras.moe_gemm_backend,
                                           attention_backend=extras.attention_kernel)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        kwargs |= dict(remat=self.recompute)
        if self.model.is_moe:
            m = self.config.moe
            kwargs |= dict(capacity_factor=m.moe_expert_capacity_factor, drop_policy=m.moe_token_drop_policy,
                           router=m.router(self.model, self.parallel.expert))
        return kwargs

    def step_config(self):
        from mlir_train.train.trainer import StepConfig

        m = self.config.moe
        return StepConfig(num_micro_batches=self.num_micro_batches, compute_dtype=self.compute_dtype,
                          layers_per_virtual_stage=self.config.parallel.layers_per_virtual_stage(self.model.num_layers),
                          pipeline_schedule=self.config.parallel.pipeline_schedule or "1f1b",
                          first_stage_layers=self.config.parallel.decoder_first_pipeline_num_layers,
                          last_stage_layers=self.config.parallel.decoder_last_pipeline_num_layers,
                          balancing=m.load_balancing(), expert_bias_update_rate=m.moe_router_bias_update_rate,
                          micro_batch_size=self.micro_batch_size,
                          per_token_loss=self.config.training.calculate_per_token_loss,
                          lm_loss_report="objective" if self.config.training.training_phase == "sft" else "token-mean")

    def lr_schedule(self):
        return self.config.training.lr_schedule(self.global_batch_size)

    def trainer(self, mesh=None, **model_overrides):
        """The :class:`~mlir_train.train.trainer.Trainer` of this run on ``mesh`` (default: its own),
        with ``model_overrides`` on top of :meth:`model_kwargs`."""
        from mlir_train.train.trainer import Trainer
        from sharding.mesh import make_mesh

        from sharding.layout import LayoutError

        t = self.config.training
        try:
            mesh = mesh if mesh is not None else make_mesh(self.parallel)
        except LayoutError as e:  # e.g. --num-devices above what this process sees
            raise ConfigError(str(e)) from None
        return Trainer(self.model, self.step_config(), t.optimizer_for(self.lr_schedule()), self.parallel, mesh,
                       loss_scaler=t.loss_scaler(), model_kwargs=self.model_kwargs() | model_overrides)


def resolve(cfg: RunConfig, model_cfg, *, num_devices: int | None = None, platform: str | None = None) -> Run:
    """Validate the layout against ``model_cfg`` and the device count and derive the batch
    split, the pipeline schedule check and the MoE implementation. Raises ConfigError."""
    from mlir_train.train.trainer import model_dims
    from sharding.mesh import validate
    from sharding.layout import LayoutError

    t, p = cfg.training, cfg.parallel
    parallel = p.parallel_config(num_devices)
    gbs = t.global_batch_size or t.micro_batch_size * parallel.data_parallel
    uneven = p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None
    if uneven and parallel.pipeline == 1:
        raise ConfigError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
    if p.pipeline_schedule and parallel.pipeline == 1:
        print(f"mlir-train: --pipeline-schedule {p.pipeline_schedule} has no effect without "
              "--pipeline-model-parallel-size > 1")
    # Uneven stages: make_schedule checks the layer split (validate's would ask L % PP == 0).
    dims = {k: v for k, v in model_dims(model_cfg).items() if not (uneven and k == "num_layers")}
    try:
        parallel = validate(parallel, dims, global_batch_size=gbs,
                            micro_batch_size=t.micro_batch_size, seq_length=cfg.data.seq_length)
        num_micro = gbs // (t.micro_batch_size * parallel.data_parallel)
        chunks = [model_cfg.num_layers]  # the layers of each pipeline chunk (megatron-core's recompute unit)
        if parallel.pipeline > 1:
            from mlir_train.train.pipeline.parallel import make_schedule

            schedule = make_schedule(model_cfg.num_layers, parallel.pipeline, kind=p.pipeline_schedule or "1f1b",
                                     layers_per_virtual_stage=p.layers_per_virtual_stage(model_cfg.num_layers),
                                     first_stage_layers=p.decoder_first_pipeline_num_layers,
                                     last_stage_layers=p.decoder_last_pipeline_num_layers, num_micro_batches=num_micro)
            chunks = [len(c) for stage in schedule.chunk_layers(model_cfg.num_layers) for c in stage]
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    recompute = t.recompute
    try:
        recompute.check_chunks(chunks, "pipeline chunk" if parallel.pipeline > 1 else "model (no pipeline)")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not model_cfg.is_moe and any(recompute.recomputes(m) for m in ("moe", "moe_act")):
        print("mlir-train: --recompute-modules moe/moe_act (or --moe-layer-recompute) have no effect: the model has "
              "no MoE layers")
    router = cfg.moe.router(model_cfg, parallel.expert)  # Megatron's router checks, before anything compiles
    if router is not None and router.dtype == "fp64" and platform == "tpu":
        raise ConfigError("--moe-router-dtype fp64: TPUs have no float64; use --moe-router-dtype fp32 (the default)")
    if model_cfg.is_moe and cfg.moe.moe_router_num_groups and not cfg.moe.moe_router_group_topk:
        print("mlir-train: --moe-router-num-groups without --moe-router-group-topk routes without groups "
              "(as in Megatron)")
    if platform is None:  # the devices the default mesh is built from
        import jax

        platform = {"cuda": "gpu", "rocm": "gpu"}.get(jax.devices()[0].platform, jax.devices()[0].platform)
    if parallel.context > 1 and platform == "gpu" and cfg.extras.attention_kernel == "auto":
        print(f"mlir-train: --context-parallel-size {parallel.context}: attention runs as XLA ops "
              "(mlir_train.model.layers.blocked_attention: each rank's queries against the gathered row, one key "
              "block at a time), not the flash kernel, which cannot mask the load-balanced chunks by their "
              "original positions")
    backend = cfg.extras.moe_gemm_backend
    if model_cfg.is_moe and backend in ("mosaic", "tokamax") and cfg.moe.moe_expert_capacity_factor is not None:
        raise ConfigError(f"--moe-gemm-backend {backend} runs the dropless block kernels; with "
                          "--moe-expert-capacity-factor use --moe-gemm-backend padded (or auto)")
    run = Run(cfg, model_cfg, parallel, gbs, num_micro, platform=platform)
    run.model_kwargs()  # refuses a kernel choice this platform / layout cannot run, before anything compiles
    return run


if __name__ == "__main__":  # python -m mlir_train.config.flags: the flag table README.md carries
    print(flag_table_markdown())
