"""`preflight`: every check of a run, in order, and the plan it prints."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_tools import models, records, setup, tools
from jaxrl_tools.check.inputs import (
    check_data,
    check_model,
    check_positions,
    check_prompt_lengths,
    check_sft,
    check_tokenizer,
    tiny_model_config,
)
from jaxrl_tools.check.setup import (
    budget_warning,
    check_batch,
    check_ground_truths,
    check_mesh,
    check_rewards,
    check_tools,
    check_writable,
    tools_schema,
)
from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.train.trackers import check_installed

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------- preflight


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def _dtype_words(cfg: RunConfig) -> str:
    d = cfg.model.dtypes
    return d.compute if not d.mixed else f"{d.compute} compute, {d.param} master weights"


def _cache_words(cfg: RunConfig, m: models.ModelConfig) -> str:
    """The decode engine's KV cache and its size (as `make_engine` builds it)."""
    r, dtype = cfg.rollout, cfg.model.dtypes.cache_dtype
    max_len = r.context_len
    size = models.cache_bytes(m, r.slots, max_len, dtype)
    words = (
        f"KV cache {r.slots} x {max_len} positions {jnp.dtype(dtype).name} = {size / 2**30:.3g} GiB"
    )
    parked = r.slots if r.max_parked is None else r.max_parked
    if parked:  # rows of trajectories waiting on tools, at most whole ones
        parked_gib = models.cache_bytes(m, parked, max_len, dtype) / 2**30
        words += f"; up to {parked} rows parked in host memory (<= {parked_gib:.3g} GiB)"
    return words


def _model_line(cfg: RunConfig, m: models.ModelConfig) -> str:
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(models.param_shapes(m)))
    what = (
        f"tiny random {m.model_type}"
        if cfg.model.path is None
        else f"{m.model_type} from {cfg.model.path}"
    )
    return (
        f"{what}: {m.num_hidden_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads}"
        f"/{m.num_key_value_heads} heads, vocab {m.vocab_size}, {_count(n)} params, "
        f"{_dtype_words(cfg)}{', remat' if cfg.model.remat else ''}, "
        f"{m.max_position_embeddings} positions"
    )


def _tool_line(tool) -> str:
    if isinstance(tool, tools.PythonTool):
        return f"{tool.name} (python sandbox, {tool.mode}; isolation bwrap available)"
    if isinstance(tool, tools.SearchTool):
        kind = "BM25" if tool.retriever == "bm25" else "dense"
        return f"{tool.name} ({kind} search over {tool.corpus_path}, top {tool.top_k})"
    return f"{tool.name} ({type(tool).__name__})"


def _data_line(cfg: RunConfig, splits: dict, lengths: dict, split: str) -> str:
    if split not in splits:
        return "none"
    where = records.source(cfg).describe(cfg, split)
    info = lengths.get(split)
    if info is None:
        return f"{where}: 0 prompts"
    line = (
        f"{where}: {info['count']} prompts, longest {info['longest']} tokens "
        f"({info['longest_name']})"
    )
    if info["dropped"]:
        line += f"; {info['dropped']} longer than rollout.max_prompt_len dropped"
    skipped = getattr(splits[split], "num_skipped", 0)
    if skipped:
        line += f"; {skipped} bad lines skipped"
    return line


