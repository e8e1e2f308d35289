"""Rule-based rewards, computed on the host, chosen by name from a registry and composed.

Each reward is a function `fn(response, ground_truth, info, **kwargs) -> float` where
`response` is the decoded model text of one trajectory (observations included, as the
papers score it), `ground_truth` is the record's answer (a string / number / list / dict,
depending on the reward) and `info` a `TrajectoryInfo` (tool-call records, counts, length and,
for group rewards, the group's call counts and correctness).

    reward = CompositeReward([("math", 1.0, {}), ("dapo_overlong", 1.0, {"max_len": 1024,
                                                                       "buffer": 256})])
    totals_N, parts = reward.batch(responses, ground_truths, infos, group_ids=group_ids)

Formulas: ../shared/METHODS.md, "Rewards"; the papers are cited at each function.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib
import json
import math
import re
import string
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RewardFn = Callable[..., float]


@dataclass(frozen=True)
class TrajectoryInfo:
    """What a reward may need besides the text.

    Attributes:
      tool_calls: one record per executed tool call; anything with an `ok` attribute or key
        (e.g. the rollout's records or `jaxrl_tools.tools.Observation`). ok=False = it failed.
      num_calls: number of tool calls the model made (default: len(tool_calls)).
      num_turns: number of turns (ReTool counts every message: user, assistant, tool ...).
      response_length: response length in tokens (model + observation tokens).
      group_num_calls: the tool-call counts of every response of this prompt's group
        (OTC-GRPO); filled by `CompositeReward.batch` when group_ids are given.
      group_correct: correctness of every response of the group, aligned with group_num_calls.
      extra: anything else (per-dataset fields).
    """

    tool_calls: Sequence[Any] = ()
    num_calls: int | None = None
    num_turns: int = 1
    response_length: int = 0
    group_num_calls: Sequence[int] | None = None
    group_correct: Sequence[bool] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def calls(self) -> int:
        return len(self.tool_calls) if self.num_calls is None else int(self.num_calls)


def _record_ok(rec: Any) -> bool:
    if isinstance(rec, Mapping):
        return bool(rec.get("ok", True))
    return bool(getattr(rec, "ok", True))


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

_REGISTRY: dict[str, RewardFn] = {}
_SLOW: set[str] = set()
_GROUP: set[str] = set()


def register_reward(name: str, *, slow: bool = False, group: bool = False):
    """Register `fn(response, ground_truth, info, **kwargs) -> float` under `name`.

    Args:
      name: registry name (used in configs: `reward: [{name: ..., weight: ..., kwargs: ...}]`).
      slow: run it in the batch API's worker pool (e.g. symbolic math checking).
      group: it needs the group context (info.group_num_calls / group_correct).
    """

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = fn
        if slow:
            _SLOW.add(name)
        if group:
            _GROUP.add(name)
        return fn

    return deco


def registered_rewards() -> list[str]:
    """Names of all registered rewards, sorted."""
    return sorted(_REGISTRY)


def get_reward(name: str) -> RewardFn:
    """Look up a reward by registry name, or import it from "package.module:function"."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise KeyError(f"cannot import reward {name!r}: {e}") from e
    raise KeyError(f"unknown reward {name!r}; registered: {registered_rewards()}")


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


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=65536)
def _math_equal_cached(pred: str, gold: str, main_thread: bool) -> bool:
    a, b = _as_number(pred), _as_number(gold)
    if a is not None and b is not None:  # fast path: plain numbers
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    from math_verify import parse, verify

    # signal-based timeouts only work in the main thread; worker threads run without.
    timeout = 5 if main_thread else None
    gold_p = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
    if not gold_p:
        gold_p = parse(gold, parsing_timeout=timeout)
    pred_p = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
    if not gold_p or not pred_p:
        return pred.strip() == gold.strip()
    return bool(verify(gold_p, pred_p, timeout_seconds=timeout))


def math_equal(pred: str, gold: Any) -> bool:
    """Mathematical equivalence of two answers (numbers fast, else math-verify)."""
    gold_s = str(gold).strip()
    inner = last_boxed(gold_s)  # a ground truth given as "\boxed{...}"
    if inner is not None:
        gold_s = inner
    return _math_equal_cached(pred.strip(), gold_s, _in_main_thread())


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


_CORRECTNESS: dict[str, Callable[[str, Any], bool]] = {
    "math": math_correct,
    "qa_em": qa_correct,
}


