"""Trajectories -> one update's Batch: rewards, group filters, packing into fixed shapes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrl_tools import algorithms
from jaxrl_tools.config import FiltersSection
from jaxrl_tools.rewards import CORRECTNESS_CHECKERS, CompositeReward, TrajectoryInfo
from jaxrl_tools.types import Batch, Record, Trajectory


def _bucket(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def pack_trajectories(
    trajectories: Sequence[Trajectory], *, pad_id: int, rows: int, length_multiple: int = 16
) -> dict[str, np.ndarray]:
    """Packs trajectories into right-padded [rows, T] arrays aligned to tokens.

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
) -> tuple[np.ndarray, dict]:
    """(rewards_N, {term: values_N}) of trajectories, `group_size` consecutive ones per record."""
    infos = [
        TrajectoryInfo(
            tool_calls=t.tool_calls,
            num_calls=t.num_tool_calls,
            # verl's count: the prompt, then every model turn and tool/environment turn
            num_turns=1 + len(t.spans),
            response_length=len(t.response_ids),
        )
        for t in trajectories
    ]
    group_ids = [i // group_size for i in range(len(trajectories))]
    gts = [records[g].get("ground_truth") for g in group_ids]
    return reward.batch([t.response_text for t in trajectories], gts, infos, group_ids=group_ids)


def rollout_metrics(trajectories: Sequence[Trajectory], scores: np.ndarray, parts: dict) -> dict:
    """Reward, accuracy, tool-use and length statistics of a batch of trajectories."""
    calls = np.array([t.num_tool_calls for t in trajectories], np.float32)
    records = [r for t in trajectories for r in t.tool_calls]
    errors = sum(1 for r in records if not r.ok)
    lengths = np.array([len(t.response_ids) for t in trajectories], np.float32)
    out = {
        "reward/mean": float(np.mean(scores)),
        "reward/std": float(np.std(scores)),
        "tools/calls_per_response": float(calls.mean()),
        "tools/error_rate": errors / max(1, len(records)),
        "tools/used_frac": float((calls > 0).mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max(initial=0)),
    }
    for name, values in parts.items():
        out[f"reward/{name}"] = float(np.mean(values))
    checker = next((name for name in CORRECTNESS_CHECKERS if name in parts), None)
    if checker is not None:  # a reward term that is an answer check gives the accuracy
        out["reward/accuracy"] = float(np.mean(np.asarray(parts[checker]) > 0))
    finish: dict[str, int] = {}
    for t in trajectories:
        finish[t.finish_reason] = finish.get(t.finish_reason, 0) + 1
    for reason, n in finish.items():
        out[f"response/finish_{reason}"] = n / len(trajectories)
    return out


def filter_groups(scores_N: np.ndarray, group_size: int, filters: FiltersSection) -> np.ndarray:
    """Indices of the prompt groups the configured filters keep (DAPO, ZeroTIR, StarPO-S)."""
    keep = np.arange(len(scores_N) // group_size)
    sel = lambda idx: keep[np.isin(keep, idx)]
    grouped = scores_N.reshape(-1, group_size)
    if filters.dynamic_sampling:
        keep = sel(algorithms.dynamic_sampling_filter(grouped))
    if filters.zerotir:
        keep = sel(
            algorithms.accuracy_band_filter(
                (grouped > 0).astype(float), low=filters.zerotir_low, high=filters.zerotir_high
            )
        )
    if filters.starpo_s:
        keep = sel(algorithms.starpo_s_filter(grouped, keep_fraction=filters.starpo_keep_frac))
    return keep


def make_batch(
    records: Sequence[Record],
    trajectories: Sequence[Trajectory],
    reward: CompositeReward,
    filters: FiltersSection,
    *,
    group_size: int,
    rows: int,
    pad_id: int,
) -> Batch:
    """Scores trajectories (G consecutive ones per record), keeps the groups the filters keep,
    and packs them into [rows, T] arrays; the rollout's statistics go in `Batch.metrics`."""
    scores, parts = score_trajectories(reward, records, trajectories, group_size)
    keep_groups = filter_groups(scores, group_size, filters)
    keep = [g * group_size + j for g in keep_groups for j in range(group_size)]
    metrics = rollout_metrics(trajectories, scores, parts)
    metrics["filter/kept_groups_frac"] = len(keep_groups) / max(1, len(records))
    arrays = pack_trajectories([trajectories[i] for i in keep], pad_id=pad_id, rows=rows)
    scores_R = np.zeros(rows, np.float32)
    scores_R[: len(keep)] = scores[keep]
    return Batch(
        tokens_RT=arrays["tokens"],
        positions_RT=arrays["positions"],
        attention_RT=arrays["attention"],
        loss_mask_RT=arrays["loss_mask"],
        behaviour_logp_RT=arrays["behaviour_logp"],
        scores_R=scores_R,
        num_rows=len(keep),
        metrics=metrics,
    )
