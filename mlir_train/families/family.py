"""What a model family provides, as one value: the :class:`Family` a family's folder defines and
:mod:`mlir_train.families` registers by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from mlir_train.config.models import ModelConfig
from mlir_train.families.table import Table


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its config class, its named sizes (``--model-name``), the HF
    ``model_type`` values its configs carry and their mapping both ways, its causal LM (built as
    ``model(cfg, rngs=..., options=ModelOptions(...))``), its parameter table (every parameter's
    HF, Megatron and LoRA names: :mod:`mlir_train.families.table`) and the mapping of Megatron's
    arguments to its configs, both ways.

    ``hf_table``: the table whose HF names a config's checkpoints use, where a family's
    checkpoints come in more than one class layout (None: :attr:`params` for every config).
    ``refused_layouts``: the :class:`~sharding.layout.Layout` splits its model cannot run
    exactly yet (a field, e.g. ``"pipeline"``, or a tuple of fields refused together when all
    are > 1, to the error naming the flags), refused by the one builder of a trainer."""

    name: str
    config: type[ModelConfig]
    models: Mapping[str, ModelConfig]
    hf_model_types: tuple[str, ...]
    from_hf: Callable[[dict[str, Any], str | None], ModelConfig]   # (config.json as a dict, name) -> config
    to_hf: Callable[[ModelConfig], dict[str, Any]]                 # config -> config.json fields
    model: Callable[..., Any]                                     # the nnx causal LM class
    params: Table
    # (Megatron's args as a dict, name=, vocab_size=, has_tensor=) -> config; CheckpointError if not this family's
    from_megatron: Callable[..., ModelConfig]
    to_megatron: Callable[[ModelConfig], dict[str, Any]]        # config -> the args Megatron builds it from
    hf_table: Callable[[ModelConfig], Table] | None = None
    refused_layouts: Mapping[str | tuple[str, ...], str] = dataclasses.field(default_factory=dict)

    def hf_params(self, cfg: ModelConfig) -> Table:
        """The parameter table with the HF names of ``cfg``'s checkpoints (its class layout)."""
        return self.params if self.hf_table is None else self.hf_table(cfg)
