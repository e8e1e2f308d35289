"""Rollouts ahead of the update by up to k policy versions (`trainer.max_staleness: k`).

The schedule is fixed, the same in every process and every run: version u is the policy after
update u, and batch b is sampled with version max(start, b - 1 - k), so update b (which starts
from version b - 1) trains on tokens at most k versions old. A worker thread samples the batches
in order, at most k + 1 ahead of the update that consumes them, while the main thread runs the
updates. With `partial_rollouts`, a rollout still decoding when a newer version is published
switches to it between two decode chunks: its earlier tokens keep their version and behaviour
log-probs, its later ones are newer (the KV cache of its earlier tokens is kept, as computed).
Every model token records the version it was sampled with (`Trajectory.versions`).

Device-call order. JAX's multi-controller model needs every process to issue the same device
computations in the same order. The worker's calls (decode chunks, the loop's agreements) form
one sequence; the main thread's device work (`turn`: an update's dispatch, an evaluation) is
slotted into it at an agreed point: at the top of a decode pass once every process has asked
(one all-gather of a flag per pass, `sharding.distributed.agree`), before a rollout whose
weights need that update, or after the worker's last rollout. The dispatch is asynchronous, so
the update runs on the devices while the worker goes on with its host work (tool calls, stop
scans, rewards) and queues its next decode chunks behind it. With one process the agreement is
the process's own flag and nothing else changes.

With several processes the hand-overs are also fences (`finish_device_work`): the device work
one thread called is done before the other thread calls its own. Calling in turn orders the
calls, not their runs: XLA:CPU runs a process's one-device computations as soon as their inputs
are ready, whichever thread called them, and two of them running at once interleave their
cross-process collectives (a collective mismatch). Only the worker's host work between the
hand-over and its next device read loses its overlap with the update. A worker that fails logs
its error at once: the main thread, which raises it, may be waiting on a device call its peers
will not make.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxrl_tools.sharding.distributed import agree, finish_device_work, is_multiprocess

log = logging.getLogger(__name__)

# The pipeline whose worker is running this rollout (the decode loop asks it for turns and
# newer weights between passes); None outside one.
CURRENT: contextvars.ContextVar[RolloutsAhead | None] = contextvars.ContextVar(
    "rollouts_ahead", default=None
)


class RolloutsAhead:
    """The worker thread and its schedule (see the module docstring).

    Args:
      rollout: rollout(b, params) -> batch b (any value), sampled with `params`; runs in the
        worker thread. Its exceptions are raised by `take`.
      params: the weights of version `start`, in buffers the trainer will not donate.
      start: the run's first version (the step it resumed from; 0 for a fresh run).
      last: the last batch to sample (the run's last step).
      max_staleness: k >= 1.
      partial: switch a running rollout to newer weights between decode chunks.
      streams: () -> what a resumed run continues from (data and sampler streams), read in the
        worker before each batch (`streams_before`).
    """

    def __init__(
        self,
        rollout: Callable[[int, Any], Any],
        params: Any,
        *,
        start: int,
        last: int,
        max_staleness: int,
        partial: bool = False,
        streams: Callable[[], dict] | None = None,
    ):
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1, got {max_staleness}")
        self._rollout, self.start, self.last = rollout, start, last
        self.k, self.partial, self._streams = max_staleness, partial, streams
        self._cv = threading.Condition()
        self._weights: dict[int, Any] = {start: params}  # version -> the worker's copy
        self._next_needed = start  # the oldest version a coming rollout starts from
        self._request: Callable | None = None  # the main thread's device work, waiting
        self._granted: Callable | None = None  # the request the worker let run
        self._alive, self._stop = True, False
        self._error: BaseException | None = None  # what ended the worker, if it failed
        self._fence = is_multiprocess()  # hand-overs wait for the device work (module doc)
        self._before: dict[int, dict] = {}  # batch -> streams before it
        # The schedule samples at most k + 1 batches ahead of their update; one more place for
        # the worker's error.
        self._ready: queue.Queue = queue.Queue(maxsize=max_staleness + 2)
        self.gate_s = 0.0  # the worker's time held by the staleness bound since `take`
        self.swaps = 0  # rollouts switched to newer weights since `take`
        # The decode loop's weights and their version (read between passes).
        self.params, self.version = params, start
        if self._fence:  # the caller's device work (e.g. the weights' copy) before the worker's
            finish_device_work()
        self._thread = threading.Thread(target=self._work, name="rollouts-ahead", daemon=True)
        self._thread.start()

    def version_for(self, batch: int) -> int:
        """The weights' version batch `batch` is sampled with."""
        return max(self.start, batch - 1 - self.k)

    # ------------------------------------------------------------------ main thread
    def take(self, batch: int) -> tuple[Any, dict[str, float]]:
        """Batch `batch` (waits for it) and the pipeline's metrics since the last take."""
        t0 = time.perf_counter()
        got, item = self._ready.get()
        wait = time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        assert got == batch, (got, batch)
        with self._cv:
            gate, swaps, self.gate_s, self.swaps = self.gate_s, self.swaps, 0.0, 0
        return item, {
            "async/trainer_wait_s": wait,
            "async/rollout_gate_s": gate,
            "async/partial_swaps": float(swaps),
        }

    def turn(self, work: Callable[[], Any]) -> Any:
        """Runs `work` (device calls of the main thread) in this thread at the next agreed
        point of the worker's sequence; returns its value. Raises the worker's error if it
        failed (the other processes' device calls would not match this thread's alone)."""
        with self._cv:
            if self._error is not None:
                raise self._error
            if self._alive:
                self._request = work
                self._cv.notify_all()
                while self._granted is not work and self._alive:
                    self._cv.wait()
                if self._error is not None:
                    raise self._error
        try:
            return work()
        finally:
            with self._cv:
                self._request = None
                self._cv.notify_all()

    def publish(self, version: int, params: Any) -> None:
        """The weights of `version` (a copy the trainer will not donate), for the batches and
        partial rollouts that use them; call inside the update's `turn`."""
        with self._cv:
            self._weights[version] = params
            self._cv.notify_all()

    def wanted(self, version: int) -> bool:
        """Whether the worker will use the weights of `version` (publish only those)."""
        return self.partial or any(
            self.version_for(b) == version for b in range(version + 1, self.last + 1)
        )

    def streams_before(self, batch: int) -> dict | None:
        """The streams read before batch `batch` was sampled (waits until the worker has read
        them; older batches' are dropped); None past the last batch."""
        with self._cv:
            while batch not in self._before and self._alive and batch <= self.last:
                self._cv.wait()
            _drop_below(self._before, batch)
            return self._before.get(batch)

    def close(self) -> None:
        """Stops the worker after its current rollout (its batch is dropped)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    # ------------------------------------------------------------------ worker thread
    def at_pass(self) -> None:
        """Between two decode passes: runs the main thread's device work once every process
        has asked for it, then (partial rollouts) takes newer weights. Every process calls it
        at the same point of its decode loop."""
        with self._cv:
            asked = self._request is not None
        if all(agree(asked)):
            self._grant()
            if self.partial:
                with self._cv:
                    newest = max(self._weights)  # older ones are dropped as they go out of use
                if newest > self.version:
                    self.params, self.version = self._weights[newest], newest
                    self._drop_older_than(min(newest, self._next_needed))
                    with self._cv:
                        self.swaps += 1

    def _grant(self) -> None:
        """Lets the main thread's waiting work run, and waits until it has (with several
        processes: until the device work of each side is done before the other's starts)."""
        with self._cv:
            work = self._request
        if work is None:
            return
        if self._fence:
            finish_device_work()
        with self._cv:
            self._granted = work
            self._cv.notify_all()
            while self._request is work:
                self._cv.wait()
            self._granted = None
        if self._fence:
            finish_device_work()

    def _wait_for_version(self, version: int) -> None:
        """Grants the main thread's turns until `version` is published (or the run stops)."""
        t0 = time.perf_counter()
        while True:
            with self._cv:
                while self._request is None and version not in self._weights and not self._stop:
                    self._cv.wait()
                if version in self._weights or self._stop:
                    break
            self._grant()
        with self._cv:
            self.gate_s += time.perf_counter() - t0

    def _drop_older_than(self, version: int) -> None:
        with self._cv:
            _drop_below(self._weights, version)

    def _work(self) -> None:
        CURRENT.set(self)
        try:
            for b in range(self.start + 1, self.last + 1):
                need = self.version_for(b)  # == self._next_needed
                self._wait_for_version(need)
                if self._stop:
                    return
                self._drop_older_than(need)
                with self._cv:
                    self.params, self.version = self._weights[need], need
                    self._next_needed = self.version_for(b + 1)
                    self._before[b] = self._streams() if self._streams else {}
                    self._cv.notify_all()
                self._ready.put((b, self._rollout(b, self.params)))
            if self._fence:  # the main thread's turns now run alone, after the worker's calls
                finish_device_work()
        except BaseException as e:  # noqa: BLE001 -- raised in the main thread by `take`
            if self._fence:
                log.error("the rollouts ahead of the update failed", exc_info=e)
            with self._cv:
                self._error = e
            self._ready.put((None, e))
        finally:
            with self._cv:
                self._alive = False
                self._cv.notify_all()


def _drop_below(entries: dict[int, Any], key: int) -> None:
    """Removes the entries of `entries` whose key is below `key` (gone out of use)."""
    for k in [k for k in entries if k < key]:
        del entries[k]
