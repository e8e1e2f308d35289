"""Typed, frozen run configuration: one frozen dataclass per section, each validating itself.

Every choice is checked against the live registry that owns it (parsers, advantage estimators,
KL types, loss aggregations, rewards, tools, model types and dtypes, schedules), so a typo fails
here, naming the field, and never after the model loaded. Errors are `ConfigError` (a
ValueError) and name the offending field (`algorithm.dual_clip_c must be > 1`). Loading YAML and
overrides is `config_loader`; derived values are properties (`cfg.algorithm.uses_critic`).

Modules: `checks` (ConfigError), `model` (model, tokenizer, data), `rollout` (rollout, tools,
env), `training` (algorithm, reward, optim, critic, sft), `trainer`, `run` (RunConfig).
"""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.config.checks import ConfigError
    from jaxrl_tools.config.model import (
        TASKS,
        DataSection,
        LoraSection,
        ModelSection,
        TinyModelConfig,
        TokenizerSection,
    )
    from jaxrl_tools.config.rollout import (
        ENV_HISTORY,
        PROTOCOLS,
        EnvSection,
        RolloutSection,
        ToolSpec,
    )
    from jaxrl_tools.config.run import ADVANTAGE_INPUT_SOURCES, STEP_INPUTS, RunConfig
    from jaxrl_tools.config.trainer import TrainerSection
    from jaxrl_tools.config.training import (
        AlgorithmSection,
        CriticSection,
        FiltersSection,
        OptimSection,
        RewardSpec,
        SFTSection,
    )

__all__ = [
    "ADVANTAGE_INPUT_SOURCES",
    "ENV_HISTORY",
    "PROTOCOLS",
    "STEP_INPUTS",
    "TASKS",
    "AlgorithmSection",
    "ConfigError",
    "CriticSection",
    "DataSection",
    "EnvSection",
    "FiltersSection",
    "LoraSection",
    "ModelSection",
    "OptimSection",
    "RewardSpec",
    "RolloutSection",
    "RunConfig",
    "SFTSection",
    "TinyModelConfig",
    "TokenizerSection",
    "ToolSpec",
    "TrainerSection",
]

__getattr__, __dir__ = lazy_api(__name__)
