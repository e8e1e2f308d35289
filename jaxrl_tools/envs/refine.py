"""Kevin-style refinement: the policy writes a Python function, hidden tests run in the sandbox,
and the feedback comes back for another try, over several turns.

A task (drawn from the seed) is a small function to write, a reference implementation (ours,
host-side) and test inputs drawn from the same seed. Each turn the last ```python block of the
model's text is run in the sandbox on the inputs only; the outputs come back as JSON and are
compared here, so the expected values never reach model-written code. The turn's reward is the
fraction of tests passed, plus 1 when all pass (the correctness gate), which ends the episode.
Kevin's discounted per-turn returns (gamma 0.4) are the estimator's business, not the env's.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

import numpy as np

from jaxrl_tools.envs.base import Env, StepResult, register_env

_CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)
_MARK = "__refine_outputs__"


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
    max_turns (refinement turns), timeout_s (per run of the tests)."""

    def __init__(self, pool, num_tests: int = 8, max_turns: int = 4, timeout_s: float = 5.0):
        self.pool, self.num_tests, self.max_turns = pool, num_tests, max_turns
        self.timeout_s = timeout_s
        self.task: Task | None = None
        self.inputs: list[tuple] = []
        self.turns = 0
        self.best = 0.0

    def reset(self, seed: int) -> str:
        rng = np.random.default_rng(seed)
        self.task = TASKS[int(rng.integers(len(TASKS)))]
        self.inputs = [self.task.draw_inputs(rng) for _ in range(self.num_tests)]
        self.turns, self.best = 0, 0.0
        return (
            f"Write `{self.task.signature}`: {self.task.description}\n"
            "Answer with the whole function in one ```python block. Hidden tests will check it; "
            "you will see how many passed and can improve it."
        )

    @property
    def state_key(self):
        return (self.task.name if self.task else None, self.turns)

    def _harness(self, code: str) -> str:
        return (
            f"{code}\n\nimport json as _json\n_outs = []\n"
            f"for _args in _json.loads({json.dumps(json.dumps(self.inputs))}):\n"
            "    try:\n"
            f"        _outs.append(['ok', {self.task.name}(*_args)])\n"
            "    except Exception as _e:\n"
            "        _outs.append(['error', type(_e).__name__ + ': ' + str(_e)[:200]])\n"
            f"print({_MARK!r} + _json.dumps(_outs, default=repr))\n"
        )

    async def step(self, action_text: str) -> StepResult:
        anchor = self.state_key
        self.turns += 1
        last = self.turns >= self.max_turns
        blocks = _CODE.findall(action_text)
        if not blocks:
            obs = "No ```python block found: answer with the whole function in one."
            return StepResult(obs, 0.0, last, {"anchor_state": anchor, "success": False})
        res = await self.pool.run(self._harness(blocks[-1]), timeout_s=self.timeout_s)
        outputs = None
        for line in reversed(res.stdout.splitlines()):
            if line.startswith(_MARK):
                try:
                    outputs = json.loads(line[len(_MARK) :])
                except ValueError:
                    pass
                break
        if not isinstance(outputs, list) or len(outputs) != len(self.inputs):
            err = (res.stderr.strip().splitlines() or [res.status])[-1]
            obs = f"Your code did not run: {err}"
            return StepResult(obs, 0.0, last, {"anchor_state": anchor, "success": False})
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
        success = passed == len(self.inputs)
        obs = f"{passed} of {len(self.inputs)} tests passed." + (
            f" First failure: {first_failure}" if first_failure else ""
        )
        reward = score + (1.0 if success else 0.0)
        return StepResult(
            obs, reward, success or last, {"anchor_state": anchor, "success": success}
        )
