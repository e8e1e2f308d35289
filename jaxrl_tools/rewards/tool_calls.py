"""Function-calling rewards: ToolRL (2504.13958) and Tool-N1 (2505.00024) against ground-truth
calls (formulas: docs/METHODS.md), and the exact-call checker that evaluations count as accuracy.

ToolRL's dynamic reward scale: with `schedule="dynamic"`, the ranges of R_format and R_correct
move linearly with the RL step s (the `step` of `TrajectoryInfo`, 1 at the first RL step) over
`schedule_steps` steps (150 in ToolRL's code), from [-2, 2] each to the fixed ranges, as the
released code's SCHEDULEREWARD option computes them (`toolrl_scales`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_tools.rewards.answers import CORRECTNESS_CHECKERS, TRUTH_CHECKS, tags_in_order
from jaxrl_tools.rewards.registry import TrajectoryInfo, register_reward
from jaxrl_tools.tools import read_tool_calls


def _norm_call(call: Mapping[str, Any]) -> dict:
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # not JSON, too deep or a too-long integer
            pass
    return {"name": call.get("name"), "arguments": args if args is not None else {}}


def ground_truth_calls(ground_truth: Any) -> list[dict]:
    """Ground-truth calls from a list of call dicts, {"tool_calls": [...]}, a JSON string of
    either, or a ToolRL answer string with <tool_call> blocks (no blocks -> no calls)."""
    if isinstance(ground_truth, str):
        if "<tool_call>" in ground_truth:
            return read_tool_calls(ground_truth) or []
        try:
            ground_truth = json.loads(ground_truth)
        except (ValueError, RecursionError):
            return []
    if isinstance(ground_truth, Mapping):
        ground_truth = ground_truth.get("tool_calls", ground_truth.get("calls", [ground_truth]))
    return [_norm_call(c) for c in ground_truth or []]


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# --------------------------------------------------------------------------------------------


def _freq_jaccard(a: Sequence[Any], b: Sequence[Any]) -> float:
    """Multiset Jaccard as ToolRL's `match_score`: equal lists 1, one empty 0."""
    if list(a) == list(b):
        return 1.0
    if not a or not b:
        return 0.0
    ca, cb = Counter(a), Counter(b)
    inter = sum((ca & cb).values())
    return inter / (len(a) + len(b) - inter)


def toolrl_correctness(
    pred_calls: Sequence[Mapping],
    gt_calls: Sequence[Mapping],
    low: float = -3.0,
    high: float = 3.0,
) -> float:
    """ToolRL (2504.13958) R_correct = (high − low)·S/S_max + low ∈ [low, high] ([−3, 3]:
    6·S/S_max − 3).

    S = Jaccard(tool names) + Σ over matched (gt, pred) pairs [Jaccard(param keys) + #exact
    value matches]; S_max = 1 + Σ_gt (1 + #params). As in the ToolRL reference code: Jaccards
    are frequency (multiset) based, each ground-truth call in order takes the best unused
    prediction of the same name (greedy), and a ground truth without calls scores 0.
    """
    pred_calls = [_norm_call(c) for c in pred_calls]
    gt_calls = [_norm_call(c) for c in gt_calls]
    if not gt_calls:
        return 0.0
    s_max = 1.0
    s = _freq_jaccard([str(c["name"]) for c in gt_calls], [str(c["name"]) for c in pred_calls])
    used: set[int] = set()
    for g in gt_calls:
        ga = _as_dict(g["arguments"])
        s_max += 1 + len(ga)
        best, best_i = 0.0, -1
        for i, p in enumerate(pred_calls):
            if i in used or p["name"] != g["name"]:
                continue
            pa = _as_dict(p["arguments"])
            score = _freq_jaccard(list(ga), list(pa)) + sum(
                1.0 for k, v in ga.items() if k in pa and pa[k] == v
            )
            if score > best:
                best, best_i = score, i
        if best_i >= 0:
            used.add(best_i)
            s += best
    return (high - low) * s / s_max + low


def _as_dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


_TOOLRL_FORMATS = {
    # (gt has calls, gt has a <response>) -> the whole response must match
    (True, False): r"<think>.*?</think>\n<tool_call>\n.*?\n</tool_call>",
    (True, True): r"<think>.*?</think>\n<tool_call>\n.*?\n</tool_call>\n<response>.*?</response>",
    (False, True): r"<think>.*?</think>\n<response>.*?</response>",
    (False, False): r"<think>.*?</think>",
}


# End-of-turn tokens (Qwen, Llama 3): a decoded response keeps its last one, and ToolRL's code
# checks the text before it.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>")


def turn_text(response: str) -> str:
    """The response up to its first end-of-turn token."""
    for marker in _END_OF_TURN:
        response = response.split(marker, 1)[0]
    return response


