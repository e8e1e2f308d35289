"""Name -> function registry for advantage estimators (``@register_advantage_estimator``)."""

from __future__ import annotations

from collections.abc import Callable

_ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}


def register_advantage_estimator(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(inputs: AdvantageInputs, config: AdvantageConfig)`` as ``name``."""

    def deco(fn: Callable) -> Callable:
        if name in _ADVANTAGE_ESTIMATORS and _ADVANTAGE_ESTIMATORS[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return deco


def get_advantage_estimator(name: str) -> Callable:
    """The estimator registered as ``name``; unknown names raise ValueError listing valid ones."""
    try:
        return _ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: "
                         f"{', '.join(sorted(_ADVANTAGE_ESTIMATORS))}") from None


def list_advantage_estimators() -> list[str]:
    """Sorted registered names."""
    return sorted(_ADVANTAGE_ESTIMATORS)
