"""Name -> function registry for advantage estimators (``@register_advantage_estimator``).

Each estimator declares the ``AdvantageInputs`` fields it needs beyond ``loss_mask_BT`` and
``scores_B`` (``requires``); an estimator that needs ``values_BT`` needs a critic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxrl_tools._lazy import import_modules

CRITIC_FIELD = "values_BT"

# The modules whose estimators are shipped: every lookup imports them first, so a registry read
# through any module (not only the package) holds them all.
ESTIMATOR_MODULES = ("outcome", "critic", "gigpo", "turns")

_ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
_REQUIREMENTS: dict[str, tuple[str, ...]] = {}
_OPTIONAL: dict[str, tuple[str, ...]] = {}
_GROUP_BASELINE: set[str] = set()
_TURN_LEVEL: set[str] = set()


def register_advantage_estimator(
    name: str,
    requires: Sequence[str] = (),
    optional: Sequence[str] = (),
    group_baseline: bool = False,
    turn_level: bool = False,
) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(inputs: AdvantageInputs, config: AdvantageConfig)`` as ``name``.

    Args:
      name: the estimator's name (``algorithm.adv_estimator`` in the run config).
      requires: AdvantageInputs fields it reads beyond ``loss_mask_BT`` / ``scores_B``, e.g.
        ``("values_BT",)``; a call without them is a ValueError naming the missing field.
      optional: fields it reads when given (e.g. ``("kl_BT",)``: token rewards a KL penalty
        can be folded into); others are ignored.
      group_baseline: its baseline is the prompt's own group of responses (a group of one, or
        of identical greedy responses, gets zero advantages).
      turn_level: every model token of one turn gets the same advantage, a function of its
        row's scalars and per-turn inputs only (no token positions, no token rewards): it
        can run on one entry per turn (windowed history, `train.batch`).
    """
    if isinstance(requires, str) or not all(isinstance(f, str) for f in requires):
        raise ValueError(
            f"requires must be a sequence of AdvantageInputs field names, got {requires!r}"
        )
    requires = tuple(requires)

    def deco(fn: Callable) -> Callable:
        if name in _ADVANTAGE_ESTIMATORS and _ADVANTAGE_ESTIMATORS[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ADVANTAGE_ESTIMATORS[name] = fn
        _REQUIREMENTS[name] = requires
        _OPTIONAL[name] = tuple(optional)
        if group_baseline:
            _GROUP_BASELINE.add(name)
        if turn_level:
            _TURN_LEVEL.add(name)
        return fn

    return deco


def load_estimators() -> None:
    """Imports the shipped estimator modules (`ESTIMATOR_MODULES`), registering their estimators."""
    import_modules("jaxrl_tools.algorithms", ESTIMATOR_MODULES)


def get_advantage_estimator(name: str) -> Callable:
    """The estimator registered as ``name``; unknown names raise ValueError listing valid ones."""
    load_estimators()
    try:
        return _ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid: "
            f"{', '.join(sorted(_ADVANTAGE_ESTIMATORS))}"
        ) from None


def list_advantage_estimators() -> list[str]:
    """Sorted registered names."""
    load_estimators()
    return sorted(_ADVANTAGE_ESTIMATORS)


def estimator_requirements(name: str) -> tuple[str, ...]:
    """AdvantageInputs fields estimator ``name`` needs beyond ``loss_mask_BT`` / ``scores_B``."""
    get_advantage_estimator(name)  # unknown name -> ValueError listing the valid ones
    return _REQUIREMENTS[name]


def estimator_inputs(name: str) -> tuple[str, ...]:
    """Every AdvantageInputs field estimator ``name`` reads (required, then optional)."""
    return estimator_requirements(name) + _OPTIONAL[name]


def uses_group_baseline(name: str) -> bool:
    """Whether estimator ``name`` compares each response with the others of its group."""
    get_advantage_estimator(name)
    return name in _GROUP_BASELINE


def needs_critic(name: str) -> bool:
    """Whether estimator ``name`` reads critic values (``values_BT``)."""
    return CRITIC_FIELD in estimator_requirements(name)


def list_critic_estimators() -> list[str]:
    """Sorted names of the registered estimators that need a critic."""
    load_estimators()
    return sorted(n for n, req in _REQUIREMENTS.items() if CRITIC_FIELD in req)


def turn_level(name: str) -> bool:
    """Whether estimator `name` gives every token of a turn one advantage (its registration's
    `turn_level`)."""
    get_advantage_estimator(name)
    return name in _TURN_LEVEL
