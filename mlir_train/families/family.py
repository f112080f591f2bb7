"""What a model family provides, as one value: the :class:`Family` a family's folder defines and
:mod:`mlir_train.families` registers by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from mlir_train.config.models import ModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its config class, its named sizes (``--model-name``), the HF
    ``model_type`` values its configs carry and their mapping both ways, and its causal LM
    (built as ``model(cfg, rngs=..., options=ModelOptions(...))``)."""

    name: str
    config: type[ModelConfig]
    models: Mapping[str, ModelConfig]
    hf_model_types: tuple[str, ...]
    from_hf: Callable[[dict[str, Any], str | None], ModelConfig]   # (config.json as a dict, name) -> config
    to_hf: Callable[[ModelConfig], dict[str, Any]]                 # config -> config.json fields
    model: Callable[..., Any]                                     # the nnx causal LM class
