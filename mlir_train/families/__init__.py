"""Model families, one folder each, and the one registry that names them.

A family's folder (``mlir_train/families/<name>/``) holds everything specific to it: its decoder
layers where they differ from the shared ones in :mod:`mlir_train.model`, its config mapping (its
released sizes, HF ``config.json`` both ways) and its parameter table. Adding a family is its
folder and one line in :data:`FAMILIES`. Everything else asks this module: which family a config
belongs to, a config by ``--model-name`` or from an HF directory or one of our checkpoints, and
the model of a config.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Callable
from typing import Any

from flax import nnx

from mlir_train.config.models import ModelConfig
from mlir_train.families import qwen3, qwen3_5
from mlir_train.families.family import Family
from mlir_train.families.table import Table
from mlir_train.model import transformer
from mlir_train.model.options import ModelOptions
from mlir_train.runtime.errors import CheckpointError, ConfigError

FAMILIES: dict[str, Family] = {f.name: f for f in (
    qwen3.FAMILY,
    qwen3_5.FAMILY,
)}

__all__ = ["FAMILIES", "Family", "build_model", "family_of", "from_flags", "from_hf_config", "from_hf_dir",
           "from_megatron", "from_saved", "get_model_config", "init_model", "known_models", "model_class"]


def family_of(cfg: ModelConfig) -> Family:
    """The family a config belongs to."""
    try:
        return FAMILIES[cfg.family]
    except KeyError:
        raise ConfigError(f"model {cfg.name}: no model family {cfg.family!r} (known: {', '.join(FAMILIES)})") from None


def model_class(cfg: ModelConfig):
    """The causal LM class of ``cfg``'s family: ``model_class(cfg)(cfg, rngs=..., options=...)``."""
    return family_of(cfg).model


def known_models() -> dict[str, ModelConfig]:
    """Every family's named sizes, by ``--model-name``."""
    return {name: cfg for f in FAMILIES.values() for name, cfg in f.models.items()}


def from_hf_config(hf: dict[str, Any], name: str | None = None) -> ModelConfig:
    """Our config of an HF ``config.json`` (as a dict), by its ``model_type``; raises
    :class:`CheckpointError` for a model type no family reads."""
    model_type = hf.get("model_type", "")
    for f in FAMILIES.values():
        if model_type in f.hf_model_types:
            return f.from_hf(hf, name)
    types = ", ".join(repr(t) for f in FAMILIES.values() for t in f.hf_model_types)
    raise CheckpointError(f"HF model_type {model_type!r} is not a model mlir-train trains (model_type {types}); "
                          "give the directory of one of those")


def from_megatron(args: dict[str, Any], *, name: str, vocab_size: int,
                  has_tensor: Callable[[Table, str], bool]) -> ModelConfig:
    """Our config of a Megatron checkpoint's ``args``, by the first family whose mapping takes
    them (``has_tensor(table, name)``: whether the checkpoint holds that global tensor, spelled as
    the family's table spells it); if none does, a :class:`CheckpointError` saying why for each."""
    errors = []
    for f in FAMILIES.values():
        try:
            return f.from_megatron(args, name=name, vocab_size=vocab_size,
                                   has_tensor=lambda tensor, table=f.params: has_tensor(table, tensor))
        except CheckpointError as e:
            errors.append((f.name, e))
    if len(errors) == 1:
        raise errors[0][1]
    raise CheckpointError("; ".join(f"as {name}: {e}" for name, e in errors))


