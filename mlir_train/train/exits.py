"""When the training loop stops early, as Megatron's restartable jobs do: SIGTERM/SIGINT,
``--exit-interval`` and ``--exit-duration-in-mins``. The loop then saves (with ``--save``) and
exits 0, so one script both starts and resumes a job."""

from __future__ import annotations

import signal
import time

import numpy as np

from mlir_train.runtime import log


class StopOnSignal:
    """SIGTERM/SIGINT set ``requested`` (the loop finishes its step, saves and exits 0); a second
    signal gets the default behaviour, so a stuck job can still be interrupted."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}
        try:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: no handlers, never requested
            self._previous = {}

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        log.info(f"{self.requested} received; finishing this iteration, then saving and exiting")
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous = {}


class ExitConditions:
    """Why the loop stops after an iteration, or None. With several processes they agree first
    (any one's signal or clock stops all), as Megatron's all-reduce of its exit flags: a process
    saving alone would wait forever in the checkpoint's collectives."""

    def __init__(self, *, exit_interval: int | None, exit_duration_in_mins: float | None, launched: float):
        self.exit_interval, self.exit_duration_in_mins, self.launched = exit_interval, exit_duration_in_mins, launched
        self.signals = StopOnSignal()

    def reason(self, iteration: int) -> str | None:
        import jax

        interval = bool(self.exit_interval) and iteration % self.exit_interval == 0
        minutes = (time.perf_counter() - self.launched) / 60
        late = self.exit_duration_in_mins is not None and minutes >= self.exit_duration_in_mins
        signalled = self.signals.requested
        if jax.process_count() > 1:  # a host round trip per iteration, only for multi-process jobs
            from jax.experimental import multihost_utils

            flags = np.asarray(multihost_utils.process_allgather(np.array([bool(signalled), late], np.int32)))
            flags = flags.reshape(-1, 2).max(axis=0)
            signalled = signalled or ("a signal on another process" if flags[0] else None)
            late = bool(flags[1])
        if signalled:
            return signalled
        if interval:
            return f"--exit-interval {self.exit_interval}"
        if late:
            return f"--exit-duration-in-mins {self.exit_duration_in_mins:g} ({minutes:.1f} min since start)"
        return None

    def close(self) -> None:
        self.signals.restore()
