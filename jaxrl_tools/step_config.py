"""A run config's RL step: the trainer's setup, the step's settings and its shapes.

One mapping of the config's sections, used by `run.make_trainer` (the step trained) and `plan`
(the step compiled on abstract shapes): both get the very same `train.step.RLStep` object.
"""

from __future__ import annotations

import dataclasses

from jaxrl_tools import models
from jaxrl_tools.train.rl import RLSetup
from jaxrl_tools.train.step import RLStep, make_rl_step


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


def rl_setup(cfg) -> RLSetup:
    """The trainer's setup of a run config (`run.make_trainer` builds its trainer with it)."""
    return RLSetup(
        rows=cfg.update_rows,
        group_size=cfg.rollout.group_size,
        temperature=cfg.rollout.temperature,
        max_response_len=cfg.rollout.max_response_len,
        total_steps=cfg.trainer.steps,
        seed=cfg.trainer.seed,
        remat=cfg.model.remat_policy if cfg.model.remat else False,
        dtypes=cfg.model.dtypes,
        attention=cfg.model.attention,
        pack=cfg.optim.pack,
        lora=cfg.model.lora.config,
        lora_decode=cfg.model.lora.decode,
        # After SFT the base is not model.path's weights: a resumed run needs it back.
        checkpoint_base=cfg.sft.enabled,
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
    settings = rl_setup(cfg).step_settings(model_cfg, cfg.algorithm, cfg.optim, cfg.critic)
    return make_rl_step(settings, mesh, rules)


def run_shapes(cfg) -> dict:
    """plan_memory's shape arguments for one RL step of the run."""
    r = cfg.rollout
    prefill = max(16, 1 << (r.max_prompt_len - 1).bit_length())  # the engine's prompt bucket
    return dict(
        rows=cfg.update_rows,
        seq_len=r.max_prompt_len + r.max_response_len,
        slots=r.slots,
        cache_len=prefill + r.max_response_len,
    )
