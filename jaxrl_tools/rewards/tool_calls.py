"""Function-calling rewards: ToolRL (2504.13958) and Tool-N1 (2505.00024) against ground-truth
calls (formulas: docs/METHODS.md)."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_tools.rewards.answers import tags_in_order
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


def _gt_calls(ground_truth: Any) -> list[dict]:
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


def toolrl_correctness(pred_calls: Sequence[Mapping], gt_calls: Sequence[Mapping]) -> float:
    """ToolRL (2504.13958) R_correct = 6·S/S_max − 3 ∈ [−3, 3].

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
    return 6.0 * s / s_max - 3.0


def _as_dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


_TOOLRL_FORMATS = {
    # (gt has calls, gt has a <response>) -> the whole response must match
    (True, False): r"<think>.*?</think>\n<tool_call>\n.*?\n</tool_call>",
    (True, True): r"<think>.*?</think>\n<tool_call>\n.*?\n</tool_call>\n<response>.*?</response>",
    (False, True): r"<think>.*?</think>\n<response>.*?</response>",
    (False, False): r"<think>.*?</think>",
}


def toolrl_format_ok(response: str, has_calls: bool, has_response: bool = False) -> bool:
    """ToolRL format check: the response is exactly <think>…</think>, then one
    <tool_call>…</tool_call> block when the ground truth has calls, then <response>…</response>
    when the ground truth has one (outer whitespace ignored)."""
    text = response.strip()
    if re.fullmatch(_TOOLRL_FORMATS[(has_calls, has_response)], text, re.DOTALL) is None:
        return False
    return text.count("<tool_call>") == int(has_calls) and text.count("<response>") == int(
        has_response
    )


@register_reward("toolrl")
def toolrl_reward(
    response: str,
    ground_truth: Any,
    info: TrajectoryInfo | None = None,
    *,
    format_weight: float = 1.0,
) -> float:
    """ToolRL: R = R_format ∈ {0, 1} + R_correct ∈ [−3, 3]. A malformed call block -> -3.

    ground_truth: a list of calls ({"name", "arguments" | "parameters"}) or ToolRL's answer
    string ("<tool_call>\n{json per line}\n</tool_call>", optionally with <response>).
    """
    gt = _gt_calls(ground_truth)
    has_response = isinstance(ground_truth, str) and "<response>" in ground_truth
    r_format = format_weight * float(toolrl_format_ok(response, bool(gt), has_response))
    pred = read_tool_calls(response)
    r_correct = -3.0 if pred is None else toolrl_correctness(pred, gt)
    return r_format + r_correct


@register_reward("tool_n1")
def tool_n1_reward(response: str, ground_truth: Any, info: TrajectoryInfo | None = None) -> float:
    """Tool-N1 (2505.00024): 1 iff <think>…</think> is present and the multiset of
    (name, canonical-json(arguments)) equals the ground truth's; else 0."""
    if not tags_in_order(response, ["think"]):
        return 0.0
    pred = read_tool_calls(response)
    if pred is None:
        return 0.0
    key = lambda c: (str(c["name"]), _canon(c["arguments"]))
    return float(Counter(map(key, pred)) == Counter(map(key, _gt_calls(ground_truth))))
