"""The loop's checkpoint hook: saving every ``--save-interval`` and at the end, under the
``--save`` directory's lock, with the JSON a checkpoint needs to resume exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax

from mlir_train.checkpoint import integrity
from mlir_train.checkpoint.orbax import LAYER_STORAGE, CheckpointManager
from mlir_train.config.models import ModelConfig
from mlir_train.runtime import log
from mlir_train.runtime.errors import CheckpointError


def run_json(*, iteration: int, global_batch_size: int, loader, seed: int, model_cfg: ModelConfig,
             tokenizer_size: int, parallel, flags: dict[str, Any]) -> dict[str, Any]:
    """What besides arrays a checkpoint records to resume exactly and to explain itself
    (``flags``: the run's flags by Megatron dest name, ``RunConfig.flat()``)."""
    return {
        "consumed_samples": int(iteration) * int(global_batch_size),
        "global_batch_size": int(global_batch_size),
        "data_loader": {k: int(v) for k, v in loader.state().items()},
        "rng": {"seed": int(seed)},  # the only randomness: init and data order (no dropout)
        "model": model_cfg.as_dict(),
        "layer_storage": LAYER_STORAGE,
        "tokenizer_size": int(tokenizer_size),
        "parallel": dataclasses.asdict(parallel) if dataclasses.is_dataclass(parallel) else dict(parallel),
        "args": json.loads(json.dumps(flags, default=str)),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


class Checkpointer:
    """The loop's checkpoint hook: saves every ``--save-interval`` and when the loop stops, each
    with the run's JSON; ``before_save`` runs first (the pending metrics' NaN check must pass
    before a state is written).

    It holds ``DIR/.lock`` (process 0, for the whole job; a second job is refused here, at
    start-up). ``save_optim=False`` (``--no-save-optim``) writes no optimizer or loss-scaler
    state, ``save_rng=False`` (``--no-save-rng``) no seed (so no data order; the position in the
    data is kept, as Megatron keeps its consumed samples). ``resume_step``: where this job
    resumed when it saves into the directory it loaded from; newer steps there (e.g. the corrupt
    one it fell back from) are moved aside as ``<step>.corrupt-<time>`` /
    ``<step>.superseded-<time>``, since this run writes those iterations anew."""

    def __init__(self, directory: str, *, save_interval: int | None, retain: int | None, meta: Callable[[int], dict],
                 save_optim: bool = True, save_rng: bool = True, resume_step: int | None = None,
                 claimed: bool = False, lock: integrity.SaveLock | None = None):
        self.directory, self._meta = directory, meta
        self.save_optim, self.save_rng = save_optim, save_rng
        # ``claimed``: the entry point ran claim_save_dir first thing (``lock``: its result, None
        # on processes other than 0); else the directory is claimed here.
        self.lock = lock if claimed else claim_save_dir(directory, resume_step=resume_step)
        self.manager = CheckpointManager(directory, max_to_keep=retain, save_interval=save_interval)
        # Steps already in DIR (process 0's listing, for all): a save of this run at iteration k
        # replaces those >= k, as Megatron's save overwrites iter_k (see _replace_earlier).
        exchange = integrity.Exchange.of_processes()
        listed = integrity.complete_steps(self.manager.directory) if exchange.index == 0 else None
        self._earlier = set(exchange.all_gather(exchange.new_key("earlier-steps"), listed)[0])

    def should_save(self, iteration: int) -> bool:
        return self.manager.should_save(iteration)

    def save(self, iteration: int, state: dict[str, Any]) -> None:
        if not self.save_optim:
            state = {**state, "opt_state": None, "loss_scale": None}
        meta = self._meta(iteration)
        if not self.save_rng:
            meta = {k: v for k, v in meta.items() if k != "rng"}
            meta["data_loader"] = {k: v for k, v in meta.get("data_loader", {}).items() if k != "seed"}
        self._replace_earlier(iteration)
        self.manager.save(iteration, state, meta, force=True)

    def _replace_earlier(self, iteration: int) -> None:
        """Move aside the steps >= ``iteration`` that an earlier run left in DIR (e.g.
        ``--finetune`` restarting at iteration 0 with ``--save`` equal to ``--load``): Megatron
        overwrites ``iter_<k>`` and points its tracker at the newest save, so a later ``--load
        DIR`` resumes this run; here the old steps are renamed ``<step>.replaced-<time>``, never
        deleted, never silently kept in place of this run's save."""
        doomed = sorted(s for s in self._earlier if s >= iteration)
        if not doomed:
            return
        self.manager.wait()
        exchange = integrity.Exchange.of_processes()
        if exchange.index == 0:
            stamp = int(time.time())
            for step in doomed:
                path = os.path.join(self.manager.directory, str(step))
                aside = f"{path}.replaced-{stamp}"
                log.warning(f"--save {self.directory} holds iteration {step}, written before this run (with --finetune "
                            f"and --save equal to --load: the run it fine-tunes); this run saves iteration {iteration}, "
                            f"which replaces it as Megatron's save overwrites iter_{step}: moved it aside to {aside} "
                            f"(not deleted), so --load {self.directory} resumes this run")
                os.rename(path, aside)
        exchange.all_gather(exchange.new_key("replaced"), 0)  # every process sees the renames from here
        self._earlier -= set(doomed)
        self.manager.reload()

    def close(self) -> None:
        try:
            self.manager.close()  # waits for the background writes and their checksums
        finally:
            self.release()

    def release(self) -> None:
        """Finish a save still in flight (so it gets its checksums rather than counting as
        corrupt), then free ``DIR/.lock``. Idempotent; the entry point calls it however the run
        ends, so a failed write is only printed here (``close`` raises it)."""
        manager = getattr(self, "manager", None)
        if manager is not None:
            try:
                manager.wait()
            except CheckpointError as e:
                log.warning(f"{e}")
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def claim_save_dir(directory: str, *, resume_step: int | None = None) -> integrity.SaveLock | None:
    """Take ``DIR/.lock`` for this job (process 0; the others follow its verdict, so a refused
    multi-host job stops on every process) and, with ``resume_step``, move aside the steps newer
    than it (see :class:`Checkpointer`). Raises CheckpointError naming the holder."""
    from mlir_train.runtime import distributed

    lock, error = None, None
    if jax.process_index() == 0:
        try:
            lock = integrity.SaveLock.acquire(os.path.abspath(directory))
            if resume_step is not None:
                _set_aside_newer(os.path.abspath(directory), resume_step)
        except integrity.SaveLockError as e:
            error = e
        except OSError as e:  # named by the flag, not by the lock file inside
            error = f"--save {directory}: cannot write there ({e.strerror}); give a directory this job can write"
    if not distributed.from_process_0(error is None):
        if lock is not None:
            lock.release()
        raise CheckpointError(str(error) if error else f"--save {directory}: process 0 could not take the directory "
                              "(see its log)")
    return lock


def _set_aside_newer(directory: str, resume_step: int) -> None:
    if not os.path.isdir(directory):
        return
    for name in sorted((n for n in os.listdir(directory) if integrity.is_step_name(n)), key=int):
        path = os.path.join(directory, name)
        if int(name) <= resume_step or not integrity.is_complete(path):
            continue
        check = integrity.verify_step(path)
        aside = f"{path}.{'superseded' if check.usable else 'corrupt'}-{int(time.time())}"
        why = "is corrupt" if not check.usable else "is newer than the checkpoint this run resumes from"
        log.info(f"checkpoint {path} {why}; this run writes iteration {name} anew: moved it aside to {aside}")
        os.rename(path, aside)
