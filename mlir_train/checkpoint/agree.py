"""The run's model, and the flags held against the checkpoint ``--load`` brings.

The checkpoint (an HF directory, ours, Megatron's, or the base of a PEFT directory named by
``--pretrained-checkpoint``) is the model. The flags that describe a model say the same or stop
the run, one line naming the flag, its value and the checkpoint's:

* ``--model-name``: the named model's network (:meth:`ModelConfig.structure`: family, sizes,
  layer kinds, experts, ...) is the checkpoint's. Another name for the same network passes.
* the size flags (``--num-layers``, ``--hidden-size``, ``--kv-channels``, ``--moe-ffn-hidden-size``,
  ``--moe-router-topk``, ...) and ``--norm-epsilon``: the checkpoint's values; a size the
  checkpoint's model has no use for (``--ffn-hidden-size`` of a model with no dense layer) is
  said and passes;
* ``--rotary-base`` / ``--rotary-seq-len-interpolation-factor``: the checkpoint's, unless
  ``--finetune``: a new training phase may move RoPE (context extension), which is said;
* ``--vocab-size``: at most the checkpoint's rows (the rest are padding); a Megatron checkpoint
  is unpadded to it, as Megatron pads from it;
* ``--untie-embeddings-and-output-weights`` against a checkpoint that ties them;
* ``--max-position-embeddings`` and ``--init-method-std`` describe a fresh model: with a
  checkpoint its own values stay (they are what an HF export records), and a differing flag is said;
* the hybrid-architecture flags (:func:`~mlir_train.config.arch_flags.check_architecture_flags`),
  ``--moe-layer-freq``, and the tokenizer's size.
"""

from __future__ import annotations

import collections

from mlir_train import families
from mlir_train.config.arch_flags import check_architecture_flags
from mlir_train.config.flags import RunConfig
from mlir_train.config.models import LayerKind, ModelConfig
from mlir_train.runtime import log
from mlir_train.runtime.errors import ConfigError

ROPE = ("rope_theta", "rope_scaling_factor")  # the checkpoint's unless --finetune
FUNCTION = (*ROPE, "rms_norm_eps")  # not sizes (no layer's structure), but what every layer computes
FRESH_ONLY = ("max_position_embeddings", "init_std")  # what a fresh model takes; a checkpoint keeps its own


def run_model_config(cfg: RunConfig, source, tokenizer_size: int) -> ModelConfig:
    """The run's model: the source's own config (a :class:`~mlir_train.checkpoint.sources.Source`),
    which every model flag given must agree with; without a checkpoint, the named one with the
    vocabulary padded as Megatron pads it."""
    m = cfg.model
    model_cfg = source.own_model_config(cfg, tokenizer_size)
    if model_cfg is None:
        model_cfg = families.from_flags(m, m.padded_vocab_size(tokenizer_size, cfg.parallel.tensor_model_parallel_size))
    else:
        where = f"the checkpoint {source.describe()}"
        _check_vocab(cfg, model_cfg, tokenizer_size, (source.meta or {}).get("tokenizer_size"), where)
        model_cfg = _check_flags(cfg, model_cfg, where)
        if m.model_name:
            _check_name(cfg, model_cfg, where)
    check_architecture_flags(m, model_cfg)
    return model_cfg


def _check_vocab(cfg: RunConfig, model_cfg: ModelConfig, tokenizer_size: int, saved_tokens, where: str) -> None:
    if tokenizer_size > model_cfg.vocab_size or (not cfg.checkpoint.finetune
                                                 and saved_tokens not in (None, tokenizer_size)):
        trained = f" (trained with a {saved_tokens}-token tokenizer)" if saved_tokens else ""
        raise ConfigError(f"tokenizer {cfg.data.tokenizer_path} has {tokenizer_size} tokens but {where} has a vocab "
                          f"of {model_cfg.vocab_size}{trained}")
    if cfg.model.vocab_size is not None and cfg.model.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"--vocab-size {cfg.model.vocab_size} but {where} has {model_cfg.vocab_size} embedding rows: "
                          "drop the flag (the checkpoint's vocabulary is the model's) or load a checkpoint of that "
                          "vocabulary")


def _check_name(cfg: RunConfig, model_cfg: ModelConfig, where: str) -> None:
    """``--model-name`` (with the size flags given) names the checkpoint's network."""
    name = cfg.model.model_name
    mine, theirs = families.from_flags(cfg.model, model_cfg.vocab_size).structure(), model_cfg.structure()
    differ = [k for k in dict.fromkeys([*mine, *theirs]) if mine.get(k) != theirs.get(k)]
    if differ:
        shown = "; ".join(f"{k} {_short(mine.get(k))} against {_short(theirs.get(k))}"
                          for k in (differ[:1] if "family" in differ else differ[:3]))
        raise ConfigError(f"--model-name {name} is not the model of {where} ({model_cfg.name}): {shown}. Drop "
                          "--model-name (the checkpoint names its model) or load a checkpoint of that model")


def _short(value) -> str:
    if isinstance(value, tuple) and value and isinstance(value[0], LayerKind):  # layers counted by kind
        counts = collections.Counter(value)
        return "[" + ", ".join(f"{n} {k.mixer}{' MoE' if k.moe else ''}" for k, n in counts.items()) + "]"
    return "absent" if value is None else str(value)


def _check_flags(cfg: RunConfig, model_cfg: ModelConfig, where: str) -> ModelConfig:
    """``model_cfg`` with what the flags may change changed (RoPE under ``--finetune``), or a
    ConfigError naming the first flag that contradicts it."""
    m, used = cfg.model, model_cfg.structure()
    for field, (flag, value) in m.given_overrides().items():
        theirs = getattr(model_cfg, field)
        if value == theirs:
            continue
        if field in FRESH_ONLY:
            log.info(f"{flag} {value} is for a fresh model: {where} keeps its own {theirs} (what an HF export records)")
        elif field in ROPE and cfg.checkpoint.finetune:
            log.warning(f"{flag} {value} replaces {where}'s {theirs} (--finetune: a new training phase, e.g. a context "
                        "extension)")
            model_cfg = model_cfg.replace(**{field: type(theirs)(value)})
        elif field not in used and field not in FUNCTION:
            log.info(f"{flag} {value}: {where}'s model ({model_cfg.name}) has no layer that uses it; nothing changes")
        else:
            extra = " (--finetune lets a new training phase move RoPE)" if field in ROPE else ""
            raise ConfigError(f"{flag} {value} contradicts {where}, whose {field} is {theirs}: drop the flag (the "
                              f"checkpoint's model is the run's){extra}")
    if m.untie_embeddings_and_output_weights and model_cfg.tie_word_embeddings:
        raise ConfigError(f"--untie-embeddings-and-output-weights contradicts {where}, whose output layer is its "
                          "embedding (tie_word_embeddings): drop the flag")
    if m.moe_layer_freq is not None and model_cfg.is_moe and \
            m.moe_layer_pattern(model_cfg.num_layers) != model_cfg.moe_layers():
        raise ConfigError(f"--moe-layer-freq {m.moe_layer_freq} differs from {where}'s MoE layers "
                          f"{[int(k) for k in model_cfg.moe_layers()]}")
    return model_cfg
