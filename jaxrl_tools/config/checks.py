"""The field checks every section's validation uses (`ConfigError` lives in `errors`, on the
lowest floor)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from jaxrl_tools.errors import ConfigError, did_you_mean, import_object


def agent_function(spec: str) -> Any:
    """The agent `spec` ("package.module:function", `rollout.agent`) names: an async function
    taking (client, record); a one-line ConfigError otherwise."""
    fn = import_object(spec, "rollout.agent", "function")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"rollout.agent={spec!r} must be an async function(client, record)")
    try:
        inspect.signature(fn).bind(None, {})
    except TypeError as e:
        raise ConfigError(f"rollout.agent={spec!r} must take (client, record): {e}") from None
    return fn


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name} {msg}")


def _at_least(section_obj: Any, section: str, minimum: int, *fields: str) -> None:
    for f in fields:
        _check(getattr(section_obj, f) >= minimum, f"{section}.{f}", f"must be >= {minimum}")


def _check_choice(value: Any, name: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(
            f"{name}={value!r} is not one of {list(choices)}{did_you_mean(value, choices)}"
        )
