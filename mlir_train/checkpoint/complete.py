"""The one completeness check of every checkpoint format (HF, PEFT, Megatron legacy and
torch_dist, ours): a load that would leave a tensor of the file unread or a parameter of the model
without its tensor, or a save that would leave a parameter unwritten, is an error naming it.

Each reader and writer works out its own three sets from its family's parameter table
(:mod:`mlir_train.families.table`; every parameter of the model has a row there, or
:meth:`~mlir_train.families.table.Table.bind` refuses it) and hands them here, so every format
says the same thing the same way, on one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from mlir_train.runtime.errors import CheckpointError

_SAY = {
    "missing": "missing tensor {name}{detail}",
    "unread": "tensor {name}{detail} has no counterpart in the model: nothing reads it",
    "unwritten": "parameter {name}{detail} has no place in the format",
}


def check(where: str, *, missing: Iterable[str] | Mapping[str, str] = (),
          unread: Iterable[str] | Mapping[str, str] = (), unwritten: Iterable[str] | Mapping[str, str] = (),
          hint: str = "", error: type[CheckpointError] = CheckpointError) -> None:
    """Raise ``error`` naming the first of the ``missing`` tensors (the model needs them, the file
    lacks them), else of the ``unread`` ones (the file has them, no parameter reads them), else of
    the ``unwritten`` parameters; each a set of names or a mapping of names to a detail (a shape)
    said after the name. ``hint``: what to do about it."""
    for kind, names in (("missing", missing), ("unread", unread), ("unwritten", unwritten)):
        details = dict(names) if isinstance(names, Mapping) else dict.fromkeys(names, "")
        if details:
            first = sorted(details)[0]
            more = f" (and {len(details) - 1} more)" if len(details) > 1 else ""
            detail = f" {details[first]}" if details[first] else ""
            raise error(f"{where}: {_SAY[kind].format(name=first, detail=detail)}{more}{hint}")


def drop(where: str, name: str, state: bool, value, fmt: str, error: type[CheckpointError] = CheckpointError) -> None:
    """Writing a parameter the ``fmt`` format has no place for: training state (``state``, e.g.
    the router's expert bias) is left out, with a warning when ``value`` is not zero; a weight is
    an error naming it."""
    import numpy as np

    from mlir_train.runtime import log

    if not state:
        check(where, unwritten=[name], hint=f" (its table row names no {fmt} tensor)", error=error)
    if np.any(np.asarray(value) != 0):
        log.warning(f"{where}: {name} (training state: the router's expert bias of --moe-router-enable-expert-bias) "
                    f"has no place in the {fmt} format and is not written; the exported model runs without it")
