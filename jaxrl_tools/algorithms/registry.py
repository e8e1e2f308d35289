"""Name -> function registry for advantage estimators (``@register_advantage_estimator``).

Each estimator declares the ``AdvantageInputs`` fields it needs beyond ``loss_mask_BT`` and
``scores_B`` (``requires``); an estimator that needs ``values_BT`` needs a critic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxrl_tools.registry import Registry

CRITIC_FIELD = "values_BT"

# The modules whose estimators are shipped: every lookup imports them first, so a registry read
# through any module (not only the package) holds them all.
ESTIMATOR_MODULES = ("outcome", "critic", "gigpo", "turns")

ESTIMATORS: Registry[Callable] = Registry(
    "advantage estimator", "jaxrl_tools.algorithms", ESTIMATOR_MODULES
)
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
        ESTIMATORS.add(name, fn)
        _REQUIREMENTS[name] = requires
        _OPTIONAL[name] = tuple(optional)
        if group_baseline:
            _GROUP_BASELINE.add(name)
        if turn_level:
            _TURN_LEVEL.add(name)
        return fn

    return deco


def get_advantage_estimator(name: str) -> Callable:
    """The estimator registered as ``name``; unknown names raise ValueError listing valid ones."""
    return ESTIMATORS.get(name)


def list_advantage_estimators() -> list[str]:
    """Sorted registered names."""
    return ESTIMATORS.names()


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
    return [n for n in ESTIMATORS.names() if CRITIC_FIELD in _REQUIREMENTS[n]]


def turn_level(name: str) -> bool:
    """Whether estimator `name` gives every token of a turn one advantage (its registration's
    `turn_level`)."""
    get_advantage_estimator(name)
    return name in _TURN_LEVEL
