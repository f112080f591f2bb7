"""The one error family: what a user can act on, said in one line, exit status 2.

Every error an entry point (``sft``, ``plan``, ``convert``, ``preprocess``, ``checkpoint
verify``) turns into one ``mlir-train: error: ...`` line on standard error and exit status 2 is
a :class:`UserError`; its message names the flag, file or line at fault and what to do. Library
code raises the subclass of its layer; :func:`exit_on_user_error` is the one place that turns
them into the line and the status. A layout the mesh cannot build (``sharding.LayoutError``,
raised by the ``sharding`` package, which imports nothing of ours) counts as one too.

No jax here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from mlir_train.runtime import log

EXIT_STATUS = 2


class UserError(Exception):
    """Bad input or a request this run cannot honour; the message says what to change."""

    exit_status = EXIT_STATUS


class ConfigError(UserError, ValueError):
    """A flag, a combination of flags or a ``--config`` file that cannot run (names the flag)."""


class DataError(UserError, ValueError):
    """Bad SFT input (file, record, config or tokenizer); the message says where and what.

    ``reason`` is the short, countable name under which a skipped record is reported.
    """

    def __init__(self, message: str, reason: str = "bad record"):
        super().__init__(message)
        self.reason = reason


class CheckpointError(UserError, ValueError):
    """A checkpoint or model directory that cannot be read or does not fit this run: missing,
    incomplete, mis-shaped or corrupt tensors, a bad index, another model (names what differs)."""


class DistributedEnvError(UserError, ValueError):
    """A launcher environment (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ...) that cannot start a job."""


class SaveLockError(UserError, RuntimeError):
    """``--save DIR`` is held by another live job (names its host, pid and job)."""


class NonFiniteLoss(UserError, RuntimeError):
    """The loss or the gradient norm went NaN/Inf (``--check-for-nan-in-loss-and-grad``): the run
    stops, as Megatron's does, with status 1: a failed run, not bad input."""

    exit_status = 1


def read_text(path: str, error: type[UserError], where: str | None = None) -> str:
    """A user's text file (UTF-8), or ``error`` in one line naming it (``where``: how, e.g.
    "--config run.yaml"): unreadable, or bytes that are no text (a damaged or binary file)."""
    where = where or path
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte {e.start}: {e.reason}); the file is damaged or of another "
                    "kind") from None
    except OSError as e:
        raise error(f"{where}: {e.strerror or e}") from None


def json_object_problem(path: str) -> str | None:
    """Why the file at ``path`` is no JSON object (empty, not UTF-8, not JSON, another JSON
    value), or None."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return "empty" if os.path.isfile(path) and os.path.getsize(path) == 0 else \
            f"not JSON ({type(e).__name__}: {str(e)[:80]})"
    return None if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"


def read_json_object(path: str, error: type[UserError], what: str) -> dict:
    """A user's JSON file holding an object, or ``error`` in one line naming it and saying it is
    damaged (``what``: what the file should be, e.g. "a safetensors index")."""
    import json

    if (why := json_object_problem(path)) is not None:
        raise error(f"{path}: not {what} ({why}); the file is damaged")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions an entry point reports as one line: ours, and the mesh's layout errors."""
    import sys

    extra = ()
    if "sharding.layout" in sys.modules:  # only a run that built a layout can raise it
        extra = (sys.modules["sharding.layout"].LayoutError,)
    return (UserError,) + extra


def report(e: BaseException) -> int:
    """Print ``e`` as the one error line; its exit status."""
    log.error(str(e).strip().replace("\n", " "), all_processes=True)
    return getattr(e, "exit_status", EXIT_STATUS)


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Turn a :func:`user_errors` exception into its one line on standard error and its exit status."""
    try:
        yield
    except user_errors() as e:
        raise SystemExit(report(e)) from None
