"""A run's episodes: the configured environment built for each one, its seed, its prompt.

Every prompt record is one episode, `{"prompt": instructions + first observation,
"env_seed": seed, "id": "name-seed"}`; each of its G samples gets a fresh environment reset
with that seed, so a group starts from one state (GRPO compares like with like, GiGPO's anchor
states line up). Training seeds are `seed, seed + 1, ...`; held-out seeds start at
`seed + EVAL_SEED_OFFSET`, so no evaluation episode is a training one.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from jaxrl_tools.envs.base import Env, GridEnv, RagenTurns, env_class

EVAL_SEED_OFFSET = 1_000_000_007
# Constructor arguments the episode builder sets itself (from the env section / the run).
_SET_BY_RUN = ("self", "pool", "max_turns")


def _params(name: str) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(env_class(name).__init__).parameters)


def env_kwargs(name: str) -> list[str]:
    """The keys `env.kwargs` may hold for environment `name` (its constructor's, less those
    the run sets: the sandbox pool and the turn limit)."""
    return [
        n for n, p in _params(name).items() if n not in _SET_BY_RUN and p.kind != p.VAR_POSITIONAL
    ]


def needs_sandbox(name: str) -> bool:
    """Whether environment `name` runs code in a sandbox pool (its constructor takes `pool`)."""
    return "pool" in _params(name)


class Episodes:
    """Builds the environment of each episode.

    Args:
      name: a registered environment.
      kwargs: its constructor's arguments.
      max_turns: turns per episode; the environment ends the episode after them (grid games
        through `RagenTurns`, others through their own `max_turns`).
      max_actions_per_turn, format_penalty: RAGEN turns of grid games.
      context_budget: prompt + response tokens per episode (None: the engine's); with
        windowed history, per turn.
      history: what the model sees each turn, "full" (one sequence per episode), "last_k"
        (a fresh prompt a turn with the last `history_length` turns) or "state" (the current
        observation only); see `config.EnvSection`.
      pool: a sandbox pool, for environments that run code (`needs_sandbox`).
    """

    def __init__(
        self,
        name: str,
        kwargs: dict[str, Any] | None = None,
        *,
        max_turns: int = 5,
        max_actions_per_turn: int = 1,
        format_penalty: float = -0.1,
        context_budget: int | None = None,
        history: str = "full",
        history_length: int = 2,
        pool=None,
    ):
        self.cls = env_class(name)
        self.name, self.kwargs = name, dict(kwargs or {})
        self.max_turns, self.context_budget = max_turns, context_budget
        self.max_actions_per_turn, self.format_penalty = max_actions_per_turn, format_penalty
        self.history, self.history_length = history, history_length
        self.pool = pool

    @classmethod
    def from_section(cls, section, pool=None) -> Episodes:
        """From a `config.EnvSection`."""
        return cls(
            section.name,
            section.kwargs,
            max_turns=section.max_turns,
            max_actions_per_turn=section.max_actions_per_turn,
            format_penalty=section.format_penalty,
            context_budget=section.context_budget,
            history=section.history,
            history_length=section.history_length,
            pool=pool,
        )

    def build(self, *, reset_only: bool = False) -> Env:
        """A new environment (not reset). `reset_only`: it will only be reset (a prompt), so an
        environment that runs code needs no sandbox pool."""
        if issubclass(self.cls, GridEnv):
            return RagenTurns(
                self.cls(**self.kwargs),
                max_actions_per_turn=self.max_actions_per_turn,
                format_penalty=self.format_penalty,
                max_turns=self.max_turns,
            )
        extra: dict[str, Any] = {}
        params = _params(self.name)
        if "max_turns" in params:
            extra["max_turns"] = self.max_turns
        if "pool" in params:
            if self.pool is None and not reset_only:
                raise ValueError(f"environment {self.name!r} runs code: it needs a sandbox pool")
            extra["pool"] = self.pool
        return self.cls(**self.kwargs, **extra)

    def start(self, seed: int) -> Env:
        """A new environment reset with `seed` (the rollout's env_factory)."""
        env = self.build()
        env.reset(int(seed))
        return env

    def prompt(self, seed: int) -> str:
        """The episode's first user turn: the environment's instructions and first observation."""
        env = self.build(reset_only=True)
        first = env.reset(int(seed))
        return window_text(instructions(env), [], first)

    @property
    def windowed(self) -> bool:
        """Whether every turn is a fresh prompt (history last_k or state), not one sequence."""
        return self.history != "full"

    @property
    def window_turns(self) -> int:
        """Earlier turns a windowed prompt holds (0 for state)."""
        return self.history_length if self.history == "last_k" else 0

    def records(self, seeds: Sequence[int]) -> list[dict]:
        """One prompt record per seed."""
        return [
            {
                "prompt": self.prompt(s),
                "env_seed": int(s),
                "ground_truth": None,
                "id": f"{self.name}-{s}",
            }
            for s in seeds
        ]

    def split_records(self, section, split: str) -> list[dict]:
        """The training or held-out episodes of a `config.EnvSection`."""
        if split == "train":
            return self.records(range(section.seed, section.seed + section.train_episodes))
        first = section.seed + EVAL_SEED_OFFSET
        return self.records(range(first, first + section.eval_episodes))


def instructions(env: Env) -> str:
    """The environment's instructions ("" when it has none)."""
    return env.instructions() if hasattr(env, "instructions") else ""


def window_text(intro: str, earlier: Sequence[tuple[str, str]], observation: str) -> str:
    """A turn's user message: the instructions, the earlier (observation, answer) pairs shown
    (oldest first) and the current observation. Without earlier pairs it is the episode's first
    prompt's form, so a `state` prompt always looks like a first turn."""
    parts = [intro] if intro else []
    parts += [f"Earlier observation:\n{obs}\nYour answer: {answer}" for obs, answer in earlier]
    return "\n\n".join([*parts, observation])
