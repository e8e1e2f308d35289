"""Multi-turn text environments, stepped with model turns: RAGEN's Sokoban and FrozenLake, and
Kevin-style refinement of a function against hidden tests in the sandbox."""

from jaxrl_tools.envs.base import (
    Env,
    GridEnv,
    RagenTurns,
    StepResult,
    env_names,
    make_env,
    parse_turn,
    register_env,
)
from jaxrl_tools.envs.frozenlake import FrozenLake
from jaxrl_tools.envs.refine import Refine
from jaxrl_tools.envs.sokoban import Sokoban

__all__ = [
    "Env",
    "FrozenLake",
    "GridEnv",
    "RagenTurns",
    "Refine",
    "Sokoban",
    "StepResult",
    "env_names",
    "make_env",
    "parse_turn",
    "register_env",
]
