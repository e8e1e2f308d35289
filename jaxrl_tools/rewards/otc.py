"""OTC (2504.14870): optimal tool-call-controlled rewards, PPO and GRPO forms
(formulas: docs/METHODS.md)."""

from __future__ import annotations

import math
from typing import Any

from jaxrl_tools.rewards.answers import TRUTH_CHECKS, is_correct
from jaxrl_tools.rewards.registry import TrajectoryInfo, register_reward


def otc_ppo_tool_reward(m: int, c: float) -> float:
    """OTC-PPO r_tool = cos(m·π / (2m + c)); 1 at m = 0, decreasing in m."""
    return math.cos(m * math.pi / (2 * m + c))


def otc_map(m: float, n: float) -> float:
    """OTC-GRPO f(m, n): 0 if m = n = 0; m if n = 0; else 2nm / (m + n)."""
    if m == 0 and n == 0:
        return 0.0
    if n == 0:
        return float(m)
    return 2.0 * n * m / (m + n)


def otc_grpo_tool_reward(m: int, n: int, c: float) -> float:
    """OTC-GRPO r_tool: 1 if f(m,n) = n = 0; cos(mπ/(2m+c)) if n = 0; else sin(f·π/(2n)).

    Peaks (1) at m = n, the fewest calls any correct response of the group needed.
    """
    f = otc_map(m, n)
    if f == 0 and n == 0:
        return 1.0
    if n == 0:
        return otc_ppo_tool_reward(m, c)
    return math.sin(f * math.pi / (2 * n))


def _truth(ground_truth: Any, kwargs) -> str | None:
    return TRUTH_CHECKS[kwargs.get("correctness", "math")](ground_truth)


@register_reward("otc_ppo", slow=True, truth=_truth)
def otc_ppo_reward(
    response: str,
    ground_truth: Any,
    info: TrajectoryInfo | None = None,
    *,
    c: float = 1.0,
    alpha: float = 1.0,
    correctness: str = "math",
    wrong: float = 0.0,
) -> float:
    """OTC-PPO (2504.14870): α·r_tool·r_correct with r_tool = cos(mπ/(2m+c)), m = tool calls.

    Args:
      c: smoothing constant of the cosine (larger = gentler decay).
      alpha: scale α.
      correctness: checker ("math" or "qa_em") giving r_correct ∈ {0, 1}.
      wrong: score of a wrong answer (r_correct = 0 gives 0).
    """
    if not is_correct(response, ground_truth, correctness):
        return wrong
    m = info.calls if info is not None else 0
    return alpha * otc_ppo_tool_reward(m, c)


@register_reward("otc_grpo", slow=True, group=True, truth=_truth)
def otc_grpo_reward(
    response: str,
    ground_truth: Any,
    info: TrajectoryInfo | None = None,
    *,
    c: float = 1.0,
    alpha: float = 1.0,
    correctness: str = "math",
    wrong: float = 0.0,
) -> float:
    """OTC-GRPO (2504.14870): α·r_tool·r_correct, r_tool from m (this response's calls) and
    n = min calls over the group's correct responses (needs info.group_num_calls and
    info.group_correct; `CompositeReward.batch(..., group_ids=...)` fills them)."""
    if not is_correct(response, ground_truth, correctness):
        return wrong
    if info is None or info.group_num_calls is None or info.group_correct is None:
        raise ValueError(
            "otc_grpo needs the group context: info.group_num_calls and info.group_correct "
            "(pass group_ids to CompositeReward.batch)"
        )
    m = info.calls
    correct_calls = [k for k, ok in zip(info.group_num_calls, info.group_correct) if ok]
    # This response is correct, so it belongs to the correct set even if the caller's
    # group context was computed with another checker.
    n = min(correct_calls + [m])
    return alpha * otc_grpo_tool_reward(m, n, c)
