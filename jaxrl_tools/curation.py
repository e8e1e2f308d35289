"""Data curation by pass rate (`jaxrl-tools pass-rate`): each training prompt is sampled k times
by the recipe's own policy, engine, tools and reward, and the prompts its policy always or never
solves are dropped.

A group whose samples all score alike gets zero advantage under GRPO and its descendants, so it
costs a rollout and teaches nothing. The papers filter such prompts out before training (an
offline pass-rate band) and order what is left by difficulty (a curriculum, `data.curriculum`).

    rates = sample_pass_rates(cfg, sampler, params, recs, reward, samples=8, seed=0)
    kept = in_band(rates, 0.1, 0.9)                         # one flag per record
    write_records(cfg, recs, rates, kept, "data/train_pass_rate.jsonl")

A sample passes when the reward's answer checker says it is right (`reward.correctness`: math,
qa_em, ...); for a reward without one, when its score is above 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.rewards import is_correct
from jaxrl_tools.train.scoring import score_trajectories


def parse_band(text: str) -> tuple[float, float]:
    """The band of `--keep LO..HI` as (LO, HI), 0 <= LO <= HI <= 1; a ConfigError otherwise."""
    lo, sep, hi = text.partition("..")
    try:
        band = (float(lo), float(hi)) if sep else None
    except ValueError:
        band = None
    if band is None or not 0.0 <= band[0] <= band[1] <= 1.0:
        raise ConfigError(f"--keep={text!r}: give LO..HI with 0 <= LO <= HI <= 1, e.g. 0.1..0.9")
    return band


def sample_pass_rates(
    cfg: RunConfig, sampler, params, recs: Sequence[dict], reward, samples: int, seed: int
) -> np.ndarray:
    """The share of `samples` samples of each record that pass, at the rollout's temperature."""
    trajs = []
    batch = cfg.data.batch_size
    for i in range(0, len(recs), batch):
        part = recs[i : i + batch]
        trajs += sampler(part, samples, params, temperature=cfg.rollout.temperature, seed=seed + i)
    scores, _ = score_trajectories(reward, recs, trajs, samples)
    kind = reward.correctness
    if kind is None:
        passed = np.asarray(scores) > 0
    else:
        gts = [recs[i // samples].get("ground_truth") for i in range(len(trajs))]
        passed = np.array([is_correct(t.model_text, gt, kind) for t, gt in zip(trajs, gts)])
    return passed.reshape(len(recs), samples).mean(axis=1)


def in_band(rates: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Which pass rates lie in [lo, hi]."""
    return (rates >= lo) & (rates <= hi)


def zero_variance_frac(rates: np.ndarray) -> float:
    """The share of groups whose samples all passed or all failed (no GRPO advantage)."""
    return float(np.mean((rates == 0.0) | (rates == 1.0))) if len(rates) else 0.0


def limr_scores(rewards_NK: np.ndarray) -> np.ndarray:
    """LIMR's learning-impact score (arXiv 2502.11886, ToRL's data selection) of each sample
    from its mean reward at each of K epochs of a full-data run, [N, K]:
    s_i = 1 - sum_k (r_ik - rbar_k)^2 / sum_k (1 - rbar_k)^2, rbar_k the mean over samples.
    A sample whose curve follows the model's average learning curve scores near 1."""
    r = np.asarray(rewards_NK, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] == 0 or r.shape[1] == 0:
        raise ValueError(f"limr_scores: rewards must be [samples, epochs], got shape {r.shape}")
    mean_K = r.mean(axis=0)
    denom = np.sum((1.0 - mean_K) ** 2)
    if denom == 0:  # every sample solved at every epoch: no curve to align with
        raise ValueError("limr_scores: the average reward is 1 at every epoch")
    return 1.0 - np.sum((r - mean_K) ** 2, axis=1) / denom


def limr_keep(rewards_NK: np.ndarray, threshold: float = 0.6) -> np.ndarray:
    """Which samples LIMR keeps: score above `threshold` (the paper's 0.6)."""
    return limr_scores(rewards_NK) > threshold


def write_records(cfg: RunConfig, recs: Sequence[dict], rates, keep, path: str | Path) -> int:
    """The kept records as a jsonl file `data.train_files` reads with the same config's keys,
    each with its "pass_rate" (what `data.curriculum` orders by). Returns the count written."""
    d = cfg.data
    n = 0
    with open(path, "w") as f:
        for rec, rate, kept in zip(recs, rates, keep):
            if not kept:
                continue
            row = {k: v for k, v in rec.items() if k not in ("meta", "source", "index")}
            row.update(rec.get("meta") or {})  # a file record's other fields, as they were
            row[d.prompt_key] = row.pop("prompt")
            row[d.answer_key] = row.pop("ground_truth", None)
            if row.get("tools") is None:
                row.pop("tools", None)
            elif d.tools_key != "tools":
                row[d.tools_key] = row.pop("tools")
            row["pass_rate"] = float(rate)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def pass_rate_of(record: dict) -> float | None:
    """A record's pass rate: its own field, or a file record's (kept under "meta")."""
    rate = record.get("pass_rate", (record.get("meta") or {}).get("pass_rate"))
    return None if rate is None else float(rate)


def curriculum_order(recs: Sequence[dict], curriculum: str) -> list[int]:
    """The record indices in `data.curriculum`'s order: "easy_to_hard" (highest pass rate
    first; ties in file order). A record without a pass rate is a ConfigError."""
    rates = []
    for i, rec in enumerate(recs):
        rate = pass_rate_of(rec)
        if rate is None:
            where = rec.get("source", f"record {i}")
            raise ConfigError(
                f"data.curriculum={curriculum!r} orders by pass rate, and {where} has none: "
                "write the training file with `jaxrl-tools pass-rate`"
            )
        rates.append(rate)
    return sorted(range(len(recs)), key=lambda i: -rates[i])


def run_pass_rate(
    cfg: RunConfig,
    *,
    samples: int,
    band: tuple[float, float],
    output: str,
    from_checkpoint: bool = False,
    step: int | None = None,
    recheck: bool = False,
) -> dict[str, Any]:
    """`jaxrl-tools pass-rate`: samples every training prompt, writes the ones in `band`, and
    returns the figures printed. With `recheck`, a second round of fresh samples measures the
    zero-variance share again, over all prompts and over the kept ones (the filter's effect on
    samples it did not select on)."""
    from jaxrl_tools import records, run  # noqa: PLC0415 - records orders by curriculum_order

    model_cfg, params, tokenizer, _ = run.load_policy(
        cfg, from_checkpoint=from_checkpoint, step=step
    )
    tools, episodes = run.setup_tools(cfg), run.setup_episodes(cfg)
    try:
        sampler = run.make_sampler(cfg, model_cfg, params, tokenizer, tools, episodes=episodes)
        train = records.records(cfg, "train")
        recs = list(records.fit_prompts(cfg, train, "train", tokenizer, sampler.tools_schema))
        reward = run.make_reward(cfg)
        rates = sample_pass_rates(
            cfg, sampler, params, recs, reward, samples, seed=cfg.trainer.seed
        )
        keep = in_band(rates, *band)
        out = {
            "prompts": len(recs),
            "kept": write_records(cfg, recs, rates, keep, output),
            "pass_rate_mean": float(rates.mean()),
            "never_solved": float(np.mean(rates == 0.0)),
            "always_solved": float(np.mean(rates == 1.0)),
            "zero_variance_frac": zero_variance_frac(rates),
            "zero_variance_frac_kept": zero_variance_frac(rates[keep]),
        }
        if recheck:
            again = sample_pass_rates(
                cfg, sampler, params, recs, reward, samples, seed=cfg.trainer.seed + 10**6
            )
            out["recheck_zero_variance_frac"] = zero_variance_frac(again)
            out["recheck_zero_variance_frac_kept"] = zero_variance_frac(again[keep])
        return out
    finally:
        run.close_tools(tools)
        run.close_episodes(episodes)