def is_correct(response: str, ground_truth: Any, kind: str = "math") -> bool:
    """Correctness by checker name ("math": last \\boxed{}, "qa_em": last <answer>)."""
    if kind not in _CORRECTNESS:
        raise KeyError(f"unknown correctness checker {kind!r}; known: {sorted(_CORRECTNESS)}")
    return _CORRECTNESS[kind](response, ground_truth)


# --------------------------------------------------------------------------------------------
# Tool-call parsing (for ToolRL / Tool-N1 style ground truth)
# --------------------------------------------------------------------------------------------

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[dict] | None:
    """All calls inside <tool_call>...</tool_call> blocks as {"name", "arguments"} dicts.

    A block holds one JSON object (Qwen) or one per line (ToolRL). Returns None when a block is
    not valid JSON or an object lacks "name" (a malformed call), [] when there are no blocks.
    """
    calls = []
    for block in _TOOL_CALL_RE.findall(text):
        block = block.strip()
        if not block:
            return None
        try:
            objs = [json.loads(block)]
        except json.JSONDecodeError:
            try:
                objs = [json.loads(line) for line in block.splitlines() if line.strip()]
            except json.JSONDecodeError:
                return None
        for obj in objs:
            objs_list = obj if isinstance(obj, list) else [obj]
            for o in objs_list:
                if not isinstance(o, dict) or "name" not in o:
                    return None
                calls.append(_norm_call(o))
    return calls


def _norm_call(call: Mapping[str, Any]) -> dict:
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return {"name": call.get("name"), "arguments": args if args is not None else {}}


def _gt_calls(ground_truth: Any) -> list[dict]:
    """Ground-truth calls from a list of call dicts, {"tool_calls": [...]}, a JSON string of
    either, or a ToolRL answer string with <tool_call> blocks (no blocks -> no calls)."""
    if isinstance(ground_truth, str):
        if "<tool_call>" in ground_truth:
            return parse_tool_calls(ground_truth) or []
        try:
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError:
            return []
    if isinstance(ground_truth, Mapping):
        ground_truth = ground_truth.get("tool_calls", ground_truth.get("calls", [ground_truth]))
    return [_norm_call(c) for c in ground_truth or []]


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# --------------------------------------------------------------------------------------------
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
    pred = parse_tool_calls(response)
    r_correct = -3.0 if pred is None else toolrl_correctness(pred, gt)
    return r_format + r_correct


@register_reward("tool_n1")
def tool_n1_reward(response: str, ground_truth: Any, info: TrajectoryInfo | None = None) -> float:
    """Tool-N1 (2505.00024): 1 iff <think>…</think> is present and the multiset of
    (name, canonical-json(arguments)) equals the ground truth's; else 0."""
    if not tags_in_order(response, ["think"]):
        return 0.0
    pred = parse_tool_calls(response)
    if pred is None:
        return 0.0
    key = lambda c: (str(c["name"]), _canon(c["arguments"]))
    return float(Counter(map(key, pred)) == Counter(map(key, _gt_calls(ground_truth))))


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


@register_reward("otc_ppo", slow=True)
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


@register_reward("otc_grpo", slow=True, group=True)
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


@register_reward("retool", slow=True)
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
    turns = info.num_turns if info is not None else 1
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


# --------------------------------------------------------------------------------------------
# Composition and the batch API
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Term:
    name: str
    weight: float
    kwargs: dict
    fn: RewardFn
    slow: bool
    group: bool


def _call_term(term: _Term, response: str, gt: Any, info: TrajectoryInfo) -> float:
    return float(term.fn(response, gt, info, **term.kwargs))


