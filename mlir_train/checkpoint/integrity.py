"""Checkpoints that cannot rot silently: per-step checksum manifests and the ``--save`` lock.

**Checksums.** ``DIR/<step>/checksums.json`` records, for every file of the step (the OCDBT/zarr
data files, Orbax's metadata, our JSON ``meta``), its size and BLAKE2b-256 digest. Since format
3 it is part of the step's atomic commit: each process hashes the shard files it wrote
(``ocdbt.process_<i>/``, :func:`writer_of`) as soon as its own writes are done, the entries
(names, sizes, digests) go to the primary process as small metadata (:class:`Exchange`, the JAX
coordination service's key-value store; no data moves), and the primary, after Orbax's finalize
and before Orbax's rename, hashes the remaining (metadata) files and writes the manifest into
the tmp directory (:func:`write_manifest`, ``in_commit``). A step directory under its final name
therefore always has its manifest, and a kill anywhere before the rename leaves only Orbax's tmp
directory, which nobody loads. Orbax's own commit marks (:data:`COMMIT_FILES`), written after the
manifest, are not hashed.

:func:`verify_step` re-hashes a step and reports the first file that is missing, truncated,
changed or unexpected; with an :class:`Exchange` every process of a job hashes its share of the
files (:func:`_share`) and they exchange verdicts. A step without a manifest is ``unverified``
when its ``meta`` says it was written before manifests existed (``format`` <
:data:`MANIFEST_SINCE_FORMAT`), else ``corrupt`` (format 2 wrote the manifest after the commit, so
a kill there left a step nobody can vouch for; since format 3 only a hand can remove it).

**The save lock.** ``DIR/.lock`` names the job writing ``DIR`` (host, pid, job id, start time)
and is held with ``fcntl.flock`` for the job's life: a second job saving into the same directory
is refused at start-up naming the holder. The kernel drops a flock when its holder dies, so a
lock file left by a crashed job is taken over (with a warning naming it). Where the file system
has no flock (some Lustre mounts), the file's contents decide: a live or unknowable holder
(another host) refuses, a dead pid on this host is taken over.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import itertools
import json
import os
import re
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from mlir_train.runtime import log
from mlir_train.runtime.errors import SaveLockError, json_object_problem

MANIFEST = "checksums.json"
MANIFEST_SINCE_FORMAT = 2  # checkpoint.FORMAT_VERSION from which every step carries a manifest
MANIFEST_IN_COMMIT_SINCE_FORMAT = 3  # ... written inside Orbax's tmp directory, before its rename
# Orbax's commit writes (commit_success.txt) and rewrites (_CHECKPOINT_METADATA's commit time)
# these after the manifest, just before its rename: not hashed in a format-3 manifest, and not
# "unexpected" on disk. (Format-2 manifests, hashed after the rename, list them and check them.)
COMMIT_FILES = ("commit_success.txt", "_CHECKPOINT_METADATA")
LOCK_NAME = ".lock"
_CHUNK = 8 << 20
# Orbax writes each process's array shards under a directory of its own (``ocdbt.process_<i>``,
# ``array_metadatas/process_<i>``): whichever path component names a process says who wrote it.
_PROCESS_PART = re.compile(r"(?:^|\.)process_(\d+)$")
_EXCHANGE_TIMEOUT_S = 3600  # hashing a host's share of a 30B state takes well under this


def _hash_file(path: str) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):  # hashlib releases the GIL on large buffers: threads scale
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel != MANIFEST and not rel.startswith(MANIFEST + ".tmp"):
                out.append(rel)
    return sorted(out)


def _hash_all(step_dir: str, rels: list[str]) -> dict[str, str]:
    workers = max(1, min(8, os.cpu_count() or 1, len(rels)))
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(rels, pool.map(lambda r: _hash_file(os.path.join(step_dir, r)), rels)))


def writer_of(rel: str) -> int | None:
    """The process whose own shard directory holds ``rel`` (None: a file of the whole step, which
    the primary process writes)."""
    for part in rel.split(os.sep):
        if m := _PROCESS_PART.search(part):
            return int(m.group(1))
    return None


def hash_files(step_dir: str, rels: list[str], *, process: int = 0) -> dict[str, dict]:
    """Manifest entries (size, BLAKE2b-256, the ``process`` that hashed it) for ``rels``."""
    digests = _hash_all(step_dir, rels)
    return {r: {"size": os.path.getsize(os.path.join(step_dir, r)), "blake2b": digests[r], "process": process}
            for r in rels}


def hash_own_files(directory: str, process: int) -> dict[str, dict]:
    """Hash the files ``process`` wrote under ``directory`` (its own shard directories): each
    process's share of a save, hashed where it was written, right after its write."""
    return hash_files(directory, [r for r in _files(directory) if writer_of(r) == process], process=process)


