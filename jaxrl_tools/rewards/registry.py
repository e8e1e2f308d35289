"""Rule-based rewards, computed on the host, chosen by name from a registry and composed.

Each reward is a function `fn(response, ground_truth, info, **kwargs) -> float` where
`response` is what the model wrote in one trajectory (`Trajectory.model_text`: each tool or
environment observation's text left out, its markup kept, so that no tool output or retrieved
passage can supply the answer), `ground_truth` is the record's answer (a string / number /
list / dict, depending on the reward) and `info` a `TrajectoryInfo` (tool-call records,
counts, length and, for group rewards, the group's call counts and correctness).

    reward = CompositeReward([("math", 1.0, {}), ("dapo_overlong", 1.0, {"max_len": 1024,
                                                                       "buffer": 256})])
    totals_N, parts = reward.batch(responses, ground_truths, infos, group_ids=group_ids)

Formulas: docs/METHODS.md, "Rewards"; the papers are cited at each function.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxrl_tools.data import DataError
from jaxrl_tools.registry import Registry
from jaxrl_tools.rewards import deadline
from jaxrl_tools.rewards.answers import CORRECTNESS_CHECKERS, TRUTH_CHECKS, is_correct

RewardFn = Callable[..., float]
# f(ground_truth, the reward's kwargs) -> what is wrong with that ground truth, or None
TruthCheck = Callable[[Any, Mapping[str, Any]], "str | None"]


class RewardError(DataError):
    """A reward raised on a trajectory; the message names the reward, the trajectory's index
    in its batch (`index`), its ground truth and the start of its response."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class TrajectoryInfo:
    """What a reward may need besides the text.

    Attributes:
      tool_calls: one record per executed tool call; anything with an `ok` attribute or key
        (e.g. the rollout's records or `jaxrl_tools.tools.Observation`). ok=False = it failed.
      num_calls: number of tool calls the model made (default: len(tool_calls)).
      num_turns: messages as verl counts them: the prompt, every model turn and every tool or
        environment turn (2 = a plain answer, 4 = one tool round).
      response_length: response length in tokens (model + observation tokens).
      group_num_calls: the tool-call counts of every response of this prompt's group
        (OTC-GRPO); filled by `CompositeReward.batch` when group_ids are given.
      group_correct: correctness of every response of the group, aligned with group_num_calls.
      env_rewards: the environment's reward of each turn (multi-turn environments).
      step: the RL step being scored (1 at the first; rewards with a schedule over training,
        e.g. ToolRL's dynamic scale; `train.scoring.score_trajectories` fills it); None: such
        rewards score as at step 0.
      extra: anything else (per-dataset fields).
    """

    tool_calls: Sequence[Any] = ()
    num_calls: int | None = None
    num_turns: int = 2
    response_length: int = 0
    group_num_calls: Sequence[int] | None = None
    group_correct: Sequence[bool] | None = None
    env_rewards: Sequence[float] = ()
    step: int | None = None
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

# The modules of the shipped rewards: every lookup imports them first, so the registry holds
# them all whichever module it is read through.
REWARD_MODULES = ("artist", "otc", "outcome", "retrieval", "tool_calls")
REWARDS: Registry[RewardFn] = Registry("reward", "jaxrl_tools.rewards", REWARD_MODULES, KeyError)
_SLOW: set[str] = set()
_GROUP: set[str] = set()
_CHECKERS: dict[str, str] = {}  # reward name -> the answer checker its accuracy is counted by
_TRUTH: dict[str, TruthCheck] = {}  # reward name -> what ground truth it accepts


