"""Checkpoints that cannot rot silently (issue 15, item 5): checksums verified on load with a
fallback only for ``--load DIR``, one job per ``--save`` directory, weights-only saves.

The manager-level tests write tiny array trees (no model); the end-to-end ones drive
``mlir_train.sft.main`` with the same tiny settings as tests/checkpoint/test_checkpoint.py, so they share
its compiled step through the persistent compilation cache.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from mlir_train import sft
from mlir_train.checkpoint import orbax as checkpoint
from mlir_train.checkpoint import integrity, saver, sources
from tests.helpers import tiny_argv


def tiny_state(scale: float):
    return {"params": {"w": jax.numpy.full((64, 64), scale, np.float32), "b": jax.numpy.arange(8.0) * scale},
            "opt_state": ({"mu": jax.numpy.full((64, 64), scale / 2)}, jax.numpy.asarray(3, np.int32)),
            "loss_scale": None, "iteration": jax.numpy.asarray(0, np.int32)}


def target_of(state):
    return {k: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state[k])
            for k in ("params", "opt_state")}


@pytest.fixture
def two_steps(tmp_path):
    """Steps 1 and 2 of a tiny tree, each with its checksums."""
    ck = str(tmp_path / "ck")
    mgr = checkpoint.CheckpointManager(ck)
    for step in (1, 2):
        assert mgr.save(step, tiny_state(float(step)), {"model": {}}, force=True)
    mgr.close()
    return ck


def data_file(step_dir: str) -> str:
    """The largest OCDBT data file of the params item (the one holding the array bytes)."""
    files = [os.path.join(r, n) for r, _, ns in os.walk(os.path.join(step_dir, "params")) for n in ns
             if os.path.basename(r) == "d"]
    return max(files, key=os.path.getsize)


def flip_bit(path: str, offset: int | None = None) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = len(data) // 2 if offset is None else offset
        data[i] ^= 0x10
        f.seek(0)
        f.write(data)


def test_every_file_is_recorded_and_verifies(two_steps):
    for step in (1, 2):
        step_dir = os.path.join(two_steps, str(step))
        with open(os.path.join(step_dir, integrity.MANIFEST)) as f:
            files = json.load(f)["files"]
        on_disk = {os.path.relpath(os.path.join(r, n), step_dir) for r, _, ns in os.walk(step_dir) for n in ns}
        # Every file but Orbax's own commit marks, written after the manifest, inside the commit.
        assert set(files) == on_disk - {integrity.MANIFEST, *integrity.COMMIT_FILES}
        assert set(integrity.COMMIT_FILES) <= on_disk
        assert any("ocdbt" in f for f in files) and "meta/metadata" in files
        assert all(v["size"] == os.path.getsize(os.path.join(step_dir, k)) for k, v in files.items())
        # the array shards were hashed by the process that wrote them, in its commit
        assert {v["process"] for k, v in files.items() if integrity.writer_of(k) is not None} == {0}
        assert integrity.verify_step(step_dir).status == "ok"
        with open(os.path.join(step_dir, "meta", "metadata")) as f:
            assert json.load(f)["format"] == checkpoint.FORMAT_VERSION == integrity.MANIFEST_IN_COMMIT_SINCE_FORMAT


def test_bit_flip_stops_naming_the_file_and_the_good_step(two_steps, capsys):
    bad = data_file(os.path.join(two_steps, "2"))
    rel = os.path.relpath(bad, os.path.join(two_steps, "2"))
    flip_bit(bad)
    check = integrity.verify_step(os.path.join(two_steps, "2"))
    assert check.status == "corrupt" and check.file == rel and "checksum mismatch" in check.problem

    reader = checkpoint.CheckpointManager(two_steps, read_only=True)
    state = tiny_state(0.0)
    with pytest.raises(checkpoint.CheckpointError) as err:
        reader.restore(target_of(state), step=2)
    msg = str(err.value)
    assert f"checkpoint {two_steps}/2 is corrupt: {bad}: checksum mismatch" in msg, msg
    assert f"newest checkpoint in {two_steps} that verifies is iteration 1" in msg and "--ckpt-step 1" in msg

    # An explicit step (--ckpt-step 2, or --load DIR/2) stops; --load DIR falls back, saying so.
    for load, step in ((two_steps, 2), (os.path.join(two_steps, "2"), None)):
        with pytest.raises(checkpoint.CheckpointError, match=f"{bad}: checksum mismatch.*verifies is iteration 1"):
            sources.detect(load, step=step)
    start = sources.detect(two_steps)
    out = capsys.readouterr().out
    assert start.kind == "ours" and start.step == 1 and start.iteration == 1
    assert f"WARNING: {two_steps}/2: CORRUPT: {bad}: checksum mismatch" in out, out
    assert f"falling back to the newest checkpoint that verifies, {two_steps}/1 (iteration 1)" in out
    restored = reader.restore(target_of(state), step=1)
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.full((64, 64), 1.0, np.float32))

    # python -m mlir_train.checkpoint verify DIR
    assert integrity.verify_main(["verify", two_steps]) == 1
    out = capsys.readouterr().out
    assert f"{two_steps}/1: OK" in out and f"{two_steps}/2: CORRUPT: {bad}" in out

    # Both corrupt: an error listing both, never a fresh start.
    flip_bit(data_file(os.path.join(two_steps, "1")))
    with pytest.raises(checkpoint.CheckpointError, match=f"no checkpoint there verifies: {two_steps}/2: CORRUPT.*"
                       f"{two_steps}/1: CORRUPT"):
        sources.detect(two_steps)


def test_truncated_missing_extra_and_manifest_problems(two_steps):
    step_dir = os.path.join(two_steps, "2")
    bad = data_file(step_dir)
    rel = os.path.relpath(bad, step_dir)
    size = os.path.getsize(bad)
    os.truncate(bad, size - 7)
    check = integrity.verify_step(step_dir)
    assert (check.status, check.file) == ("corrupt", rel) and f"{size - 7} bytes where {size}" in check.problem
    assert "truncated" in check.problem
    os.remove(bad)
    check = integrity.verify_step(step_dir)
    assert (check.status, check.file) == ("corrupt", rel) and "missing" in check.problem

    step_dir = os.path.join(two_steps, "1")
    stray = os.path.join(step_dir, "params", "d", "stray")
    with open(stray, "wb") as f:
        f.write(b"x")
    check = integrity.verify_step(step_dir)
    assert (check.status, check.file) == ("corrupt", os.path.join("params", "d", "stray"))
    os.remove(stray)
    assert integrity.verify_step(step_dir).status == "ok"
    # A new-format step whose manifest is gone (killed while hashing, or removed): failing.
    os.remove(os.path.join(step_dir, integrity.MANIFEST))
    check = integrity.verify_step(step_dir)
    assert (check.status, check.file) == ("corrupt", integrity.MANIFEST) and "commits its checksums" in check.problem
    with pytest.raises(checkpoint.CheckpointError, match=f"{step_dir}/checksums.json: missing.*no checkpoint in"):
        checkpoint.CheckpointManager(two_steps, read_only=True).check_step(1)


def test_old_format_without_manifest_loads_with_a_warning(two_steps, capsys):
    """What the trainer wrote before checksums (format 1, no checksums.json) still loads."""
    for step in (1, 2):
        step_dir = os.path.join(two_steps, str(step))
        os.remove(os.path.join(step_dir, integrity.MANIFEST))
        meta_path = os.path.join(step_dir, "meta", "metadata")
        with open(meta_path) as f:
            meta = json.load(f)
        with open(meta_path, "w") as f:
            json.dump({**meta, "format": 1}, f)
    start = sources.detect(two_steps)
    assert start.step == 2
    out = capsys.readouterr().out
    assert f"WARNING: checkpoint {two_steps}/2 written before checkpoints carried checksums (format 1); " \
           "it cannot be verified" in out and out.count("WARNING") == 1
    restored = checkpoint.CheckpointManager(two_steps, read_only=True).restore(target_of(tiny_state(0.0)), step=2)
    np.testing.assert_array_equal(np.asarray(restored["params"]["b"]), np.arange(8.0) * 2)
    assert integrity.verify_main(["verify", two_steps]) == 0
    assert f"{two_steps}/2: UNVERIFIED" in capsys.readouterr().out


# ----- one job per --save directory ---------------------------------------------------------------
HOLDER = textwrap.dedent("""
    import sys
    from mlir_train.checkpoint.integrity import SaveLock
    lock = SaveLock.acquire(sys.argv[1], job_id="job-A")
    print("held", flush=True)
    sys.stdin.read()
