"""RL losses, advantage estimators, token log-probs and batch filters (pure jnp; filters NumPy).

Public API:
  log-probs   token_logprobs, token_entropy, chunked_token_logprobs,
              chunked_token_logprobs_and_entropy
  advantages  AdvantageInputs, AdvantageConfig, compute_advantages, register_advantage_estimator,
              get_advantage_estimator, list_advantage_estimators, discounted_returns,
              gae_advantages, gae_step, last_token_onehot
  losses      LossTerms, PolicyLossConfig, policy_loss, ppo_clip_loss, value_loss,
              entropy_loss, kl_loss, aggregate, loss_denominator, log_ratio, LOSS_AGG_MODES
  kl          kl_penalty, apply_kl_penalty, KL_TYPES
  masked      masked_sum, masked_mean, masked_var, masked_whiten
  filters     dynamic_sampling_filter, starpo_s_filter, accuracy_band_filter
"""

from jaxrl_tools.algorithms.advantages import (
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    gae_step,
    last_token_onehot,
)
from jaxrl_tools.algorithms.filters import (
    accuracy_band_filter,
    dynamic_sampling_filter,
    starpo_s_filter,
)
from jaxrl_tools.algorithms.kl import KL_TYPES, apply_kl_penalty, kl_penalty
from jaxrl_tools.algorithms.logprobs import (
    chunked_token_logprobs,
    chunked_token_logprobs_and_entropy,
    token_entropy,
    token_logprobs,
)
from jaxrl_tools.algorithms.losses import (
    LOSS_AGG_MODES,
    LossTerms,
    PolicyLossConfig,
    aggregate,
    entropy_loss,
    kl_loss,
    log_ratio,
    loss_denominator,
    policy_loss,
    ppo_clip_loss,
    value_loss,
)
from jaxrl_tools.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from jaxrl_tools.algorithms.registry import (
    get_advantage_estimator,
    list_advantage_estimators,
    register_advantage_estimator,
)

__all__ = [
    "KL_TYPES", "LOSS_AGG_MODES", "AdvantageConfig", "AdvantageInputs", "LossTerms",
    "PolicyLossConfig", "accuracy_band_filter", "aggregate", "apply_kl_penalty",
    "chunked_token_logprobs", "chunked_token_logprobs_and_entropy", "compute_advantages",
    "discounted_returns", "dynamic_sampling_filter", "entropy_loss", "gae_advantages", "gae_step",
    "get_advantage_estimator", "kl_loss", "kl_penalty", "last_token_onehot",
    "list_advantage_estimators", "log_ratio", "loss_denominator", "masked_mean", "masked_sum",
    "masked_var", "masked_whiten", "policy_loss", "ppo_clip_loss", "register_advantage_estimator",
    "starpo_s_filter", "token_entropy", "token_logprobs", "value_loss",
]
