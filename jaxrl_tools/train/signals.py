"""Stopping a run cleanly: SIGINT (Ctrl-C) and SIGTERM (preemptible hosts) ask the RL loop to
finish its step, save a checkpoint and exit; a second Ctrl-C interrupts at once."""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)


class RunInterrupted(Exception):
    """The run stopped on a signal after saving the checkpoint of `step`."""

    def __init__(self, step: int, signum: int, checkpoint_dir: str):
        self.step, self.signum, self.checkpoint_dir = step, signum, checkpoint_dir
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} after step {step}; its checkpoint is in {checkpoint_dir}. "
            "Run the same command with --resume (trainer.resume=true) to continue"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: the job is not done


class StopOnSignal:
    """While active, SIGINT / SIGTERM set `signum` instead of killing the process.

    Outside the main thread (signal handlers cannot be installed there) it does nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now
        self.signum = signum
        log.warning(
            "%s: finishing this step, then saving a checkpoint (Ctrl-C again to stop now)",
            signal.Signals(signum).name,
        )

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
