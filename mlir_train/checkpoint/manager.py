"""Orbax's side of our checkpoints: :class:`CheckpointManager` writes a step asynchronously,
committed with its checksums, and restores one into any sharded target
(:mod:`mlir_train.checkpoint.orbax` describes the format and lays a step into a run's state).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import shutil
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from mlir_train.checkpoint import complete, integrity
from mlir_train.runtime import log
from mlir_train.runtime.errors import CheckpointError

# 1: no checksums; 2: every step carries checksums.json (a format-2 step without one is corrupt);
# 3: checksums.json is written inside Orbax's tmp directory, so it is committed with the step,
# and each process hashes the shards it wrote.
FORMAT_VERSION = integrity.MANIFEST_IN_COMMIT_SINCE_FORMAT
ARRAY_ITEMS = ("params", "opt_state", "loss_scale")


def _disk_full(e: BaseException | None) -> bool:
    """ENOSPC/EDQUOT, from Python's file writes (OSError) or from TensorStore's array writes
    (a ValueError "RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']")."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(s in str(e) for s in ("No space left on device", "Disk quota exceeded",
                                     f"os_error_code='{errno.ENOSPC}'", f"os_error_code='{errno.EDQUOT}'")):
            return True
        e = e.__cause__ or e.__context__
    return False


def _size(path: str) -> int:
    """Bytes of the files under ``path``."""
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(path) for n in names
               if os.path.isfile(os.path.join(r, n)))


def _io_error(e: BaseException) -> bool:
    """A failed write: OSError, or an OS error that TensorStore reports as another exception."""
    return isinstance(e, OSError) or "os_error_code=" in str(e) or _disk_full(e)


def _newest_verified(directory: str, below: int | None = None,
                     exchange: integrity.Exchange | None = None) -> int | None:
    """The newest step (older than ``below``, if given) that verifies or predates checksums."""
    for s in reversed(integrity.complete_steps(directory)):
        if (below is None or s < below) and integrity.verify_step(os.path.join(directory, str(s)), exchange).usable:
            return s
    return None


def _corrupt_error(directory: str, check: integrity.StepCheck,
                   exchange: integrity.Exchange | None = None) -> CheckpointError:
    good = _newest_verified(directory, exchange=exchange)
    where = os.path.join(check.step_dir, check.file) if check.file else check.step_dir
    hint = (f"the newest checkpoint in {directory} that verifies is iteration {good} "
            f"({os.path.join(directory, str(good))}): resume from it with --load {directory} "
            f"--ckpt-step {good} (a plain --load {directory} falls back to it with a warning)"
            if good is not None else f"no checkpoint in {directory} verifies")
    return CheckpointError(f"checkpoint {check.step_dir} is corrupt: {where}: {check.problem}; {hint}")


def _check_step(directory: str, step: int, exchange: integrity.Exchange | None = None) -> None:
    """Raise a :func:`_corrupt_error` unless ``step`` verifies; one warning if it cannot be verified.
    With ``exchange``, every process of the job checks its share of the files (see verify_step)."""
    check = integrity.verify_step(os.path.join(directory, str(step)), exchange)
    if not check.usable:
        raise _corrupt_error(directory, check, exchange)
    if check.status == "unverified":
        log.warning(f"checkpoint {check.step_dir} {check.problem}")


TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax 0.12.8 writes step N into DIR/N.orbax-checkpoint-tmp, then renames it
# A test's fault injection: MLIR_TRAIN_CKPT_KILL=<point> SIGKILLs the process there (see _fault).
KILL_POINTS = ("before_manifest", "after_manifest", "after_commit")


