"""How a run-configuration field is spelled on the command line: the metadata the parser,
``--help`` groups and README's flag table are generated from."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

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
