"""`ConfigError`, and the object a "package.module:name" spec names: both on the lowest floor,
so any package (an environment's class, an agent, a reward) can check a user's spec."""

from __future__ import annotations

import importlib
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
