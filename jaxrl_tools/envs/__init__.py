"""Multi-turn text environments, stepped with model turns: RAGEN's Sokoban and FrozenLake,
Kevin-style refinement of a function against hidden tests in the sandbox, and gymnasium and
OpenEnv environments of the user's (`external.py`)."""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.envs.base import (
        Env,
        GridEnv,
        RagenTurns,
        StepResult,
        env_class,
        env_names,
        make_env,
        parse_turn,
        register_env,
    )
    from jaxrl_tools.envs.episodes import EVAL_SEED_OFFSET, Episodes, env_kwargs, needs_sandbox
    from jaxrl_tools.envs.external import GymnasiumText, OpenEnv
    from jaxrl_tools.envs.frozenlake import FrozenLake
    from jaxrl_tools.envs.refine import Refine
    from jaxrl_tools.envs.sokoban import Sokoban

__all__ = [
    "EVAL_SEED_OFFSET",
    "Env",
    "Episodes",
    "FrozenLake",
    "GridEnv",
    "GymnasiumText",
    "OpenEnv",
    "RagenTurns",
    "Refine",
    "Sokoban",
    "StepResult",
    "env_class",
    "env_kwargs",
    "env_names",
    "make_env",
    "needs_sandbox",
    "parse_turn",
    "register_env",
]

__getattr__, __dir__ = lazy_api(__name__)
