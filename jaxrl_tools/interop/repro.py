"""`jaxrl-tools repro`: one update on a saved batch, here and in the PyTorch reference."""

from __future__ import annotations

import numpy as np

from jaxrl_tools import algorithms, models
from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.interop import reference, trl_grpo
from jaxrl_tools.interop.batch import load_batch
from jaxrl_tools.interop.compare import (
    BF16,
    FP32,
    compare_updates,
    compare_with_batch,
    format_grad_table,
)
from jaxrl_tools.interop.update import UpdateSettings, jax_update


def _flat(settings: dict) -> dict:
    """{"algorithm": {...}, "optim": {...}, ...} as {"algorithm.<field>": ..., ...}."""
    out = {}
    for k, v in settings.items():
        if isinstance(v, dict):
            out.update({f"{k}.{f}": x for f, x in v.items()})
        else:
            out[k] = v
    return out


def repro(
    cfg: RunConfig, batch_path: str, with_torch: bool, with_trl: bool = False
) -> tuple[list[str], bool]:
    """(report lines, every stage within tolerance) of one update on the batch at
    ``batch_path``, with the policy ``cfg.model.path`` and the settings of ``cfg``; with_torch
    adds the PyTorch reference, with_trl TRL's GRPO loss (loss and gradients only)."""
    if cfg.model.path is None:
        raise ConfigError(
            "repro: set model.path to the Hugging Face folder of the policy that produced the "
            "batch (both frameworks load it)"
        )
    batch, stored = load_batch(batch_path)
    settings = UpdateSettings.from_run_config(cfg)
    if with_trl:
        trl_grpo.check_settings(settings)  # before anything runs
    B, R = batch["responses"].shape
    mine = _flat(settings.to_dict())
    shown = ", ".join(f"{k}={v!r}" for k, v in mine.items())
    lines = [f"batch {batch_path}: {B} responses, {R} response columns", f"settings: {shown}"]
    stored = _flat(stored)
    differ = {k: v for k, v in stored.items() if k in mine and np.any(np.asarray(v) != mine[k])}
    if differ:
        lines.append(f"note: the batch was made with other settings: {differ}")
    tol = BF16 if cfg.model.dtype == "bfloat16" else FP32
    model_cfg, params = models.from_pretrained(
        cfg.model.path, dtype=models.PARAM_DTYPES[cfg.model.dtype]
    )
    ours = jax_update(model_cfg, params, batch, settings)
    lines.append(f"loss here: {ours.loss:.8g}")
    stages = compare_with_batch(ours, batch, tol)
    if with_torch:
        model = reference.load_model(cfg.model.path, cfg.model.dtype)
        ref = reference.torch_update(model, batch, settings)
        lines += ["gradient norms by parameter:", format_grad_table(ours.grads, ref.grads)]
        stages += compare_updates(ours, ref, batch["response_mask"], tol)
    else:
        lines += ["gradient norms by parameter:", format_grad_table(ours.grads)]
    if with_trl:
        stages += trl_grpo.compare_with_trl(
            ours, cfg.model.path, batch, settings, tol, cfg.model.dtype
        )
    mask = batch["response_mask"]
    mode, L = settings.algorithm.loss_agg_mode, cfg.rollout.max_response_len
    verl_d = float(algorithms.verl_loss_denominator(mask, mode, R))
    ours_d = float(algorithms.loss_denominator(mask, mode, L))
    if verl_d != ours_d:
        lines.append(
            f"note: these updates divide the loss as verl does ({verl_d:g}); the jaxrl-tools "
            f"trainer divides {mode} by {ours_d:g} (docs/METHODS.md §7): its gradient is "
            f"{verl_d / ours_d:.4g} times this one (Adam's first step barely changes)"
        )
    lines += [s.line() for s in stages]
    ok = all(s.ok for s in stages)
    lines.append("repro: all stages within tolerance" if ok else "repro: FAILED (see FAIL lines)")
    return lines, ok
