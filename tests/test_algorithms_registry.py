"""The valid-name lists and the estimator registry's declared requirements."""

import jax.numpy as jnp
import numpy as np
import pytest
from fakes import ESTIMATORS

import jaxrl_tools.algorithms as A
from jaxrl_tools.algorithms import registry


def test_requirements_of_the_builtin_estimators():
    want = {
        "grpo": (),
        "drgrpo": (),
        "rloo": (),
        "reinforce_pp": (),
        "reinforce_pp_baseline": (),
        "remax": ("baseline_B",),
        "gae": ("values_BT",),
        "vapo": ("values_BT",),
        "gigpo": ("step_rewards_BS", "step_mask_BS", "anchor_ids_BS", "token_step_BT"),
        "kevin": ("step_rewards_BS", "step_mask_BS", "token_step_BT"),
        "turn_rloo": ("step_rewards_BS", "step_mask_BS", "token_step_BT"),
    }
    assert {n: A.estimator_requirements(n) for n in ESTIMATORS} == want
    assert A.list_advantage_estimators() == ESTIMATORS
    assert A.list_critic_estimators() == ["gae", "vapo"]
    assert [n for n in ESTIMATORS if A.needs_critic(n)] == ["gae", "vapo"]
    # every declared requirement is an AdvantageInputs field
    fields = set(A.AdvantageInputs.__dataclass_fields__)
    assert all(set(A.estimator_requirements(n)) <= fields for n in ESTIMATORS)


def test_unknown_names():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; valid: drgrpo, gae"):
        A.estimator_requirements("ppo")
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        A.needs_critic("ppo")
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'; valid: ppo_clip, gspo"):
        A.policy_loss_ratio_type("grpo")


def test_name_lists():
    assert A.POLICY_LOSSES == ("ppo_clip", "gspo")
    assert [A.policy_loss_ratio_type(n) for n in A.POLICY_LOSSES] == ["token", "sequence"]
    assert [A.policy_loss_dual_clip(n) for n in A.POLICY_LOSSES] == [3.0, None]
    assert A.LOSS_AGG_MODES == (
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    )
    assert {"k1", "k2", "k3", "low_var_kl", "abs"} <= set(A.KL_TYPES)
    for kl_type in A.KL_TYPES:  # every listed name is accepted
        A.PolicyLossConfig(kl_type=kl_type)
    for mode in A.LOSS_AGG_MODES:
        A.PolicyLossConfig(loss_agg_mode=mode, max_len=8)


def test_requires_must_be_field_names():
    with pytest.raises(ValueError, match="requires must be a sequence"):
        A.register_advantage_estimator("x", requires="values_BT")


def test_custom_estimator_requirements_enforced(monkeypatch):
    registry.ESTIMATORS.load()  # the shipped ones, registered before the registry is copied
    monkeypatch.setattr(registry.ESTIMATORS, "_entries", dict(registry.ESTIMATORS._entries))
    monkeypatch.setattr(registry, "_REQUIREMENTS", dict(registry._REQUIREMENTS))

    @A.register_advantage_estimator("value_baseline", requires=("values_BT",))
    def value_baseline(inputs, config):
        a = (inputs.scores_B[:, None] - inputs.values_BT) * inputs.loss_mask_BT
        return a, a

    assert A.needs_critic("value_baseline")
    assert "value_baseline" in A.list_critic_estimators()
    m = jnp.ones((2, 3))
    inputs = A.AdvantageInputs(loss_mask_BT=m, scores_B=jnp.ones(2))
    with pytest.raises(ValueError, match="'value_baseline' needs AdvantageInputs.values_BT"):
        A.compute_advantages("value_baseline", inputs, A.AdvantageConfig())
    with pytest.raises(ValueError, match="'value_baseline': AdvantageInputs.values_BT has shape"):
        A.compute_advantages(
            "value_baseline",
            A.AdvantageInputs(loss_mask_BT=m, scores_B=jnp.ones(2), values_BT=jnp.ones(3)),
            A.AdvantageConfig(),
        )
    a, _ = A.compute_advantages(
        "value_baseline",
        A.AdvantageInputs(loss_mask_BT=m, scores_B=jnp.ones(2), values_BT=jnp.zeros((2, 3))),
        A.AdvantageConfig(),
    )
    np.testing.assert_array_equal(a, np.ones((2, 3)))
