"""Multi-host start-up with JAX's own multi-controller runtime."""

import logging
import os

import jax

log = logging.getLogger(__name__)

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_distributed() -> bool:
    """Starts `jax.distributed` when the environment describes several processes.

    Reads JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (all three, or none). On
    clusters that JAX detects by itself (TPU pods, SLURM, Open MPI) set JAXRL_DISTRIBUTED=auto.
    Returns True when the distributed runtime was started (now or by an earlier call), False on
    a single process. Calling it again is harmless (`check.preflight` calls it before it counts
    the devices, and `run.train` after).
    """
    if jax.distributed.is_initialized():
        return True
    given = {k: os.environ[k] for k in _ENV if os.environ.get(k)}
    if os.environ.get("JAXRL_DISTRIBUTED") == "auto":
        jax.distributed.initialize()
    elif not given:
        return False
    elif len(given) != len(_ENV):
        missing = [k for k in _ENV if k not in given]
        raise ValueError(f"multi-host start-up needs {', '.join(missing)} as well as {list(given)}")
    elif int(given["JAX_NUM_PROCESSES"]) == 1:
        return False
    else:
        jax.distributed.initialize(
            coordinator_address=given["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(given["JAX_NUM_PROCESSES"]),
            process_id=int(given["JAX_PROCESS_ID"]),
        )
    log.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
    return True


def is_main_process() -> bool:
    """Only process 0 logs and writes files."""
    return jax.process_index() == 0