def register_reward(
    name: str,
    *,
    slow: bool = False,
    group: bool = False,
    correctness: str | None = None,
    truth: str | TruthCheck | None = None,
):
    """Register `fn(response, ground_truth, info, **kwargs) -> float` under `name`.

    Args:
      name: registry name (used in configs: `reward: [{name: ..., weight: ..., kwargs: ...}]`).
      slow: run it in the batch API's worker pool (e.g. symbolic math checking).
      group: it needs the group context (info.group_num_calls / group_correct).
      correctness: the `CORRECTNESS_CHECKERS` name evaluations count as accuracy for a run with
        this reward (e.g. "tool_calls" for function-calling rewards).
      truth: the ground truth it accepts, checked on every record before a run: a
        `TRUTH_CHECKS` name ("math", "qa_em", "tool_calls") or a `TruthCheck`; default
        `correctness`'s (or the reward's own name, when that is a checker's); None: anything.
    """

    def deco(fn: RewardFn) -> RewardFn:
        if name == TIMEOUTS:
            raise ValueError(f"{TIMEOUTS!r} is the name of the timeouts' count; pick another")
        REWARDS.add(name, fn)
        if slow:
            _SLOW.add(name)
        if group:
            _GROUP.add(name)
        if correctness is not None:
            _CHECKERS[name] = correctness
        kind = truth or correctness or (name if name in CORRECTNESS_CHECKERS else None)
        if isinstance(kind, str):
            _TRUTH[name] = lambda gt, kwargs, kind=kind: TRUTH_CHECKS[kind](gt)
        elif kind is not None:
            _TRUTH[name] = kind
        return fn

    return deco


def registered_rewards() -> list[str]:
    """Names of all registered rewards, sorted."""
    return REWARDS.names()


def get_reward(name: str) -> RewardFn:
    """Look up a reward by registry name, or import it from "package.module:function"."""
    if name in REWARDS or ":" not in name:
        return REWARDS.get(name)
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise KeyError(f"cannot import reward {name!r}: {e}") from e


# --------------------------------------------------------------------------------------------
# Composition and the batch API
# --------------------------------------------------------------------------------------------


# parts[TIMEOUTS]: each trajectory's timed-out calls (the trainer logs their sum)
TIMEOUTS = "timeouts"
# A bounded call's checks end at its deadline; it is given up only this much later, so that a
# call cut short by its own checks returns its value instead.
GRACE_S = 1.0


@dataclass(frozen=True)
class _Term:
    name: str
    weight: float
    kwargs: dict
    fn: RewardFn
    slow: bool
    group: bool
    timeout_s: float
    timeout_score: float


def _call_term(term: _Term, response: str, gt: Any, info: TrajectoryInfo) -> float:
    return float(term.fn(response, gt, info, **term.kwargs))


def _counted_call(term: _Term, item) -> tuple[float, int]:
    """(value, timeouts noted during the call); an exception is returned, not raised."""
    with deadline.counting_timeouts() as timeouts:
        try:
            return _call_term(term, *item), len(timeouts)
        except Exception as e:  # noqa: BLE001 -- named with its item by _collect
            return e, len(timeouts)


def _collect(term: _Term, results, responses: Sequence[str], ground_truths: Sequence[Any]):
    """(values, timeouts) of the term's calls in order: a call past its deadline scores the
    term's timeout_score; the first that raised is a RewardError naming its item."""
    values, timeouts = [], []
    for i, result in enumerate(results):
        if result is deadline.TIMED_OUT:
            deadline.note_timeout(
                f"reward {term.name!r} ran past reward[].timeout_s={term.timeout_s} (response "
                f"begins {responses[i][:80]!r}); scored reward[].timeout_score="
                f"{term.timeout_score}"
            )
            result = (term.timeout_score, 1)
        value, n = result
        if isinstance(value, Exception):
            raise RewardError(
                f"reward {term.name!r} raised {type(value).__name__}: {value} (ground truth "
                f"{ground_truths[i]!r:.80}; response begins {responses[i][:120]!r})",
                i,
            ) from value
        values.append(value)
        timeouts.append(n)
    return values, timeouts