class CompositeReward:
    """A weighted sum of registered rewards.

    Args:
      terms: (name, weight, kwargs) triples, or objects/dicts with name/weight/kwargs
        (e.g. config.RewardSpec).
      max_workers: worker count of the batch API's pool for slow rewards.
      executor: "thread" (default; math-verify runs without its signal timeout) or "process"
        (true parallelism for CPU-bound checking; rewards must be importable module functions).
    """

    def __init__(self, terms: Sequence[Any], *, max_workers: int = 4, executor: str = "thread"):
        if executor not in ("thread", "process"):
            raise ValueError(f"executor must be 'thread' or 'process', got {executor!r}")
        self.terms: list[_Term] = []
        for t in terms:
            if isinstance(t, Mapping):
                name, weight, kwargs = t["name"], t.get("weight", 1.0), t.get("kwargs", {})
            elif isinstance(t, tuple | list):
                name, weight, kwargs = (list(t) + [1.0, {}][len(t) - 1 :])[:3]
            else:
                name, weight, kwargs = t.name, t.weight, t.kwargs
            fn = get_reward(name)
            self.terms.append(
                _Term(name, float(weight), dict(kwargs or {}), fn, name in _SLOW, name in _GROUP)
            )
        names = [t.name for t in self.terms]
        if len(set(names)) != len(names):
            raise ValueError(f"CompositeReward: duplicate reward names {names}")
        self.max_workers = max_workers
        self.executor = executor

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.terms]

    def components(self, response: str, ground_truth: Any, info: TrajectoryInfo | None = None):
        """Unweighted value of each term, by name."""
        info = info or TrajectoryInfo()
        return {t.name: _call_term(t, response, ground_truth, info) for t in self.terms}

    def __call__(self, response: str, ground_truth: Any, info: TrajectoryInfo | None = None):
        """The weighted sum for one trajectory."""
        parts = self.components(response, ground_truth, info)
        return float(sum(t.weight * parts[t.name] for t in self.terms))

    def batch(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        infos: Sequence[TrajectoryInfo | None] | None = None,
        *,
        group_ids: Sequence[Any] | None = None,
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Rewards for a batch; slow terms run in a concurrent.futures pool.

        Args:
          responses, ground_truths: aligned, length N.
          infos: per-trajectory TrajectoryInfo (None = empty).
          group_ids: prompt-group id of each trajectory; needed by group rewards (OTC-GRPO),
            whose group context (call counts, correctness) is filled in here when missing.

        Returns:
          (totals_N float32, {term name: values_N float32 (unweighted)}).
        """
        n = len(responses)
        if len(ground_truths) != n or (infos is not None and len(infos) != n):
            raise ValueError("responses, ground_truths and infos must have the same length")
        infos = [i or TrajectoryInfo() for i in (infos if infos is not None else [None] * n)]
        parts: dict[str, np.ndarray] = {}
        pool = None
        try:
            for term in self.terms:
                term_infos = infos
                if term.group:
                    term_infos = self._with_group_context(
                        term, responses, ground_truths, infos, group_ids
                    )
                if term.slow and n > 1 and self.max_workers > 1:
                    if pool is None:
                        cls = (
                            concurrent.futures.ThreadPoolExecutor
                            if self.executor == "thread"
                            else concurrent.futures.ProcessPoolExecutor
                        )
                        pool = cls(max_workers=self.max_workers)
                    fn = functools.partial(_call_term, term)
                    vals = list(pool.map(fn, responses, ground_truths, term_infos))
                else:
                    vals = [
                        _call_term(term, r, g, i)
                        for r, g, i in zip(responses, ground_truths, term_infos)
                    ]
                parts[term.name] = np.asarray(vals, np.float32)
        finally:
            if pool is not None:
                pool.shutdown()
        totals = np.zeros((n,), np.float32)
        for term in self.terms:
            totals += np.float32(term.weight) * parts[term.name]
        return totals, parts

    @staticmethod
    def _with_group_context(term, responses, ground_truths, infos, group_ids):
        if all(i.group_num_calls is not None and i.group_correct is not None for i in infos):
            return infos
        if group_ids is None:
            raise ValueError(f"reward {term.name!r} needs group_ids in CompositeReward.batch")
        kind = term.kwargs.get("correctness", "math")
        correct = [is_correct(r, g, kind) for r, g in zip(responses, ground_truths)]
        members: dict[Any, list[int]] = {}
        for idx, gid in enumerate(group_ids):
            members.setdefault(gid, []).append(idx)
        out = []
        for idx, info in enumerate(infos):
            group = members[group_ids[idx]]
            out.append(
                dataclasses.replace(
                    info,
                    group_num_calls=[infos[j].calls for j in group],
                    group_correct=[correct[j] for j in group],
                )
            )
        return out


__all__ = [
    "TrajectoryInfo",
    "register_reward",
    "registered_rewards",
    "get_reward",
    "CompositeReward",
    "last_boxed",
    "last_answer_tag",
    "normalize_answer",
    "math_equal",
    "math_correct",
    "qa_correct",
    "is_correct",
    "tags_in_order",
    "parse_tool_calls",
    "toolrl_correctness",
    "otc_ppo_tool_reward",
    "otc_grpo_tool_reward",
    "otc_map",
]
