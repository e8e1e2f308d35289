"""Multi-host start-up with JAX's own multi-controller runtime, and host-side agreement.

A multi-host run is the same command on every host (one process each); `initialize_distributed`
joins them through `jax.distributed` before any device is touched. Everything the processes
decide on the host must then be the same everywhere, or their device calls differ and the job
deadlocks: `agree` and `to_host` are the two collectives the rollout loop uses for that.
"""

import atexit
import faulthandler
import logging
import os
import pickle
import sys
import threading
import time
from typing import Any

import jax
import jax.extend.backend
import numpy as np
from jax._src import distributed as jax_distributed  # the runtime's client: no public handle
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_FLAGS = {
    "JAX_COORDINATOR_ADDRESS": "--coordinator",
    "JAX_NUM_PROCESSES": "--num-processes",
    "JAX_PROCESS_ID": "--process-id",
}
# Seconds before a dead peer is noticed (default 60) and before a stuck shutdown gives up (jax's
# default 300); tests set them low.
HEARTBEAT_ENV = "JAXRL_HEARTBEAT_TIMEOUT_S"
SHUTDOWN_ENV = "JAXRL_SHUTDOWN_TIMEOUT_S"
DEFAULT_HEARTBEAT_S = 60


def set_process_flags(
    coordinator: str | None, num_processes: int | None, process_id: int | None
) -> None:
    """Puts the CLI's `--coordinator/--num-processes/--process-id` into the environment
    variables `initialize_distributed` reads (flags win over the environment).

    Raises:
      ValueError: some of the three given but not all (one line naming the missing ones).
    """
    given = {
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "JAX_NUM_PROCESSES": num_processes,
        "JAX_PROCESS_ID": process_id,
    }
    if all(v is None for v in given.values()):
        return
    missing = [_FLAGS[k] for k, v in given.items() if v is None]
    if missing:
        raise ValueError(
            f"a multi-process launch needs {', '.join(missing)} as well: give all of "
            "--coordinator HOST:PORT, --num-processes N and --process-id I (or none)"
        )
    for k, v in given.items():
        os.environ[k] = str(v)


def initialize_distributed() -> bool:
    """Starts `jax.distributed` when the environment describes several processes.

    Reads JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (all three, or none;
    the CLI's flags set them). On clusters that JAX detects by itself (TPU pods, SLURM, Open MPI)
    set JAXRL_DISTRIBUTED=auto. On CPU the processes' collectives go over gloo. Returns True
    when the distributed runtime was started (now or by an earlier call), False on a single
    process. Calling it again is harmless (the CLI calls it first, `check.preflight` before it
    counts the devices, `run.train` after).

    Raises:
      ValueError: a partial or malformed setting (one line naming the variable).
    """
    if jax.distributed.is_initialized():
        return True
    given = {k: os.environ[k] for k in _ENV if os.environ.get(k)}
    kwargs: dict[str, Any] = {}
    if os.environ.get("JAXRL_DISTRIBUTED") == "auto":
        pass
    elif not given:
        return False
    elif len(given) != len(_ENV):
        missing = [k for k in _ENV if k not in given]
        raise ValueError(
            f"a multi-process launch needs {', '.join(missing)} as well as "
            f"{', '.join(given)} (or the flags --coordinator, --num-processes, --process-id)"
        )
    else:
        n, i = _int(given, "JAX_NUM_PROCESSES"), _int(given, "JAX_PROCESS_ID")
        if n < 1 or not 0 <= i < n:
            raise ValueError(f"JAX_PROCESS_ID={i} must be in 0..{n - 1} (JAX_NUM_PROCESSES={n})")
        if n == 1:
            return False
        kwargs = dict(
            coordinator_address=given["JAX_COORDINATOR_ADDRESS"], num_processes=n, process_id=i
        )
    heartbeat = _int(os.environ, HEARTBEAT_ENV) if os.environ.get(HEARTBEAT_ENV) else None
    heartbeat = heartbeat or DEFAULT_HEARTBEAT_S
    # jax's own check aborts a process with a C++ stack trace when a peer misses its heartbeats;
    # it gets twice as long, so the watchdog (one line, exit status 1) speaks first.
    kwargs["heartbeat_timeout_seconds"] = 2 * heartbeat
    if os.environ.get(SHUTDOWN_ENV):
        kwargs["shutdown_timeout_seconds"] = _int(os.environ, SHUTDOWN_ENV)
    # Cross-process collectives of the CPU backend (the only one that needs telling; harmless
    # on GPU and TPU, whose collectives are NCCL's and ICI's).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # An import may already have started a single-process backend (a library that runs a jax op
    # when imported, as bm25s does: `tools.search` imports it lazily); nothing of the run lives
    # on it yet, and initialize() must come first.
    jax.extend.backend.clear_backends()
    jax.distributed.initialize(**kwargs)
    log.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
    # A process that XLA or gloo aborts (SIGABRT: a collective mismatch) prints where each of
    # its threads was, not only the C++ message its peers' errors drown.
    faulthandler.enable()
    _Watchdog(heartbeat).start()
    return True


