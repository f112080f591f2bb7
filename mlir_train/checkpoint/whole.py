"""Exports put in place whole: after ``--save-hf``, ``--save-peft`` or ``convert``'s write, the
directory holds exactly what that write made.

A write goes into a staging directory beside the destination (``.<name>.partial``). Only when it
is complete does the staging directory take the destination's place; the earlier content is
set aside first (``.<name>.replaced``) and removed after. A crash while writing leaves the
earlier content untouched; a crash between the two renames leaves the earlier content set
aside, and the next export of that destination puts it back before it starts.

Each export records the files it wrote (:data:`MANIFEST`). A destination is replaced only if it
is empty or holds nothing but files an export of ours recorded. Any other file there is the
user's: the export is refused naming it, before a run trains (:func:`problem`), never deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

from mlir_train.runtime import log
from mlir_train.runtime.errors import CheckpointError

MANIFEST = ".mlir-train-export.json"  # {"what": ..., "files": [paths relative to the directory]}
WRITING = ".mlir-train-writing"  # in a staging directory until its write completes


def _aside(dst: str, suffix: str) -> str:
    dst = os.path.abspath(dst)
    return os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.{suffix}")


def _files(root: str) -> list[str]:
    """Every file under ``root`` (relative paths, sorted)."""
    found = []
    for here, dirs, names in os.walk(root):
        dirs.sort()
        found += [os.path.relpath(os.path.join(here, n), root) for n in names]
    return sorted(found)


def _recorded(root: str) -> set[str] | None:
    """The files the manifest in ``root`` lists, or None where there is no readable one."""
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            files = json.load(f)["files"]
        return {str(p) for p in files}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def problem(dst: str) -> str | None:
    """Why an export may not replace what ``dst`` holds, or None: it is absent, empty, or holds
    only files an export of ours wrote (its manifest lists them)."""
    if not os.path.isdir(dst):
        return None
    present = _files(dst)
    if not present:
        return None
    recorded = _recorded(dst)
    foreign = [p for p in present if p != MANIFEST and (recorded is None or p not in recorded)]
    if not foreign:
        return None
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    why = "no export of ours wrote them" if recorded is None else "the export there did not write them"
    return (f"it holds files an export would replace or leave beside its own ({shown}; {why}): empty it, or give "
            "a new directory")


def check_destinations(exports: dict[str, str | None], others: dict[str, str | None]) -> None:
    """Before a run: each of ``exports`` (``{flag: dir}``) replaceable (:func:`problem`) and
    apart from every other output directory given (``others`` too), or a CheckpointError naming
    the flags. One export would otherwise replace another, or a checkpoint."""
    given = {f: os.path.abspath(d) for f, d in {**exports, **others}.items() if d}
    for flag, path in exports.items():
        if not path:
            continue
        why = problem(path)
        if why:
            raise CheckpointError(f"{flag} {path}: {why}")
        for other, where in given.items():
            mine = given[flag]
            if other != flag and (where == mine or where.startswith(mine + os.sep) or mine.startswith(where + os.sep)):
                raise CheckpointError(f"{flag} {path} and {other} {where}: an export replaces its directory whole, "
                                      "so the two must be apart (neither inside the other)")


def _recover(dst: str) -> None:
    """Finish what a crashed export of ``dst`` left: its earlier content set aside and not put
    back (restored), an old copy not yet removed, a partial write (removed)."""
    replaced, partial = _aside(dst, "replaced"), _aside(dst, "partial")
    if os.path.isdir(replaced) and _recorded(replaced) is not None:
        if not os.path.exists(dst):
            os.rename(replaced, dst)
            log.warning(f"{dst}: put back the earlier export an interrupted one had set aside ({replaced})")
        else:
            shutil.rmtree(replaced)
    if os.path.isdir(partial):
        if not os.path.exists(os.path.join(partial, WRITING)):
            raise CheckpointError(f"{partial}: the staging directory of an export to {dst} exists and is not ours: "
                                  "move it away")
        shutil.rmtree(partial)
        log.warning(f"{dst}: removed {partial}, the partial write of an interrupted export")


@contextlib.contextmanager
def staged(dst: str, what: str, *, leader: bool = True):
    """Write ``what`` into the directory this yields; on a clean exit it becomes ``dst`` whole.
    Every process enters (a multi-process write shares the staging directory); only the
    ``leader`` prepares and puts it in place. Raises CheckpointError where :func:`problem` does."""
    from mlir_train.runtime.distributed import barrier

    dst = os.path.abspath(dst)
    partial = _aside(dst, "partial")
    if leader:
        _recover(dst)
        why = problem(dst)
        if why:
            raise CheckpointError(f"{dst}: {why}")
        os.makedirs(partial)
        open(os.path.join(partial, WRITING), "w").close()
    barrier(f"export-stage:{dst}")
    try:
        with log.shown_as(partial, dst):
            yield partial
    except BaseException as e:
        if leader:
            shutil.rmtree(partial, ignore_errors=True)
        if e.args and isinstance(e.args[0], str):  # the error names where the files were to go
            e.args = (e.args[0].replace(partial, dst),) + e.args[1:]
        raise
    barrier(f"export-written:{dst}")
    if leader:
        os.remove(os.path.join(partial, WRITING))
        files = _files(partial)
        with open(os.path.join(partial, MANIFEST), "w") as f:
            json.dump({"what": what, "files": files}, f, indent=1)
        _swap(partial, dst)
    barrier(f"export-placed:{dst}")


def _swap(partial: str, dst: str) -> None:
    if not os.path.exists(dst):
        os.rename(partial, dst)
        return
    replaced = _aside(dst, "replaced")
    os.rename(dst, replaced)
    os.rename(partial, dst)
    shutil.rmtree(replaced)


def write(dst: str, what: str, make):
    """``make(directory)`` writes ``what`` into :func:`staged`'s directory, which then becomes
    ``dst``; returns what ``make`` returns. Every process calls it."""
    import jax

    with staged(dst, what, leader=jax.process_index() == 0) as stage:
        return make(stage)
