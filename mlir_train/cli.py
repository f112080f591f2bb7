"""Megatron/AIAK-compatible command line for ``python -m mlir_train.sft``.

Every flag of the user's Megatron script (seed: ``qwen3_30b_a3b_sft_megatron_aiak.txt``) is
accepted under Megatron's name, type and default, in a ``--help`` group named after the seed's
bash array that carries it (MODEL_ARGS -> "model", ..., LOGGING_ARGS -> "logging").

Three kinds of flags:

* real flags, parsed into the returned namespace under Megatron's ``dest`` names;
* flags that mean nothing under JAX/XLA (kernel fusions, NCCL knobs, checkpoint formats...)
  or that restate what the Qwen3 architecture already fixes (``--swiglu``, ``--normalization
  RMSNorm``...). They are accepted with Megatron's arity, are *not* put in the namespace, and are
  returned by :func:`parse_args` so the trainer prints them once. Architecture flags whose value
  contradicts Qwen3 (``--normalization LayerNorm``) are errors, not silently ignored;
* anything else is an error naming the closest known flag, exit code 2.

Architecture flags (``--num-layers``, ``--hidden-size``, ``--moe-router-topk``, ``--rotary-base``,
``--norm-epsilon``...) default to ``None`` = "take it from ``--model-name``", where Megatron
would use its own built-in default (e.g. ``--moe-router-topk 2``, ``--rotary-base 10000``):
AIAK also fills them from the model name, and a Megatron default silently overriding the
Qwen3-30B-A3B release values would be a bug. All other defaults are Megatron's.

``--config FILE`` (YAML or JSON) holds flags as keys, with dashes or underscores, optionally
nested one level under group names (``training: {lr: 1e-5}``); the command line wins over it.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from typing import Any, Iterable, Sequence

PROG = "mlir-train-sft"

# Group titles, in --help order. The first seven are the seed script's bash arrays.
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
}

_IGNORED_DEST = "_mlir_train_ignored_flags"

# Flags with no meaning under JAX/XLA: flag -> number of values Megatron gives it (0 or 1).
JAX_IGNORED_FLAGS: dict[str, int] = {
    # kernels and fusions: XLA fuses on its own
    "--use-flash-attn": 0,
    "--attention-backend": 1,
    "--transformer-impl": 1,
    "--no-masked-softmax-fusion": 0,
    "--masked-softmax-fusion": 0,
    "--no-bias-gelu-fusion": 0,
    "--no-bias-swiglu-fusion": 0,
    "--no-bias-dropout-fusion": 0,
    "--no-rope-fusion": 0,
    "--no-persist-layer-norm": 0,
    "--no-gradient-accumulation-fusion": 0,
    "--cross-entropy-loss-fusion": 0,
    "--attention-softmax-in-fp32": 0,  # we always take the softmax in float32
    "--apply-query-key-layer-scaling": 0,
    "--moe-grouped-gemm": 0,
    "--moe-permute-fusion": 0,
    "--moe-use-legacy-grouped-gemm": 0,
    "--moe-token-dispatcher-type": 1,
    "--moe-router-dtype": 1,  # the router always runs in float32
    # torch.distributed / NCCL / DDP plumbing: XLA inserts and schedules the collectives
    "--distributed-timeout-minutes": 1,
    "--overlap-grad-reduce": 0,
    "--overlap-param-gather": 0,
    "--accumulate-allreduce-grads-in-fp32": 0,
    "--ddp-average-in-collective": 0,
    "--no-async-tensor-model-parallel-allreduce": 0,
    "--tp-comm-overlap": 0,
    "--num-distributed-optimizer-instances": 1,
    "--use-precision-aware-optimizer": 0,
    "--local-rank": 1,
    "--lazy-mpu-init": 0,
    "--use-mpi": 0,
    "--use-cpu-initialization": 0,
    "--empty-unused-memory-level": 1,
    "--manual-gc": 0,
    "--manual-gc-interval": 1,
    # legacy/mcore model selection
    "--use-mcore-models": 0,
    "--use-legacy-models": 0,
    # data loader plumbing
    "--num-workers": 1,
    "--dataloader-type": 1,
    "--no-create-attention-mask-in-dataloader": 0,
    # checkpoint formats (we always write Orbax) and scheduler-state handling (our schedule is a
    # pure function of the iteration, so there is no stored scheduler state to use or override)
    "--ckpt-format": 1,
    "--use-dist-ckpt": 0,
    "--auto-detect-ckpt-format": 0,
    "--async-save": 0,
    "--use-checkpoint-args": 0,
    "--use-checkpoint-opt_param-scheduler": 0,
    "--override-opt_param-scheduler": 0,
    # logging we always do, or do not have
    "--log-throughput": 0,
    "--log-progress": 0,
    "--log-params-norm": 0,
    "--log-num-zeros-in-grad": 0,
    "--log-memory-to-tensorboard": 0,
    "--log-validation-ppl-to-tensorboard": 0,
    "--log-world-size-to-tensorboard": 0,
    "--timing-log-level": 1,
    "--timing-log-option": 1,
    "--tensorboard-queue-size": 1,
    # our loss is already sum(token losses) / number of loss tokens over the global batch
    "--calculate-per-token-loss": 0,
}

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
    "--moe-router-score-function": (1, ("softmax",)),
}


class _IgnoredAction(argparse.Action):
    """Accepts a Megatron flag, checks its value where the architecture fixes it, and records
    the flag name (not its value) so the trainer can report it once."""

    def __init__(self, option_strings, dest, allowed=None, **kwargs):
        self.allowed = allowed
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.allowed is not None and values not in self.allowed:
            parser.error(
                f"{option_string} {values}: mlir-train implements the Qwen3 architecture, which "
                f"fixes {option_string} to {' or '.join(self.allowed)}"
            )
        seen = getattr(namespace, _IGNORED_DEST, None)
        if seen is None:
            seen = []
            setattr(namespace, _IGNORED_DEST, seen)
        if option_string not in seen:
            seen.append(option_string)


def _hidden_default(action: argparse.Action) -> bool:
    return action.nargs == 0 or any(action.default is v for v in (None, False, argparse.SUPPRESS))


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default unless it is None/False or the help text already explains it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" not in text
            and not _hidden_default(action)
        ):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    error_context = ""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {self.error_context}{message}\n")


def _add_ignored(group, flag: str, nargs: int, allowed=None, help_text=None) -> None:
    group.add_argument(
        flag,
        action=_IgnoredAction,
        nargs=0 if nargs == 0 else None,
        allowed=allowed,
        metavar="VALUE" if nargs else None,
        help=help_text or "ignored under JAX",
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        usage=f"{PROG} [--config FILE] [Megatron-style flags ...]   (see --help)",
        description="Qwen3 / Qwen3-MoE supervised fine-tuning in JAX, with Megatron-LM/AIAK flags.",
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
    )
    g = {name: p.add_argument_group(title) for name, title in GROUP_TITLES.items()}

    # ---- model (MODEL_ARGS) --------------------------------------------------------------
    m = g["model"]
    m.add_argument("--model-name", default="qwen3-moe-tiny",
                   help="registry name (qwen3-30b-a3b, qwen3-moe-tiny, ...) or a path to an HF "
                        "config.json / model directory")
    m.add_argument("--rotary-base", type=int, default=None, help="RoPE theta (default: from --model-name)")
    m.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                   help="linear RoPE position interpolation factor (default: from --model-name)")
    m.add_argument("--num-layers", type=int, default=None, help="default: from --model-name")
    m.add_argument("--hidden-size", type=int, default=None, help="default: from --model-name")
    m.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="dense SwiGLU width (default: from --model-name)")
    m.add_argument("--num-attention-heads", type=int, default=None, help="default: from --model-name")
    m.add_argument("--num-query-groups", type=int, default=None,
                   help="number of KV heads (default: from --model-name)")
    m.add_argument("--kv-channels", type=int, default=None, help="head dim (default: from --model-name)")
    m.add_argument("--num-experts", type=int, default=None, help="default: from --model-name")
    m.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="per-expert SwiGLU width (default: from --model-name)")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None,
                   help="separate LM head (default: from --model-name)")
    m.add_argument("--vocab-size", type=int, default=None,
                   help="unpadded vocab size (default: the tokenizer's)")
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocab to a multiple of this (times the TP size, as Megatron)")
    for flag, (nargs, allowed) in ARCH_IMPLIED_FLAGS.items():
        _add_ignored(m, flag, nargs, allowed,
                     "accepted; the Qwen3 architecture already implies it"
                     + (f" (only {'/'.join(allowed)})" if allowed else ""))

    # ---- data (DATA_ARGS) ----------------------------------------------------------------
    d = g["data"]
    d.add_argument("--tokenizer-type", default=None, choices=["HFTokenizer", "HuggingFaceTokenizer"],
                   help="only Hugging Face tokenizers (default: the bundled tokenizer)")
    d.add_argument("--hf-tokenizer-path", default=None, help="HF tokenizer directory (AIAK)")
    d.add_argument("--tokenizer-model", default=None,
                   help="Megatron's spelling of the HF tokenizer path for HuggingFaceTokenizer")
    d.add_argument("--data-path", nargs="+", default=None,
                   help="data files; Megatron blend syntax 'W1 PATH1 W2 PATH2 ...' allowed "
                        "(default: the bundled alpaca data)")
    d.add_argument("--split", default="969, 30, 1",
                   help="train,valid,test proportions (Megatron's fallback default)")
    d.add_argument("--data-cache-path", default=None, help="where tokenized/packed data is cached")

    # ---- sft (SFT_ARGS) ------------------------------------------------------------------
    s = g["sft"]
    s.add_argument("--chat-template", default=None,
                   help="prompt template name, e.g. alpaca, qwen (default: the data's)")
    s.add_argument("--sft-num-preprocess-workers", type=int, default=None,
                   help="processes for tokenizing the SFT data")
    s.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="do not stop on NaN/Inf loss or grad norm")
    s.add_argument("--packing-sft-data", action="store_true",
                   help="pack several samples into one --seq-length row (attention kept per sample)")
    s.add_argument("--sft-dataset-config", default=None, help="JSON describing the SFT data formats (AIAK)")
    s.add_argument("--train-on-prompt", action="store_true",
                   help="compute the loss on prompt tokens too (default: responses only)")
    s.add_argument("--sft-skip-bad-records", action="store_true",
                   help="skip malformed records with a warning instead of failing")
    s.add_argument("--drop-long-samples", "--sft-drop-long-samples", dest="drop_long_samples", action="store_true",
                   help="drop samples longer than --seq-length instead of truncating them")

    # ---- training (TRAINING_ARGS) --------------------------------------------------------
    t = g["training"]
    t.add_argument("--training-phase", default="sft", choices=["sft", "pretrain"])
    t.add_argument("--seq-length", type=int, default=None, help="tokens per sample row")
    t.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: from --model-name")
    t.add_argument("--init-method-std", type=float, default=None,
                   help="init std for fresh weights (default: from --model-name, 0.02)")
    t.add_argument("--micro-batch-size", type=int, default=None, help="rows per data-parallel rank per micro-step")
    t.add_argument("--global-batch-size", type=int, default=None, help="rows per optimizer step")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate")
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    t.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    t.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of --lr-decay-iters")
    t.add_argument("--lr-warmup-iters", type=int, default=0)
    t.add_argument("--lr-warmup-init", type=float, default=0.0)
    t.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    t.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="annealing iterations of WSD")
    t.add_argument("--clip-grad", type=float, default=1.0, help="global L2 grad-norm clip (0: off)")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-08)
    t.add_argument("--sgd-momentum", type=float, default=0.9)
    t.add_argument("--norm-epsilon", type=float, default=None, help="RMSNorm eps (default: from --model-name)")
    t.add_argument("--train-iters", type=int, default=None)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--bf16", action="store_true", help="bfloat16 compute, float32 master weights")
    t.add_argument("--fp16", action="store_true", help="float16 compute with dynamic loss scaling")
    t.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="fp16 only")
    t.add_argument("--min-loss-scale", type=float, default=1.0)
    t.add_argument("--loss-scale-window", type=float, default=1000)
    t.add_argument("--hysteresis", type=int, default=2)
    t.add_argument("--loss-scale", type=float, default=None, help="static loss scale (fp16)")
    t.add_argument("--attention-dropout", type=float, default=0.0, help="only 0 is supported")
    t.add_argument("--hidden-dropout", type=float, default=0.0, help="only 0 is supported")
    t.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="rematerialisation: full layers or attention core only")
    t.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    t.add_argument("--recompute-num-layers", type=int, default=None)
    t.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's alias of --recompute-granularity selective")
    t.add_argument("--load", default=None, help="checkpoint directory to start from")
    t.add_argument("--save", default=None, help="checkpoint directory to write")
    t.add_argument("--save-interval", type=int, default=None)
    t.add_argument("--eval-interval", type=int, default=1000)
    t.add_argument("--eval-iters", type=int, default=100)
    t.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="an error if --load holds no checkpoint (default: warn and start from scratch, as Megatron)")
    t.add_argument("--exit-signal-handler", action="store_true",
                   help="always on here: SIGTERM/SIGINT finish the iteration, save (with --save) and exit 0")
    t.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and exit 0 after an iteration divisible by this")
    t.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit 0 after the iteration that ends this many minutes in")
    t.add_argument("--no-load-optim", action="store_true", default=None)
    t.add_argument("--no-load-rng", action="store_true", default=None)

    # ---- moe (MOE_ARGS) ------------------------------------------------------------------
    e = g["moe"]
    e.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    e.add_argument("--moe-router-topk", type=int, default=None, help="default: from --model-name")
    e.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    e.add_argument("--moe-z-loss-coeff", type=float, default=None)
    e.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="tokens per expert = factor * tokens * topk / experts (default: no dropping)")
    e.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"])
    e.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    e.add_argument("--moe-layer-freq", default=None, metavar="N|LIST",
                   help="which decoder layers are MoE: every N-th from layer 0, or a 0/1 list expression "
                        "such as ([0]*3+[1]*45) (default: from --model-name / the checkpoint)")

    # ---- model-parallel (MODEL_PARALLEL_ARGS) --------------------------------------------
    mp = g["model-parallel"]
    mp.add_argument("--tensor-model-parallel-size", type=int, default=1)
    mp.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    mp.add_argument("--expert-model-parallel-size", type=int, default=1)
    mp.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    mp.add_argument("--context-parallel-size", type=int, default=1)
    mp.add_argument("--sequence-parallel", action="store_true")
    mp.add_argument("--use-distributed-optimizer", action="store_true",
                    help="shard optimizer state over data-parallel ranks (ZeRO-1)")
    mp.add_argument("--use-torch-fsdp2", action="store_true",
                    help="FSDP: shard the parameters too over the data-parallel ranks, gathered for compute "
                         "(same as --data-parallel-sharding-strategy optim_grads_params)")
    mp.add_argument("--data-parallel-sharding-strategy", default="no_shard",
                    choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                    help="Megatron-FSDP's ZeRO stage: optim / optim_grads shard the optimizer state "
                         "(= --use-distributed-optimizer), optim_grads_params the parameters too (FSDP)")
    mp.add_argument("--use-megatron-fsdp", "--use-custom-fsdp", dest="use_megatron_fsdp", action="store_true",
                    help="accepted for Megatron-FSDP scripts; the sharding follows --data-parallel-sharding-strategy")
    mp.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    mp.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    mp.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    _add_ignored(mp, "--distributed-backend", 1, None, "ignored: XLA picks the collectives")

    # ---- logging (LOGGING_ARGS) ----------------------------------------------------------
    lg = g["logging"]
    lg.add_argument("--log-interval", type=int, default=100)
    lg.add_argument("--tensorboard-dir", default=None)
    lg.add_argument("--tensorboard-log-interval", type=int, default=1)
    lg.add_argument("--log-timers-to-tensorboard", action="store_true")
    lg.add_argument("--wandb-project", default="")
    lg.add_argument("--wandb-exp-name", default="")
    lg.add_argument("--wandb-save-dir", default="")

    # ---- checkpointing -------------------------------------------------------------------
    c = g["checkpointing"]
    c.add_argument("--finetune", action="store_true",
                   help="load weights only and restart the iteration count at 0")
    c.add_argument("--no-save-optim", action="store_true", default=None)
    c.add_argument("--no-save-rng", action="store_true", default=None)
    c.add_argument("--save-retain", type=int, default=None, metavar="K",
                   help="keep only the newest K checkpoints in --save (default: keep all)")
    c.add_argument("--save-hf", default=None, metavar="DIR",
                   help="at the end, also write the weights as an HF model directory")

    # ---- mlir-train extras ---------------------------------------------------------------
    x = g["mlir-train"]
    x.add_argument("--config", metavar="FILE", default=None,
                   help="YAML/JSON file of flags (keys with dashes or underscores); "
                        "the command line overrides it")
    x.add_argument("--num-devices", type=int, default=None, help="use only the first N devices")
    x.add_argument("--cpu-devices", type=int, default=None,
                   help="fake CPU device count set in XLA_FLAGS before jax starts")
    x.add_argument("--compilation-cache-dir", default=None, help="persistent XLA compilation cache")
    x.add_argument("--print-sharding", action="store_true", help="print every parameter's sharding")
    x.add_argument("--pipeline-schedule", default=None, choices=["1f1b", "gpipe", "circular"],
                   help="with --pipeline-model-parallel-size > 1: 1f1b (default, as Megatron; interleaved with "
                        "--num-layers-per-virtual-pipeline-stage; activations of at most ~2 x stages micro-batches), "
                        "gpipe, or circular (needs --num-layers-per-virtual-pipeline-stage; both keep every "
                        "micro-batch's activations)")
    x.add_argument("--peak-tflops", type=float, default=None,
                   help="per-device peak TFLOP/s for MFU (default: from the device kind)")

    for flag, nargs in JAX_IGNORED_FLAGS.items():
        _add_ignored(g["ignored"], flag, nargs)
    for action in p._actions:
        if action.help is None and not _hidden_default(action):
            action.help = "default: %(default)s"
    return p


def _option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings if opt.startswith("--")}


def flag_groups(parser: argparse.ArgumentParser | None = None) -> dict[str, list[str]]:
    """Group name (``model``, ``data``, ...) -> the long flags in that group."""
    parser = parser or build_parser()
    by_title = {title: name for name, title in GROUP_TITLES.items()}
    out: dict[str, list[str]] = {}
    for grp in parser._action_groups:
        if grp.title in by_title:
            out[by_title[grp.title]] = [
                o for a in grp._group_actions for o in a.option_strings if o.startswith("--")
            ]
    return out


FLAG_GROUPS: dict[str, list[str]] = flag_groups()
ALL_FLAGS: frozenset[str] = frozenset(f for flags in FLAG_GROUPS.values() for f in flags)


def _closest(flag: str, known: Iterable[str]) -> str | None:
    known = list(known)
    norm = {k.replace("_", "-"): k for k in known}
    if flag.replace("_", "-") in norm:
        return norm[flag.replace("_", "-")]
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown_flag_message(flag: str, known: Iterable[str], where: str = "") -> str:
    best = _closest(flag, known)
    hint = f"; did you mean {best}?" if best else "; see --help for the accepted flags"
    return f"unknown flag {flag}{where}{hint}"


def _load_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise SystemExit(f"{PROG}: error: --config {path}: {e.strerror}") from None
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # yaml.YAMLError / json.JSONDecodeError, both carry line info
        raise SystemExit(f"{PROG}: error: --config {path}: cannot parse: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SystemExit(f"{PROG}: error: --config {path}: expected a mapping of flag: value")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and str(key).replace("_", "-") in GROUP_TITLES:
            flat.update(value)  # one level of grouping, mirroring the seed's arrays
        else:
            flat[str(key)] = value
    return flat


def _config_to_argv(parser: argparse.ArgumentParser, cfg: dict[str, Any], path: str) -> list[str]:
    """Turn config keys into command-line tokens so argparse applies types, choices and arity."""
    actions = _option_actions(parser)
    by_norm = {opt.replace("_", "-"): opt for opt in actions}
    by_dest = {a.dest: opt for opt, a in actions.items() if a.dest != argparse.SUPPRESS}
    argv: list[str] = []
    for key, value in cfg.items():
        flag = by_norm.get("--" + key.lstrip("-").replace("_", "-"))
        negate = False
        if flag is None and key in by_dest:
            # A dest name such as check_for_nan_in_loss_and_grad: false -> --no-check-...
            flag = by_dest[key]
            negate = isinstance(actions[flag], argparse._StoreFalseAction)
        if flag is None:
            parser.error(_unknown_flag_message("--" + key.replace("_", "-"), actions, f" in {path}"))
        if flag == "--config":
            parser.error(f"--config {path}: a config file cannot name another --config")
        action = actions[flag]
        if value is None:
            continue
        if action.nargs == 0:
            if not isinstance(value, bool):
                parser.error(f"--config {path}: {key} is a switch; give true or false, not {value!r}")
            if value != negate:
                argv.append(flag)
        elif isinstance(value, (list, tuple)):
            if action.nargs not in ("+", "*"):
                parser.error(f"--config {path}: {key} takes one value, not a list")
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value given for ``flag`` (``--flag V`` or ``--flag=V``) before parsing: for the
    few settings that must be known before jax is imported or the config file is read.
    (This module imports no jax, so entry points may use it first.)"""
    value = None
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif tok.startswith(flag + "="):
            value = tok.split("=", 1)[1]
    return value


