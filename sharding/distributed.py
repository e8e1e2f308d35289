"""Multi-host start-up with JAX's own multi-controller runtime, and host-side agreement.

A multi-host run is the same command on every host (one process each); `initialize_distributed`
joins them through `jax.distributed` before any device is touched. Everything the processes
decide on the host must then be the same everywhere, or their device calls differ and the job
deadlocks: `agree` and `to_host` are the two collectives the rollout loop uses for that.
"""

import logging
import os
import pickle
import sys
from typing import Any

import jax
import jax.extend.backend
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_FLAGS = {
    "JAX_COORDINATOR_ADDRESS": "--coordinator",
    "JAX_NUM_PROCESSES": "--num-processes",
    "JAX_PROCESS_ID": "--process-id",
}
# Seconds before a dead peer is noticed (jax's default: 100) and before a stuck shutdown gives
# up (300); tests set them low.
HEARTBEAT_ENV = "JAXRL_HEARTBEAT_TIMEOUT_S"
SHUTDOWN_ENV = "JAXRL_SHUTDOWN_TIMEOUT_S"


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
    for env, name in (
        (HEARTBEAT_ENV, "heartbeat_timeout_seconds"),
        (SHUTDOWN_ENV, "shutdown_timeout_seconds"),
    ):
        if os.environ.get(env):
            kwargs[name] = _int(os.environ, env)
    # Cross-process collectives of the CPU backend (the only one that needs telling; harmless
    # on GPU and TPU, whose collectives are NCCL's and ICI's).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # An import may already have started a single-process backend (a library that runs a jax op
    # when imported, as bm25s does: `tools.search` imports it lazily); nothing of the run lives
    # on it yet, and initialize() must come first.
    jax.extend.backend.clear_backends()
    jax.distributed.initialize(**kwargs)
    log.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
    return True


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
