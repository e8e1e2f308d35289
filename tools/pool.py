"""Pool of pre-started sandboxed Python workers with an asyncio interface.

Each worker (see `sandbox.py`) imports numpy/sympy once and forks a fresh child per snippet.
Concurrency is bounded by the number of workers: one snippet per worker at a time, further calls
wait their turn (back-pressure), and with `max_pending` set, calls beyond it are refused at once
with a `SandboxError` result. A worker that crashes, hangs past its timeout or is killed is
discarded and replaced in the background; the call it was serving reports the error. A worker
whose background cleanup fell behind is replaced too, but serves on until its replacement is up,
so no caller waits for a start-up.

The pool is not bound to an event loop: blocking work happens in the pool's own threads, so one
pool serves several `asyncio.run` loops (tests) or plain threads (`run_sync`).

Sandbox Fusion's `/run_code` request and answer shapes, and an HTTP front, over a pool:
`sandbox_fusion.py`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time

import numpy as np

from jaxrl_tools.tools.sandbox import (
    SandboxConfig,
    SandboxUnavailableError,
    SandboxWorker,
    WorkerDiedError,
    check_isolation,
)

logger = logging.getLogger(__name__)

_HOST_SLACK_S = 5.0  # the worker enforces the timeout; the host only catches a hung worker


@dataclasses.dataclass
class ExecResult:
    """Outcome of one snippet.

    Attributes:
      status: "Finished" (ran to the end, any exit code), "Error" (output limit, failed session
        replay), "TimeLimitExceeded", or "SandboxError" (the worker died or the pool refused).
      stdout, stderr: captured output, each cut to head + "..." + tail of max_output_bytes.
      return_code: the snippet process's exit code (negative: killed by that signal), or None.
      execution_time: seconds spent in the snippet's process (measured in the sandbox).
      latency_s: seconds from the call to the answer on the host (queueing included).
    """

    status: str
    stdout: str = ""
    stderr: str = ""
    return_code: int | None = None
    execution_time: float = 0.0
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "Finished" and self.return_code == 0


class SandboxPool:
    """Pre-started sandboxed workers; `await pool.run(code)`.

    Args:
      n_workers: number of workers (= maximum concurrency); default os.cpu_count().
      config: SandboxConfig (isolation, limits, preloaded modules).
      max_pending: if set, calls beyond this many waiting ones are refused (SandboxError).
      start: start the workers now (blocking, ~0.6 s each, in parallel).

    Raises:
      SandboxUnavailableError: the configured isolation is missing on this host (fail-closed).
    """

    def __init__(
        self,
        n_workers: int | None = None,
        config: SandboxConfig | None = None,
        *,
        max_pending: int | None = None,
        start: bool = True,
    ):
        self.config = config or SandboxConfig()
        self.n_workers = int(n_workers or os.cpu_count() or 1)
        if self.n_workers < 1:
            raise ValueError(f"n_workers must be >= 1, got {n_workers}")
        self.max_pending = max_pending
        self._idle: queue.Queue[SandboxWorker] = queue.Queue()
        self._all: list[SandboxWorker] = []
        self._recycling: set[SandboxWorker] = set()  # serving on while a replacement starts
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending = 0
        self._closed = False
        self._latencies = collections.deque(maxlen=10000)
        self._counts = collections.Counter()
        self._t_first: float | None = None
        self._t_last = 0.0
        # All worker processes are forked from this one long-lived thread (see
        # SandboxWorker.start: --die-with-parent fires when the forking thread exits).
        self._spawn_q: queue.Queue = queue.Queue()
        self._spawner = threading.Thread(
            target=self._spawn_loop, daemon=True, name="sandbox-spawner"
        )
        self._spawner.start()
        if start:
            self.start()

    # --------------------------------------------------------------------------- lifecycle
    def _spawn_loop(self) -> None:
        while True:
            item = self._spawn_q.get()
            if item is None:
                return
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                fut.set_exception(e)

    def _on_spawner(self, fn):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._spawn_q.put((fn, fut))
        return fut.result()

    def start(self) -> None:
        """Starts all workers; raises SandboxUnavailableError if isolation is missing."""
        if self._executor is not None:
            return
        problems = check_isolation(self.config)
        if problems:
            raise SandboxUnavailableError("sandbox isolation unavailable: " + "; ".join(problems))
        workers = [SandboxWorker(self.config) for _ in range(self.n_workers)]
        with concurrent.futures.ThreadPoolExecutor(self.n_workers) as ex:
            futures = [ex.submit(w.start, self._on_spawner) for w in workers]
            errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            for w in workers:
                w.kill()
            self._spawn_q.put(None)
            raise errors[0]
        self._all = workers
        for w in workers:
            self._idle.put(w)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self.n_workers, thread_name_prefix="sandbox-pool"
        )
        logger.info(
            "sandbox pool: %d workers (%s isolation, %s)",
            self.n_workers,
            self.config.isolation,
            workers[0].hello,
        )

    def close(self) -> None:
        """Kills every worker (and its sandbox); idempotent."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            workers, self._all = list(self._all), []
        with concurrent.futures.ThreadPoolExecutor(max(len(workers), 1)) as ex:
            list(ex.map(lambda w: w.kill(graceful=True), workers))
        self._spawn_q.put(None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()

    def worker_pids(self) -> list[int]:
        """Host pids of the workers' outermost processes (for tests and monitoring)."""
        with self._lock:
            return [w.pid for w in self._all if w.pid is not None]

    # --------------------------------------------------------------------------- calls
    async def run(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        memory_mb: int | None = None,
        stdin: str = "",
        replay: list[str] | None = None,
        files: dict[str, bytes] | None = None,
        max_call_s: float | None = None,
    ) -> ExecResult:
        """Runs `code` in a fresh sandboxed child; never raises for snippet or worker failures.

        Args:
          code: Python source.
          timeout_s: wall-clock limit (default config.timeout_s); the CPU rlimit follows it.
          memory_mb: address space the snippet may add (default config.memory_mb).
          stdin: text given on the snippet's stdin.
          replay: earlier snippets run first in the same child with their output suppressed
            (session mode). `timeout_s` still limits the new snippet on its own.
          files: relative path -> bytes written into the snippet's work dir first.
          max_call_s: with `replay`, the time limit of the whole call, replay included
            (default 2 x timeout_s), so a long session cannot hold a worker for minutes.

        Returns:
          ExecResult.
        """
        req = self._request(code, timeout_s, memory_mb, stdin, replay, files, max_call_s)
        t0 = time.monotonic()
        if self._executor is None or self._closed:
            return ExecResult("SandboxError", stderr="SandboxError: pool is not running")
        with self._lock:
            if self.max_pending is not None and self._pending >= self.max_pending + self.n_workers:
                self._counts["rejected"] += 1
                return ExecResult(
                    "SandboxError",
                    stderr=f"SandboxError: pool saturated ({self._pending} calls pending)",
                )
            self._pending += 1
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        try:
            self._executor.submit(self._serve, req, loop, answer)
            res = await answer
        finally:
            with self._lock:
                self._pending -= 1
        res.latency_s = time.monotonic() - t0
        self._record(res)
        return res

    def run_sync(self, code: str, **kwargs) -> ExecResult:
        """Blocking version of `run` (same arguments)."""
        return asyncio.run(self.run(code, **kwargs))

    def _request(self, code, timeout_s, memory_mb, stdin, replay, files, max_call_s) -> dict:
        c = self.config
        timeout = float(timeout_s or c.timeout_s)
        return {
            "code": code,
            "timeout": timeout,
            "total_timeout": float(max_call_s or 2 * timeout) if replay else timeout,
            "memory_mb": int(memory_mb or c.memory_mb),
            "stdin": stdin or "",
            "replay": list(replay or []),
            "nproc": c.nproc,
            "nofile": c.nofile,
            "fsize_mb": c.fsize_mb,
            "max_output_bytes": c.max_output_bytes,
            "kill_output_bytes": c.kill_output_bytes,
            "files": {k: v.hex() for k, v in (files or {}).items()},
        }

    def _serve(self, req: dict, loop, answer: asyncio.Future) -> None:
        """On a pool thread: runs `req` on an idle worker and hands the result to the caller,
        then waits, off the caller's clock, until the worker has cleaned up after it."""
        worker = self._idle.get()
        try:
            res = self._run_on(worker, req)
        except BaseException as e:  # noqa: BLE001 -- the caller gets it
            res = ExecResult("SandboxError", stderr=f"SandboxError: {e!r}")
            worker.kill()
        try:
            loop.call_soon_threadsafe(_resolve, answer, res)
        except RuntimeError:  # the caller's event loop is gone
            pass
        if res.status == "SandboxError" and not worker.alive():
            self._counts["worker_restarts"] += 1
            self._replace_unless_coming(worker)
        elif worker.wait_ready():
            with self._lock:
                retired = worker.retired
                recycle = worker.recycle and not retired and worker not in self._recycling
                if recycle:
                    self._recycling.add(worker)
                    self._counts["worker_recycled"] += 1
                if not retired:
                    self._idle.put(worker)
            if recycle:
                self._replace_later(worker)
            if retired:  # its replacement took its place while it served this call
                self._kill_later(worker)
        else:  # it cannot take another call (its zygote is gone, ...): replace it now
            self._counts["worker_recycled"] += 1
            worker.kill()
            self._replace_unless_coming(worker)

    def _run_on(self, worker: SandboxWorker, req: dict) -> ExecResult:
        try:
            resp = worker.request(req, req["total_timeout"] + _HOST_SLACK_S)
        except WorkerDiedError as e:
            logger.warning("sandbox worker %s lost (%s); replacing it", worker.pid, e)
            worker.kill()
            return ExecResult(
                "SandboxError", stderr=f"SandboxError: worker lost ({e}); it was replaced"
            )
        return ExecResult(
            status=resp.get("status", "SandboxError"),
            stdout=resp.get("stdout", ""),
            stderr=resp.get("stderr", ""),
            return_code=resp.get("return_code"),
            execution_time=float(resp.get("execution_time", 0.0)),
        )

    def _replace_unless_coming(self, dead: SandboxWorker) -> None:
        with self._lock:  # a recycled worker has its replacement started, or already up
            coming = dead.retired or dead in self._recycling
        if not coming:
            self._replace_later(dead)

    def _replace_later(self, old: SandboxWorker) -> None:
        threading.Thread(target=self._replace, args=(old,), daemon=True).start()

    @staticmethod
    def _kill_later(worker: SandboxWorker) -> None:
        threading.Thread(target=worker.kill, kwargs={"graceful": True}, daemon=True).start()

    def _replace(self, old: SandboxWorker) -> None:
        """Starts a worker in `old`'s place; `old` (dead, or recycled and still serving) is
        retired: killed now if idle, else by the thread serving it, after its call."""
        while not self._closed:
            new = SandboxWorker(self.config)
            try:
                new.start(self._on_spawner)
            except Exception as e:  # noqa: BLE001 -- retry; the slot stays empty meanwhile
                logger.error("sandbox worker restart failed: %s", e)
                time.sleep(1.0)
                continue
            with self._lock:
                if self._closed:
                    new.kill()
                    return
                self._all = [w for w in self._all if w is not old] + [new]
                self._recycling.discard(old)
                old.retired = True
                idle = self._take_from_idle(old)
                self._idle.put(new)
            if idle:
                self._kill_later(old)
            return

    def _take_from_idle(self, worker: SandboxWorker) -> bool:
        """Removes `worker` from the idle queue (under the lock); False if it was not there."""
        others, found = [], False
        while True:
            try:
                w = self._idle.get_nowait()
            except queue.Empty:
                break
            if w is worker:
                found = True
            else:
                others.append(w)
        for w in others:
            self._idle.put(w)
        return found

    # --------------------------------------------------------------------------- metrics
    def _record(self, res: ExecResult) -> None:
        with self._lock:
            now = time.monotonic()
            if self._t_first is None:
                self._t_first = now - res.latency_s
            self._t_last = now
            self._latencies.append(res.latency_s)
            self._counts["calls"] += 1
            self._counts[f"status_{res.status}"] += 1

    def metrics(self) -> dict:
        """Counts, latency percentiles (s) and throughput (calls/s) since the first call."""
        with self._lock:
            lat = np.asarray(self._latencies, dtype=np.float64)
            out = dict(self._counts)
            out["workers"] = self.n_workers
            out["pending"] = self._pending
            if lat.size:
                out["latency_p50_s"] = float(np.percentile(lat, 50))
                out["latency_p99_s"] = float(np.percentile(lat, 99))
                span = max(self._t_last - (self._t_first or self._t_last), 1e-9)
                out["throughput_per_s"] = self._counts["calls"] / span
        return out


def _resolve(future: asyncio.Future, res: ExecResult) -> None:
    if not future.done():  # the caller may have been cancelled meanwhile
        future.set_result(res)
