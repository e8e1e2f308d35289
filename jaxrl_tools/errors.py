"""`ConfigError`, and the object a "package.module:name" spec names: both on the lowest floor,
so any package (an environment's class, an agent, a reward) can check a user's spec."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable, Sequence
from typing import Any


class ConfigError(ValueError):
    """A configuration error; the message names the field (dotted path) at fault."""


def import_object(spec: str, field: str, kind: str) -> Any:
    """The `kind` ("function", "Class") that `spec`, "package.module:name", names; a
    ConfigError naming `field` when it cannot be imported."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"{field}={spec!r}: give 'package.module:{kind}'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{field}={spec!r} cannot be loaded: {e}") from None


def did_you_mean(word: Any, names: Sequence[str]) -> str:
    """ " (did you mean 'name'?)" for the closest of `names` to `word`; "" when none is close."""
    close = difflib.get_close_matches(str(word), names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def reject_unknown_keys(keys: Iterable[Any], valid: Sequence[str], field: str, owner: str) -> None:
    """A ConfigError for the first of `keys` not in `valid`, naming `field` (what holds the
    keys) and `owner` (what takes them), the closest valid key and all of them."""
    for key in keys:
        if key not in valid:
            raise ConfigError(
                f"{field} has unknown key {key!r} for {owner}{did_you_mean(key, valid)}; "
                f"valid keys: {valid}"
            )