def preflight(cfg: RunConfig, *, needs_eval: bool = False) -> dict[str, Any]:
    """Checks the whole run before anything expensive (no model weights are read, no tool is
    started); builds the tokenizer of a tiny model if it is not there yet.

    Args:
      cfg: the run config (already validated by loading).
      needs_eval: the run evaluates on the held-out data (eval files are then required).

    Returns:
      What the run would do: one line of text per part ("model", "tokenizer", "devices",
      "batch", "algorithm", "rollout", "tools", "rewards", "train data", "eval data", "sft",
      "steps", "outputs") and "warnings" (a list); `format_summary` prints it.

    Raises:
      ConfigError: the first problem found, in one line naming the field or file and the fix.
    """
    model_cfg = check_model(cfg)
    if model_cfg is not None:
        check_positions(cfg, model_cfg.max_position_embeddings)
    else:
        check_positions(cfg, cfg.model.tiny.max_position_embeddings)
    tokenizer_action = check_tokenizer(cfg)
    splits = check_data(cfg, needs_eval=needs_eval)
    n_traces = check_sft(cfg)
    built = check_tools(cfg)
    check_rewards(cfg)
    check_ground_truths(cfg, splits)
    mesh_shape, n_devices, warnings = check_mesh(cfg)
    if (budget := budget_warning(cfg)) is not None:
        warnings = [*warnings, budget]
    for warning in warnings:
        log.warning("%s", warning)
    check_batch(cfg, mesh_shape)
    t = cfg.trainer
    check_writable(t.checkpoint_dir, "trainer.checkpoint_dir")
    check_writable(t.log_dir, "trainer.log_dir")
    check_installed(t.loggers)  # wandb / mlflow: the `trackers` extra
    # Last, the one check that may write (a tiny model's tokenizer, where train would build it).
    tokenizer = setup.setup_tokenizer(cfg)
    lengths = check_prompt_lengths(cfg, tokenizer, splits, tools_schema(cfg, built))
    if model_cfg is None:
        model_cfg = tiny_model_config(cfg, len(tokenizer))
    elif len(tokenizer) > model_cfg.vocab_size:
        raise ConfigError(
            f"the tokenizer at {cfg.tokenizer_path} has {len(tokenizer)} tokens, more than the "
            f"model's vocab_size={model_cfg.vocab_size}: use the model's own tokenizer"
        )

    r, a, o, d = cfg.rollout, cfg.algorithm, cfg.optim, cfg.data
    rows = cfg.update_rows
    micro_per_mini = rows // o.num_mini_batches // o.micro_batch_size
    kl = f"KL {a.kl_type} x {a.kl_coef:g}" + (" in the reward" if a.kl_in_reward else "")
    s = cfg.sft
    if not s.enabled:
        sft_line = "off"
    else:
        source = ", ".join(s.train_files) if s.train_files else "generated"
        sft_line = (
            f"{n_traces} traces ({source}), {s.epochs} epoch(s), batch {s.batch_size}, "
            f"lr {s.lr:g}, max {s.max_len} tokens"
        )
    platform = jax.devices()[0].platform
    return {
        "model": _model_line(cfg, model_cfg),
        "tokenizer": f"{cfg.tokenizer_path} ("
        + ("built now" if tokenizer_action == "build" else "present")
        + f", {len(tokenizer)} tokens)",
        "devices": f"{n_devices} {platform}; mesh {'x'.join(map(str, mesh_shape))} "
        "(data x fsdp x tensor)"
        + ("" if r.mesh is None else f", decode on {r.mesh}")
        + (
            f", rollouts up to {cfg.trainer.max_staleness} version(s) ahead"
            + (" (partial)" if cfg.trainer.partial_rollouts else "")
            if cfg.trainer.max_staleness
            else ""
        ),
        "batch": f"{d.batch_size} prompts x {r.group_size} samples"
        + (f" x {cfg.env.max_turns} turns" if cfg.env.windowed else "")
        + f" = {rows} sequences per step: "
        f"{o.num_mini_batches} mini-batch(es) x {micro_per_mini} micro-batch(es) of "
        f"{o.micro_batch_size}, {o.ppo_epochs} epoch(s)",
        "algorithm": f"{a.adv_estimator}, {a.policy_loss} (clip {a.clip_eps_low:g}/"
        f"{a.clip_eps_high:g}, {a.loss_agg_mode}), "
        + (kl if a.kl_coef > 0 else "no KL")
        + (f", off-policy {c.describe()}" if (c := a.correction()).active else "")
        + (", critic" if cfg.critic.enabled else "")
        + f"; lr {o.lr:g} {o.schedule}, warm-up {o.warmup_steps}",
        "rollout": f"protocol {r.protocol}, prompts <= {r.max_prompt_len} tokens, responses <= "
        f"{r.max_response_len}, temperature {r.temperature:g}, <= {r.max_tool_calls} tool "
        f"calls, {r.slots} slots, {_cache_words(cfg, model_cfg)}",
        "tools": "; ".join(_tool_line(tool) for tool in built) or "none",
        "rewards": ", ".join(
            f"{x.name} x {x.weight:g}" + (f" {dict(x.kwargs)}" if x.kwargs else "")
            for x in cfg.reward
        ),
        "train data": _data_line(cfg, splits, lengths, "train"),
        "eval data": _data_line(cfg, splits, lengths, "eval"),
        "sft": sft_line,
        "steps": f"{t.steps} RL steps, checkpoint every {t.checkpoint_every or t.steps} (keep "
        f"{t.keep_checkpoints}), eval every {t.eval_every or '-'}, resume "
        + ("on" if t.resume else "off"),
        "outputs": f"checkpoints {t.checkpoint_dir}, logs {t.log_dir} (both writable); "
        f"loggers {', '.join(t.loggers)}"
        + (f", samples every {t.log_samples_every} steps" if t.log_samples_every else ""),
        "warnings": warnings,
    }


def preflight_sft(cfg: RunConfig) -> None:
    """The checks of `jaxrl-tools sft` (the SFT stage alone, whatever `sft.enabled` says)."""
    check_model(cfg)
    check_tokenizer(cfg)
    check_sft(dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, enabled=True)))


def preflight_eval(cfg: RunConfig) -> None:
    """The checks of `jaxrl-tools eval` (held-out data, tools, rewards; the model or
    checkpoint is found by the evaluation itself)."""
    check_model(cfg)
    check_tokenizer(cfg)
    splits = check_data(cfg, needs_eval=True, needs_train=False)
    check_tools(cfg)
    check_rewards(cfg)
    check_ground_truths(cfg, splits)


def format_summary(summary: dict[str, Any]) -> str:
    """The summary of `preflight` as aligned text, warnings last."""
    lines = [f"  {k:<11} {v}" for k, v in summary.items() if k != "warnings"]
    lines += [f"  warning     {w}" for w in summary.get("warnings", ())]
    return "\n".join(lines)
