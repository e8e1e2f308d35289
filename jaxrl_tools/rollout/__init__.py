"""Rollout, on the decode engine (`jaxrl_tools.engine`, whose main names it re-exports): the pure
stop scan, the host-side agent loop (`scheduler`: which sample decodes in
which slot; `resolver`: what an ended segment becomes; `loop`: the driver over the engine), the
run's records -> trajectories sampler, and rollouts ahead of the update (`ahead`)."""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.engine.core import EngineCore
    from jaxrl_tools.engine.kernels import DecodeState, Prefix, StepOutput
    from jaxrl_tools.engine.sampling import GREEDY, SamplingParams
    from jaxrl_tools.rollout.ahead import RolloutsAhead
    from jaxrl_tools.rollout.loop import BUDGET_NOTICE, RolloutLimits, arun_rollouts, run_rollouts
    from jaxrl_tools.rollout.sampler import Sampler, declares_tools, make_engine

__all__ = [
    "RolloutsAhead",
    "BUDGET_NOTICE",
    "DecodeState",
    "EngineCore",
    "GREEDY",
    "Prefix",
    "RolloutLimits",
    "Sampler",
    "SamplingParams",
    "StepOutput",
    "arun_rollouts",
    "declares_tools",
    "make_engine",
    "run_rollouts",
]

__getattr__, __dir__ = lazy_api(__name__)
