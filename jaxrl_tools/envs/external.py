"""Environments from the ecosystem, played through the `env` section like our own.

    env: {name: gymnasium, kwargs: {id: "my_pkg.envs:Guess-v0", make_kwargs: {size: 5}}}
    env: {name: openenv, kwargs: {environment: "my_pkg.server:EchoEnvironment"}}

A model turn is the action, as text; the observation comes back as text, with the turn's
reward and whether the episode ended. `gymnasium`: any environment `gymnasium.make` builds from
its id ("module:Name-v0" imports the module that registers it) whose actions are text.
`openenv`: an OpenEnv (`openenv-core`) `Environment` class, run in process; the turn's text is
the one text field of its action type (or `action_field`), the observation the one text field of
its observation (or `observation_field`, or the observation's fields as JSON).

Both keep `info["success"]` when the environment reports it (gymnasium's info, OpenEnv's
observation metadata), and the observation a turn was taken in is its GiGPO anchor state.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Hashable
from typing import Any

from jaxrl_tools.envs.base import Env, StepResult, register_env
from jaxrl_tools.errors import import_object


class _TextTurns(Env):
    """Counts turns, remembers the observation (the anchor state) and ends at `max_turns`."""

    def __init__(self, instructions: str, max_turns: int):
        self._instructions, self.max_turns = instructions, max_turns
        self.turns, self.observation = 0, ""

    def instructions(self) -> str:
        return self._instructions

    @property
    def state_key(self) -> Hashable:
        return self.observation

    def _started(self, observation: str) -> str:
        self.turns, self.observation = 0, observation
        return observation

    def _stepped(self, observation: str, reward, done: bool, success) -> StepResult:
        anchor, self.observation = self.observation, observation
        self.turns += 1
        info = {"anchor_state": anchor, "success": bool(success)}
        return StepResult(
            observation, float(reward or 0.0), done or self.turns >= self.max_turns, info
        )


@register_env("gymnasium")
class GymnasiumText(_TextTurns):
    """A gymnasium environment with text actions, by id.

    Args:
      id: its registered id (`gymnasium.make`'s; "module:Name-v0" imports the module first).
      make_kwargs: `gymnasium.make`'s keyword arguments for it.
      instructions: text shown before the first observation.
      max_turns: set by the run (`env.max_turns`).
    """

    def __init__(
        self,
        id: str,  # noqa: A002 -- gymnasium's name for it
        make_kwargs: dict[str, Any] | None = None,
        instructions: str = "",
        max_turns: int = 5,
    ):
        import gymnasium  # noqa: PLC0415 -- a core dependency, imported when used

        super().__init__(instructions, max_turns)
        try:
            self.env = gymnasium.make(id, **(make_kwargs or {}))
        except Exception as e:  # an unknown id, a module that fails to import, bad kwargs
            raise ValueError(f"env.kwargs.id={id!r}: gymnasium.make failed: {e}") from None

    def reset(self, seed: int) -> str:
        obs, _ = self.env.reset(seed=seed)
        return self._started(str(obs))

    def step(self, action_text: str) -> StepResult:
        obs, reward, terminated, truncated, info = self.env.step(action_text)
        return self._stepped(str(obs), reward, terminated or truncated, info.get("success"))


@register_env("openenv")
class OpenEnv(_TextTurns):
    """An OpenEnv `Environment` class, in process.

    Args:
      environment: the class, "package.module:Class".
      kwargs: its constructor's arguments.
      action: its action type, "package.module:Class" (default: from `Environment[Act, ...]`).
      action_field: the action's field the turn's text goes in (default: its one str field).
      observation_field: the observation's field shown (default: its one str field; none or
        several: its fields as JSON, less done, reward and metadata).
      instructions: text shown before the first observation.
      max_turns: set by the run (`env.max_turns`).
    """

    def __init__(
        self,
        environment: str,
        kwargs: dict[str, Any] | None = None,
        action: str | None = None,
        action_field: str | None = None,
        observation_field: str | None = None,
        instructions: str = "",
        max_turns: int = 5,
    ):
        super().__init__(instructions, max_turns)
        cls = import_object(environment, "env.kwargs.environment", "Class")
        self.action_type = (
            import_object(action, "env.kwargs.action", "Class") if action else _action_type(cls)
        )
        self.action_field = action_field or _text_field(self.action_type, "env.kwargs.action_field")
        if self.action_field not in self.action_type.model_fields:
            raise ValueError(
                f"env.kwargs.action_field={self.action_field!r} is not a field of "
                f"{self.action_type.__name__} (fields: {list(self.action_type.model_fields)})"
            )
        fields = self.action_type.model_fields.items()
        required = [n for n, f in fields if f.is_required() and n != self.action_field]
        if required:
            raise ValueError(
                f"env.kwargs.action: {self.action_type.__name__} needs {required} besides "
                f"{self.action_field!r}, and a turn gives only its text: give an action type "
                "with defaults for the others"
            )
        self.observation_field = observation_field
        self.env = cls(**(kwargs or {}))

    def reset(self, seed: int) -> str:
        return self._started(self._text(self.env.reset(seed=seed)))

    def step(self, action_text: str) -> StepResult:
        obs = self.env.step(self.action_type(**{self.action_field: action_text}))
        return self._stepped(self._text(obs), obs.reward, obs.done, obs.metadata.get("success"))

    def _text(self, obs) -> str:
        field = self.observation_field or _text_field(type(obs), None)
        if field is not None:
            return str(getattr(obs, field))
        return json.dumps(obs.model_dump(exclude={"done", "reward", "metadata"}), default=str)


def _action_type(cls: type) -> type:
    """`Act` of the first `Environment[Act, Obs, State]` among the class's bases."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if getattr(typing.get_origin(base), "__name__", "") == "Environment" and args:
                if isinstance(args[0], type):
                    return args[0]
    raise ValueError(
        f"env.kwargs.environment: {cls.__name__} does not subclass Environment[Action, ...] "
        "with a concrete action type; name it in env.kwargs.action"
    )


def _text_field(model: type, field: str | None) -> str | None:
    """The one str field of a pydantic model (metadata aside); several or none: an error
    naming `field`, or None when `field` is None."""
    names = [n for n, f in model.model_fields.items() if f.annotation is str and n != "metadata"]
    if len(names) == 1:
        return names[0]
    if field is None:
        return None
    raise ValueError(
        f"{field}: {model.__name__} has {len(names)} str fields ({names}); name the one the "
        "turn's text goes in"
    )