""")


def holder(directory: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, directory], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_saver_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys, monkeypatch):
    ck = str(tmp_path / "ck")
    proc = holder(ck)
    try:
        with pytest.raises(checkpoint.CheckpointError) as err:
            saver.Checkpointer(ck, save_interval=1, retain=None, meta=lambda it: {})
        msg = str(err.value)
        assert f"--save {os.path.abspath(ck)} is in use by job job-A on host {os.uname().nodename}, pid {proc.pid}" in msg
        assert "its own --save directory" in msg and os.path.join(ck, ".lock") in msg
        # Without flock (some Lustre mounts), the lock file's live pid still refuses.
        import fcntl

        def no_flock(fd, op):
            raise OSError(37, "No locks available")  # ENOLCK

        with monkeypatch.context() as m:
            m.setattr(fcntl, "flock", no_flock)
            with pytest.raises(integrity.SaveLockError, match=f"pid {proc.pid}.*no flock"):
                integrity.SaveLock.acquire(ck)
    finally:
        proc.kill()  # dies holding it: the file stays, the flock goes
        proc.wait()
    assert os.path.exists(os.path.join(ck, ".lock"))
    # A job killed before its first save leaves only the lock: still "no checkpoint yet" to --load.
    assert sources.detect(ck).kind == "scratch" and "no complete checkpoint there" in capsys.readouterr().out
    ckpt_saver = saver.Checkpointer(ck, save_interval=1, retain=None, meta=lambda it: {"model": {}})
    out = capsys.readouterr().out
    assert f"taking over the lock left by job job-A (host {os.uname().nodename}, pid {proc.pid}" in out, out
    with open(os.path.join(ck, ".lock")) as f:
        assert json.load(f)["pid"] == os.getpid()
    ckpt_saver.save(1, tiny_state(1.0))
    ckpt_saver.close()
    assert not os.path.exists(os.path.join(ck, ".lock"))  # released: the next job starts quietly
    assert checkpoint.CheckpointManager(ck, read_only=True).steps() == [1]


# ----- end to end through the CLI ---------------------------------------------------------------
@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return {"data": str(tmp_path_factory.mktemp("integrity_shared") / "data")}


def test_load_falls_back_past_a_flipped_bit_and_resumes_exactly(shared, tmp_path, capsys):
    """Steps 2 and 4 saved; one bit of step 4's array data flipped. ``--load DIR`` warns and resumes
    from 2: iterations 3, 4 train again with the straight run's losses (finite, bitwise equal); the
    corrupt step 4 is moved aside and rewritten. ``--ckpt-step 4`` stops naming the file."""
    ck = str(tmp_path / "ck")
    straight = sft.main(tiny_argv(shared, tmp_path, "straight", "--save", ck, "--save-interval", "2"))
    bad = data_file(os.path.join(ck, "4"))
    flip_bit(bad)
    capsys.readouterr()

    with pytest.raises(SystemExit) as exc:
        sft.main(tiny_argv(shared, tmp_path, "explicit", "--load", ck, "--ckpt-step", "4"))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"checkpoint {ck}/4 is corrupt: {bad}: checksum mismatch" in err and "verifies is iteration 2" in err, err

    resumed = sft.main(tiny_argv(shared, tmp_path, "resumed", "--load", ck, "--save", ck, "--save-interval", "2"))
    out = capsys.readouterr().out
    assert f"WARNING: {ck}/4: CORRUPT: {bad}" in out and f"{ck}/2 (iteration 2)" in out, out
    assert f"checkpoint {ck}/4 is corrupt; this run writes iteration 4 anew: moved it aside" in out
    assert resumed.history["lm loss"] == straight.history["lm loss"][2:]
    assert all(np.isfinite(loss) for _, loss in resumed.history["lm loss"])
    assert checkpoint.CheckpointManager(ck, read_only=True).steps() == [2, 4]
    assert integrity.verify_step(os.path.join(ck, "4")).status == "ok"
    assert any(n.startswith("4.corrupt-") for n in os.listdir(ck))
    assert integrity.verify_main(["verify", ck]) == 0

    # Our Megatron export carries checksums too: a flipped bit there is named on reading it. Writing
    # one needs torch (its pickles), absent from the newest-jax lane: the default lane runs this part.
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return
    from mlir_train import convert
    from mlir_train.checkpoint import megatron as mc

    mg = str(tmp_path / "megatron")
    assert convert.main([ck, mg, "--to", "megatron"]) == 0
    assert mc.find(mg).release
    rank_file = os.path.join(mg, "release", "mp_rank_00", "model_optim_rng.pt")
    flip_bit(rank_file, offset=os.path.getsize(rank_file) - 4096)
    with pytest.raises(checkpoint.CheckpointError, match=f"Megatron checkpoint .*{rank_file}: checksum mismatch"):
        sources.detect(mg)


def test_weights_only_checkpoints_resume_with_a_fresh_optimizer(shared, tmp_path, capsys):
    """--no-save-optim --no-save-rng, as Megatron: no optimizer state and no seed in the checkpoint;
    resuming needs --no-load-optim / --no-load-rng (an error naming them otherwise), then runs on
    from the saved iteration and data position with zero Adam moments. Iteration 3's loss is the
    forward of step 2's weights on batch 3, so resuming step 2 must reproduce it bitwise."""
    ck = str(tmp_path / "w")
    first = sft.main(tiny_argv(shared, tmp_path, "first", "--save", ck, "--save-interval", "2", "--train-iters", "3",
                               "--no-save-optim", "--no-save-rng"))
    reader = checkpoint.CheckpointManager(ck, read_only=True)
    assert reader.steps() == [2, 3]
    meta = reader.read_meta(2)
    assert meta["items"] == ["params"] and "rng" not in meta and "seed" not in meta["data_loader"]
    assert meta["data_loader"]["position"] == 16 and meta["consumed_samples"] == 16
    assert not os.path.exists(os.path.join(ck, "2", "opt_state"))

    state, _ = checkpoint.load_state(ck, first.trainer, step=3)
    assert int(state["iteration"]) == 3
    for a, b in zip(jax.tree.leaves(first.state["params"]), jax.tree.leaves(state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0]
    assert moments and all(not np.asarray(x).any() for x in moments)  # Adam's mu, nu: zero
    assert all(int(x) == 0 for x in jax.tree.leaves(state["opt_state"]) if x.ndim == 0)  # its step count
    assert any(np.asarray(x).any() for x in jax.tree.leaves(first.state["opt_state"]) if x.ndim > 0)

    capsys.readouterr()
    for extra, needed in (((), "--no-load-optim"), (("--no-load-optim",), "--no-load-rng")):
        with pytest.raises(SystemExit) as exc:
            sft.main(tiny_argv(shared, tmp_path, "refused", "--load", ck, "--ckpt-step", "2", "--train-iters", "3",
                               *extra))
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"add {needed} to resume at iteration 2" in err and "--finetune" in err, err
    resumed = sft.main(tiny_argv(shared, tmp_path, "resumed", "--load", ck, "--ckpt-step", "2", "--no-load-optim",
                                 "--no-load-rng", "--train-iters", "3"))
    out = capsys.readouterr().out
    assert "holds no optimizer state (--no-save-optim): resuming with a fresh optimizer" in out
    assert resumed.history["lm loss"] == first.history["lm loss"][2:]
    assert [i for i, _ in resumed.history["lm loss"]] == [3] and np.isfinite(resumed.history["lm loss"][0][1])


def test_resuming_an_older_step_into_the_same_directory_moves_newer_ones_aside(two_steps, capsys):
    """--load DIR --ckpt-step 1 --save DIR: this run writes iteration 2 anew, so the old step 2
    is set aside (renamed, never deleted) instead of silently blocking that save."""
    ckpt_saver = saver.Checkpointer(two_steps, save_interval=1, retain=None, meta=lambda it: {"model": {}},
                                    resume_step=1)
    assert f"checkpoint {two_steps}/2 is newer than the checkpoint this run resumes from" in capsys.readouterr().out
    assert checkpoint.CheckpointManager(two_steps, read_only=True).steps() == [1]
    ckpt_saver.save(2, tiny_state(5.0))
    ckpt_saver.close()
    reader = checkpoint.CheckpointManager(two_steps, read_only=True)
    assert reader.steps() == [1, 2] and reader.verify(2).status == "ok"
    restored = reader.restore(target_of(tiny_state(0.0)), step=2)
    np.testing.assert_array_equal(np.asarray(restored["params"]["b"]), np.arange(8.0) * 5)
    assert [n for n in os.listdir(two_steps) if n.startswith("2.superseded-")]


def test_a_second_sft_job_is_refused_at_start_up(shared, tmp_path, capsys):
    """Through the CLI: the refusal comes before any weights or data are loaded (exit status 2),
    and a run in the same process after one that died with an error can still take the directory."""
    ck = str(tmp_path / "busy")
    proc = holder(ck)
    try:
        with pytest.raises(SystemExit) as exc:
            sft.main(tiny_argv(shared, tmp_path, "second", "--save", ck))
        assert exc.value.code == 2
        captured = capsys.readouterr()
        assert f"is in use by job job-A on host {os.uname().nodename}, pid {proc.pid}" in captured.err
        assert "devices, mesh" not in captured.out  # before the mesh, the weights and the data
    finally:
        proc.kill()
        proc.wait()
    stale = integrity.SaveLock.acquire(ck)  # left unreleased, as by a run that raised
    again = integrity.SaveLock.acquire(ck)
    again.release()
    assert not os.path.exists(os.path.join(ck, ".lock")) and stale.info["pid"] == os.getpid()


# ----- two JAX processes agree (each verifies its share, process 0 locks; the others follow) ------
AGREE = textwrap.dedent("""
    import sys
    from mlir_train.runtime import distributed
    layout = distributed.initialize_from_env(cpu_devices=1)
    import jax
    from mlir_train.checkpoint import orbax as checkpoint, saver, sources
    corrupt_dir, held_dir = sys.argv[1:3]
    print("fallback", sources.detect(corrupt_dir).step, flush=True)
    for what, call in (("explicit", lambda: sources.detect(corrupt_dir, step=2)),
                       ("lock", lambda: saver.claim_save_dir(held_dir))):
        try:
            call()
            print(what, "taken")
        except checkpoint.CheckpointError as e:
            print(what, "refused:", e)
    distributed.shutdown(layout)
""")


def test_two_processes_follow_process_0_on_verification_and_the_lock(two_steps, tmp_path):
    import socket

    bad = data_file(os.path.join(two_steps, "2"))
    flip_bit(bad)
    held = str(tmp_path / "held")
    proc = holder(held)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "WORLD_SIZE", "RANK", "NNODES", "NODE_RANK")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd(), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2")
    try:
        procs = [subprocess.Popen([sys.executable, "-c", AGREE, two_steps, held], env={**env, "RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        proc.kill()
        proc.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err[-3000:]
        lines = out.splitlines()
        assert "fallback 1" in lines, out
        assert any(line.startswith("explicit refused:") for line in lines), out
        assert any(line.startswith("lock refused:") for line in lines), out
        # Each process hashed its share; the verdicts were exchanged, so both name the same file.
        assert f"explicit refused: --load {two_steps}: checkpoint {two_steps}/2 is corrupt: {bad}: checksum " \
               "mismatch" in out, out
    assert "CORRUPT" in outs[0][0] and "CORRUPT" not in outs[1][0]  # the warning: process 0 prints
    assert "lock refused: --save" in outs[0][0] and "is in use by job job-A" in outs[0][0]
    assert "could not take the directory (see its log)" in outs[1][0]


def test_an_unwritable_save_dir_is_named_by_its_flag(tmp_path, monkeypatch):
    """An OSError taking the lock (a read-only directory: root cannot make one here) names
    --save and the directory, not the .lock file inside it."""
    from mlir_train.checkpoint import saver
    from mlir_train.runtime.errors import CheckpointError

    def refuse(path):
        raise PermissionError(13, "Permission denied", os.path.join(path, ".lock"))

    monkeypatch.setattr(integrity.SaveLock, "acquire", staticmethod(refuse))
    with pytest.raises(CheckpointError) as e:
        saver.claim_save_dir(str(tmp_path / "ro"))
    assert str(e.value) == (f"--save {tmp_path / 'ro'}: cannot write there (Permission denied); give a directory "
                            "this job can write")
