"""Estimators with a learned critic: PPO's GAE and VAPO's decoupled, length-adaptive GAE.

Formulas in docs/METHODS.md; the uniform call in ``advantages``. Both need ``values_BT``.
  gae         PPO GAE; observation tokens (m = 0) are skipped: the next value and the running
              advantage are carried across them; returns = A + V; optional batch whitening.
  vapo        GAE with λ_policy = clip(1 − 1/(α·|o|), 0, 1) per response for the advantages and
              λ_critic (1.0) for the returns (decoupled GAE, 2504.05118).

Notes where sources differ:
  * GAE: verl whitens the advantages (``masked_whiten``); here that is ``config.whiten`` (True).
  * VAPO: the paper's λ = 1 − 1/(α·l) is negative for l < 1/α = 20 tokens; we clip to [0, 1].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms._checks import check_like, check_ndim, shape_of
from jaxrl_tools.algorithms.advantages import (
    AdvantageConfig,
    AdvantageInputs,
    check_inputs,
    token_rewards,
)
from jaxrl_tools.algorithms.masked import masked_whiten
from jaxrl_tools.algorithms.registry import CRITIC_FIELD, register_advantage_estimator

f32 = jnp.float32


def _check_lam(fn: str, name: str, lam, B: int) -> None:
    if shape_of(lam) not in ((), (B,)):
        raise ValueError(
            f"{fn}: {name} has shape {shape_of(lam)}, expected a scalar or [B] = "
            f"{(B,)} (one λ per row)"
        )


def gae_step(gamma: float, lam_B: jax.Array, carry, x):
    """One backward GAE step (the ``lax.scan`` body of ``gae_advantages``).

    carry = (next_v_B, last_a_B): value and advantage of the next model token; x = (r_B, v_B, m_B).
    On a masked token (m = 0) the carry passes through unchanged. ``lam_B``: scalar or [B].
    """
    next_v, last_a = carry
    r, v, m = x
    check_ndim("gae_step", "r_B", r, "[B]")
    check_like("gae_step", "r_B", r, v_B=v, m_B=m, next_v_B=next_v, last_a_B=last_a)
    _check_lam("gae_step", "lam_B", lam_B, shape_of(r)[0])
    a = r + gamma * next_v - v + gamma * lam_B * last_a
    next_v = jnp.where(m, v, next_v)
    last_a = jnp.where(m, a, last_a)
    return (next_v, last_a), last_a


def gae_advantages(
    rewards_BT: jax.Array, values_BT: jax.Array, loss_mask_BT: jax.Array, gamma: float, lam
) -> jax.Array:
    """Raw GAE (no whitening, not masked), skipping m = 0 positions (verl multi-turn GAE).

    δ_t = r_t + γ·V_next − V_t;  A_t = δ_t + γλ·A_next, where V_next / A_next are those of the next
    model token (carried across masked positions).

    Args:
      rewards_BT: [B, T] token rewards.
      values_BT: [B, T] critic values; exactly the shape of ``rewards_BT``.
      loss_mask_BT: [B, T] 1 on model tokens; exactly the shape of ``rewards_BT``.
      gamma: discount.
      lam: λ, a scalar or a [B] array (one per row).
    Returns:
      [B, T] float32 advantages.
    """
    check_ndim("gae_advantages", "rewards_BT", rewards_BT, "[B, T]")
    check_like(
        "gae_advantages", "rewards_BT", rewards_BT, values_BT=values_BT, loss_mask_BT=loss_mask_BT
    )
    B = shape_of(rewards_BT)[0]
    _check_lam("gae_advantages", "lam", lam, B)
    lam_B = jnp.broadcast_to(jnp.asarray(lam, f32), (B,))
    xs = (rewards_BT.astype(f32).T, values_BT.astype(f32).T, loss_mask_BT.T > 0)
    zeros = jnp.zeros((B,), f32)
    step = functools.partial(gae_step, gamma, lam_B)
    _, a_TB = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
    return a_TB.T


@register_advantage_estimator("gae", requires=(CRITIC_FIELD,), optional=("kl_BT",))
def gae(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """PPO GAE(γ, λ) over model tokens; returns = A + V (before whitening)."""
    check_inputs("gae", inputs)
    m = inputs.loss_mask_BT
    a = gae_advantages(
        token_rewards(inputs, config, "gae"), inputs.values_BT, m, config.gamma, config.lam
    )
    mf = m.astype(f32)
    returns = (a + inputs.values_BT.astype(f32)) * mf
    return (masked_whiten(a, m) if config.whiten else a * mf), returns


@register_advantage_estimator("vapo", requires=(CRITIC_FIELD,), optional=("kl_BT",))
def vapo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """VAPO decoupled, length-adaptive GAE: policy λ = 1 − 1/(α|o|), critic λ = critic_lam."""
    check_inputs("vapo", inputs)
    m = inputs.loss_mask_BT
    mf = m.astype(f32)
    r = token_rewards(inputs, config, "vapo")
    length = jnp.sum(mf, axis=1)
    lam_policy = jnp.clip(1.0 - 1.0 / jnp.maximum(config.vapo_alpha * length, 1e-6), 0.0, 1.0)
    a = gae_advantages(r, inputs.values_BT, m, config.gamma, lam_policy)
    a_critic = gae_advantages(r, inputs.values_BT, m, config.gamma, config.critic_lam)
    returns = (a_critic + inputs.values_BT.astype(f32)) * mf
    return (masked_whiten(a, m) if config.whiten else a * mf), returns