def _check_unknown(parser: argparse.ArgumentParser, extras: list[str], where: str = "") -> None:
    if not extras:
        return
    known = _option_actions(parser)
    flag = next((tok.split("=", 1)[0] for tok in extras if tok.startswith("-")), None)
    if flag is None:
        parser.error(f"unexpected argument{where}: {' '.join(extras)}")
    parser.error(_unknown_flag_message(flag, known, where))


def _validate(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """The subset of Megatron's ``validate_args`` that concerns flags we read."""
    if ns.bf16 and ns.fp16:
        parser.error("--bf16 and --fp16 are mutually exclusive")
    if ns.lr_warmup_fraction is not None and ns.lr_warmup_iters != 0:
        parser.error("give only one of --lr-warmup-fraction and --lr-warmup-iters")
    if ns.lr_decay_style == "WSD" and ns.lr_wsd_decay_iters is None:
        parser.error("--lr-decay-style WSD needs --lr-wsd-decay-iters")
    if ns.attention_dropout or ns.hidden_dropout:
        parser.error("dropout is not implemented: use --attention-dropout 0 --hidden-dropout 0")
    if ns.recompute_activations and ns.recompute_granularity is None:
        ns.recompute_granularity = "selective"  # Megatron's alias
    if ns.micro_batch_size is not None and ns.global_batch_size is not None:
        if ns.global_batch_size % ns.micro_batch_size:
            parser.error(
                f"--global-batch-size {ns.global_batch_size} is not a multiple of "
                f"--micro-batch-size {ns.micro_batch_size}"
            )


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Parse Megatron-style flags (and an optional ``--config FILE``).

    Returns the namespace (Megatron dest names: ``ns.global_batch_size``, ``ns.lr``...) and the
    flags that were accepted but have no effect under JAX, in order of first appearance.
    Exits with status 2 on unknown flags or bad values.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    file_argv: list[str] = []
    config_path = flag_value(argv, "--config")
    if config_path is not None:
        file_argv = _config_to_argv(parser, _load_config_file(config_path), config_path)
        # Parse the file's flags alone first so a bad value is reported against the file.
        parser.error_context = f"--config {config_path}: "
        _, extras = parser.parse_known_args(file_argv)
        _check_unknown(parser, extras, f" in {config_path}")
        parser.error_context = ""
    ns, extras = parser.parse_known_args(file_argv + argv)
    _check_unknown(parser, extras)
    ignored = list(getattr(ns, _IGNORED_DEST, None) or [])
    if hasattr(ns, _IGNORED_DEST):
        delattr(ns, _IGNORED_DEST)
    _validate(parser, ns)
    return ns, ignored


def data_config(args: argparse.Namespace):
    """The data pipeline's :class:`~mlir_train.data.DataConfig` from the parsed flags; shared by
    ``python -m mlir_train.sft`` and ``python -m mlir_train.preprocess`` so both read the same
    flags the same way (and so hit the same cache)."""
    from mlir_train.data import DataConfig

    return DataConfig(
        data_path=tuple(args.data_path), tokenizer_path=args.hf_tokenizer_path,
        tokenizer_type=args.tokenizer_type or "HFTokenizer", chat_template=args.chat_template or "alpaca",
        seq_length=args.seq_length, packing=args.packing_sft_data,
        num_workers=args.sft_num_preprocess_workers or 1, cache_path=args.data_cache_path,
        dataset_config=args.sft_dataset_config, split=args.split, train_on_prompt=args.train_on_prompt,
        drop_long=args.drop_long_samples, skip_bad_records=args.sft_skip_bad_records, seed=args.seed,
    )


def parse_data_blend(paths: Sequence[str] | None) -> list[tuple[float, str]]:
    """Megatron's ``--data-path`` blend: ``['0.3', 'a', '0.7', 'b']`` -> ``[(0.3, 'a'), (0.7, 'b')]``;
    plain paths get equal weights. Weights are normalised to sum to 1."""
    if not paths:
        return []

    def is_number(s: str) -> bool:
        try:
            float(s)
        except ValueError:
            return False
        return not os.path.exists(s)

    if len(paths) % 2 == 0 and all(is_number(w) for w in paths[0::2]):
        pairs = [(float(w), p) for w, p in zip(paths[0::2], paths[1::2])]
    else:
        pairs = [(1.0, p) for p in paths]
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise ValueError(f"--data-path weights must sum to a positive number, got {paths}")
    return [(w / total, p) for w, p in pairs]


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's ``--split`` ('969, 30, 1', '100,0,0', '98/2/0') -> normalised fractions."""
    parts = [float(s) for s in split.replace("/", ",").split(",") if s.strip()]
    parts = (parts + [0.0, 0.0, 0.0])[:3]
    total = sum(parts)
    if total <= 0 or any(x < 0 for x in parts):
        raise ValueError(f"--split {split!r}: expected non-negative proportions with a positive sum")
    return tuple(x / total for x in parts)  # type: ignore[return-value]
