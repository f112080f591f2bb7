"""Kills during saves (issue 27, item 2): a step is complete exactly when its manifest is.

A worker process resumes from ``--save DIR`` the way ``mlir_train.sft`` does (``sources.detect``:
the newest step that verifies; the ``Checkpointer``: the lock, taken over from a killed holder,
retention) and saves one step per "iteration" of a known state (``state_at(k)``), until it is
killed with SIGKILL: at random moments, or deterministically at the boundaries of Orbax's commit
(``MLIR_TRAIN_CKPT_KILL``: before the manifest, after it but before Orbax's rename, after the
commit). After every kill the next worker must resume from the newest complete step on disk
(never fall back past a step marked corrupt by the kill, never start from scratch while a
step exists), restore exactly ``state_at(step)`` (finite), and carry on.
"""

import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from mlir_train.checkpoint import integrity
from mlir_train.checkpoint import orbax as checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = r"""
import sys
import numpy as np
import jax
from mlir_train.checkpoint import orbax as checkpoint, saver, sources

ck, last = sys.argv[1], int(sys.argv[2])

def state_at(k):
    w = np.arange(128 * 128, dtype=np.float32).reshape(128, 128) / 7 + k
    return {"params": {"w": jax.numpy.asarray(w), "b": jax.numpy.full((64,), k, np.float32)},
            "opt_state": ({"mu": jax.numpy.asarray(w / 3)}, jax.numpy.asarray(k, np.int32)), "loss_scale": None}

source = sources.detect(ck)
start = source.step if source.kind == "ours" else 0
if source.kind == "ours":
    like = state_at(0)
    target = {name: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like[name])
              for name in ("params", "opt_state")}
    got = checkpoint.CheckpointManager(ck, read_only=True).restore(target, step=start, verify=False)
    want = state_at(start)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves({k: want[k] for k in target})):
        a = np.asarray(a)
        assert np.isfinite(a).all(), "non-finite values restored"
        np.testing.assert_array_equal(a, np.asarray(b))
print("RESUMED", source.kind, start, flush=True)
ckpt = saver.Checkpointer(ck, save_interval=1, retain=3, meta=lambda it: {"model": {}},
                          resume_step=start if source.kind == "ours" else None)
for it in range(start + 1, last + 1):
    ckpt.save(it, state_at(it))
    print("SAVING", it, flush=True)
ckpt.close()
print("DONE", flush=True)
"""


def _worker(ck: str, last: int, kill_at: str | None = None, *, kill_after: float | None = None) -> tuple[int, str, str]:
    """Run a worker to its end, or SIGKILL it ``kill_after`` seconds after it resumed; (status, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLIR_TRAIN_CKPT_KILL",)}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    if kill_at:
        env["MLIR_TRAIN_CKPT_KILL"] = kill_at
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: nothing blocks while we read stdout
        proc = subprocess.Popen([sys.executable, "-c", WORKER, ck, str(last)], env=env, stdout=subprocess.PIPE,
                                stderr=err, text=True)
        out = ""
        if kill_after is not None:
            while (line := proc.stdout.readline()) and not line.startswith("RESUMED"):
                out += line
            out += line
            time.sleep(kill_after)
            proc.send_signal(signal.SIGKILL)
        out += proc.stdout.read()
        proc.wait(timeout=120)
        err.seek(0)
        return proc.returncode, out, err.read()


def _newest_complete(ck: str) -> int | None:
    steps = integrity.complete_steps(ck)
    return steps[-1] if steps else None


def _resumed(out: str) -> tuple[str, int]:
    line = next(line for line in out.splitlines() if line.startswith("RESUMED"))
    _, kind, step = line.split()
    return kind, int(step)


def _check_after_kill(ck: str) -> int | None:
    """The newest complete step verifies (a kill never leaves a complete step without its
    manifest); returns it."""
    newest = _newest_complete(ck)
    if newest is not None:
        check = integrity.verify_step(os.path.join(ck, str(newest)))
        assert check.status == "ok", check.describe()
    return newest


def _expect_resume(proc_out: str, proc_err: str, newest: int | None) -> int:
    kind, step = _resumed(proc_out)
    assert "CORRUPT" not in proc_out and "falling back" not in proc_out, proc_out
    if newest is None:
        assert kind == "scratch" and step == 0, proc_out
    else:
        assert (kind, step) == ("ours", newest), (proc_out, proc_err[-2000:])
    return step


def _run_kills(ck: str, kills: list[tuple[str, float | str]]) -> list[int]:
    """Each kill: ("point", name) kills at that commit boundary on the first save; ("random",
    seconds) SIGKILLs that long after the worker resumed (the workers save on and on until
    killed). A last run then resumes and saves two more steps. Returns the step each run resumed at."""
    resumed = []
    for how, arg in kills:
        newest = _check_after_kill(ck)
        status, out, err = _worker(ck, 10**9, kill_at=arg if how == "point" else None,
                                   kill_after=float(arg) if how == "random" else None)
        assert status == -signal.SIGKILL and "DONE" not in out, (status, out, err[-3000:])
        resumed.append(_expect_resume(out, err, newest))
    newest = _check_after_kill(ck)
    last = (newest or 0) + 2
    status, out, err = _worker(ck, last)
    assert status == 0 and "DONE" in out, err[-3000:]
    resumed.append(_expect_resume(out, err, newest))
    assert _newest_complete(ck) == last and integrity.verify_step(os.path.join(ck, str(last))).status == "ok"
    return resumed


def test_kills_at_the_commit_boundary_never_cost_a_step(tmp_path):
    """Deterministic kills (fast): before the manifest and between it and Orbax's rename the step
    is not there (the tmp directory is ignored; the previous step is the newest, and verifies);
    after the commit the step is complete with its manifest and is the one resumed."""
    ck = str(tmp_path / "ck")
    resumed = _run_kills(ck, [("point", "after_commit"), ("point", "before_manifest"),
                              ("point", "after_manifest"), ("point", "after_commit")])
    # 1 saved and killed after its commit; the next two runs die inside step 2's commit; the
    # fourth commits step 2 and dies; the last resumes at 2 and saves 3 and 4.
    assert resumed == [0, 1, 1, 1, 2], resumed
    assert checkpoint.CheckpointManager(ck, read_only=True).steps() == [2, 3, 4]


def _random_kills(tmp_path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    kills = []
    for i in range(n):
        if i % 5 == 4:
            kills.append(("point", checkpoint.KILL_POINTS[(i // 5) % len(checkpoint.KILL_POINTS)]))
        else:
            kills.append(("random", rng.uniform(0.0, 2.5)))
    resumed = _run_kills(str(tmp_path / "ck"), kills)
    assert resumed == sorted(resumed)  # never back to an older step, nor to scratch after a save


@pytest.mark.slow  # 2026-12-08, CI time: the commit-boundary kills above run by default
def test_a_few_random_kills(tmp_path):
    _random_kills(tmp_path, 3, seed=1)


@pytest.mark.slow  # ~1 min on 2 cores: 24 killed runs, each a fresh JAX process
def test_random_kills_across_many_saves(tmp_path):
    _random_kills(tmp_path, 24, seed=27)
