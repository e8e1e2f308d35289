"""RL losses, advantage estimators, token log-probs and batch filters (pure jnp; filters NumPy).

Public API:
  log-probs   target_logprobs (targets aligned by the caller; the sequence convention is
              train.policy.token_logprobs), token_entropy,
              chunked_token_logprobs, chunked_token_logprobs_and_entropy
  advantages  AdvantageInputs, AdvantageConfig, compute_advantages, register_advantage_estimator,
              get_advantage_estimator, list_advantage_estimators, estimator_requirements,
              contiguous_groups (verl uid -> contiguous rows),
              needs_critic, list_critic_estimators, discounted_returns, gae_advantages, gae_step,
              last_token_onehot
  aggregation LossTerms, aggregate, loss_denominator, verl_loss_denominator, LOSS_AGG_MODES
  losses      ppo_clip_loss, value_loss, entropy_loss, kl_loss, log_ratio
  off_policy  OffPolicyConfig, off_policy_weights, decoupled
  objective   PolicyLossConfig, policy_loss, POLICY_LOSSES, policy_loss_ratio_type,
              policy_loss_dual_clip
  kl          kl_penalty, apply_kl_penalty, KL_TYPES
  masked      masked_sum, masked_mean, masked_var, masked_whiten
  filters     dynamic_sampling_filter, starpo_s_filter, accuracy_band_filter

Valid names of each configurable choice, owned by the module that implements it:
  advantage estimators  list_advantage_estimators(); those needing a critic
                        list_critic_estimators() / needs_critic(name)
  KL estimators         KL_TYPES
  loss aggregation      LOSS_AGG_MODES
  policy losses         POLICY_LOSSES

Estimator modules (imported by the registry's lookups, so that their estimators are registered
before any is looked up): ``outcome`` (grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline,
remax), ``critic`` (gae, vapo), ``gigpo``, ``turns`` (kevin). Names are imported on first use.
"""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.algorithms.advantages import (
        AdvantageConfig,
        AdvantageInputs,
        compute_advantages,
        contiguous_groups,
        discounted_returns,
        last_token_onehot,
    )
    from jaxrl_tools.algorithms.aggregation import (
        LOSS_AGG_MODES,
        LossTerms,
        aggregate,
        loss_denominator,
        verl_loss_denominator,
    )
    from jaxrl_tools.algorithms.critic import gae_advantages, gae_step
    from jaxrl_tools.algorithms.filters import (
        accuracy_band_filter,
        dynamic_sampling_filter,
        starpo_s_filter,
    )
    from jaxrl_tools.algorithms.kl import KL_TYPES, apply_kl_penalty, kl_penalty
    from jaxrl_tools.algorithms.logprobs import (
        chunked_token_logprobs,
        chunked_token_logprobs_and_entropy,
        target_logprobs,
        token_entropy,
    )
    from jaxrl_tools.algorithms.losses import (
        entropy_loss,
        kl_loss,
        log_ratio,
        ppo_clip_loss,
        value_loss,
    )
    from jaxrl_tools.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
    from jaxrl_tools.algorithms.objective import (
        POLICY_LOSSES,
        PolicyLossConfig,
        policy_loss,
        policy_loss_dual_clip,
        policy_loss_ratio_type,
    )
    from jaxrl_tools.algorithms.off_policy import OffPolicyConfig, decoupled, off_policy_weights
    from jaxrl_tools.algorithms.registry import (
        estimator_inputs,
        estimator_requirements,
        get_advantage_estimator,
        list_advantage_estimators,
        list_critic_estimators,
        needs_critic,
        register_advantage_estimator,
        turn_level,
        uses_group_baseline,
    )

__all__ = [
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdvantageConfig",
    "AdvantageInputs",
    "LossTerms",
    "OffPolicyConfig",
    "PolicyLossConfig",
    "accuracy_band_filter",
    "aggregate",
    "apply_kl_penalty",
    "chunked_token_logprobs",
    "chunked_token_logprobs_and_entropy",
    "compute_advantages",
    "contiguous_groups",
    "decoupled",
    "discounted_returns",
    "dynamic_sampling_filter",
    "entropy_loss",
    "estimator_inputs",
    "uses_group_baseline",
    "estimator_requirements",
    "gae_advantages",
    "gae_step",
    "get_advantage_estimator",
    "kl_loss",
    "kl_penalty",
    "last_token_onehot",
    "list_advantage_estimators",
    "list_critic_estimators",
    "log_ratio",
    "loss_denominator",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "needs_critic",
    "off_policy_weights",
    "policy_loss",
    "policy_loss_dual_clip",
    "policy_loss_ratio_type",
    "ppo_clip_loss",
    "register_advantage_estimator",
    "starpo_s_filter",
    "target_logprobs",
    "token_entropy",
    "turn_level",
    "value_loss",
    "verl_loss_denominator",
]

__getattr__, __dir__ = lazy_api(__name__)
