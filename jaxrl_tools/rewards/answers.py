"""Answer extraction and checking: the last \\boxed{}, <answer> tags, exact match, tag order."""

from __future__ import annotations

import collections
import functools
import math
import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_tools.rewards import deadline

# --------------------------------------------------------------------------------------------
# Answer extraction and checking
# --------------------------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}, or "\\boxed 5") with nested braces.

    Returns None when there is none or its braces never close.
    """
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    for start in reversed(starts):
        i = start
        if i < len(text) and text[i] == " ":  # "\boxed 42": up to the next space or $
            m = re.match(r" +([^\s$]+)", text[i:])
            if m:
                return m.group(1)
            continue
        while i < len(text) and text[i] in "\t\n":
            i += 1
        if i >= len(text) or text[i] != "{":
            continue
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == "\\" and j + 1 < len(text) and text[j + 1] in "{}":
                j += 2  # "\{" / "\}" are literal braces
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j]
            j += 1
        # unbalanced: try an earlier one
    return None


_NUM_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def _as_number(s: str) -> float | None:
    s = s.strip().strip("$").replace(",", "").replace("\\!", "").replace(" ", "")
    s = s.removeprefix("\\text{").removesuffix("}") if s.startswith("\\text{") else s
    return float(s) if _NUM_RE.match(s) else None


@functools.lru_cache(maxsize=65536)
def _symbolic_equal_cached(pred: str, gold: str) -> bool | None:
    value = deadline.SYMBOLIC.equal(pred, gold)
    if value is deadline.TIMED_OUT:
        raise _CheckTimedOut  # not cached: a later check may have more time
    return value


class _CheckTimedOut(Exception):
    pass


def math_equal(pred: str, gold: Any) -> bool:
    """Mathematical equivalence of two answers: plain numbers here, anything else by
    math-verify in a worker process, bounded by the thread's deadline (`rewards.deadline`).
    A check past it is noted as a timeout (counted by the trainer as `reward/timeouts`) and
    counts as not equal, so a reward scores it as its wrong answer."""
    gold_s = str(gold).strip()
    inner = last_boxed(gold_s)  # a ground truth given as "\boxed{...}"
    if inner is not None:
        gold_s = inner
    pred = pred.strip()
    a, b = _as_number(pred), _as_number(gold_s)
    if a is not None and b is not None:  # fast path: plain numbers
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    try:
        same = _symbolic_equal_cached(pred, gold_s)
    except _CheckTimedOut:
        deadline.note_timeout(f"the math check of {pred[:60]!r} against {gold_s[:60]!r}")
        return False
    if same is None:  # a side math-verify cannot parse: compare the strings
        return pred == gold_s
    return same


def math_correct(response: str, ground_truth: Any) -> bool:
    """True iff the last \\boxed{} of `response` is equivalent to the ground truth."""
    pred = last_boxed(response)
    return pred is not None and math_equal(pred, ground_truth)


_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def last_answer_tag(text: str) -> str | None:
    """Content of the last <answer>...</answer>, or None."""
    found = _ANSWER_RE.findall(text)
    return found[-1] if found else None


def normalize_answer(s: str) -> str:
    """SQuAD / Search-R1 normalisation: lower, drop punctuation and articles, squash spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _qa_targets(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, Mapping):  # Search-R1 data: {"target": [...]}
        ground_truth = ground_truth.get("target", ground_truth.get("answers", []))
    if isinstance(ground_truth, str):
        return [ground_truth]
    return [str(g) for g in ground_truth]


def qa_correct(response: str, ground_truth: Any) -> bool:
    """Normalised exact match of the last <answer> against any of the ground-truth strings."""
    pred = last_answer_tag(response)
    if pred is None:
        return False
    pred_n = normalize_answer(pred)
    return any(pred_n == normalize_answer(t) for t in _qa_targets(ground_truth))


def qa_f1(prediction: str, ground_truth: Any) -> float:
    """SQuAD's word-level F1 of a prediction against the best of the ground-truth strings
    (both normalised; words counted as a multiset)."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for target in _qa_targets(ground_truth):
        gold = normalize_answer(target).split()
        common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
        if common:
            precision, recall = common / len(pred), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def boxed_correct(response: str, ground_truth: Any) -> bool:
    """The last \\boxed{} against a number (numerically) or words (normalised exact match):
    short answers of either kind, with no symbolic parse."""
    pred = last_boxed(response)
    if pred is None:
        return False
    a, b = _as_number(pred), _as_number(str(ground_truth))
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return normalize_answer(pred) == normalize_answer(str(ground_truth))


CORRECTNESS_CHECKERS: dict[str, Callable[[str, Any], bool]] = {
    "math": math_correct,
    "qa_em": qa_correct,
    "boxed": boxed_correct,
}


def _scalar(x: Any) -> bool:
    return isinstance(x, str | int | float) and not isinstance(x, bool)


def math_truth_error(ground_truth: Any) -> str | None:
    """What is wrong with a ground truth for "math" checking (None: nothing)."""
    return None if _scalar(ground_truth) else "expects the answer as a string or a number"


def qa_truth_error(ground_truth: Any) -> str | None:
    """What is wrong with a ground truth for "qa_em" checking (None: nothing)."""
    gt = ground_truth
    if isinstance(gt, Mapping):
        gt = gt.get("target", gt.get("answers"))
    if isinstance(gt, str) or (isinstance(gt, list | tuple) and gt and all(map(_scalar, gt))):
        return None
    return 'expects a string, a non-empty list of strings, or {"target": [strings]}'


# Checker name -> what ground truth it accepts (`register_reward(truth=...)`).
TRUTH_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "math": math_truth_error,
    "qa_em": qa_truth_error,
    "boxed": math_truth_error,
}


def is_correct(response: str, ground_truth: Any, kind: str = "math") -> bool:
    """Correctness by checker name ("math": last \\boxed{}, "qa_em": last <answer>, "boxed":
    last \\boxed{} as a number or words)."""
    if kind not in CORRECTNESS_CHECKERS:
        raise KeyError(
            f"unknown correctness checker {kind!r}; known: {sorted(CORRECTNESS_CHECKERS)}"
        )
    return CORRECTNESS_CHECKERS[kind](response, ground_truth)


def tags_in_order(text: str, tags: Sequence[str]) -> bool:
    """True iff each <tag>...</tag> appears, each opening after the previous one's close."""
    pos = 0
    for tag in tags:
        start = text.find(f"<{tag}>", pos)
        if start < 0:
            return False
        end = text.find(f"</{tag}>", start + len(tag) + 2)
        if end < 0:
            return False
        pos = end + len(tag) + 3
    return True
