"""Trajectories -> one update's Batch: padding into fixed shapes, per-turn inputs, sampling rounds.

`make_batch` scores one round of trajectories (`train.scoring`), keeps the groups the filters
keep and pads them; `collect_batch` samples rounds until the filters have kept a full batch
(DAPO dynamic sampling) and adds ReMax's greedy baselines. Multi-turn trajectories also give
per-turn advantage inputs (`step_arrays`): turn k is the k-th model span, its step reward the
reward of the environment step its text went to. Episodes played with windowed history
(`Trajectory.turns`) are laid out a turn per row (`_turn_batch`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl_tools.config import FiltersSection
from jaxrl_tools.rewards import CompositeReward
from jaxrl_tools.train.scoring import (
    complete_groups,
    filter_groups,
    greedy_baselines,
    rollout_metrics,
    score_trajectories,
    state_key,
)
from jaxrl_tools.types import Batch, Record, Trajectory


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
            out["anchor_ids"][i, k] = ids.setdefault(state_key(state, (i, k)), len(ids))
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
    metrics = rollout_metrics(trajectories, scores, parts, group_size=group_size, records=records)
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
    sampled_records: list[Record] = []
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
        sampled_records.extend(records)
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
    metrics = rollout_metrics(
        sampled,
        np.concatenate(all_scores),
        all_parts,
        group_size=group_size,
        records=sampled_records,
    )
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
