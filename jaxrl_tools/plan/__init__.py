"""`jaxrl-tools plan`: a run's memory per device and its floor, from the compilers themselves.

`memory`: the RL step and the decode step the run executes, compiled on abstract shapes (no
weights) for a mesh's devices, and what each phase keeps allocated. `run_plan`: a config's plan on
its mesh (this host's, an accelerator's, or a target's compile-only devices: `targets`), whether
it fits and the largest micro-batch that does. `report`: what is printed, with each step's
roofline floor.
"""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.plan.memory import (
        FUNCTIONS,
        Memory,
        compile_functions,
        decode_engine,
        describe,
        grpo_settings,
        largest_fitting_micro_batch,
        lower_decode,
        phase_totals,
        plan_memory,
        resident_bytes,
    )
    from jaxrl_tools.plan.report import Floor, RunPlan, floors
    from jaxrl_tools.plan.run_plan import (
        check_fits,
        device_memory,
        fit_error,
        plan_command,
        plan_run,
        plan_target,
    )

__all__ = [
    "FUNCTIONS",
    "Floor",
    "Memory",
    "RunPlan",
    "check_fits",
    "compile_functions",
    "decode_engine",
    "describe",
    "device_memory",
    "fit_error",
    "floors",
    "grpo_settings",
    "largest_fitting_micro_batch",
    "lower_decode",
    "phase_totals",
    "plan_command",
    "plan_memory",
    "plan_run",
    "plan_target",
    "resident_bytes",
]

__getattr__, __dir__ = lazy_api(__name__)
