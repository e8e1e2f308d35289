"""Kevin-style refinement: the policy writes a Python function, hidden tests run in the sandbox,
and the feedback comes back for another try, over several turns.

A task (drawn from the seed) is a small function to write, a reference implementation (ours,
host-side) and test inputs drawn from the same seed. Each turn the last ```python block of the
model's text is run in the sandbox on the inputs only; the outputs come back as JSON and are
compared here, so the expected values never reach model-written code. The turn's reward is the
fraction of tests passed, plus 1 when all pass (the correctness gate), which ends the episode.
Kevin's discounted per-turn returns (gamma 0.4) are the estimator's business, not the env's.

Two more of Kevin's settings:
- Reward hacking (`hacking_penalty`): code that could pass by other means than computing the
  answer (imports outside a small list, reading files or its own source, leaving the process,
  reaching interpreter internals through `__dunder__` attributes or `globals()`) is not run; the
  turn scores `hacking_penalty` (Kevin's: 0) and its info says `hacking` (logged as
  env/hacking). The marker that the harness prints its outputs after is drawn afresh per run.
- Summaries (`summaries`): the prompt asks the model to end each answer with a short
  `<summary>`, and each observation is the task again and the attempts so far, each as its
  code, that summary and its test result, without the rest of its reasoning. With
  `env.history: state` that is the whole context of a turn: `max_turns` attempts, not every
  turn's reasoning.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import secrets
from collections.abc import Callable

import numpy as np

from jaxrl_tools.envs.base import Env, StepResult, register_env

_CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)
_SUMMARY = re.compile(r"<summary>(.*?)</summary>", re.DOTALL)
# What a solution may import: enough to write any of the tasks, nothing that reaches the process.
ALLOWED_IMPORTS = frozenset(
    ("bisect", "collections", "functools", "heapq", "itertools", "math", "operator", "re",
     "string", "typing")
)  # fmt: skip
_FORBIDDEN_NAMES = frozenset(
    ("__builtins__", "__file__", "__import__", "__loader__", "__spec__", "breakpoint",
     "compile", "eval", "exec", "exit", "getattr", "globals", "input", "locals", "open",
     "quit", "setattr", "vars")
)  # fmt: skip


def hacking(code: str) -> str | None:
    """Why `code` is refused as reward hacking (Kevin's checks, for Python), or None. Read from
    the syntax tree: nothing runs (code that does not parse is the sandbox's to report)."""
    if len(code) > 20_000:
        return "it is over 20,000 characters"
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for name in names:
                if (name or "").split(".")[0] not in ALLOWED_IMPORTS:
                    return f"it imports {name or 'from a relative module'}"
        elif isinstance(node, ast.Name) and node.id in _FORBIDDEN_NAMES:
            return f"it uses {node.id}"
        elif isinstance(node, ast.Attribute) and node.attr.startswith("__"):
            return f"it reaches the attribute {node.attr}"
    return None


@dataclasses.dataclass(frozen=True)
class Task:
    name: str  # the function to write
    signature: str
    description: str
    reference: Callable
    draw_inputs: Callable[[np.random.Generator], tuple]


def _ints(lo, hi, n):
    return lambda rng: tuple(int(x) for x in rng.integers(lo, hi, n))


TASKS = (
    Task(
        "digit_sum",
        "def digit_sum(n: int) -> int",
        "Return the sum of the decimal digits of n (n >= 0).",
        lambda n: sum(int(c) for c in str(n)),
        _ints(0, 10**6, 1),
    ),
    Task(
        "clip",
        "def clip(x: int, lo: int, hi: int) -> int",
        "Return x limited to the range [lo, hi] (lo <= hi).",
        lambda x, lo, hi: max(lo, min(hi, x)),
        lambda rng: (int(rng.integers(-50, 50)), *sorted(int(v) for v in rng.integers(-30, 30, 2))),
    ),
    Task(
        "count_vowels",
        "def count_vowels(s: str) -> int",
        "Return how many characters of s are vowels (a, e, i, o, u, either case).",
        lambda s: sum(c in "aeiouAEIOU" for c in s),
        lambda rng: ("".join(rng.choice(list("abcdeiouxyzAEU "), int(rng.integers(0, 12)))),),
    ),
    Task(
        "second_largest",
        "def second_largest(xs: list[int]) -> int",
        "Return the second largest distinct value of xs (it has at least two distinct values).",
        lambda xs: sorted(set(xs))[-2],
        lambda rng: ([int(v) for v in rng.permutation(20)[: int(rng.integers(2, 8))]],),
    ),
    Task(
        "run_length",
        "def run_length(s: str) -> list[list]",
        "Return the runs of equal characters of s as [character, length] pairs, in order.",
        lambda s: [[c, len(m.group())] for m in re.finditer(r"(.)\1*", s) for c in [m.group()[0]]],
        lambda rng: ("".join(rng.choice(list("aab"), int(rng.integers(0, 10)))),),
    ),
    Task(
        "is_palindrome",
        "def is_palindrome(s: str) -> bool",
        "Return whether s reads the same backwards, ignoring case and non-letters.",
        lambda s: (t := [c.lower() for c in s if c.isalpha()]) == t[::-1],
        lambda rng: (
            (lambda w: w + w[::-1] if rng.random() < 0.5 else w)(
                "".join(rng.choice(list("abAB ,"), int(rng.integers(0, 6))))
            ),
        ),
    ),
)


@register_env("refine")
class Refine(Env):
    """Args: pool (a `jaxrl_tools.tools.SandboxPool`), num_tests (hidden tests per task),
    max_turns (refinement turns), timeout_s (per run of the tests), hacking_penalty (the
    reward of code refused by `hacking`; null: no check), summaries (module docstring)."""

    def __init__(
        self,
        pool,
        num_tests: int = 8,
        max_turns: int = 4,
        timeout_s: float = 5.0,
        hacking_penalty: float | None = 0.0,
        summaries: bool = False,
    ):
        self.pool, self.num_tests, self.max_turns = pool, num_tests, max_turns
        self.timeout_s, self.hacking_penalty, self.summaries = timeout_s, hacking_penalty, summaries
        self.task: Task | None = None
        self.inputs: list[tuple] = []
        self.turns = 0
        self.statement = ""  # the task, as reset() shows it
        self.attempts: list[str] = []  # with summaries: each earlier attempt, as shown

    def reset(self, seed: int) -> str:
        rng = np.random.default_rng(seed)
        self.task = TASKS[int(rng.integers(len(TASKS)))]
        self.inputs = [self.task.draw_inputs(rng) for _ in range(self.num_tests)]
        self.turns, self.attempts = 0, []
        self.statement = (
            f"Write `{self.task.signature}`: {self.task.description}\n"
            "Answer with the whole function in one ```python block. Hidden tests will check it; "
            "you will see how many passed and can improve it."
            + (
                " End your answer with a short summary of your reasoning in <summary>...</summary>."
                if self.summaries
                else ""
            )
        )
        return self.statement

    @property
    def state_key(self):
        return (self.task.name if self.task else None, self.turns)

    def _harness(self, code: str, mark: str) -> str:
        return (
            f"{code}\n\nimport json as _json\n_outs = []\n"
            f"for _args in _json.loads({json.dumps(json.dumps(self.inputs))}):\n"
            "    try:\n"
            f"        _outs.append(['ok', {self.task.name}(*_args)])\n"
            "    except Exception as _e:\n"
            "        _outs.append(['error', type(_e).__name__ + ': ' + str(_e)[:200]])\n"
            f"print({mark!r} + _json.dumps(_outs, default=repr))\n"
        )

    async def step(self, action_text: str) -> StepResult:
        anchor = self.state_key
        self.turns += 1
        last = self.turns >= self.max_turns
        blocks = _CODE.findall(action_text)
        info = {"anchor_state": anchor, "success": False, "hacking": 0.0}
        if not blocks:
            obs = "No ```python block found: answer with the whole function in one."
            return self._result(action_text, None, obs, 0.0, last, info)
        why = hacking(blocks[-1]) if self.hacking_penalty is not None else None
        if why is not None:
            obs = (
                f"Your code was not run: {why}, which the tests do not allow. Write the "
                f"function in plain Python (imports: {', '.join(sorted(ALLOWED_IMPORTS))})."
            )
            info["hacking"] = 1.0
            return self._result(action_text, blocks[-1], obs, self.hacking_penalty, last, info)
        mark = f"__refine_outputs_{secrets.token_hex(8)}__"  # not known to the code beforehand
        res = await self.pool.run(self._harness(blocks[-1], mark), timeout_s=self.timeout_s)
        outputs = None
        for line in reversed(res.stdout.splitlines()):
            if line.startswith(mark):
                try:
                    outputs = json.loads(line[len(mark) :])
                except ValueError:
                    pass
                break
        if not isinstance(outputs, list) or len(outputs) != len(self.inputs):
            err = (res.stderr.strip().splitlines() or [res.status])[-1]
            obs = f"Your code did not run: {err}"
            return self._result(action_text, blocks[-1], obs, 0.0, last, info)
        passed, first_failure = 0, None
        for args, out in zip(self.inputs, outputs):
            want = json.loads(json.dumps(self.task.reference(*args)))
            if out[0] == "ok" and out[1] == want:
                passed += 1
            elif first_failure is None:
                call = f"{self.task.name}({', '.join(map(repr, args))})"
                got = f"raised {out[1]}" if out[0] == "error" else f"returned {out[1]!r}"
                first_failure = f"{call} {got}, expected {want!r}"
        score = passed / len(self.inputs)
        info["success"] = success = passed == len(self.inputs)
        obs = f"{passed} of {len(self.inputs)} tests passed." + (
            f" First failure: {first_failure}" if first_failure else ""
        )
        reward = score + (1.0 if success else 0.0)
        return self._result(action_text, blocks[-1], obs, reward, success or last, info)

    def _result(self, text, code, feedback, reward, done, info) -> StepResult:
        """The step's result; with summaries, the observation lists every attempt so far."""
        if not self.summaries:
            return StepResult(feedback, reward, done, info)
        summary = _SUMMARY.findall(text)
        self.attempts.append(
            f"Attempt {self.turns}:\n"
            + (f"```python\n{code}```\n" if code is not None else "(no code)\n")
            + (f"Summary: {summary[-1].strip()}\n" if summary else "")
            + f"Result: {feedback}"
        )
        return StepResult("\n\n".join([self.statement, *self.attempts]), reward, done, info)
