"""The flag sections of a run: one frozen dataclass per group of Megatron/AIAK flags.

Each field carries the flag it comes from (:func:`~mlir_train.config.fields.flag`); field names
are Megatron's argparse ``dest`` names. The methods here derive plain values and policies
(:mod:`mlir_train.config.policies`) from one section; what needs the model, the devices or the
trainer is derived by :mod:`mlir_train.train.build`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from mlir_train.config.fields import flag, switch
from mlir_train.config.moe_flags import MoEFlags
from mlir_train.config.parallel_flags import ParallelFlags
from mlir_train.config.policies import LoRAPolicy, RecomputePolicy
from mlir_train.runtime.errors import ConfigError

@dataclasses.dataclass(frozen=True)
class ModelFlags:
    """Architecture. ``None`` = take it from ``--model-name`` (where Megatron would use its own
    built-in default, e.g. ``--moe-router-topk 2``, ``--rotary-base 10000``: AIAK fills these
    from the model name too, and a Megatron default overriding the release values would be a bug)."""

    GROUP: ClassVar[str] = "model"
    model_name: str | None = flag("--model-name",
                                  help="registry name (qwen3-30b-a3b, qwen3-moe-tiny, ...) or a path to an HF "
                                       "config.json / model directory (default: the --load checkpoint's own model; with --load, it must "
                                       "name that model's network)")
    rotary_base: int | None = flag("--rotary-base", type=int, help="RoPE theta (default: from --model-name; with --load, "
                                   "the checkpoint's unless --finetune)")
    rotary_seq_len_interpolation_factor: int | None = flag(
        "--rotary-seq-len-interpolation-factor", type=int,
        help="linear RoPE position interpolation factor (default: from --model-name; with --load, the "
             "checkpoint's unless --finetune)")
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
    vocab_size: int | None = flag("--vocab-size", type=int, help="unpadded vocab size (default: the tokenizer's; at most a --load "
                                  "checkpoint's rows; a Megatron checkpoint is unpadded to it)")
    make_vocab_size_divisible_by: int = flag(
        "--make-vocab-size-divisible-by", default=128, type=int,
        help="pad the vocab to a multiple of this (times the TP size, as Megatron)")
    max_position_embeddings: int | None = flag("--max-position-embeddings", type=int, group="training",
                                               help="default: from --model-name (a fresh model's; a --load "
                                                    "checkpoint keeps its own, said if the flag differs)")
    init_method_std: float | None = flag("--init-method-std", type=float, group="training",
                                         help="init std for fresh weights (default: from --model-name, 0.02; a "
                                              "--load checkpoint keeps its own, said if the flag differs)")
    norm_epsilon: float | None = flag("--norm-epsilon", type=float, group="training",
                                      help="RMSNorm eps (default: from --model-name)")
    moe_router_topk: int | None = flag("--moe-router-topk", type=int, group="moe", help="default: from --model-name")
    mtp_num_layers: int | None = flag(
        "--mtp-num-layers", type=int,
        help="train N multi-token-prediction depths after the decoder, as megatron-core's MTP block (Qwen3.5 / "
             "Qwen3.6 / Qwen3-Next: an HF checkpoint's mtp.* head is depth 1; default: none, the head is carried "
             "untouched)")
    mtp_loss_scaling_factor: float = flag(
        "--mtp-loss-scaling-factor", default=0.1, type=float, group="training",
        help="with --mtp-num-layers: the MTP losses' weight in the objective, split evenly over the depths")
    moe_layer_freq: str | None = flag(
        "--moe-layer-freq", group="moe", metavar="N|LIST",
        help="which decoder layers are MoE: every N-th from layer 0, or a 0/1 list expression such as "
             "([0]*3+[1]*45) (default: from --model-name / the checkpoint)")

    # Hybrid (Qwen3.5 / Qwen3-Next) architecture flags: checked against the model, never applied
    # (mlir_train.config.arch_flags).
    experimental_attention_variant: str | None = flag(
        "--experimental-attention-variant", choices=["gated_delta_net"],
        help="gated_delta_net: the model has gated-DeltaNet layers (checked against --model-name)")
    linear_attention_freq: str | None = flag(
        "--linear-attention-freq", metavar="N|LIST",
        help="which layers are gated DeltaNet: N ((N-1) linear then one softmax-attention layer) or a 0/1 list "
             "(1 = linear), as megatron-core reads it (checked against --model-name)")
    linear_conv_kernel_dim: int | None = flag("--linear-conv-kernel-dim", type=int,
                                              help="gated DeltaNet's causal conv width (checked against --model-name)")
    linear_key_head_dim: int | None = flag("--linear-key-head-dim", type=int,
                                           help="gated DeltaNet's key head dim (checked against --model-name)")
    linear_value_head_dim: int | None = flag("--linear-value-head-dim", type=int,
                                             help="gated DeltaNet's value head dim (checked against --model-name)")
    linear_num_key_heads: int | None = flag("--linear-num-key-heads", type=int,
                                            help="gated DeltaNet's key heads (checked against --model-name)")
    linear_num_value_heads: int | None = flag("--linear-num-value-heads", type=int,
                                              help="gated DeltaNet's value heads (checked against --model-name)")
    attention_output_gate: bool = switch("--attention-output-gate",
                                         help="the attention output is sigmoid-gated (checked against --model-name)")
    apply_layernorm_1p: bool = switch("--apply-layernorm-1p",
                                      help="zero-centred (1 + w) RMSNorm (checked against --model-name)")
    rotary_percent: float | None = flag("--rotary-percent", type=float,
                                        help="fraction of each head RoPE rotates (checked against --model-name: "
                                             "1.0 for Qwen3, 0.25 for Qwen3.5 / Qwen3-Next)")
    moe_shared_expert_intermediate_size: int | None = flag(
        "--moe-shared-expert-intermediate-size", type=int, group="moe",
        help="the shared expert's width (checked against --model-name; Qwen3-MoE has none)")
    moe_shared_expert_gate: bool = switch("--moe-shared-expert-gate", group="moe",
                                          help="the shared expert is sigmoid-gated (checked against --model-name)")

    DEFAULT_MODEL: ClassVar[str] = "qwen3-moe-tiny"  # --model-name when neither it nor a --load model names one

    # The architecture flags (by attribute) and the ModelConfig field each sets; each flag is
    # spelled "--" + the attribute with dashes.
    OVERRIDES: ClassVar[dict[str, str]] = dict(
        num_layers="num_layers", hidden_size="hidden_size", num_attention_heads="num_heads",
        num_query_groups="num_kv_heads", ffn_hidden_size="intermediate_size", num_experts="num_experts",
        moe_ffn_hidden_size="moe_intermediate_size", moe_router_topk="top_k", rotary_base="rope_theta",
        rotary_seq_len_interpolation_factor="rope_scaling_factor", norm_epsilon="rms_norm_eps",
        max_position_embeddings="max_position_embeddings", init_method_std="init_std", kv_channels="head_dim",
        mtp_num_layers="mtp_num_layers")

    def overrides(self) -> dict:
        """The architecture fields these flags set (None: keep the model's), by ModelConfig field name;
        :func:`mlir_train.families.from_flags` applies them to ``--model-name``'s config."""
        return {field: getattr(self, attr) for attr, field in self.OVERRIDES.items()}

    def given_overrides(self) -> dict[str, tuple[str, Any]]:
        """``{ModelConfig field: (flag, value)}`` for the architecture flags given."""
        return {field: ("--" + attr.replace("_", "-"), getattr(self, attr)) for attr, field in self.OVERRIDES.items()
                if getattr(self, attr) is not None}

    def moe_layer_pattern(self, num_layers: int) -> tuple[bool, ...]:
        """``--moe-layer-freq`` read as megatron-core reads it: MoE or not, per layer."""
        from mlir_train.config.models import moe_layer_pattern

        try:
            return moe_layer_pattern(self.moe_layer_freq, num_layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def padded_vocab_size(self, tokenizer_size: int, tensor_parallel: int) -> int:
        return padded_vocab_size(tokenizer_size, self.make_vocab_size_divisible_by, tensor_parallel)



def padded_vocab_size(tokenizer_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's ``_vocab_size_with_padding``: round up to divisible_by * TP."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(tokenizer_size / multiple) * multiple)


@dataclasses.dataclass(frozen=True)
class DataFlags:
    GROUP: ClassVar[str] = "data"
    tokenizer_type: str | None = flag("--tokenizer-type", choices=["HFTokenizer", "HuggingFaceTokenizer"],
                                      help="only Hugging Face tokenizers")
    hf_tokenizer_path: str | None = flag("--hf-tokenizer-path", help="HF tokenizer directory (AIAK)")
    tokenizer_model: str | None = flag(
        "--tokenizer-model", help="Megatron's spelling of the HF tokenizer directory (HuggingFaceTokenizer); "
                                  "used when --hf-tokenizer-path is not given")
    data_path: tuple[str, ...] | None = flag(
        "--data-path", nargs="+", help="data files; Megatron blend syntax 'W1 PATH1 W2 PATH2 ...' allowed")
    split: str = flag("--split", default="969, 30, 1", help="train,valid,test proportions (Megatron's fallback default)")
    data_cache_path: str | None = flag("--data-cache-path", help="where tokenized/packed data is cached")
    seq_length: int | None = flag("--seq-length", type=int, group="training", help="tokens per sample row")
    chat_template: str | None = flag("--chat-template", group="sft",
                                     help="alpaca, qwen/chatml, qwen3 (Qwen3's official template: thinking, tools), "
                                          "qwen3_5 / qwen3_6 (Qwen3.5's / Qwen3.6's: XML tool calls), "
                                          "qwen3_next / qwen3_next_thinking (Qwen3-Next's Instruct / Thinking), "
                                          "hf (the tokenizer's jinja) or auto (the official template "
                                          "the tokenizer directory carries, else hf) (default: alpaca)")
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
    drop_long_samples: bool = switch("--drop-long-samples", "--sft-drop-long-samples", "--enable-discard-sample",
                                     group="sft",
                                     help="drop samples longer than --seq-length instead of truncating them "
                                          "(--enable-discard-sample: LoongForge's spelling)")
    history_mask_loss: bool = switch("--history-mask-loss", group="sft",
                                     help="loss on the last assistant turn of each conversation only (LoongForge)")
    reasoning_loss: str = flag("--reasoning-loss", default="nonempty", group="sft",
                               choices=["nonempty", "all", "none"],
                               help="qwen3 template: which <think> blocks get loss: nonempty (reasoning is "
                                    "trained, an empty think block never), all (empty ones too), none")
    chat_template_kwargs: str | None = flag(
        "--chat-template-kwargs", group="sft",
        help="JSON object (or a file of one) of chat template kwargs, e.g. '{\"enable_thinking\": false}'; "
             "a record's own chat_template_kwargs field overrides it per key (qwen3 and hf templates)")
    eod_mask_loss: bool = switch("--eod-mask-loss", group="sft",
                                 help="no loss on end-of-document (eos) and pad tokens (Megatron/LoongForge)")
    sft_dataset: tuple[str, ...] | None = flag(
        "--sft-dataset", nargs="*", group="sft",
        help="names of --sft-dataset-config entries: one for every --data-path file, or one per file "
             "(LoongForge; default: the entry named after each file)")
    sft_data_mix_strategy: str = flag(
        "--sft-data-mix-strategy", default="concat", group="sft",
        choices=["concat", "interleave_under", "interleave_over"],
        help="several --data-path files without weights: concat (all of each), interleave_under (as many "
             "from each as the smallest has), interleave_over (as many as the largest has, repeating)")
    packing_buffer_size: int | None = flag(
        "--packing-buffer-size", type=int, group="sft",
        help="with --packing-sft-data: pack N samples at a time, in split order, as LoongForge does "
             "(default: the whole split at once)")

    @property
    def tokenizer_path(self) -> str | None:
        return self.hf_tokenizer_path or self.tokenizer_model


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
             "are refused (no model here has MLA; moe recomputes a shared expert with its layer); moe_act needs no --moe-grouped-gemm here")
    moe_layer_recompute: bool = switch(
        "--moe-layer-recompute", group="moe",
        help="Megatron's deprecated spelling of --recompute-granularity selective --recompute-modules ... moe "
             "(added to the modules, core_attn by default)")
    recompute_activations: bool = switch("--recompute-activations",
                                         help="Megatron's alias of --recompute-granularity selective")
    lora_dim: int | None = flag("--lora-dim", type=int, metavar="R",
                                help="LoRA: train rank-R adapters on a frozen base (held in the compute dtype, no "
                                     "optimizer state) instead of every weight (LoongForge's name; default: off)")
    lora_alpha: float = flag("--lora-alpha", default=32.0, type=float,
                             help="LoRA scaling numerator: the adapter adds (alpha / R) A B (Megatron-Bridge's default 32)")
    lora_dropout: float = flag("--lora-dropout", default=0.0, type=float, help="only 0 is supported")
    lora_target_modules: tuple[str, ...] | None = flag(
        "--lora-target-modules", nargs="+", metavar="PATTERN",
        help="the layers LoRA adapts: Megatron's module names of the model's linear layers (its family's parameter "
             "table lists them), short (the last component: every module of that name) or full, with wildcards "
             "('*experts*' only the routed experts); default all-linear: attention, dense MLPs and routed experts, "
             "never the router")
    lora_expert_adapters: str = flag(
        "--lora-expert-adapters", default="per-expert", choices=["per-expert", "shared"],
        help="per-expert: every routed expert its own adapter; shared: one adapter for all experts of a layer")
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
        selective = self.recompute_activations or self.moe_layer_recompute
        granularity = "selective" if selective else self.recompute_granularity
        if granularity != "selective":
            return RecomputePolicy(granularity, self.recompute_method, self.recompute_num_layers)
        modules = tuple(self.recompute_modules or ("core_attn",))
        if self.moe_layer_recompute and "moe" not in modules:
            modules += ("moe",)
        return RecomputePolicy("selective", modules=modules)

    @property
    def lora(self):
        """The :class:`~mlir_train.config.policies.LoRAPolicy` of these flags (None: full fine-tuning)."""
        return LoRAPolicy.from_flags(self.lora_dim, self.lora_alpha, self.lora_dropout, self.lora_target_modules,
                                     self.lora_expert_adapters)

    @property
    def remat(self) -> str:
        """The recompute granularity: "none" | "full" | "selective"."""
        return self.recompute.kind


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
    save_hf: str | None = flag("--save-hf", metavar="DIR", help="at the end, also write the weights as an HF model "
                               "directory (under LoRA the merged model: base + adapters), with what the HF directory "
                               "the model came from holds besides (tensors the model does not use, byte for byte; "
                               "its config.json fields, generation config and tokenizer files)")
    pretrained_checkpoint: str | None = flag(
        "--pretrained-checkpoint", metavar="DIR",
        help="LoRA: the base the adapters apply to (HF directory, ours or Megatron), when --load holds adapters (a "
             "LoRA checkpoint of ours, which records its base otherwise, or a PEFT adapter directory)")
    save_peft: str | None = flag("--save-peft", metavar="DIR",
                                 help="LoRA: at the end, write the adapters as an HF PEFT adapter directory "
                                      "(adapter_config.json + adapter_model.safetensors)")
    lora_export_format: str | None = flag(
        "--lora-export-format", choices=["per-expert", "fused"], metavar="{per-expert,fused}",
        help="--save-peft's routed-expert adapters: per-expert (default: every expert's gate_proj / up_proj / "
             "down_proj, what vLLM and SGLang serve) or fused (peft's target_parameters on transformers 5's fused "
             "experts)")


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
    moe_ep_buffer_factor: float = flag(
        "--moe-ep-buffer-factor", type=float, default=2.0, metavar="F",
        help="dropless MoE under expert parallelism: the all-to-all buffers hold F times the rows a balanced "
             "routing sends (per rank; per expert on the padded CPU path); a step whose routing sends more "
             "exchanges the rest in further rounds through the same buffer, exactly, and logs the rows as "
             "'ep overflow rows'. Nothing is dropped (unlike Megatron's --moe-expert-capacity-factor, which "
             "this does not touch); F >= EP never overflows on the GPU ragged/grouped exchange, F >= experts/topk "
             "on the padded one; under ETP = TP with SP (the expert-tensor ranks all-gather what they received) at "
             "most 1 x, so the gather moves a balanced routing's rows")
    code_paths: str = flag(
        "--code-paths", default="auto", choices=("auto", "gpu"),
        help="which platform's program the step runs: auto (the devices' own); gpu on CPU devices: the GPU "
             "program's code paths, whole: the dropless ragged/grouped EP exchange (overflow rounds included; "
             "the ragged all-to-all by a dense stand-in typed as the real op), the GPU kernels in the "
             "Pallas / Mosaic-GPU interpreters with the tiles chosen for compute capability 9.0 (H100/H200). "
             "Slow: for checks on CPU of what a GPU would run (the xla_gpu_* XLA flags mean nothing to "
             "XLA:CPU and are not set). On GPUs gpu is auto; refused on TPUs")
    attention_kernel: str = flag("--attention-kernel", default="auto",
                                 choices=("auto", "tokamax", "pallas-mha", "mlir", "xla"),
                                 help="attention: mlir (our Pallas-Triton flash attention, mlir_train.model.kernels.docs_flash: "
                                      "skips other documents' tiles forward and backward), tokamax (tokamax's "
                                      "Mosaic-GPU flash attention, skips other documents' key blocks in the forward; needs tokamax), pallas-mha (JAX's Pallas "
                                      "Triton flash attention; jax < 0.12 only, JAX removed it), xla (masked / blocked XLA "
                                      "ops); auto: the platform's default (GPU mlir, else xla; xla under context "
                                      "parallelism). "
                                      "(Megatron's --attention-backend is accepted as a no-op)")


SECTIONS: dict[str, type] = {
    "model": ModelFlags, "data": DataFlags, "training": TrainingFlags, "moe": MoEFlags,
    "parallel": ParallelFlags, "logging": LoggingFlags, "checkpoint": CheckpointFlags, "extras": ExtraFlags,
}


def section_fields():
    """(section name, dataclass field, Flag) for every flag-carrying field, in parser order."""
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                yield name, cls, f, f.metadata["flag"]


def _flag_names() -> dict[str, tuple[str, str]]:
    """Every field's primary flag -> (section, field name)."""
    return {fl.name: (sec, f.name) for sec, _, f, fl in section_fields()}
