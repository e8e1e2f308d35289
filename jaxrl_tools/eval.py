"""Held-out evaluation: a sampler and a reward, nothing of the trainer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_tools.datasets import call_metrics
from jaxrl_tools.rewards import CompositeReward, is_correct
from jaxrl_tools.rewards.tool_calls import ground_truth_calls
from jaxrl_tools.tools import read_tool_calls
from jaxrl_tools.train.scoring import means_by, rollout_metrics, score_trajectories
from jaxrl_tools.types import Record, Sampler


def evaluate(
    sampler: Sampler,
    params: Any,
    records: Sequence[Record],
    reward: CompositeReward,
    *,
    group_size: int = 1,
    temperature: float = 0.0,
    batch_size: int = 32,
    seed: int = 0,
    step: int | None = None,
) -> dict:
    """Accuracy (by the reward's answer checker), pass@G, tool use and reward on `records`.

    Args:
      sampler: records -> trajectories.
      params: the policy.
      records: held-out prompts with their ground truth (and optional "difficulty" and
        "kind": accuracy and tool use are also reported per value).
      reward: the run's reward (its terms are reported; accuracy uses `reward.correctness`).
      group_size: samples per problem (pass@G when > 1).
      temperature: 0 = greedy.
      batch_size: prompts per sampler call.
      seed: base seed of the sampler calls.
      step: the RL step the rewards score at (rewards scheduled over training read it).
    """
    g = group_size
    trajs = []
    for i in range(0, len(records), batch_size):
        trajs += sampler(
            records[i : i + batch_size], g, params, temperature=temperature, seed=seed + i
        )
    gts = [records[i // g].get("ground_truth") for i in range(len(trajs))]
    scores, parts = score_trajectories(reward, records, trajs, g, step)
    metrics = rollout_metrics(trajs, scores, parts, group_size=g)
    metrics["num_problems"] = len(records)
    kind = reward.correctness
    correct = np.array([is_correct(t.model_text, gt, kind) for t, gt in zip(trajs, gts)])
    used = np.array([t.num_tool_calls > 0 for t in trajs])
    metrics["reward/accuracy"] = float(correct.mean())
    if g > 1:  # pass@g: any of a problem's g samples correct
        metrics[f"reward/pass@{g}"] = float(correct.reshape(-1, g).any(axis=1).mean())
    if kind == "tool_calls":  # function calling: the calls against the ground truth's
        metrics.update(function_call_metrics([t.model_text for t in trajs], gts))
    levels = [records[i // g].get("difficulty") for i in range(len(trajs))]
    metrics |= means_by("level", levels, accuracy=correct, tool=used)
    kinds = [records[i // g].get("kind") for i in range(len(trajs))]  # finer, where named
    metrics |= means_by("kind", kinds, accuracy=correct, tool=used)
    # Each problem's mean over its samples: the paired standard error of a change needs them.
    per_problem = {
        "reward/accuracy": correct.reshape(-1, g).mean(axis=1).tolist(),
        "tools/used_frac": used.reshape(-1, g).mean(axis=1).tolist(),  # which problems call
    }
    if "env/success_rate" in metrics:
        success = np.array([t.env_success for t in trajs], np.float64)
        per_problem["env/success_rate"] = success.reshape(-1, g).mean(axis=1).tolist()
    metrics["_per_problem"] = per_problem
    # The first sample of each level (the report's answers before and after RL), else the first 3.
    firsts: dict = {}
    for i, lv in enumerate(levels):
        firsts.setdefault(lv, i)
    shown = sorted(firsts.values()) if len(firsts) > 1 else range(min(3, len(trajs)))
    metrics["_examples"] = [
        {
            "prompt": records[i // g].get("prompt"),
            "response": trajs[i].response_text,
            "ground_truth": gts[i],
            "score": float(scores[i]),
        }
        for i in shown
    ]
    return metrics


def function_call_metrics(responses: Sequence[str], ground_truths: Sequence[Any]) -> dict:
    """`calls/...`: exact-call accuracy, name and argument F1, no-call precision
    (`datasets.call_metrics`) and the fraction of responses that call. A response whose
    <tool_call> block does not parse counts as one call that matches nothing."""
    unreadable = [{"name": None, "arguments": {}}]
    predicted = [read_tool_calls(r) for r in responses]
    predicted = [unreadable if p is None else p for p in predicted]
    truth = [ground_truth_calls(gt) for gt in ground_truths]
    out = {f"calls/{k}": v for k, v in call_metrics(predicted, truth).items()}
    out["calls/call_rate"] = float(np.mean([bool(p) for p in predicted])) if predicted else 0.0
    return out