class CompositeReward:
    """A weighted sum of registered rewards.

    Args:
      terms: (name, weight, kwargs) triples, or objects/dicts with name/weight/kwargs
        (e.g. config.RewardSpec).
        Each term may also give `timeout_s` and `timeout_score` (config.RewardSpec's).
      max_workers: threads of the batch API for slow rewards.

    Every call of a term on a trajectory is bounded by its `timeout_s` (wall clock, in any
    thread: `rewards.deadline`). Its symbolic math checks stop at that deadline and count as
    not equal (the reward scores its wrong answer); a slow or imported term's call still
    running a second later is given up and scores `timeout_score`. Either is counted in
    `parts[TIMEOUTS]`.
    """

    def __init__(self, terms: Sequence[Any], *, max_workers: int = 4):
        self.terms: list[_Term] = []
        for t in terms:
            if isinstance(t, Mapping):
                name, weight, kwargs = t["name"], t.get("weight", 1.0), t.get("kwargs", {})
                limits = t.get("timeout_s"), t.get("timeout_score")
            elif isinstance(t, tuple | list):
                name, weight, kwargs = (list(t) + [1.0, {}][len(t) - 1 :])[:3]
                limits = None, None
            else:
                name, weight, kwargs = t.name, t.weight, t.kwargs
                limits = getattr(t, "timeout_s", None), getattr(t, "timeout_score", None)
            fn = get_reward(name)
            timeout_s = deadline.DEFAULT_TIMEOUT_S if limits[0] is None else float(limits[0])
            self.terms.append(
                _Term(
                    name,
                    float(weight),
                    dict(kwargs or {}),
                    fn,
                    # a reward imported by name is not ours to trust with the step's thread
                    name in _SLOW or name not in REWARDS,
                    name in _GROUP,
                    timeout_s,
                    float(limits[1] or 0.0),
                )
            )
        names = [t.name for t in self.terms]
        if len(set(names)) != len(names):
            raise ValueError(f"CompositeReward: duplicate reward names {names}")
        self.max_workers = max_workers

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.terms]

    @property
    def correctness(self) -> str:
        """The answer checker of this reward, for accuracy whatever the reward's shaping: the
        first term that is a checker itself ("math", "qa_em") or names one (`correctness`
        kwarg, as OTC's do, or registered with the reward, as ToolRL's "tool_calls"); "math"
        otherwise (ReTool, DAPO)."""
        for t in self.terms:
            kind = t.name if t.name in CORRECTNESS_CHECKERS else t.kwargs.get("correctness")
            kind = kind or _CHECKERS.get(t.name)
            if kind is not None:
                return kind
        return "math"

    def truth_error(self, ground_truth: Any) -> str | None:
        """What is wrong with a record's ground truth for these rewards, or None."""
        for t in self.terms:
            check = _TRUTH.get(t.name)
            msg = check(ground_truth, t.kwargs) if check is not None else None
            if msg is not None:
                shown = repr(ground_truth)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                return f"reward {t.name!r} {msg}; got {type(ground_truth).__name__} {shown}"
        return None

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
        """Rewards for a batch; slow terms run on `max_workers` threads, every call bounded.

        Args:
          responses, ground_truths: aligned, length N.
          infos: per-trajectory TrajectoryInfo (None = empty).
          group_ids: prompt-group id of each trajectory; needed by group rewards (OTC-GRPO),
            whose group context (call counts, correctness) is filled in here when missing.

        Returns:
          (totals_N float32, {term name: values_N float32 (unweighted), TIMEOUTS: each
          trajectory's timed-out calls_N float32}).
        """
        n = len(responses)
        if len(ground_truths) != n or (infos is not None and len(infos) != n):
            raise ValueError("responses, ground_truths and infos must have the same length")
        infos = [i or TrajectoryInfo() for i in (infos if infos is not None else [None] * n)]
        parts: dict[str, np.ndarray] = {}
        timeouts = np.zeros((n,), np.float32)
        for term in self.terms:
            term_infos = infos
            if term.group:
                term_infos = self._with_group_context(
                    term, responses, ground_truths, infos, group_ids
                )
            items = list(zip(responses, ground_truths, term_infos))
            if term.slow:
                results = deadline.run_bounded(
                    functools.partial(_counted_call, term),
                    items,
                    timeout_s=term.timeout_s,
                    grace_s=GRACE_S,
                    workers=self.max_workers,
                )
            else:  # our own string rules: only their math checks can take long
                with deadline.deadline(term.timeout_s):
                    results = [_counted_call(term, item) for item in items]
            values, counts = _collect(term, results, responses, ground_truths)
            parts[term.name] = np.asarray(values, np.float32)
            timeouts += np.asarray(counts, np.float32)
        totals = np.zeros((n,), np.float32)
        for term in self.terms:
            totals += np.float32(term.weight) * parts[term.name]
        parts[TIMEOUTS] = timeouts
        return totals, parts

    @staticmethod
    def _with_group_context(term, responses, ground_truths, infos, group_ids):
        if all(i.group_num_calls is not None and i.group_correct is not None for i in infos):
            return infos
        if group_ids is None:
            raise ValueError(f"reward {term.name!r} needs group_ids in CompositeReward.batch")
        kind = term.kwargs.get("correctness", "math")
        correct = []
        for r, g in zip(responses, ground_truths):
            with deadline.deadline(term.timeout_s):
                correct.append(is_correct(r, g, kind))
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
