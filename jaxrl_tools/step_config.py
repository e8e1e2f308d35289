"""A run config's RL step: the step's settings and its shapes.

One mapping of the config's sections, used by `run.make_trainer` (the step trained) and `plan`
(the step compiled on abstract shapes): both get the very same `train.step.RLStep` object.
"""

from __future__ import annotations

import dataclasses

from jaxrl_tools import models
from jaxrl_tools.train.step import RLStep, StepSettings, make_rl_step


def model_config(cfg) -> models.ModelConfig:
    """The run's architecture without its weights: `config.json` of `model.path`, or the tiny
    model with the tokenizer's vocabulary (`tokenizer.vocab_size` when it is not built yet)."""
    if cfg.model.path is not None:
        return models.load_config(cfg.model.path)
    tiny = dataclasses.asdict(cfg.model.tiny)
    tiny.pop("seed")
    return models.ModelConfig(
        **tiny,
        vocab_size=cfg.tokenizer.vocab_size,
        attention_bias=tiny["model_type"] == "qwen2",
        qk_norm=tiny["model_type"] == "qwen3",
    )


def step_settings(cfg, model_cfg: models.ModelConfig) -> StepSettings:
    """The RL step's settings of a run config: the trainer's (`run.make_trainer`) and `plan`'s."""
    return StepSettings(
        model=model_cfg,
        algorithm=cfg.algorithm,
        optim=cfg.optim,
        critic=cfg.critic,
        group_size=cfg.rollout.group_size,
        temperature=cfg.rollout.temperature,
        max_response_len=cfg.rollout.max_response_len,
        total_steps=cfg.trainer.steps,
        remat=cfg.model.remat_policy if cfg.model.remat else False,
        dtypes=cfg.model.dtypes,
        attention=cfg.model.attention,
        lora=cfg.model.lora.config,
        on_nonfinite=cfg.trainer.on_nonfinite,
    )


def run_step(cfg, mesh=None, rules=None, model_cfg: models.ModelConfig | None = None) -> RLStep:
    """The RL step a run's trainer runs (the same object: `train.step.make_rl_step`).

    Args:
      cfg: the run config.
      mesh, rules: the trainer's mesh and rules table (None: one device, the default rules).
      model_cfg: the architecture (default: `model_config(cfg)`).
    """
    model_cfg = model_config(cfg) if model_cfg is None else model_cfg
    return make_rl_step(step_settings(cfg, model_cfg), mesh, rules)


def run_shapes(cfg) -> dict:
    """plan_memory's shape arguments for one RL step of the run."""
    r = cfg.rollout
    return dict(
        rows=cfg.update_rows,
        seq_len=r.max_prompt_len + r.max_response_len,
        slots=r.slots,
        cache_len=r.context_len,
    )
