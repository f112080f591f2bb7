"""The library's one console: every line starts with ``mlir-train: ``; only process 0 prints.

As Megatron prints from rank 0 only (``print_rank_0``), so do we: :func:`set_process` is called
once the process knows its index (:mod:`mlir_train.runtime.distributed`), and from then on the
other processes stay quiet unless a call passes ``all_processes=True``. Levels: ``debug``,
``info`` (the default), ``warning`` (the line says ``WARNING:``), ``error`` (standard error,
``error:``); ``MLIR_TRAIN_LOG_LEVEL`` or :func:`set_level` picks the lowest printed. Everything
but errors goes to standard output, where the training log has always been.

No jax here, so entry points can log before any backend starts.
"""

from __future__ import annotations

import contextlib
import os
import sys

PREFIX = "mlir-train: "
LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
_MARKS = {"debug": "debug: ", "info": "", "warning": "WARNING: ", "error": "error: "}


def _level_from_env() -> int:
    name = os.environ.get("MLIR_TRAIN_LOG_LEVEL", "info").lower()
    if name not in LEVELS:
        print(f"{PREFIX}WARNING: MLIR_TRAIN_LOG_LEVEL={name!r} is not one of {', '.join(LEVELS)}; using info",
              file=sys.stderr)
        return LEVELS["info"]
    return LEVELS[name]


_state = {"level": _level_from_env(), "process": 0, "aliases": []}


def set_level(name: str) -> None:
    if name not in LEVELS:
        raise ValueError(f"log level {name!r}: choose one of {', '.join(LEVELS)}")
    _state["level"] = LEVELS[name]


def set_process(index: int) -> None:
    """This process's index in the job: only process 0 prints."""
    _state["process"] = int(index)


def is_printing_process() -> bool:
    return _state["process"] == 0


def log(level: str, message: str, *, all_processes: bool = False) -> None:
    if LEVELS[level] < _state["level"] or not (all_processes or is_printing_process()):
        return
    for hidden, shown in _state["aliases"]:
        message = message.replace(hidden, shown)
    stream = sys.stderr if level == "error" else sys.stdout
    print(PREFIX + _MARKS[level] + message, file=stream, flush=True)


@contextlib.contextmanager
def shown_as(hidden: str, shown: str):
    """Within this block, messages name ``hidden`` (a staging path) as ``shown``."""
    _state["aliases"].append((hidden, shown))
    try:
        yield
    finally:
        _state["aliases"].remove((hidden, shown))


def debug(message: str, **kw) -> None:
    log("debug", message, **kw)


def info(message: str, **kw) -> None:
    log("info", message, **kw)


def warning(message: str, **kw) -> None:
    log("warning", message, **kw)


def error(message: str, **kw) -> None:
    log("error", message, **kw)
