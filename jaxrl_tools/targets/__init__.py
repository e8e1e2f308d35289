"""The accelerators `jaxrl-tools plan` compiles for without one: their figures, their compilers.

XLA compiles for a GPU or a TPU on a machine that has neither ("deviceless" / ahead-of-time):
`compilers.target_devices` gives compile-only devices of a target (a TPU slice from libtpu, GPUs
from the CUDA plugin and a `stream_executor.GpuTargetConfigProto`), and
`jax.jit(f).lower(...).compile()` on a mesh over them runs that accelerator's own compiler: its
fusion, layouts, buffer assignment, collectives. `plan` reads the executable's
`memory_analysis()` and, from its HLO, the work of one step (`cost.hlo_cost`), whose floor on the
accelerator (`accelerators.ACCELERATORS`: the vendors' figures) it prints.
"""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.targets.accelerators import ACCELERATORS, Accelerator
    from jaxrl_tools.targets.compilers import (
        INSTALL,
        TargetUnavailable,
        Toolchain,
        gpu_target_config,
        prepare,
        resolve_topology,
        target_devices,
        toolchain,
        topology_devices,
    )
    from jaxrl_tools.targets.cost import Cost, hlo_cost

__all__ = [
    "ACCELERATORS",
    "INSTALL",
    "Accelerator",
    "Cost",
    "TargetUnavailable",
    "Toolchain",
    "gpu_target_config",
    "hlo_cost",
    "prepare",
    "resolve_topology",
    "target_devices",
    "toolchain",
    "topology_devices",
]

__getattr__, __dir__ = lazy_api(__name__)
