"""Wall-clock bounds on scoring, in any thread.

Python cannot stop a thread, and signal-based timeouts work only in the main thread, so:
- symbolic answer checks (math-verify, sympy: `\\boxed{9^{9^{9}}}` runs for ever) run in
  worker processes (`SymbolicChecker`), killed when a check passes its deadline;
- the calls of a reward term run on daemon threads (`run_bounded`); a call past its deadline
  is given up and scored as timed out, its thread left to end on its own.
Each timeout is noted (`note_timeout`, logged with what timed out) and counted by the caller
that asked (`counting_timeouts`): the trainer reports them as `reward/timeouts`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jaxrl_tools.rewards import symbolic_worker

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0


class TimedOut:
    """The value of a call given up at its deadline."""

    def __repr__(self) -> str:
        return "TIMED_OUT"


TIMED_OUT = TimedOut()

# ------------------------------------------------------------------------ deadlines, timeouts

_local = threading.local()


class Deadline:
    """A point in time (monotonic clock) work should end by."""

    def __init__(self, seconds: float):
        self.until = time.monotonic() + seconds
        self.paused = False

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Time spent inside does not count (a worker's start-up is not the check's time)."""
        t0, self.paused = time.monotonic(), True
        try:
            yield
        finally:
            self.until += time.monotonic() - t0
            self.paused = False


@contextlib.contextmanager
def deadline(seconds: float | Deadline) -> Iterator[Deadline]:
    """Work in this thread (symbolic checks) ends by `seconds` from now (or a `Deadline`)."""
    previous = getattr(_local, "deadline", None)
    current = seconds if isinstance(seconds, Deadline) else Deadline(seconds)
    _local.deadline = current
    try:
        yield current
    finally:
        _local.deadline = previous


def remaining() -> float:
    """Seconds left of this thread's deadline (DEFAULT_TIMEOUT_S outside `deadline`)."""
    current = getattr(_local, "deadline", None)
    return DEFAULT_TIMEOUT_S if current is None else max(0.0, current.until - time.monotonic())


@contextlib.contextmanager
def counting_timeouts() -> Iterator[list[str]]:
    """The timeouts noted in this thread meanwhile (a list of what timed out)."""
    previous = getattr(_local, "timeouts", None)
    _local.timeouts = found = []
    try:
        yield found
    finally:
        _local.timeouts = previous
        if previous is not None:
            previous.extend(found)


def note_timeout(what: str) -> None:
    """Logs a timeout and counts it for the thread's `counting_timeouts`."""
    log.warning("timed out: %s", what)
    found = getattr(_local, "timeouts", None)
    if found is not None:
        found.append(what)


# ------------------------------------------------------------------------ symbolic checks


class _Died(Exception):
    pass


class _Starting:
    """A worker's place in the count while it starts."""


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen(
            # -P: the script's folder (our package) stays off its path
            [sys.executable, "-P", symbolic_worker.__file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            ready = self._read(120.0)
        except _Died:
            ready = None
        if ready != "ready":
            self.kill()
            raise RuntimeError("the symbolic answer checker did not start (math-verify missing?)")

    def _read(self, timeout: float):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return TIMED_OUT
        frame = symbolic_worker.read_frame(self.proc.stdout)
        if frame is None:
            raise _Died(f"exit {self.proc.wait()}")
        return frame

    def check(self, pred: str, gold: str, timeout: float):
        try:
            symbolic_worker.write_frame(self.proc.stdin, (pred, gold, timeout))
        except BrokenPipeError:
            raise _Died(f"exit {self.proc.wait()}") from None
        return self._read(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class SymbolicChecker:
    """math-verify's equivalence in at most `max_workers` worker processes (more would only
    contend for the cores; each costs a second or two to start), each check bounded by the
    calling thread's deadline. A worker whose check times out is killed (with all it was
    computing) and replaced on a later check; idle workers are kept for the next checks."""

    def __init__(self, max_workers: int = min(4, os.cpu_count() or 1)):
        self.max_workers = max_workers
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()  # busy ones too: a given-up check may still run
        self._lock = threading.Condition()
        atexit.register(self.close)

    def _take(self) -> _Worker:
        """An idle worker, a new one while there are fewer than max_workers, or the next to
        be free (neither start-up nor waiting counts against the deadline)."""
        current = getattr(_local, "deadline", None)
        with current.pause() if current is not None else contextlib.nullcontext():
            with self._lock:
                while not self._idle and len(self._all) >= self.max_workers:
                    self._lock.wait()
                if self._idle:
                    return self._idle.pop()
                placeholder = _Starting()
                self._all.add(placeholder)  # counted while it starts
            try:
                worker = _Worker()
            finally:
                with self._lock:
                    self._all.discard(placeholder)
                    self._lock.notify_all()
            with self._lock:
                self._all.add(worker)
            return worker

    def equal(self, pred: str, gold: str) -> bool | None | TimedOut:
        """True / False; None: a side does not parse; TIMED_OUT: past the deadline."""
        worker = self._take()
        try:
            reply = worker.check(pred, gold, remaining())
        except _Died as e:  # (sympy overflowed its stack, say): a check that gave no answer
            log.warning("the math check of %r crashed (%s)", pred[:60], e)
            self._drop(worker)
            return TIMED_OUT
        except BaseException:
            self._drop(worker)
            raise
        if reply is TIMED_OUT:
            self._drop(worker)  # with what it was computing
            return TIMED_OUT
        with self._lock:
            self._idle.append(worker)
            self._lock.notify_all()
        status, value = reply
        if status == "error":
            raise RuntimeError(f"math-verify raised {value}")
        return value

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)
            self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            workers, self._all, self._idle = self._all, set(), []
        for w in workers:
            if isinstance(w, _Worker):
                w.kill()


SYMBOLIC = SymbolicChecker()

# ------------------------------------------------------------------------ bounded calls


def run_bounded(
    fn: Callable[[Any], Any],
    items: Sequence[Any],
    *,
    timeout_s: float,
    grace_s: float,
    workers: int,
) -> list[Any]:
    """[fn(item) for item in items] on `workers` daemon threads. Each call runs under a
    `deadline` of `timeout_s` and is given up `grace_s` after it: its result is then TIMED_OUT,
    and a fresh thread takes its place. A call that raises has its exception as its result."""
    n = len(items)
    results: list[Any] = [None] * n
    running: dict[int, Deadline] = {}
    done = threading.Condition()
    state = {"next": 0, "finished": 0}

    def work() -> None:
        while True:
            with done:
                i = state["next"]
                if i >= n:
                    return
                state["next"] += 1
                running[i] = due = Deadline(timeout_s)
            with deadline(due):
                try:
                    value = fn(items[i])
                except Exception as e:  # noqa: BLE001 -- the caller's to report
                    value = e
            with done:
                if running.pop(i, None) is None:  # given up meanwhile: this thread retires
                    return
                results[i] = value
                state["finished"] += 1
                done.notify_all()

    def start() -> None:
        threading.Thread(target=work, daemon=True, name="reward").start()

    for _ in range(min(max(1, workers), n)):
        start()
    with done:
        while state["finished"] < n:
            now = time.monotonic()
            for i, d in list(running.items()):
                if not d.paused and now >= d.until + grace_s:
                    del running[i]
                    results[i] = TIMED_OUT
                    state["finished"] += 1
                    start()
            waits = [d.until + grace_s - now for d in running.values()]
            # short waits keep the main thread's signal handlers (SIGTERM) running
            done.wait(min([1.0, *waits]))
    return results
