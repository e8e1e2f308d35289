"""Off-policy corrections: per-token weights for tokens sampled by another policy than the one
the update starts from.

The behaviour policy b sampled the tokens (the engine: older weights with asynchronous rollouts,
or the same weights in another dtype and kernel); π_old is the trainer's policy at the start of
the update. With ρ_t = π_old(y_t) / b(y_t) on each model token and, per sequence i over its
tokens t ∈ i:

  sequence ratio   ρ_i = exp(Σ_t log ρ_t)          geometric mean   ρ̄_i = exp(mean_t log ρ_t)

a correction is an importance weight times a mask, both without gradient, multiplying each
token's policy loss (`ppo_clip_loss(is_weights_BT=...)`):

  weight  "token": min(ρ_t, C)      "sequence": min(ρ_i, C)      (C None: uncapped)
  mask    "token": ρ_t ∈ [lo, hi]   "sequence": ρ_i ∈ [lo, hi]   "geometric": ρ̄_i ∈ [lo, hi]

Truncated IS (TIS) is the token weight; IcePop / masked IS (MIS) the token or sequence mask;
the geometric sequence mask is SkyRL's; AReaL's decoupled PPO clips the ratio π_θ / π_old
(π_old the proximal policy) and weights each token by ρ_t, dropping tokens with ρ_t above a cap:
the uncapped token weight with a token mask [0, cap] (`DECOUPLED`). A masked token weighs 0: it
still counts in the loss's denominator, as a truncated one does.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms.aggregation import check_bt
from jaxrl_tools.algorithms.masked import masked_mean, segment_masked_sum

f32 = jnp.float32
WEIGHT_LEVELS = ("token", "sequence")
MASK_LEVELS = ("token", "sequence", "geometric")


@dataclasses.dataclass(frozen=True)
class OffPolicyConfig:
    """A correction (module docstring): an importance weight at `weight` level capped at `cap`,
    and a mask at `mask` level keeping ratios in [`low`, `high`]; None turns either off."""

    weight: str | None = None
    cap: float | None = None
    mask: str | None = None
    low: float = 0.0
    high: float = math.inf

    def __post_init__(self):
        if self.weight not in (None, *WEIGHT_LEVELS):
            raise ValueError(f"OffPolicyConfig.weight {self.weight!r}; valid: {WEIGHT_LEVELS}")
        if self.mask not in (None, *MASK_LEVELS):
            raise ValueError(f"OffPolicyConfig.mask {self.mask!r}; valid: {MASK_LEVELS}")
        if self.cap is not None and (self.weight is None or not self.cap > 0):
            raise ValueError(f"OffPolicyConfig.cap {self.cap} needs a weight level and must be > 0")
        if not 0 <= self.low < 1 < self.high:
            raise ValueError(
                f"OffPolicyConfig low, high = {self.low}, {self.high}: need 0 <= low < 1 < high "
                "(a ratio of 1, on-policy, is always kept)"
            )

    @property
    def active(self) -> bool:
        return self.weight is not None or self.mask is not None

    def describe(self) -> str:
        """One phrase, e.g. "token weight (cap 2), sequence mask [0.5, 2]"."""
        parts = []
        if self.weight is not None:
            parts.append(
                f"{self.weight} weight" + ("" if self.cap is None else f" (cap {self.cap:g})")
            )
        if self.mask is not None:
            parts.append(f"{self.mask} mask [{self.low:g}, {self.high:g}]")
        return ", ".join(parts) or "none"


def decoupled(cap: float) -> OffPolicyConfig:
    """AReaL's decoupled PPO weight: ρ_t uncapped, tokens with ρ_t > cap dropped."""
    return OffPolicyConfig(weight="token", mask="token", high=cap)


