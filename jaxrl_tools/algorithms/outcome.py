"""Critic-free estimators from outcome rewards: group baselines and REINFORCE-style returns.

Formulas in docs/METHODS.md; group layout and the uniform call in ``advantages``.
  grpo        (s − μ_g)/(σ_g + eps), σ unbiased (ddof=1); G = 1 -> μ = 0, σ = 1; ``norm_by_std``.
  drgrpo      s − μ_g (Dr. GRPO, 2503.20783).
  rloo        s_i − mean_{j≠i} s_j (G = 1 -> s_i).
  reinforce_pp  token rewards (outcome at the last model token, − kl_beta·KL_t if ``kl_BT``),
              G_t = r_t + γ G_{t+1} carried through masked tokens, then batch whitening.
  reinforce_pp_baseline  (s − μ_g) on every model token, then batch whitening.
  remax       G_t − b, b = ``baseline_B`` (reward of the greedy response).

Notes where sources differ:
  * GRPO σ: verl uses torch.std (unbiased, ddof=1), as docs/METHODS.md; the DeepSeekMath paper
    does not say which. A population std (ddof=0) would scale advantages by sqrt(G/(G−1)).
  * REINFORCE++ returns: verl resets the running return at mask = 0 positions
    (``running_return *= mask``), which cuts an outcome off from earlier turns when tool
    observations sit in between; here (docs/METHODS.md) it is carried through, undiscounted, at
    masked positions. Identical for single-turn responses whose mask is a contiguous prefix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms.advantages import (
    AdvantageConfig,
    AdvantageInputs,
    broadcast_rows,
    check_inputs,
    discounted_returns,
    group_mean_std,
    group_rows,
    grpo_scores,
    token_rewards,
)
from jaxrl_tools.algorithms.masked import masked_whiten
from jaxrl_tools.algorithms.registry import register_advantage_estimator

f32 = jnp.float32


@register_advantage_estimator("grpo", group_baseline=True, turn_level=True)
def grpo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """GRPO: (s − μ_group)/(σ_group + eps) (σ only if ``config.norm_by_std``) on model tokens."""
    check_inputs("grpo", inputs, "scores_B")
    a = grpo_scores(inputs.scores_B, config, config.norm_by_std, "grpo")
    a = broadcast_rows(a, inputs.loss_mask_BT)
    return a, a


@register_advantage_estimator("drgrpo", group_baseline=True, turn_level=True)
def drgrpo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """Dr. GRPO: s − μ_group on model tokens (pair with loss_agg seq-mean-token-sum-norm)."""
    check_inputs("drgrpo", inputs, "scores_B")
    a = broadcast_rows(grpo_scores(inputs.scores_B, config, False, "drgrpo"), inputs.loss_mask_BT)
    return a, a


@register_advantage_estimator("rloo", group_baseline=True, turn_level=True)
def rloo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """RLOO: s_i − mean_{j≠i} s_j (a group of one keeps s_i)."""
    check_inputs("rloo", inputs, "scores_B")
    s = group_rows(inputs.scores_B, config.group_size, "rloo")
    G = s.shape[1]
    if G > 1:
        s = s - (jnp.sum(s, axis=1, keepdims=True) - s) / (G - 1)
    a = broadcast_rows(s.reshape(-1), inputs.loss_mask_BT)
    return a, a


@register_advantage_estimator("reinforce_pp", optional=("kl_BT",))
def reinforce_pp(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++: discounted token returns (outcome − β·KL), whitened over the batch."""
    check_inputs("reinforce_pp", inputs)
    m = inputs.loss_mask_BT
    g = discounted_returns(token_rewards(inputs, config, "reinforce_pp"), m, config.gamma)
    return masked_whiten(g, m), g * m.astype(f32)


@register_advantage_estimator("reinforce_pp_baseline", group_baseline=True)
def reinforce_pp_baseline(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++-baseline: (s − μ_group) on each model token, whitened over the batch."""
    check_inputs("reinforce_pp_baseline", inputs, "scores_B")
    s = group_rows(inputs.scores_B, config.group_size, "reinforce_pp_baseline")
    mu, _ = group_mean_std(s)
    m = inputs.loss_mask_BT
    a = masked_whiten(broadcast_rows((s - mu).reshape(-1), m), m)
    return a, a


@register_advantage_estimator("remax", requires=("baseline_B",), optional=("kl_BT",))
def remax(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """ReMax: A_t = G_t − b with b the greedy response's reward (``baseline_B``)."""
    check_inputs("remax", inputs)
    m = inputs.loss_mask_BT.astype(f32)
    g = discounted_returns(token_rewards(inputs, config, "remax"), m, config.gamma) * m
    return g - broadcast_rows(inputs.baseline_B.astype(f32), m), g