def _fault(point: str) -> None:
    """SIGKILL this process at ``point`` when ``MLIR_TRAIN_CKPT_KILL`` names it (the
    fault-injection test's deterministic kills at the commit / manifest boundary)."""
    if os.environ.get("MLIR_TRAIN_CKPT_KILL") == point:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class _SaveHashes:
    """The checksums of one save, made where the data is: every process, as soon as its own
    writes of an array item are done (in Orbax's commit future, before Orbax's cross-process
    barrier), hashes the files it wrote (its ``ocdbt.process_<i>`` shards) and publishes their
    entries (names, sizes, digests: metadata, never data); the primary process, in Orbax's
    post-finalization callback (after every process's writes and Orbax's finalize, before the
    rename that commits the step), collects them, hashes what is left (the step's own metadata,
    written by the primary) and writes ``checksums.json`` into the tmp directory. The rename then
    commits the arrays and their manifest at once: a step is complete exactly when its manifest
    is, and a kill anywhere before the rename leaves only a tmp directory, which is ignored."""

    def __init__(self):
        self.exchange = integrity.Exchange.of_processes()
        self.key: str | None = None
        self.items: list[str] = []
        self.tmp_dir: str | None = None
        self.seconds: float | None = None  # the primary's hashing + merging time, for reports
        self.own_bytes = 0  # bytes this process hashed in its commit, for reports

    def begin(self, items: list[str]) -> None:
        self.key, self.items, self.tmp_dir, self.own_bytes = self.exchange.new_key("ckpt"), items, None, 0

    def hash_own(self, item_dir: str, item: str) -> None:
        # Orbax writes the item into <tmp step dir>/<item>.orbax-checkpoint-tmp and renames it to
        # <item> in its finalize: the entries take the names the committed step will have.
        self.tmp_dir = os.path.dirname(item_dir)
        entries = {f"{item}/{rel}": e for rel, e in
                   integrity.hash_own_files(item_dir, self.exchange.index).items()}
        self.own_bytes += sum(e["size"] for e in entries.values())
        self.exchange.publish(f"{self.key}/{item}", entries)

    def commit_manifest(self, step_dir: str) -> None:
        t0 = time.perf_counter()
        hashed = {}
        for item in self.items:
            for entries in self.exchange.collect(f"{self.key}/{item}", delete=True):
                hashed.update(entries)
        _fault("before_manifest")
        integrity.write_manifest(step_dir, hashed, in_commit=True)
        self.seconds = time.perf_counter() - t0
        _fault("after_manifest")


class _HashingHandler(ocp.StandardCheckpointHandler):
    """Orbax's array handler, whose commit ends, on every process, by hashing the files that
    process wrote for the item (see :class:`_SaveHashes`)."""

    def __init__(self, item: str, hashes: _SaveHashes):
        super().__init__()
        self._item, self._hashes = item, hashes

    async def async_save(self, directory, *args, **kwargs):
        from orbax.checkpoint import future

        futures = await super().async_save(directory, *args, **kwargs) or []
        path = str(getattr(directory, "path", directory))
        return [future.ChainedFuture(futures, cb=lambda: self._hashes.hash_own(path, self._item))]


@ocp.args.register_with_handler(_HashingHandler, for_save=True)
class _HashedSave(ocp.args.StandardSave):
    """``StandardSave`` for :class:`_HashingHandler` (Orbax finds an item's handler by its args' type)."""


@ocp.args.register_with_handler(_HashingHandler, for_restore=True)
class _HashedRestore(ocp.args.StandardRestore):
    """Registered for completeness: restores go through a read-only manager's plain handler."""


