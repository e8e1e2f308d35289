"""jaxrl-tools: agentic, tool-using reinforcement learning of LLMs in JAX/Flax.

The package is the pipeline; each subpackage is a stage:

    config / config_loader   the typed run configuration and its YAML loader
    data                     prompt records, grain pipelines, the prompt renderer
    rollout                  decode engine, sampling, stop scan, agent loop, sampler
    rewards                  rule-based rewards by registry, composed
    algorithms               advantage estimators, losses, KL, log-probs, filters
    train                    state, policy, batches, objectives, the RL trainer, SFT
    eval, demo, run, cli     evaluation, the demo task, composition, the command line
    check, smoke             pre-flight checks of a whole run; the `--smoke` version of a recipe
    interop                  batches in verl's layout; one update here vs PyTorch (`repro`)
    gateway                  the OpenAI-compatible API over the rollout engine (agents, `serve`)

`models`, `sharding` and `tools` are the decoders, the device mesh and the tools.

docs/DESIGN.md is the map: the floors (what may import what, kept by tests/test_layers.py), one
RL step and one gateway request as data through named files and functions, the engine protocol
and the registries.
"""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools import rewards
    from jaxrl_tools.config import ConfigError, RunConfig
    from jaxrl_tools.config_loader import load_config
    from jaxrl_tools.eval import evaluate
    from jaxrl_tools.rollout import EngineCore, RolloutLimits, Sampler, SamplingParams, run_rollouts
    from jaxrl_tools.train.batch import make_batch
    from jaxrl_tools.train.rl import RLTrainer
    from jaxrl_tools.train.step import StepSettings
    from jaxrl_tools.types import Batch, Span, ToolCallRecord, Trajectory

__all__ = [
    "Batch",
    "ConfigError",
    "EngineCore",
    "RLTrainer",
    "RolloutLimits",
    "RunConfig",
    "Sampler",
    "SamplingParams",
    "Span",
    "StepSettings",
    "ToolCallRecord",
    "Trajectory",
    "evaluate",
    "load_config",
    "make_batch",
    "rewards",
    "run_rollouts",
]

__getattr__, __dir__ = lazy_api(__name__)