def _per_sequence(x_BT, mask_BT, segment_ids_BT):
    """Per token, the masked sum of x over its sequence (its row, or its segment when packed)."""
    if segment_ids_BT is not None:
        return segment_masked_sum(x_BT, mask_BT, segment_ids_BT)
    total = jnp.sum(jnp.where(mask_BT > 0, x_BT, 0.0), axis=1, keepdims=True)
    return jnp.broadcast_to(total, x_BT.shape)


def off_policy_weights(
    config: OffPolicyConfig,
    old_logp_BT: jax.Array,
    behaviour_logp_BT: jax.Array,
    loss_mask_BT: jax.Array,
    segment_ids_BT: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """The correction's weight per token (no gradient; 1 off the mask) and its drift metrics.

    Args:
      config: the correction.
      old_logp_BT, behaviour_logp_BT, loss_mask_BT: [B, T]: π_old's and b's log-probs of the
        sampled tokens, 1 on model tokens.
      segment_ids_BT: [B, T] the sequence of each token in packed rows, or None (one a row).

    Returns:
      (weights [B, T], metrics): the drift between the two policies on model tokens —
      logp_diff_mean / logp_diff_max of |log π_old − log b|, kl_behaviour (the k3 estimate of
      KL(b ‖ π_old) from b's samples), ratio_max — and what the correction did: is_weight_mean,
      truncated_frac (tokens whose weight hit the cap), masked_token_frac, masked_seq_frac.
    """
    check_bt(
        "off_policy_weights",
        "old_logp_BT",
        old_logp_BT,
        behaviour_logp_BT=behaviour_logp_BT,
        loss_mask_BT=loss_mask_BT,
        segment_ids_BT=segment_ids_BT,
    )
    m = (loss_mask_BT > 0).astype(f32)
    log_r = jnp.clip(old_logp_BT.astype(f32) - behaviour_logp_BT.astype(f32), -20.0, 20.0)
    log_r = jax.lax.stop_gradient(jnp.where(m > 0, log_r, 0.0))
    seq_log_r = _per_sequence(log_r, m, segment_ids_BT)
    seq_tokens = _per_sequence(jnp.ones_like(m), m, segment_ids_BT)
    level_log_r = {
        "token": log_r,
        "sequence": jnp.clip(seq_log_r, -20.0, 20.0),
        "geometric": seq_log_r / jnp.maximum(seq_tokens, 1.0),
    }
    weights, truncated = jnp.ones_like(m), jnp.zeros_like(m)
    if config.weight is not None:
        weights = jnp.exp(level_log_r[config.weight])
        if config.cap is not None:
            truncated = (weights > config.cap).astype(f32)
            weights = jnp.minimum(weights, config.cap)
    keep = jnp.ones_like(m)
    if config.mask is not None:
        r = jnp.exp(level_log_r[config.mask])
        keep = ((r >= config.low) & (r <= config.high)).astype(f32)
    weights = jnp.where(m > 0, weights * keep, 1.0)
    # A sequence is masked when any of its tokens is (all of them, at sequence level).
    seq_masked = _per_sequence(1.0 - keep, m, segment_ids_BT) > 0
    first = m * (seq_tokens > 0) / jnp.maximum(seq_tokens, 1.0)  # each sequence counts once
    r_tok = jnp.exp(log_r)
    metrics = {
        "logp_diff_mean": masked_mean(jnp.abs(log_r), m),
        "logp_diff_max": jnp.max(jnp.where(m > 0, jnp.abs(log_r), 0.0)),
        "kl_behaviour": masked_mean(r_tok - 1.0 - log_r, m),
        "ratio_max": jnp.max(jnp.where(m > 0, r_tok, 0.0)),
        "is_weight_mean": masked_mean(weights, m),
        "truncated_frac": masked_mean(truncated, m),
        "masked_token_frac": masked_mean(1.0 - keep, m),
        "masked_seq_frac": jnp.sum(first * seq_masked) / jnp.maximum(jnp.sum(first), 1.0),
    }
    return weights, metrics