def write_manifest(step_dir: str, hashed: dict[str, dict] | None = None, *, in_commit: bool = False) -> dict:
    """Write ``checksums.json`` atomically (tmp, fsync, rename): ``hashed`` (other processes'
    entries, by file name) plus every other file under ``step_dir``, hashed here. ``in_commit``:
    ``step_dir`` is Orbax's tmp directory, whose :data:`COMMIT_FILES` come after. Returns it."""
    rels = [r for r in _files(step_dir) if not (in_commit and r in COMMIT_FILES)]
    present = set(rels)
    # What the processes hashed stands where the file is still there at that size (a writer's
    # transient file, e.g. a lock, may be gone; a size that moved is hashed again here).
    hashed = {r: e for r, e in (hashed or {}).items()
              if r in present and os.path.getsize(os.path.join(step_dir, r)) == e["size"]}
    hashed.update(hash_files(step_dir, [r for r in rels if r not in hashed]))
    manifest = {"algorithm": "blake2b-256", "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "files": {r: hashed[r] for r in sorted(hashed)}}
    tmp = os.path.join(step_dir, f"{MANIFEST}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))
    return manifest


# ----- small JSON values between the job's processes ---------------------------------------------
_KEY_SEQ = itertools.count()


class Exchange:
    """Small JSON values passed between a job's processes through the JAX coordination service's
    key-value store (never array data): one process's value goes to all (:meth:`all_gather`) or
    to process 0 (:meth:`publish` / :meth:`collect`). With one process, a dict in memory.

    Keys come from :meth:`new_key`, which every process must call in the same order (the main
    thread of an SPMD program does), so that the n-th key is the same on every process."""

    def __init__(self, index: int = 0, count: int = 1, client=None):
        self.index, self.count, self._client, self._local = index, count, client, {}

    @classmethod
    def of_processes(cls) -> "Exchange":
        import jax

        if jax.process_count() == 1:
            return cls()
        from jax._src import distributed  # the client jax.distributed.initialize started

        return cls(jax.process_index(), jax.process_count(), distributed.global_state.client)

    def new_key(self, what: str) -> str:
        return f"mlir_train/{what}/{next(_KEY_SEQ)}" if self.count > 1 else what

    def publish(self, key: str, value) -> None:
        if self._client is None:
            self._local[f"{key}/{self.index}"] = value
        else:
            self._client.key_value_set(f"{key}/{self.index}", json.dumps(value))

    def collect(self, key: str, *, delete: bool = False) -> list:
        """Every process's published value under ``key``, in process order (blocks until all are there)."""
        if self._client is None:
            return [self._local.pop(f"{key}/0") if delete else self._local[f"{key}/0"]]
        out = [json.loads(self._client.blocking_key_value_get(f"{key}/{i}", _EXCHANGE_TIMEOUT_S * 1000))
               for i in range(self.count)]
        if delete:
            for i in range(self.count):
                self._client.key_value_delete(f"{key}/{i}")
        return out

    def all_gather(self, key: str, value) -> list:
        self.publish(key, value)
        return self.collect(key)


def _share(files: dict[str, dict], index: int, count: int) -> list[str]:
    """This process's part of the hashing: largest files first, each to the least loaded
    process (the same split on every process: it depends on the manifest alone)."""
    load, mine = [0] * count, []
    for rel in sorted(files, key=lambda r: (-int(files[r].get("size", 0)), r)):
        p = min(range(count), key=lambda i: (load[i], i))
        load[p] += int(files[rel].get("size", 0)) or 1
        if p == index:
            mine.append(rel)
    return mine


@dataclasses.dataclass(frozen=True)
class StepCheck:
    """The verdict on one step directory: ``status`` "ok", "unverified" (older format, no
    manifest) or "corrupt", with the offending ``file`` (relative to the step) and ``problem``."""

    step_dir: str
    status: str
    problem: str = ""
    file: str | None = None

    @property
    def usable(self) -> bool:
        return self.status != "corrupt"

    def describe(self) -> str:
        if self.status == "ok":
            return f"{self.step_dir}: OK"
        if self.status == "unverified":
            return f"{self.step_dir}: UNVERIFIED ({self.problem})"
        where = os.path.join(self.step_dir, self.file) if self.file else self.step_dir
        return f"{self.step_dir}: CORRUPT: {where}: {self.problem}"


def verify_step(step_dir: str, exchange: Exchange | None = None) -> StepCheck:
    """Check ``step_dir`` against its manifest: sizes first (cheap: a truncated or missing file
    needs no hashing), then every digest. With ``exchange`` (every process of the job calls
    this together) each process hashes its :func:`_share` of the files and the verdicts are
    exchanged, so all return the same one: the problem a single process would report first."""
    exchange = exchange or Exchange()
    rank, check = _check_share(step_dir, exchange.index, exchange.count)
    if exchange.count == 1:
        return check
    verdicts = exchange.all_gather(exchange.new_key("verify"), [rank, dataclasses.asdict(check)])
    return StepCheck(**min(verdicts, key=lambda v: (v[0], v[1]["file"] or ""))[1])


def _check_share(step_dir: str, index: int, count: int) -> tuple[int, StepCheck]:
    """(how early a single process would have found it, the verdict) for this process's share."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.exists(path):
        return 0, _without_manifest(step_dir)
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return 0, StepCheck(step_dir, "corrupt", f"unreadable checksum manifest ({type(e).__name__}: {e})", MANIFEST)
    on_disk = set(_files(step_dir))
    for rel in sorted(files):
        if rel not in on_disk:
            return 1, StepCheck(step_dir, "corrupt", "missing (listed in checksums.json)", rel)
        size = os.path.getsize(os.path.join(step_dir, rel))
        if size != files[rel]["size"]:
            return 1, StepCheck(step_dir, "corrupt", f"{size} bytes where {files[rel]['size']} were written "
                                f"({'truncated' if size < files[rel]['size'] else 'grown'})", rel)
    extra = sorted(on_disk - set(files) - set(COMMIT_FILES))
    if (why := commit_metadata_problem(step_dir)) is not None:  # written after the manifest: not hashed
        return 2, StepCheck(step_dir, "corrupt", why, COMMIT_FILES[1])
    if extra:
        return 2, StepCheck(step_dir, "corrupt", "not written by the save (absent from checksums.json)"
                            + (f"; and {len(extra) - 1} more" if len(extra) > 1 else ""), extra[0])
    mine = _share(files, index, count)
    digests = _hash_all(step_dir, mine)
    for rel in mine:
        if digests[rel] != files[rel]["blake2b"]:
            return 3, StepCheck(step_dir, "corrupt", "checksum mismatch (its bytes changed since the save)", rel)
    return 4, StepCheck(step_dir, "ok")


def commit_metadata_problem(step_dir: str) -> str | None:
    """Why Orbax's ``_CHECKPOINT_METADATA`` (written after the checksums) is unreadable, or None
    (absent, or a JSON object). Orbax itself logs a parse error and goes on; we stop. Its other
    commit mark, ``commit_success.txt``, commits by being there: its bytes are never read."""
    path = os.path.join(step_dir, COMMIT_FILES[1])
    why = json_object_problem(path) if os.path.exists(path) else None
    return None if why is None else f"{why}; the file is damaged"


def _without_manifest(step_dir: str) -> StepCheck:
    meta = os.path.join(step_dir, "meta", "metadata")
    try:
        with open(meta) as f:
            fmt = int(json.load(f).get("format", 1))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        return StepCheck(step_dir, "corrupt", f"no {MANIFEST} and unreadable meta ({type(e).__name__})",
                         os.path.join("meta", "metadata"))
    if fmt >= MANIFEST_IN_COMMIT_SINCE_FORMAT:  # the manifest is committed with the step: only a hand removed it
        return StepCheck(step_dir, "corrupt", f"missing: this checkpoint format (version {fmt}) commits its checksums "
                         "with the step, so the file was removed after the save", MANIFEST)
    if fmt >= MANIFEST_SINCE_FORMAT:
        return StepCheck(step_dir, "corrupt", f"missing: this checkpoint format (version {fmt}) records checksums, "
                         "so the save did not finish (killed while hashing?) or the file was removed", MANIFEST)
    return StepCheck(step_dir, "unverified", f"written before checkpoints carried checksums (format {fmt}); "
                     "it cannot be verified")


# ----- one writer per --save directory --------------------------------------------------------
def _job_id() -> str:
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID"):
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return f"local-{uuid.uuid4().hex[:12]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True




class SaveLock:
    """``DIR/.lock`` held (flock) by the one job saving into ``DIR``; :meth:`release` (or the
    process's death) frees it."""

    def __init__(self, directory: str, fd: int, info: dict):
        self.directory, self.path, self._fd, self.info = directory, os.path.join(directory, LOCK_NAME), fd, info

    @classmethod
    def acquire(cls, directory: str, *, job_id: str | None = None) -> "SaveLock":
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LOCK_NAME)
        info = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id or _job_id(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        for _ in range(10):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                has_flock = cls._flock(fd, path, directory)
                # The holder may have released (unlinked) the file between our open and flock:
                # then we hold a lock on a name nobody sees. Retry on the current file.
                if os.fstat(fd).st_ino != os.stat(path).st_ino:
                    os.close(fd)
                    continue
            except FileNotFoundError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            previous = _read_info(fd)
            if previous and not has_flock and not _stale_without_flock(previous):
                os.close(fd)
                raise SaveLockError(_refusal(directory, previous, "its lock file names a job that may still run "
                                             "(this file system has no flock to tell)"))
            if previous and previous.get("pid") != info["pid"]:
                log.warning(f"--save {directory}: taking over the lock left by job {previous.get('job')} "
                      f"(host {previous.get('host')}, pid {previous.get('pid')}, since {previous.get('started')}), "
                      "which no longer holds it (it ended without releasing it)")
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            os.fsync(fd)
            return cls(directory, fd, info)
        raise SaveLockError(f"--save {directory}: could not take {path} (it keeps being replaced)")

    @staticmethod
    def _flock(fd: int, path: str, directory: str) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            holder = _read_info(fd)
            if holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
                # This very process holds it through a lock an earlier run in it never released
                # (it stopped with an error before its cleanup): that run is over, take it again.
                return True
            raise SaveLockError(_refusal(directory, holder, "it holds the lock")) from None
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False  # no flock on this file system: the file's contents decide
            raise

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if _read_info(self._fd).get("pid") == self.info["pid"]:
                os.unlink(self.path)  # while still holding the flock: nobody can take it half-released
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None


def _read_info(fd: int) -> dict:
    try:
        raw = os.pread(fd, 1 << 16, 0)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {"job": "unknown (unreadable lock file)"}


def _stale_without_flock(previous: dict) -> bool:
    return previous.get("host") == socket.gethostname() and not _pid_alive(int(previous.get("pid", -1)))


def _refusal(directory: str, holder: dict, why: str) -> str:
    who = (f"job {holder.get('job')} on host {holder.get('host')}, pid {holder.get('pid')}, since "
           f"{holder.get('started')}") if holder else "another process"
    return (f"--save {directory} is in use by {who}: {why}. Two jobs saving into one directory would overwrite "
            f"each other's checkpoints. Give this job its own --save directory, or stop that job first (if it is "
            f"certainly gone, delete {os.path.join(directory, LOCK_NAME)})")


# ----- step directories on disk, and python -m mlir_train.checkpoint verify DIR ... ---------------------
COMMIT_MARKERS = COMMIT_FILES  # Orbax's marks of a finished write


def is_step_name(name: str) -> bool:
    return name.isdigit()


def is_complete(step_dir: str) -> bool:
    return (any(os.path.exists(os.path.join(step_dir, m)) for m in COMMIT_MARKERS)
            and os.path.exists(os.path.join(step_dir, "meta", "metadata")))


def complete_steps(directory: str) -> list[int]:
    """The complete steps in ``directory``, oldest first, from the files alone: code that runs on
    process 0 only must not build an Orbax manager (its constructor synchronises the processes)."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(n) for n in names if is_step_name(n) and is_complete(os.path.join(directory, n)))


def verify_main(argv: list[str] | None = None) -> int:
    """Print each step of each directory OK / UNVERIFIED / CORRUPT (naming the file); exit 1 if
    any is corrupt, 2 if a directory holds no checkpoint of ours."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mlir_train.checkpoint",
                                     description="Check mlir-train checkpoints against their checksums.")
    parser.add_argument("command", choices=["verify"])
    parser.add_argument("directories", nargs="+", metavar="DIR", help="a --save directory, or one DIR/<step>")
    args = parser.parse_args(argv)
    status = 0
    for d in args.directories:
        parent, base = os.path.split(os.path.normpath(d))
        if is_step_name(base) and is_complete(d):
            checks = [verify_step(os.path.normpath(d))]
        else:  # files only: no JAX backend (or GPU plugin) starts for this
            steps = complete_steps(d)
            if not steps:
                log.error(f"{d}: no complete checkpoint in it")
                status = max(status, 2)
            checks = [verify_step(os.path.join(os.path.normpath(d), str(s))) for s in steps]
        for check in checks:
            print(check.describe())
            if not check.usable:
                status = max(status, 1)
    return status
