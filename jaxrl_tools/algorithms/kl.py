"""Per-token KL estimators between the policy and the reference policy.

With d = clamp(logπ_ref − logπ_θ, −20, 20) (docs/METHODS.md):
  k1 = −d,  k2 = ½ d²,  k3 (low_var_kl) = clamp(e^d − d − 1, −10, 10),  abs = |d|.
Names accepted: "k1" ("kl"), "k2" ("mse"), "k3" ("low_var_kl"), "abs".

Note (verl ``kl_penalty``): verl clamps d to ±20 only for k3; for k1/k2/abs it uses the raw
difference. Results differ only where |logπ_ref − logπ_θ| > 20.
Use either in the loss (``losses.kl_loss``, β·KL) or folded into token rewards
(``apply_kl_penalty``, REINFORCE++/PPO).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms._checks import check_like

f32 = jnp.float32

_ALIASES = {
    "k1": "k1",
    "kl": "k1",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
    "abs": "abs",
}
KL_TYPES = tuple(sorted(_ALIASES))


def canonical_kl_type(kl_type: str) -> str:
    """Map an alias to k1/k2/k3/abs; unknown names raise ValueError listing the valid ones."""
    if kl_type not in _ALIASES:
        raise ValueError(f"unknown kl_type {kl_type!r}; valid: {', '.join(KL_TYPES)}")
    return _ALIASES[kl_type]


def kl_penalty(logp_BT: jax.Array, ref_logp_BT: jax.Array, kl_type: str = "k3") -> jax.Array:
    """Per-token KL estimate (not masked; mask it in aggregation).

    Args:
      logp_BT: [B, T] log-probs of the current policy.
      ref_logp_BT: [B, T] log-probs of the reference policy.
      kl_type: one of k1|kl, k2|mse, k3|low_var_kl, abs.
    Returns:
      kl_BT: [B, T] float32.
    """
    kind = canonical_kl_type(kl_type)
    check_like("kl_penalty", "logp_BT", logp_BT, ref_logp_BT=ref_logp_BT)
    d = jnp.clip(ref_logp_BT.astype(f32) - logp_BT.astype(f32), -20.0, 20.0)
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)
    return jnp.abs(d)


def apply_kl_penalty(
    token_rewards_BT: jax.Array, kl_BT: jax.Array, loss_mask_BT: jax.Array, beta: float
) -> jax.Array:
    """Fold the KL into the rewards: r_t − β·KL_t on model tokens (r_t elsewhere).

    Args:
      token_rewards_BT: [B, T] rewards.
      kl_BT, loss_mask_BT: [B, T], exactly the shape of ``token_rewards_BT``.
      beta: KL coefficient β.
    Returns:
      [B, T] float32 rewards.
    """
    check_like(
        "apply_kl_penalty",
        "token_rewards_BT",
        token_rewards_BT,
        kl_BT=kl_BT,
        loss_mask_BT=loss_mask_BT,
    )
    pen = jnp.where(loss_mask_BT > 0, kl_BT.astype(f32), 0.0)
    return token_rewards_BT.astype(f32) - beta * pen