def from_hf_dir(path: str) -> ModelConfig:
    """The config of an HF directory (or its ``config.json``); anything unusable there is a
    :class:`CheckpointError` naming the file."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as fh:
            hf = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no HF config.json there") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}:{e.lineno}: not valid JSON ({e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read it ({e})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file}: not an HF config (expected a JSON object)")
    try:
        return from_hf_config(hf, name=os.path.basename(os.path.dirname(os.path.abspath(file))))
    except CheckpointError as e:
        raise CheckpointError(f"{file}: {e}") from None
    except KeyError as e:
        raise CheckpointError(f"{file}: HF config without {e.args[0]!r}; is it the config.json of a model "
                              "mlir-train trains?") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: not a usable model config ({e})") from None


def from_saved(saved: dict[str, Any]) -> ModelConfig:
    """The config one of our checkpoints recorded (:meth:`ModelConfig.as_dict`); checkpoints
    written before families were recorded are Qwen3's."""
    fields = dict(saved)
    name = fields.pop("family", "qwen3")
    if name not in FAMILIES:
        raise CheckpointError(f"the checkpoint's model {fields.get('name')!r} is of family {name!r}, which this "
                              f"mlir-train does not know (known: {', '.join(FAMILIES)})")
    cls = FAMILIES[name].config
    known = {f.name for f in dataclasses.fields(cls)}
    tuples = {f.name for f in dataclasses.fields(cls) if str(f.type).startswith("tuple")}
    return cls(**{k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in fields.items() if k in known})


def get_model_config(name_or_path: str | ModelConfig, **overrides: Any) -> ModelConfig:
    """A named config (``--model-name``), one read from an HF directory / config.json, or a given
    config, with per-run overrides (``num_layers=..., top_k=..., vocab_size=...``; None: keep) on top."""
    models = known_models()
    if isinstance(name_or_path, ModelConfig):
        cfg = name_or_path
    elif name_or_path in models:
        cfg = models[name_or_path]
    elif os.path.exists(name_or_path):
        try:
            cfg = from_hf_dir(name_or_path)
        except CheckpointError as e:
            raise ConfigError(f"--model-name {name_or_path}: {e}") from None
    else:
        close = difflib.get_close_matches(name_or_path, models, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"--model-name {name_or_path!r} is neither a known model ({', '.join(models)}) "
                          f"nor a path to an HF config.json.{hint}")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(cfg)}
    if unknown:
        raise TypeError(f"unknown {type(cfg).__name__} override(s): {sorted(unknown)}")
    return cfg.replace(**{k: v for k, v in overrides.items() if v is not None})


def from_flags(flags, vocab_size: int | None, base: ModelConfig | None = None) -> ModelConfig:
    """The config the model flags (:class:`mlir_train.config.sections.ModelFlags`) describe:
    ``--model-name`` (or ``base``, e.g. a checkpoint's own config) with the flags' overrides and
    ``vocab_size``."""
    cfg = get_model_config(flags.model_name or flags.DEFAULT_MODEL if base is None else base,
                           vocab_size=vocab_size, **flags.overrides())
    if flags.moe_layer_freq is not None:
        cfg = cfg.with_moe_layers(flags.moe_layer_pattern(cfg.num_layers))
    if cfg.mtp_num_layers:
        if cfg.mtp_num_layers < 0:
            raise ConfigError(f"--mtp-num-layers {cfg.mtp_num_layers}: the number of MTP depths is at least 1")
        try:
            cfg.mtp_kinds()
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return cfg.replace(tie_word_embeddings=False) if flags.untie_embeddings_and_output_weights else cfg


def build_model(cfg: ModelConfig, options: ModelOptions = ModelOptions(), *, seed: int = 0, abstract: bool = False):
    """The model of ``cfg`` (its family's causal LM) built as ``options`` say, its parameters
    drawn from ``seed``; ``abstract``: shapes only (``nnx.eval_shape``), nothing allocated."""
    build = lambda: model_class(cfg)(cfg, rngs=nnx.Rngs(seed), options=options)
    return nnx.eval_shape(build) if abstract else build()


def init_model(cfg: ModelConfig, *, seed: int = 0, shardings: Any = None, options: ModelOptions = ModelOptions()):
    """A fresh model of ``cfg`` born in ``shardings`` (:func:`mlir_train.model.transformer.init_model`)."""
    return transformer.init_model(cfg, model_class(cfg), seed=seed, shardings=shardings, options=options)