class _Watchdog(threading.Thread):
    """Ends this process with one line when a peer goes silent.

    Every `timeout_s / 10` seconds each process bumps its counter in the coordination service's
    key-value store and reads the others'. A peer whose counter has not moved for `timeout_s`
    (dead, or hung), or a coordination service that no longer answers (process 0 is gone), ends
    this process through `exit_job`, wherever its main thread is (a collective with a dead peer
    may wait long). A process that ends normally marks itself done first (atexit), so the
    others do not take its silence for a death.
    """

    def __init__(self, timeout_s: float):
        super().__init__(name="jaxrl-watchdog", daemon=True)
        self.client = jax_distributed.global_state.client
        self.timeout_s = float(timeout_s)
        self.me, self.n = jax.process_index(), jax.process_count()
        self._halt = threading.Event()
        atexit.register(self._done)

    def _done(self) -> None:
        self._halt.set()
        try:
            self.client.key_value_set(f"jaxrl/done/{self.me}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the service may be gone at exit; nothing to tell
            pass

    def run(self) -> None:
        seen: dict[str, tuple[str, float]] = {}
        while not self._halt.wait(self.timeout_s / 10):
            try:
                self.client.key_value_increment(f"jaxrl/alive/{self.me}", 1)
                counters = dict(self.client.key_value_dir_get("jaxrl/alive/"))
                done = {
                    k.rsplit("/", 1)[-1] for k, _ in self.client.key_value_dir_get("jaxrl/done/")
                }
            except Exception as e:  # noqa: BLE001 - any failure here means the job is broken
                if self._halt.is_set():
                    return
                exit_job(RuntimeError(f"the coordination service stopped answering ({e})"))
            now = time.monotonic()
            for p in range(self.n):
                key = f"jaxrl/alive/{p}"
                value = counters.get(key, "")
                if p == self.me or str(p) in done:
                    continue
                if key not in seen or seen[key][0] != value:
                    seen[key] = (value, now)
                elif now - seen[key][1] > self.timeout_s:
                    exit_job(
                        RuntimeError(
                            f"process {p} sent no heartbeat for {self.timeout_s:.0f} s (it died "
                            "or hangs)"
                        )
                    )


def _int(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} must be an integer") from None


def is_main_process() -> bool:
    """Only process 0 logs and writes files."""
    return jax.process_index() == 0


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def agree(local: Any) -> list[Any]:
    """Every process's `local` (any picklable value), in process order, on every process.

    A collective: every process must call it at the same point. One process: `[local]`, with
    no device call (single-process runs are unchanged).
    """
    if not is_multiprocess():
        return [local]
    data = np.frombuffer(pickle.dumps(local), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([data.size], np.int64))
    padded = np.zeros((int(sizes.max()),), np.uint8)
    padded[: data.size] = data
    gathered = multihost_utils.process_allgather(padded)
    return [pickle.loads(gathered[p, : int(sizes[p, 0])].tobytes()) for p in range(len(gathered))]


def to_host(x: jax.Array) -> np.ndarray:
    """A device array's whole value as NumPy on every process (an all-gather when its shards
    live on several processes; a plain copy otherwise). A collective in the former case."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def finish_device_work() -> None:
    """Waits until the computations behind this process's live arrays are done: the fence
    between two threads that take turns issuing a multi-process run's device calls.

    The turns order the calls, but not always their runs: with one device in a process, XLA:CPU
    starts a computation called from one thread as soon as its inputs are ready, while one
    called earlier from another thread may still run (with several devices it launches them one
    at a time, in call order). Two computations running at once interleave their cross-process
    collectives (gloo pairs messages by order), and the processes abort on a size mismatch.
    """
    jax.block_until_ready(jax.live_arrays())


def exit_job(error: BaseException) -> None:
    """Ends this process of a multi-process job after an error, with one line on stderr.

    The usual exit would wait in jax's shutdown barrier for the other processes, and one of
    them may be dead (the error is often its absence: a failed collective). Exit status 1.
    """
    first = (str(error).strip().splitlines() or [""])[0]
    print(
        f"jaxrl-tools: process {jax.process_index()} of {jax.process_count()}: "
        f"{type(error).__name__}: {first[:300]} (if another process died, see its log; "
        "relaunch every process with --resume to continue from the last checkpoint)",
        file=sys.stderr,
        flush=True,
    )
    logging.shutdown()
    os._exit(1)
