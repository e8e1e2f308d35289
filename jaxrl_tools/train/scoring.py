"""Scoring sampled trajectories: their rewards, the group filters and the rollout's statistics.

`score_trajectories` gives each trajectory its reward (an agent's own, or the run's composite
reward on its model text); `filter_groups` keeps the prompt groups that DAPO's dynamic sampling,
ZeroTIR's accuracy band and StarPO-S keep, and `complete_groups` drops groups holding an agent
run cut at its timeout; `rollout_metrics` is a batch's reward, accuracy, tool-use, length and
environment statistics; `greedy_baselines` is ReMax's greedy-rollout baseline.
`train.batch` puts these together into an update's `Batch`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl_tools import algorithms
from jaxrl_tools.config import FiltersSection
from jaxrl_tools.rewards import (
    CORRECTNESS_CHECKERS,
    TIMEOUTS,
    CompositeReward,
    RewardError,
    TrajectoryInfo,
)
from jaxrl_tools.types import AGENT_TIMEOUT, Record, Trajectory


def score_trajectories(
    reward: CompositeReward,
    records: Sequence[Record],
    trajectories: Sequence[Trajectory],
    group_size: int,
    step: int | None = None,
) -> tuple[np.ndarray, dict]:
    """(rewards_N, {term: values_N}) of trajectories, `group_size` consecutive ones per record,
    scored at RL step `step` (rewards scheduled over training read it)."""
    infos = [
        TrajectoryInfo(
            tool_calls=t.tool_calls,
            num_calls=t.num_tool_calls,
            # verl's count: the prompt, then every model turn and tool/environment turn
            num_turns=1 + len(t.spans),
            response_length=len(t.response_ids),
            env_rewards=tuple(t.env_rewards),
            step=step,
        )
        for t in trajectories
    ]
    group_ids = [i // group_size for i in range(len(trajectories))]
    gts = [records[g].get("ground_truth") for g in group_ids]
    texts = [t.model_text for t in trajectories]
    # a run cut at its timeout returns nothing (its group is left out of the update)
    returned = [
        t.agent_reward is not None or t.finish_reason == AGENT_TIMEOUT for t in trajectories
    ]
    if any(t.agent_reward is not None for t in trajectories):  # agents score their episodes
        if not all(returned):
            i = returned.index(False)
            rec = records[group_ids[i]]
            raise RewardError(
                f"record {rec.get('id', group_ids[i])}, sample {i % group_size}: the agent "
                "returned no reward where others did; return one from every run, or none",
                i,
            )
        scores = np.asarray([t.agent_reward or 0.0 for t in trajectories], np.float32)
        return scores, {"agent": scores}
    try:
        return reward.batch(texts, gts, infos, group_ids=group_ids)
    except RewardError as e:  # name the record and sample, and stop the run
        rec = records[group_ids[e.index]]
        where = rec.get("source") or f"record {rec.get('id', group_ids[e.index])}"
        raise RewardError(f"{where}, sample {e.index % group_size}: {e}", e.index) from None


def group_reward_metrics(scores: np.ndarray, group_size: int) -> dict:
    """RAGEN's signal of the "echo trap": the reward spread within each prompt's group (the
    sample std, as StarPO-S ranks groups by), averaged over the groups, and the share of groups
    whose samples all scored alike (no advantage, no gradient). A batch-wide std hides a
    collapse that happens group by group."""
    if group_size < 2 or len(scores) % group_size:
        return {}
    groups = scores.reshape(-1, group_size)
    return {
        "reward/group_std": float(groups.std(axis=1, ddof=1).mean()),
        "reward/uniform_groups_frac": float((groups.max(axis=1) == groups.min(axis=1)).mean()),
    }


def means_by(prefix: str, labels: Sequence, **values: np.ndarray) -> dict:
    """`{prefix}/{label}/{name}`: each of `values` averaged over the samples of each label
    (samples labelled None are in no group)."""
    labels = np.array(labels, dtype=object)
    out = {}
    for label in sorted({x for x in labels if x is not None}):
        sel = labels == label
        out |= {
            f"{prefix}/{label}/{k}": float(np.mean(np.asarray(v)[sel])) for k, v in values.items()
        }
    return out


def rollout_metrics(
    trajectories: Sequence[Trajectory],
    scores: np.ndarray,
    parts: dict,
    *,
    group_size: int,
    records: Sequence[Record] | None = None,
) -> dict:
    """Reward, accuracy, tool-use and length statistics of a batch of trajectories (`group_size`
    consecutive ones per prompt: the within-group reward spread, and the anchor-state
    statistics of environment episodes); with their `records`, reward and tool use per
    "difficulty" where records give one (`level/<d>/...`)."""
    calls = np.array([t.num_tool_calls for t in trajectories], np.float32)
    call_records = [c for t in trajectories for c in t.tool_calls]
    errors = sum(1 for c in call_records if not c.ok)
    lengths = np.array([len(t.response_ids) for t in trajectories], np.float32)
    out = {
        "reward/mean": float(np.mean(scores)),
        "reward/std": float(np.std(scores)),
        **group_reward_metrics(np.asarray(scores, np.float64), group_size),
        "tools/calls_per_response": float(calls.mean()),
        "tools/error_rate": errors / max(1, len(call_records)),
        "tools/used_frac": float((calls > 0).mean()),
        # turns with neither a call nor an answer (Search-R1's invalid actions), per response
        "tools/invalid_actions": float(np.mean([t.invalid_actions for t in trajectories])),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max(initial=0)),
    }
    for name, values in parts.items():
        total = name == TIMEOUTS  # calls, not a mean
        out[f"reward/{name}"] = float(np.sum(values) if total else np.mean(values))
    correct = answer_correct(parts)
    if correct is not None:
        out["reward/accuracy"] = float(np.mean(correct))
    turns = np.array([len(t.env_rewards) for t in trajectories], np.float32)
    if turns.any():  # episodes of an environment
        out["env/success_rate"] = float(np.mean([t.env_success for t in trajectories]))
        out["env/turns_mean"] = float(turns.mean())
        steps = [m for t in trajectories for m in t.env_metrics]
        for name in sorted({k for m in steps for k in m}):
            out[f"env/{name}"] = float(np.mean([m.get(name, 0.0) for m in steps]))
        out.update(anchor_metrics(trajectories, group_size))
    if records is not None:
        levels = [r.get("difficulty") for r in records for _ in range(group_size)]
        out.update(means_by("level", levels, reward=scores, tool=calls > 0))
    finish: dict[str, int] = {}
    for t in trajectories:
        finish[t.finish_reason] = finish.get(t.finish_reason, 0) + 1
    for reason, n in finish.items():
        out[f"response/finish_{reason}"] = n / len(trajectories)
    return out


def state_key(state, where):
    """A hashable key of an environment state (None: a state of its own, at `where`)."""
    if state is None:
        return ("none", *where)
    try:
        hash(state)
        return ("state", state)
    except TypeError:  # an unhashable state: compared by its repr
        return ("repr", repr(state))


def anchor_metrics(trajectories: Sequence[Trajectory], group_size: int) -> dict:
    """How GiGPO's anchor-state groups come out: over the environment steps of the batch, the
    mean number of steps of the same prompt group taken in the same state
    ("env/anchor_group_size"), and the share of steps whose state another step of the group
    also met ("env/anchor_shared_frac": only those get a step-level advantage)."""
    sizes = []
    for g in range(0, len(trajectories), group_size):
        keys = [
            state_key(state, (i, k))
            for i, t in enumerate(trajectories[g : g + group_size])
            for k, state in enumerate(t.env_states[: len(t.env_rewards)])
        ]
        count = Counter(keys)
        sizes += [count[key] for key in keys]
    if not sizes:
        return {}
    sizes = np.asarray(sizes, np.float32)
    return {
        "env/anchor_group_size": float(sizes.mean()),
        "env/anchor_shared_frac": float((sizes > 1).mean()),
    }


def complete_groups(groups, trajectories: Sequence[Trajectory], group_size: int) -> list[int]:
    """`groups` without those holding an agent run cut at rollout.agent_timeout_s: its ending
    is not the policy's, and any score given it would bias its group's baseline."""
    return [
        g
        for g in groups
        if all(
            t.finish_reason != AGENT_TIMEOUT
            for t in trajectories[g * group_size : (g + 1) * group_size]
        )
    ]


def answer_correct(parts: dict) -> np.ndarray | None:
    """Whether each response's answer is right, from the reward term that is an answer check
    ("math", "qa_em", ...); None when no term is one."""
    checker = next((name for name in CORRECTNESS_CHECKERS if name in parts), None)
    return None if checker is None else np.asarray(parts[checker]) > 0


def filter_groups(
    scores_N: np.ndarray, group_size: int, filters: FiltersSection, parts: dict | None = None
) -> np.ndarray:
    """Indices of the prompt groups the configured filters keep (DAPO, ZeroTIR, StarPO-S).
    DAPO's dynamic sampling drops groups whose accuracy is all 0 or all 1 (the answer check's
    term of `parts`; the reward itself where there is none): shaping such as the overlong
    penalty does not keep an all-correct group."""
    keep = np.arange(len(scores_N) // group_size)
    sel = lambda idx: keep[np.isin(keep, idx)]
    grouped = scores_N.reshape(-1, group_size)
    if filters.dynamic_sampling:
        correct = answer_correct(parts or {})
        signal = grouped if correct is None else correct.astype(float).reshape(-1, group_size)
        keep = sel(algorithms.dynamic_sampling_filter(signal))
    if filters.zerotir:
        keep = sel(
            algorithms.accuracy_band_filter(
                (grouped > 0).astype(float), low=filters.zerotir_low, high=filters.zerotir_high
            )
        )
    if filters.starpo_s:
        keep = sel(algorithms.starpo_s_filter(grouped, keep_fraction=filters.starpo_keep_frac))
    return keep


def greedy_baselines(
    sample: Callable[..., list[Trajectory]],
    records: Sequence[Record],
    reward: CompositeReward,
    step: int | None = None,
) -> np.ndarray:
    """ReMax's baseline: one greedy (temperature 0) rollout per record, scored by the run's
    reward at RL step `step`; [len(records)]. `sample(records, group_size, temperature=...)`
    is the sampler."""
    trajs = sample(records, 1, temperature=0.0)
    scores, _ = score_trajectories(reward, records, trajs, 1, step)
    return np.asarray(scores, np.float32)
