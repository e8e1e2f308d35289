"""Trajectories -> one update's Batch: rewards, group filters, padding into fixed shapes.

`make_batch` scores one round of trajectories; `collect_batch` samples rounds until the filters
have kept a full batch (DAPO dynamic sampling) and adds ReMax's greedy baselines. Multi-turn
trajectories also give per-turn advantage inputs (`step_arrays`): turn k is the k-th model
span, its step reward the reward of the environment step its text went to. Episodes played with
windowed history (`Trajectory.turns`) are laid out a turn per row (`_turn_batch`).
"""

from __future__ import annotations

import time
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
from jaxrl_tools.types import AGENT_TIMEOUT, Batch, Record, Trajectory


def _bucket(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def pad_trajectories(
    trajectories: Sequence[Trajectory], *, pad_id: int, rows: int, length_multiple: int = 16
) -> dict[str, np.ndarray]:
    """Lays trajectories out as right-padded [rows, T] arrays aligned to tokens.

    Rows beyond the trajectories are all padding (mask 0). T is rounded up to `length_multiple`
    (few compiles).
    """
    if len(trajectories) > rows:
        raise ValueError(f"{len(trajectories)} trajectories do not fit in {rows} rows")
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    T = _bucket(max(lengths, default=1), length_multiple)
    out = {
        "tokens": np.full((rows, T), pad_id, np.int32),
        "positions": np.zeros((rows, T), np.int32),
        "attention": np.zeros((rows, T), np.int32),
        "loss_mask": np.zeros((rows, T), np.float32),
        "behaviour_logp": np.zeros((rows, T), np.float32),
    }
    for i, traj in enumerate(trajectories):
        p, r = len(traj.prompt_ids), len(traj.response_ids)
        out["tokens"][i, : p + r] = np.concatenate([traj.prompt_ids, traj.response_ids])
        out["positions"][i, : p + r] = np.arange(p + r)
        out["attention"][i, : p + r] = 1
        out["loss_mask"][i, p : p + r] = traj.loss_mask
        out["behaviour_logp"][i, p : p + r] = np.asarray(traj.logprobs) * np.asarray(traj.loss_mask)
    return out


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


def rollout_metrics(
    trajectories: Sequence[Trajectory], scores: np.ndarray, parts: dict, *, group_size: int
) -> dict:
    """Reward, accuracy, tool-use and length statistics of a batch of trajectories (`group_size`
    consecutive ones per prompt: the within-group reward spread, and the anchor-state
    statistics of environment episodes)."""
    calls = np.array([t.num_tool_calls for t in trajectories], np.float32)
    records = [r for t in trajectories for r in t.tool_calls]
    errors = sum(1 for r in records if not r.ok)
    lengths = np.array([len(t.response_ids) for t in trajectories], np.float32)
    out = {
        "reward/mean": float(np.mean(scores)),
        "reward/std": float(np.std(scores)),
        **group_reward_metrics(np.asarray(scores, np.float64), group_size),
        "tools/calls_per_response": float(calls.mean()),
        "tools/error_rate": errors / max(1, len(records)),
        "tools/used_frac": float((calls > 0).mean()),
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
    finish: dict[str, int] = {}
    for t in trajectories:
        finish[t.finish_reason] = finish.get(t.finish_reason, 0) + 1
    for reason, n in finish.items():
        out[f"response/finish_{reason}"] = n / len(trajectories)
    return out


def _state_key(state, where):
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
            _state_key(state, (i, k))
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


def step_arrays(
    trajectories: Sequence[Trajectory], *, rows: int, length: int, step_multiple: int = 4
) -> dict[str, np.ndarray]:
    """Per-turn advantage inputs of trajectories laid out as by `pad_trajectories`.

    Environment step k is the k-th model span whose text went to the environment (one followed
    by an observation span carrying a reward, or the last span when the environment ended the
    episode); its step reward is `env_rewards[k]`. Model spans that were tool turns belong to
    the step of the next environment turn (they lead to its action). A turn the environment
    never saw (cut by a length, budget or turn limit) is step `len(env_rewards)`, with step
    mask 0: it gets no step-level signal. Anchor ids number the distinct `env_states` of the
    whole batch in order of first appearance (equal states, equal ids); a missing state (None)
    gets an id of its own. S is rounded up to `step_multiple` (few compiles).

    Returns:
      {"step_rewards" [rows, S] f32, "step_mask" [rows, S] f32, "anchor_ids" [rows, S] i32,
       "token_step" [rows, length] i32 (0 off model tokens)}.
    """
    turns = [max(t.num_turns, len(t.env_rewards)) for t in trajectories]
    S = _bucket(max(turns, default=1), step_multiple)
    out = {
        "step_rewards": np.zeros((rows, S), np.float32),
        "step_mask": np.zeros((rows, S), np.float32),
        "anchor_ids": np.zeros((rows, S), np.int32),
        "token_step": np.zeros((rows, length), np.int32),
    }
    ids: dict = {}
    for i, t in enumerate(trajectories):
        n = len(t.env_rewards)
        out["step_rewards"][i, :n] = t.env_rewards
        out["step_mask"][i, :n] = 1.0
        for k, state in enumerate(t.env_states[:n]):
            out["anchor_ids"][i, k] = ids.setdefault(_state_key(state, (i, k)), len(ids))
        p, k = len(t.prompt_ids), 0
        for j, sp in enumerate(t.spans):
            if sp.kind != "model":
                continue
            out["token_step"][i, p + sp.start : p + sp.end] = min(k, S - 1)
            nxt = t.spans[j + 1] if j + 1 < len(t.spans) else None
            if nxt is not None and nxt.reward is not None:  # an environment turn
                k += 1
    return out


def _batch(
    trajectories: Sequence[Trajectory],
    scores: np.ndarray,
    metrics: dict,
    *,
    rows: int,
    pad_id: int,
    baselines: np.ndarray | None = None,
    turn_rows: int | None = None,
    step: int | None = None,
) -> Batch:
    """Pads kept trajectories (G consecutive ones per group) and their per-row inputs; episodes
    with windowed history into `turn_rows` rows of turns (`_turn_batch`)."""
    if trajectories and trajectories[0].turns is not None:
        if turn_rows is None:
            raise ValueError("episodes with windowed history need turn_rows (rows of turns)")
        return _turn_batch(
            trajectories, scores, metrics, rows=rows, turn_rows=turn_rows, pad_id=pad_id
        )
    arrays = pad_trajectories(trajectories, pad_id=pad_id, rows=rows)
    n = len(trajectories)
    scores_R = np.zeros(rows, np.float32)
    scores_R[:n] = scores
    # Always built (cheap): a batch in which no turn reached the environment (every one cut by
    # a limit) still feeds the per-turn estimators, with all step masks 0.
    length = arrays["tokens"].shape[1]
    steps = {
        f"{k}_R{'T' if k == 'token_step' else 'S'}": v
        for k, v in step_arrays(trajectories, rows=rows, length=length).items()
    }
    baseline_R = None
    if baselines is not None:
        baseline_R = np.zeros(rows, np.float32)
        baseline_R[:n] = baselines
    return Batch(
        **{f"{k}_RT": v for k, v in arrays.items()},  # tokens_RT, positions_RT, ...
        scores_R=scores_R,
        num_rows=n,
        metrics=metrics,
        baseline_R=baseline_R,
        **steps,
    )


def _turn_batch(
    episodes: Sequence[Trajectory],
    scores: np.ndarray,
    metrics: dict,
    *,
    rows: int,
    turn_rows: int,
    pad_id: int,
) -> Batch:
    """Windowed episodes as rows of turns: each turn's own prompt and tokens are a row; the
    estimators' inputs are the episodes' scores and [rows, S] step arrays, and `turn_slot_R`
    maps each row to its (episode, turn) entry (see `types.Batch`)."""
    turns = [turn for ep in episodes for turn in ep.turns]
    if len(turns) > turn_rows:
        raise ValueError(f"{len(turns)} turns do not fit in {turn_rows} rows")
    arrays = pad_trajectories(turns, pad_id=pad_id, rows=turn_rows)
    steps = step_arrays(episodes, rows=rows, length=1)
    S = steps["step_mask"].shape[1]
    slot = np.full(turn_rows, -1, np.int32)
    scores_R = np.zeros(turn_rows, np.float32)
    i = 0
    for e, ep in enumerate(episodes):
        n = len(ep.turns)
        slot[i : i + n] = e * S + np.arange(n)
        scores_R[i : i + n] = scores[e]
        i += n
    episode_scores = np.zeros(rows, np.float32)
    episode_scores[: len(episodes)] = scores
    return Batch(
        **{f"{k}_RT": v for k, v in arrays.items()},  # tokens_RT, positions_RT, ...
        scores_R=scores_R,
        num_rows=len(turns),
        metrics=metrics,
        step_rewards_RS=steps["step_rewards"],
        step_mask_RS=steps["step_mask"],
        anchor_ids_RS=steps["anchor_ids"],
        episode_scores_E=episode_scores,
        num_episodes=len(episodes),
        turn_slot_R=slot,
    )


def make_batch(
    records: Sequence[Record],
    trajectories: Sequence[Trajectory],
    reward: CompositeReward,
    filters: FiltersSection,
    *,
    group_size: int,
    rows: int,
    pad_id: int,
    baselines: np.ndarray | None = None,
    turn_rows: int | None = None,
    step: int | None = None,
) -> Batch:
    """Scores trajectories (G consecutive ones per record), keeps the groups the filters keep,
    and pads them into [rows, T] arrays (windowed episodes: [turn_rows, T] rows of turns); the
    rollout's statistics go in `Batch.metrics`; scored at RL step `step`. `baselines`
    ([len(records)], ReMax): each record's greedy-rollout reward, per row."""
    scores, parts = score_trajectories(reward, records, trajectories, group_size, step)
    keep_groups = complete_groups(
        filter_groups(scores, group_size, filters, parts), trajectories, group_size
    )
    keep = [g * group_size + j for g in keep_groups for j in range(group_size)]
    metrics = rollout_metrics(trajectories, scores, parts, group_size=group_size)
    metrics["filter/kept_groups_frac"] = len(keep_groups) / max(1, len(records))
    base = None
    if baselines is not None:
        base = np.repeat(np.asarray(baselines, np.float32)[keep_groups], group_size)
    return _batch(
        [trajectories[i] for i in keep],
        scores[keep],
        metrics,
        rows=rows,
        pad_id=pad_id,
        baselines=base,
        turn_rows=turn_rows,
    )


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


def collect_batch(
    next_records: Callable[[], Sequence[Record]],
    sample: Callable[..., list[Trajectory]],
    reward: CompositeReward,
    filters: FiltersSection,
    *,
    group_size: int,
    rows: int,
    pad_id: int,
    greedy_baseline: bool = False,
    turn_rows: int | None = None,
    step: int | None = None,
    samples: bool = False,
) -> Batch:
    """One update's batch, sampled in rounds: each round draws `next_records()` and samples
    them with `sample(records, group_size)`; kept groups accumulate until `rows // group_size`
    groups are kept (`rows` are episodes; windowed ones are laid out in `turn_rows` rows of
    turns) or `filters.max_sampling_rounds` rounds ran (DAPO dynamic sampling:
    only then are rounds repeated; other filters keep what one round gives). Surplus groups of
    the last round are dropped; a batch still short after the last round trains on what it has.

    Trajectories are scored at RL step `step`. With `greedy_baseline` (ReMax), the kept groups'
    records also get one greedy rollout each (`greedy_baselines`), as `Batch.baseline_R`.

    Metrics: the rollout statistics over every sampled trajectory, `time/score_s` (the rewards'
    share of the rollout time), `filter/sampling_rounds`,
    `filter/kept_groups_frac` (kept / sampled groups) and `filter/batch_fill` (kept groups /
    groups of a full batch). With `samples`, also "_samples" (private: not a scalar): every
    sampled trajectory as {"prompt", "response", "reward"}, G consecutive ones per prompt.
    """
    need = rows // group_size
    max_rounds = filters.max_sampling_rounds if filters.dynamic_sampling else 1
    kept: list[Trajectory] = []
    kept_scores: list[np.ndarray] = []
    kept_records: list[Record] = []
    sampled: list[Trajectory] = []
    all_scores: list[np.ndarray] = []
    all_parts: dict[str, list] = {}
    rows_out: list[dict] = []
    rounds = groups_seen = 0
    score_s = 0.0
    while rounds < max_rounds and len(kept_records) < need:
        records = list(next_records())
        trajs = sample(records, group_size)
        rounds += 1
        groups_seen += len(records)
        t0 = time.perf_counter()
        scores, parts = score_trajectories(reward, records, trajs, group_size, step)
        score_s += time.perf_counter() - t0
        sampled.extend(trajs)
        all_scores.append(scores)
        for name, values in parts.items():
            all_parts.setdefault(name, []).extend(np.asarray(values).tolist())
        if samples:
            rows_out += [
                {
                    "prompt": records[i // group_size].get("prompt"),
                    "response": t.response_text,
                    "reward": float(scores[i]),
                }
                for i, t in enumerate(trajs)
            ]
        kept_groups = complete_groups(
            filter_groups(scores, group_size, filters, parts), trajs, group_size
        )
        for g in kept_groups[: need - len(kept_records)]:
            kept.extend(trajs[g * group_size : (g + 1) * group_size])
            kept_scores.append(scores[g * group_size : (g + 1) * group_size])
            kept_records.append(records[g])
    metrics = rollout_metrics(sampled, np.concatenate(all_scores), all_parts, group_size=group_size)
    metrics["filter/sampling_rounds"] = float(rounds)
    metrics["filter/kept_groups_frac"] = len(kept_records) / max(1, groups_seen)
    metrics["filter/batch_fill"] = len(kept_records) / max(1, need)
    metrics["rollout/tokens"] = float(sum(len(t.response_ids) for t in sampled))
    metrics["time/score_s"] = score_s
    versions = np.concatenate([np.asarray(t.versions, np.float64) for t in sampled] or [[]])
    if versions.size:  # sampled ahead of the update (`rollout.ahead`)
        metrics["rollout/version_min"] = float(versions.min())
        metrics["rollout/version_mean"] = float(versions.mean())
    if samples:
        metrics["_samples"] = rows_out
    base = None
    if greedy_baseline and kept_records:
        base = np.repeat(greedy_baselines(sample, kept_records, reward, step), group_size)
    scores_kept = np.concatenate(kept_scores) if kept_scores else np.zeros(0, np.float32)
    return _batch(
        kept, scores_kept, metrics, rows=rows, pad_id=pad_id, baselines=base, turn_rows=turn_rows
    )
