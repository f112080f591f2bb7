"""Output directories checked before a run spends any time: each is a directory this process can
create or write, or one error naming its flag (never a traceback after the training)."""

from __future__ import annotations

import os

from mlir_train.runtime.errors import ConfigError


def output_dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be (or become) a directory this process writes, or None. Nothing is
    created: the nearest existing ancestor must be a writable directory."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return "it is a file, not a directory"
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable" if probe == path else f"cannot create it in {probe} (not writable)"
    return None


def check_output_dirs(dirs: dict[str, str | None]) -> None:
    """``{flag: path}``: every given path a directory this process can write, or a ConfigError
    naming the first that is not and what to do."""
    for flag, path in dirs.items():
        problem = path and output_dir_problem(path)
        if problem:
            raise ConfigError(f"{flag} {path}: {problem}; give a directory this job can write")
