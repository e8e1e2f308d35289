"""One-step asynchronous rollouts: step k+1's batch is sampled while step k's update runs.

The trainer's loop starts `rollout(k + 1, params)` in a worker thread with a copy of the weights
before update k (`EngineCore.serving_copy`: the update donates its own buffers), then runs update
k. JAX dispatch is thread-safe and the rollout is mostly host work (stop scans, tool calls in the
sandbox, rewards) between short device calls, so the two overlap. Batch k+1 is then one update
stale (its behaviour policy is the weights before update k), which `algorithm.tis_cap` corrects
with truncated importance weights against the sampler's log-probs. Staleness is bounded by one:
at most one batch is in flight.

One process only: threads of different processes would interleave their device calls in
different orders, and collectives need the same order everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class AsyncRollouts:
    """At most one rollout in flight, in a worker thread.

    Args:
      rollout: rollout(step, params) -> the step's batch (any value); its exceptions are
        raised by `result`.
    """

    def __init__(self, rollout: Callable[[int, Any], Any]):
        self._rollout = rollout
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
        self._future: Future | None = None

    @property
    def pending(self) -> bool:
        """A rollout was started and its result not yet taken."""
        return self._future is not None

    def start(self, step: int, params: Any) -> None:
        if self._future is not None:
            raise RuntimeError("AsyncRollouts.start: the previous rollout's result was not taken")
        self._future = self._pool.submit(self._rollout, step, params)

    def wait(self) -> None:
        """Blocks until the rollout in flight (if any) is done; its result stays pending."""
        if self._future is not None:
            self._future.exception()

    def result(self) -> Any:
        """The rollout's result (waits for it); raises what the rollout raised."""
        future, self._future = self._future, None
        if future is None:
            raise RuntimeError("AsyncRollouts.result: no rollout in flight")
        return future.result()

    def close(self) -> None:
        """Waits for a rollout in flight (its result is dropped) and stops the thread."""
        self.wait()
        self._future = None
        self._pool.shutdown(wait=True)
