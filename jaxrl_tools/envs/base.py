"""Multi-turn text environments: the interface, the registry and the RAGEN turn protocol.

An environment is stepped with the text of one model turn. `reset(seed)` gives the first
observation (the same seed, the same episode: a GRPO group starts from one state), `step` gives
the next observation, the turn's reward, whether the episode ended, and `info`:
`info["anchor_state"]` is the hashable state the turn's action was taken in (GiGPO groups steps
that share it), `info["success"]` whether the goal was reached.

Grid games act on short action words (`Up`, `Left`, ...): `RagenTurns` wraps one in RAGEN's turn
protocol, `<think>...</think><answer>Up || Left</answer>`, up to `max_actions_per_turn` actions a
turn, and a format penalty for a turn that is not in that form or names no valid action.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

from jaxrl_tools.registry import Registry


@dataclasses.dataclass
class StepResult:
    """What one turn did. Unpacks as (observation, reward, done) for the rollout loop."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __iter__(self):
        return iter((self.observation, self.reward, self.done))


class Env(abc.ABC):
    """A text environment (one episode at a time)."""

    name: ClassVar[str] = "base"

    @abc.abstractmethod
    def reset(self, seed: int) -> str:
        """Starts the episode determined by `seed`; returns the first observation."""

    @abc.abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Applies one turn's text."""

    @property
    @abc.abstractmethod
    def state_key(self) -> Hashable:
        """The current state, as GiGPO's anchor."""


class GridEnv(Env):
    """An environment whose actions are words (`actions`), one per step."""

    actions: ClassVar[tuple[str, ...]] = ()
    instructions: ClassVar[str] = ""

    @abc.abstractmethod
    def render(self) -> str:
        """The current state as a text grid."""

    @property
    def state_key(self) -> Hashable:
        return self.render()


# The modules of the shipped environments: every lookup imports them first.
ENV_MODULES = ("external", "frozenlake", "refine", "sokoban")
ENVS: Registry[type[Env]] = Registry("environment", "jaxrl_tools.envs", ENV_MODULES)


def register_env(name: str) -> Callable[[type[Env]], type[Env]]:
    def deco(cls):
        cls.name = name
        ENVS.add(name, cls)
        return cls

    return deco


def env_names() -> tuple[str, ...]:
    return tuple(ENVS.names())


def env_class(name: str) -> type[Env]:
    """The class registered as `name` (unknown: a ValueError listing the registered ones)."""
    return ENVS.get(name)


def make_env(name: str, **kwargs) -> Env:
    """A registered environment by name; the kwargs are its constructor's."""
    return env_class(name)(**kwargs)


_TURN = re.compile(r"^\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*$", re.DOTALL)


def parse_turn(text: str, actions: tuple[str, ...], max_actions: int) -> list[str] | None:
    """The actions of a RAGEN turn, `<think>...</think><answer>A || B</answer>`, in order.

    Action words are matched case-insensitively and returned as spelled in `actions`; actions
    past `max_actions` are dropped. None: the turn is not in that form, or an answer item is
    not a valid action (RAGEN takes no action from such a turn).
    """
    m = _TURN.match(text)
    if m is None:
        return None
    spelled = {a.lower(): a for a in actions}
    items = [item.strip().lower() for item in m.group(2).split("||")]
    if not items or any(item not in spelled for item in items):
        return None
    return [spelled[item] for item in items[:max_actions]]


class RagenTurns(Env):
    """A `GridEnv` stepped with RAGEN turns.

    Args:
      env: the grid environment.
      max_actions_per_turn: actions taken from one turn's answer (RAGEN's limit).
      format_penalty: the reward of a turn that is not `<think>..</think><answer>..</answer>`
        or names an invalid action; the environment does not move.
      max_turns: the episode ends (not successfully) after this many turns.
    """

    def __init__(
        self,
        env: GridEnv,
        *,
        max_actions_per_turn: int = 1,
        format_penalty: float = -0.1,
        max_turns: int = 10,
    ):
        if max_actions_per_turn < 1 or max_turns < 1:
            raise ValueError("max_actions_per_turn and max_turns must be >= 1")
        self.env = env
        self.max_actions_per_turn = max_actions_per_turn
        self.format_penalty = float(format_penalty)
        self.max_turns = max_turns
        self.turns = 0

    @property
    def state_key(self) -> Hashable:
        return self.env.state_key

    def reset(self, seed: int) -> str:
        self.turns = 0
        return self.env.reset(seed)

    def instructions(self) -> str:
        actions = ", ".join(self.env.actions)
        return (
            f"{self.env.instructions}\nAnswer every turn as <think>your reasoning</think>"
            f"<answer>action</answer>, with up to {self.max_actions_per_turn} actions separated "
            f'by " || ". Actions: {actions}.'
        )

    def step(self, action_text: str) -> StepResult:
        anchor = self.env.state_key
        self.turns += 1
        out_of_turns = self.turns >= self.max_turns
        actions = parse_turn(action_text, self.env.actions, self.max_actions_per_turn)
        if actions is None:
            obs = (
                "Invalid answer: write <think>...</think><answer>action</answer> with actions "
                f"from {', '.join(self.env.actions)}.\n{self.env.render()}"
            )
            info = {"anchor_state": anchor, "valid": False, "success": False, "actions": []}
            return StepResult(obs, self.format_penalty, out_of_turns, info)
        reward, done, success = 0.0, False, False
        for action in actions:
            res = self.env.step(action)
            reward += res.reward
            done, success = res.done, bool(res.info.get("success"))
            if done:
                break
        info = {"anchor_state": anchor, "valid": True, "success": success, "actions": actions}
        return StepResult(self.env.render(), reward, done or out_of_turns, info)
