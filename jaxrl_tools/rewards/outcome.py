"""Outcome and shaping rewards: math, QA exact match, format, ToRL execution penalty, ARTIST
tool success, ReTool turn bonus, DAPO overlong shaping (formulas: docs/METHODS.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxrl_tools.rewards.answers import (
    boxed_correct,
    last_answer_tag,
    last_boxed,
    math_correct,
    math_equal,
    qa_correct,
    qa_f1,
    tags_in_order,
)
from jaxrl_tools.rewards.registry import TrajectoryInfo, _record_ok, register_reward

# Rewards
# --------------------------------------------------------------------------------------------


@register_reward("math", slow=True)
def math_reward(
    response: str,
    ground_truth: Any,
    info: TrajectoryInfo | None = None,
    *,
    correct: float = 1.0,
    wrong: float = -1.0,
    no_answer: float | None = None,
) -> float:
    """Outcome reward (ToRL / ReTool / DAPO): last \\boxed{} vs the answer, via math-verify.

    Args:
      correct / wrong: scores (ToRL: +1 / -1; use wrong=0 for a 0/1 reward).
      no_answer: score when there is no \\boxed{} (default: `wrong`).
    """
    pred = last_boxed(response)
    if pred is None:
        return wrong if no_answer is None else no_answer
    return correct if math_equal(pred, ground_truth) else wrong


@register_reward("qa_em")
def qa_em_reward(
    response: str,
    ground_truth: Any,
    info: TrajectoryInfo | None = None,
    *,
    correct: float = 1.0,
    wrong: float = 0.0,
) -> float:
    """Search-R1 exact match on the last <answer>, SQuAD-normalised; any target may match."""
    return correct if qa_correct(response, ground_truth) else wrong


@register_reward("boxed")
def boxed_reward(
    response: str,
    ground_truth: Any,
    info: TrajectoryInfo | None = None,
    *,
    correct: float = 1.0,
    wrong: float = 0.0,
) -> float:
    """Short answers of either kind: the last \\boxed{} as a number or as words
    (`answers.boxed_correct`); no symbolic parse, so it never needs a worker."""
    return correct if boxed_correct(response, ground_truth) else wrong


@register_reward("qa_f1", correctness="qa_em")
def qa_f1_reward(
    response: str,
    ground_truth: Any,
    info: TrajectoryInfo | None = None,
    *,
    format_penalty: float = -1.0,
) -> float:
    """DeepResearcher's reward: the word-level F1 of the last <answer> against the best
    ground-truth string (SQuAD-normalised); `format_penalty` when there is no <answer>."""
    answer = last_answer_tag(response)
    return format_penalty if answer is None else qa_f1(answer, ground_truth)


@register_reward("format")
def format_reward(
    response: str,
    ground_truth: Any = None,
    info: TrajectoryInfo | None = None,
    *,
    tags: Sequence[str] = ("think", "answer"),
    score: float = 1.0,
    fail: float = 0.0,
) -> float:
    """`score` if the required tags appear, closed, in the required order (e.g. think ->
    tool_call -> answer), else `fail`."""
    return score if tags_in_order(response, tags) else fail


@register_reward("exec_penalty")
def exec_penalty_reward(
    response: str,
    ground_truth: Any = None,
    info: TrajectoryInfo | None = None,
    *,
    penalty: float = -0.5,
) -> float:
    """ToRL's option: `penalty` (-0.5) when any executed code failed, else 0. Add it to `math`."""
    if info is None:
        return 0.0
    return penalty if any(not _record_ok(r) for r in info.tool_calls) else 0.0


@register_reward("tool_success")
def tool_success_reward(
    response: str,
    ground_truth: Any = None,
    info: TrajectoryInfo | None = None,
    *,
    no_calls: float = 0.0,
) -> float:
    """ARTIST tool-execution reward: successful calls / total calls (`no_calls` if none)."""
    if info is None or not info.tool_calls:
        return no_calls
    return sum(_record_ok(r) for r in info.tool_calls) / len(info.tool_calls)


@register_reward("retool", slow=True, truth="math")
def retool_reward(
    response: str,
    ground_truth: Any,
    info: TrajectoryInfo | None = None,
    *,
    correct: float = 1.0,
    wrong: float = -1.0,
    turn_bonus: float = 0.1,
    cap: float = -0.6,
) -> float:
    """ReTool recipe (verl): ±1 outcome; a wrong answer gets min(cap, wrong + (turns−2)/2·0.1),
    a small bonus for using more turns (tool calls) that never reaches the cap (−0.6)."""
    if math_correct(response, ground_truth):
        return correct
    turns = info.num_turns if info is not None else TrajectoryInfo.num_turns
    return min(cap, wrong + (turns - 2) / 2 * turn_bonus)


@register_reward("dapo_overlong")
def dapo_overlong_reward(
    response: str,
    ground_truth: Any = None,
    info: TrajectoryInfo | None = None,
    *,
    max_len: int = 20480,
    buffer: int = 4096,
    penalty_factor: float = 1.0,
) -> float:
    """DAPO soft overlong punishment: 0 if |o| ≤ L_max − L_c; ((L_max − L_c) − |o|)/L_c in the
    buffer; −1 beyond L_max (times `penalty_factor`). |o| = info.response_length (tokens)."""
    if buffer <= 0 or buffer > max_len:
        raise ValueError(f"dapo_overlong: need 0 < buffer <= max_len, got {buffer}, {max_len}")
    n = info.response_length if info is not None else 0
    expected = max_len - buffer
    if n <= expected:
        return 0.0
    if n <= max_len:
        return penalty_factor * (expected - n) / buffer
    return -penalty_factor


@register_reward("env_return")
def env_return_reward(
    response: str, ground_truth: Any = None, info: TrajectoryInfo | None = None
) -> float:
    """Multi-turn environments (RAGEN's episode score): the sum of the per-turn environment
    rewards of the trajectory (`info.env_rewards`); 0 for a trajectory with no env step."""
    return float(sum(info.env_rewards)) if info is not None else 0.0