class _ReadOnlyNotice(logging.Filter):
    """Orbax's "Given directory is read only" warning: our read-only managers only read (a
    restore, ``convert``, ``--load``), and the directory is not read-only at all."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


@contextlib.contextmanager
def _quiet_read_only():
    absl_logger, notice = logging.getLogger("absl"), _ReadOnlyNotice()
    absl_logger.addFilter(notice)
    try:
        yield
    finally:
        absl_logger.removeFilter(notice)


def _check_commit_metadata(directory: str) -> None:
    """Every step's Orbax commit metadata readable, or a CheckpointError naming it: Orbax's
    manager reads them all as it opens, and a damaged one escapes from it as a ValueError."""
    if not os.path.isdir(directory):
        return
    for name in sorted(os.listdir(directory)):
        step = os.path.join(directory, name)
        if integrity.is_step_name(name) and (why := integrity.commit_metadata_problem(step)) is not None:
            raise CheckpointError(f"{os.path.join(step, integrity.COMMIT_FILES[1])}: {why}; the step cannot be "
                                  "read (restore the file, or move the step away)")


class CheckpointManager:
    """A thin wrapper over ``orbax.checkpoint.CheckpointManager`` for the trainer's state dict.

    ``save(iteration, state, extra_json)`` writes ``state``'s array items (``None`` items and
    ``"iteration"``, which is the step number, are skipped) plus a JSON ``meta`` item;
    ``restore(target)`` reads the items named in ``target`` into its shapes and shardings.
    """

    def __init__(self, directory: str, *, max_to_keep: int | None = None, save_interval: int | None = None,
                 async_save: bool = True, read_only: bool = False):
        self.directory = os.path.abspath(directory)
        self.save_interval = save_interval
        self.async_save = async_save
        self._writing: int | None = None  # the step whose background write may still be running
        self._saved: set[int] = set()  # the steps this manager wrote
        self._state_bytes = 0  # the array bytes of the newest save (what the next one needs on disk)
        if read_only and not os.path.isdir(self.directory):
            raise CheckpointError(f"{directory}: no such checkpoint directory")
        if not read_only and jax.process_index() == 0 and os.path.isdir(self.directory):
            self._set_aside_partial()
        self._hashes = None if read_only else _SaveHashes()
        _check_commit_metadata(self.directory)
        arrays = (ocp.StandardCheckpointHandler if read_only else lambda k: _HashingHandler(k, self._hashes))
        handlers = ({k: arrays() if read_only else arrays(k) for k in ARRAY_ITEMS}
                    | {"meta": ocp.JsonCheckpointHandler()})
        # Always Orbax's asynchronous checkpointer (its post-finalization callback writes the
        # manifest inside the commit); ``async_save=False`` waits for each save in save().
        async_options = None if read_only else ocp.AsyncOptions(post_finalization_callback=self._commit_manifest)
        with _quiet_read_only():
            self._mgr = ocp.CheckpointManager(self.directory, item_handlers=handlers, options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=not read_only, create=not read_only,
                read_only=read_only, cleanup_tmp_directories=not read_only, async_options=async_options,
                **({"save_interval_steps": 0} if read_only else {})))

    @property
    def last_manifest_seconds(self) -> float | None:
        """The primary process's time to collect and write the newest save's manifest (hashing its share)."""
        return None if self._hashes is None else self._hashes.seconds

    @property
    def last_hashed_bytes(self) -> int:
        """The bytes this process hashed of the newest save (its own shards; the primary also the rest)."""
        return 0 if self._hashes is None else self._hashes.own_bytes

    def _commit_manifest(self) -> None:
        """Orbax's post-finalization callback (primary process, Orbax's background thread): the
        manifest goes into the tmp directory Orbax is about to rename."""
        step_dir = self._hashes.tmp_dir or self._tmp_dir(self._writing)
        self._hashes.commit_manifest(step_dir)

    def _tmp_dir(self, step: int | None) -> str:
        found = sorted(glob.glob(os.path.join(glob.escape(self.directory), f"{step}{TMP_SUFFIX}*")))
        if not found:
            raise CheckpointError(f"{self.directory}: Orbax's tmp directory for step {step} is not there "
                                  f"({step}{TMP_SUFFIX}*): has orbax-checkpoint changed how it commits?")
        return found[-1]

    def _set_aside_partial(self) -> None:
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if integrity.is_step_name(name) and os.path.isdir(path) and not integrity.is_complete(path):
                aside = f"{path}.partial-{int(time.time())}"
                log.info(f"checkpoint {path} is incomplete (interrupted write?); moved aside to {aside}")
                os.rename(path, aside)

    # ----- which steps exist ------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first (in-progress and partial writes excluded)."""
        return sorted(s for s in self._mgr.all_steps() if integrity.is_complete(os.path.join(self.directory, str(s))))

    def reload(self) -> None:
        """Re-read which steps exist (after steps were moved aside outside Orbax)."""
        self._mgr.reload()

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    # ----- save -------------------------------------------------------------------------------
    def should_save(self, iteration: int) -> bool:
        return bool(self.save_interval) and iteration % self.save_interval == 0

    def save(self, iteration: int, state: dict[str, Any], extra_json: dict[str, Any], *, force: bool = False) -> bool:
        """Start writing ``state`` as step ``iteration``; returns False if not due (and not
        ``force``) or already written by this manager. A step of that number written by someone
        else is never overwritten: a warning says so (the :class:`~mlir_train.checkpoint.saver.Checkpointer`
        moves such steps aside first). Returns once the arrays are off the devices (with
        ``async_save=False``: once the step is committed)."""
        if not (force or self.should_save(iteration)):
            return False
        self.wait()  # Orbax waits for the previous write anyway; this names it if it failed
        if iteration in self._saved:
            return False
        if iteration in self._mgr.all_steps():
            log.warning(f"checkpoint {self.directory}/{iteration} already exists and was not written by this run: "
                        f"iteration {iteration} is not saved over it")
            return False
        # ARRAY_ITEMS only: a LoRA run's frozen "base" is not saved (its meta records where it comes from).
        items = {k: v for k, v in state.items() if v is not None and k in ARRAY_ITEMS}
        meta = {"format": FORMAT_VERSION, "iteration": int(iteration), "items": sorted(items), **extra_json}
        self._state_bytes = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(items))
        self._hashes.begin(sorted(k for k in items if k in ARRAY_ITEMS))  # the items _HashingHandler writes
        self._writing = iteration
        try:
            started = self._mgr.save(iteration, args=ocp.args.Composite(
                **{k: _HashedSave(v) for k, v in items.items()}, meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:
            if not _io_error(e):
                raise
            raise self._write_error(iteration, e) from e
        if not started:
            self._writing = None
            return False
        self._saved.add(iteration)
        if not self.async_save:
            self.wait()
        return True

    def wait(self) -> None:
        """Block until every started save is committed with its checksums; a failed background
        write raises here (or from the next ``save``) as a ``CheckpointError``."""
        try:
            self._mgr.wait_until_finished()
        except Exception as e:
            step, self._writing = self._writing, None
            if step is None:  # Orbax raises a failed write again on every wait: reported already
                return
            self._saved.discard(step)
            raise self._write_error(step, e) from e
        if self._writing is not None:
            _fault("after_commit")
        self._writing = None

    def close(self) -> None:
        self.wait()
        try:
            self._mgr.close()
        except Exception as e:
            raise self._write_error(None, e) from e

    def _write_error(self, step: int | None, e: BaseException) -> CheckpointError:
        what = f"checkpoint {step}" if step is not None else "a checkpoint"
        try:
            newest = self.latest_step()
        except Exception:  # noqa: BLE001 - only for the message
            newest = None
        kept = (f"the newest complete checkpoint there is still iteration {newest}" if newest is not None
                else "no complete checkpoint is there yet")
        aside = self._set_aside_failed(step)
        if _disk_full(e):
            return CheckpointError(
                f"writing {what} to {self.directory} failed: the disk is full (no space left on device). "
                f"{self._space_needed(newest)}{aside}. Free space there (or --save to a disk with room) and resume "
                f"with --load {self.directory}; {kept}, and the training state in memory is intact")
        reason = str(e).split(" [tensorstore_spec=")[0][:500]
        return CheckpointError(f"writing {what} to {self.directory} failed: {type(e).__name__}: {reason}{aside}; "
                               f"{kept}, and the training state in memory is intact")

    def _set_aside_failed(self, step: int | None) -> str:
        """Rename the failed save's tmp directory to ``<step>.partial-<time>`` (never deleted:
        the user decides; Orbax would otherwise remove it at the next start); the message part."""
        if jax.process_index() != 0:
            return ""
        moved = []
        pattern = f"{step}{TMP_SUFFIX}*" if step is not None else f"*{TMP_SUFFIX}*"
        for tmp in sorted(glob.glob(os.path.join(glob.escape(self.directory), pattern))):
            name = os.path.basename(tmp)
            aside = os.path.join(self.directory, f"{name[:name.index(TMP_SUFFIX)]}.partial-{int(time.time())}")
            try:
                os.rename(tmp, aside)
            except OSError:
                continue
            moved.append(f"{aside} ({_size(aside) / 1e9:.2f} GB)")
        if not moved:
            return ""
        return f"; the partial write was moved aside to {', '.join(moved)}: delete it to free that space"

    def _space_needed(self, newest: int | None) -> str:
        """How much the next save needs: the newest complete step's size on disk (the same state
        saved again), else the arrays' bytes; and what is free now."""
        need, source = self._state_bytes, "the training state's arrays"
        if newest is not None:
            on_disk = _size(os.path.join(self.directory, str(newest)))
            if on_disk:
                need, source = on_disk, f"the size of checkpoint {newest}"
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            return f"The next save needs about {need / 1e9:.2f} GB there ({source})"
        return f"The next save needs about {need / 1e9:.2f} GB there ({source}); {free / 1e9:.2f} GB are free"

    # ----- restore ----------------------------------------------------------------------------
    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        step = self._step_or_latest(step)
        with open(os.path.join(self.directory, str(step), "meta", "metadata")) as f:
            return json.load(f)

    def _step_or_latest(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"{self.directory}: no complete checkpoint in it")
        elif step not in self.steps():
            raise CheckpointError(f"{self.directory}: no complete checkpoint for iteration {step} "
                                  f"(have {self.steps()})")
        return step

    # ----- integrity ---------------------------------------------------------------------------
    def verify(self, step: int) -> integrity.StepCheck:
        return integrity.verify_step(os.path.join(self.directory, str(step)))

    def newest_verified(self, below: int | None = None) -> int | None:
        """The newest step (older than ``below``, if given) that verifies or predates checksums."""
        return _newest_verified(self.directory, below)

    def check_step(self, step: int) -> None:
        """Raise a CheckpointError naming the file unless ``step`` verifies (and the newest
        step that does); one warning if it cannot be verified (written before checksums). Every
        process of the job calls it (as :meth:`restore`): each hashes its share."""
        _check_step(self.directory, step, integrity.Exchange.of_processes())

    def restore(self, target: dict[str, Any], step: int | None = None, *, verify: bool = True) -> dict[str, Any]:
        """Restore the items of ``target`` (trees of ``jax.ShapeDtypeStruct`` with shardings;
        ``None`` items are skipped) from ``step`` (default: the newest complete one), after
        checking its files against their checksums (``verify=False``: the caller just did)."""
        step = self._step_or_latest(step)
        if verify:
            self.check_step(step)
        meta = self.read_meta(step)
        names = [k for k, v in target.items() if v is not None]
        missing = [k for k in names if k not in meta["items"]]
        if missing:
            raise CheckpointError(f"{self.directory}/{step} has no {', '.join(missing)} "
                                  f"(it holds {', '.join(meta['items'])})")
        self._check_shapes(step, target, names)
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(
                **{k: ocp.args.StandardRestore(target[k]) for k in names}))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{self.directory}/{step} does not fit this run's state: {e}") from e
        return {k: out[k] for k in names}

    def _check_shapes(self, step: int, target: dict[str, Any], names: list[str]) -> None:
        try:
            stored = self._mgr.item_metadata(step)
        except Exception as e:  # unreadable metadata: corrupt checkpoint
            raise CheckpointError(f"{self.directory}/{step}: cannot read its metadata ({e}); corrupt checkpoint?") from e
        for name in names:
            tree = getattr(stored[name], "tree", stored[name])
            have = {_path(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(tree)[0]
                    if hasattr(m, "shape")}
            want = {_path(p): tuple(s.shape) for p, s in jax.tree_util.tree_flatten_with_path(target[name])[0]}
            if name != "params" and len(have) == len(want):
                continue  # optax states flatten to different path spellings; leaf shapes are checked by Orbax
            if name == "params":  # nothing of the step left unread, no parameter of this run without its array
                complete.check(f"{self.directory}/{step} {name}", missing=set(want) - set(have),
                               unread={k: str(have[k]) for k in set(have) - set(want)},
                               hint="; was it written for another model (or LoRA targets)?")
            diffs = [f"{k}: checkpoint {have.get(k, 'absent')} vs this run {want.get(k, 'absent')}"
                     for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k)]
            if diffs:
                raise CheckpointError(f"{self.directory}/{step} {name} do not match this model: "
                                      + "; ".join(diffs[:6]) + (f" (and {len(diffs) - 6} more)" if len(diffs) > 6 else ""))


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