def toolrl_format_ok(response: str, has_calls: bool, has_response: bool = False) -> bool:
    """ToolRL format check: the response is exactly <think>…</think>, then one
    <tool_call>…</tool_call> block when the ground truth has calls, then <response>…</response>
    when the ground truth has one (outer whitespace ignored; read up to the end of the turn)."""
    text = turn_text(response).strip()
    if re.fullmatch(_TOOLRL_FORMATS[(has_calls, has_response)], text, re.DOTALL) is None:
        return False
    return text.count("<tool_call>") == int(has_calls) and text.count("<response>") == int(
        has_response
    )


SCHEDULES = ("fixed", "dynamic")


def toolrl_scales(
    step: int, schedule: str = "fixed", schedule_steps: int = 150, format_max: float = 1.0
) -> tuple[float, float, float, float]:
    """(format_low, format_high, correct_low, correct_high) at RL step `step`.

    fixed: [0, format_max] and [−3, 3]. dynamic (ToolRL's SCHEDULEREWARD, p = step /
    schedule_steps): format [min(−1, −2 + 2p), max(1, 2 − (2 − format_max)·p)], correctness
    [max(−3, −2 − p), min(3, 2 + p)]: both start at [−2, 2]; correctness widens to [−3, 3] and
    the format's reward shrinks to format_max, its penalty to −1 (reached at p = 1/2; the code's
    clip keeps it there, so a malformed response costs 1 more than the fixed scale's 0).
    """
    if schedule == "fixed":
        return 0.0, format_max, -3.0, 3.0
    if schedule != "dynamic":
        raise ValueError(f"toolrl schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule_steps < 1:
        raise ValueError(f"toolrl schedule_steps must be >= 1, got {schedule_steps}")
    p = step / schedule_steps
    return (
        min(-1.0, -2.0 + 2.0 * p),
        max(1.0, 2.0 - (2.0 - format_max) * p),
        max(-3.0, -2.0 - p),
        min(3.0, 2.0 + p),
    )


@register_reward("toolrl", correctness="tool_calls")
def toolrl_reward(
    response: str,
    ground_truth: Any,
    info: TrajectoryInfo | None = None,
    *,
    format_weight: float = 1.0,
    schedule: str = "fixed",
    schedule_steps: int = 150,
) -> float:
    """ToolRL: R = R_format + R_correct; fixed scale: R_format ∈ {0, 1}, R_correct ∈ [−3, 3].

    ground_truth: a list of calls ({"name", "arguments" | "parameters"}; the response must hold
    them in one <tool_call> block, or, for an empty list, answer in <response>…</response>) or
    ToolRL's answer string ("<tool_call>\n{json per line}\n</tool_call>", optionally with
    <response>). A malformed call block gets the lowest R_correct.
    format_weight: the format reward's top (1 in the paper).
    schedule, schedule_steps: "dynamic" = ToolRL's dynamic reward scale (`toolrl_scales`) over
      this many RL steps, read from `info.step`.
    """
    gt = ground_truth_calls(ground_truth)
    if isinstance(ground_truth, str):
        has_response = "<response>" in ground_truth
    else:  # a call list: a turn that calls nothing answers the user
        has_response = not gt
    step = info.step if info is not None and info.step is not None else 0
    f_low, f_high, c_low, c_high = toolrl_scales(step, schedule, schedule_steps, format_weight)
    r_format = f_high if toolrl_format_ok(response, bool(gt), has_response) else f_low
    pred = read_tool_calls(response)
    r_correct = c_low if pred is None else toolrl_correctness(pred, gt, c_low, c_high)
    return r_format + r_correct


def exact_call_match(response: str, ground_truth: Any) -> bool:
    """The response's calls (<tool_call> blocks) equal the ground truth's as a multiset of
    (name, canonical-json(arguments)); no calls against no calls is a match."""
    pred = read_tool_calls(response)
    if pred is None:
        return False
    key = lambda c: (str(c["name"]), _canon(c["arguments"]))
    return Counter(map(key, pred)) == Counter(map(key, ground_truth_calls(ground_truth)))


def calls_truth_error(ground_truth: Any) -> str | None:
    """What is wrong with a ground truth of function calls (None: nothing)."""
    try:
        calls = ground_truth_calls(ground_truth)
    except (AttributeError, TypeError, ValueError):
        calls = None
    if calls is not None and all(isinstance(c["name"], str) for c in calls):
        return None
    return (
        'expects a list of calls ({"name": ..., "arguments": {...}}), {"tool_calls": [...]}, '
        "or an answer string with <tool_call> blocks"
    )


# Evaluations of function-calling runs count exact call matches as accuracy.
CORRECTNESS_CHECKERS["tool_calls"] = exact_call_match
TRUTH_CHECKS["tool_calls"] = calls_truth_error


@register_reward("tool_n1", correctness="tool_calls")
def tool_n1_reward(response: str, ground_truth: Any, info: TrajectoryInfo | None = None) -> float:
    """Tool-N1 (2505.00024): 1 iff <think>…</think> is present and the multiset of
    (name, canonical-json(arguments)) equals the ground truth's; else 0."""
    return float(tags_in_order(response, ["think"]) and exact_call_match(response, ground_truth))
