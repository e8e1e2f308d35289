"""Policy, value, KL and entropy losses that return (sum, denominator, metrics).

Each returns ``LossTerms(total, denominator, metrics)``, aggregated by ``loss_agg_mode`` (see
``aggregation`` for the modes and for micro-batching with a global ``denominator``).

Shapes: every [B, T] argument of a function must have exactly the shape of its first one (a
mask, old/ref log-prob, advantage or value of another shape is a ValueError naming it, never a
broadcast), and ``denominator`` must be a scalar.

The actor objective that combines them (``PolicyLossConfig``, ``policy_loss``) and the policy
loss names (``POLICY_LOSSES``) are in ``objective``.

Policy loss per token, ρ = exp(clamp(logπ − logπ_old, ±20)):
  PPO clip with decoupled bounds: L = max(−Aρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high));
  dual clip (c > 1): L = min(−A·c, L) where A < 0.
  GSPO (ratio_type "sequence"): ρ_i = exp(mean_t over m of (logπ − logπ_old)), used per token
  as GSPO-token does, ρ_i,t = sg[ρ_i]·π_t/sg[π_t]: same value as ρ_i, and with
  seq-mean-token-mean aggregation the same gradient as the sequence-level objective.

Notes where sources differ:
  * verl's GSPO clamps the sequence log-ratio to ≤ 10 before exp; here ±20 like the token ratio.
  * GSPO's paper uses ε_low = 3e-4, ε_high = 4e-4 (sequence ratios are close to 1); the PPO/DAPO
    values 0.2/0.28 are far too loose for it. Set them in the config; GSPO's paper aggregates
    with seq-mean-token-mean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms._checks import check_scalar
from jaxrl_tools.algorithms.aggregation import (
    LOSS_AGG_MODES,
    LossTerms,
    aggregate,
    check_bt,
    loss_denominator,
)
from jaxrl_tools.algorithms.kl import kl_penalty
from jaxrl_tools.algorithms.masked import masked_mean, segment_masked_sum

f32 = jnp.float32

# Re-exported: the aggregation names are also importable from here.
__all__ = [
    "LOSS_AGG_MODES",
    "RATIO_TYPES",
    "LossTerms",
    "aggregate",
    "entropy_loss",
    "kl_loss",
    "log_ratio",
    "loss_denominator",
    "ppo_clip_loss",
    "value_loss",
]

RATIO_TYPES = ("token", "sequence")


def check_dual_clip(c) -> None:
    """The dual-clip constant is None (off) or > 1."""
    if c is not None and not c > 1.0:
        raise ValueError(f"dual-clip constant c (clip_ratio_c) must be > 1, got {c}")


def _masked_min_max(x, mask):
    keep = mask > 0
    return jnp.min(jnp.where(keep, x, jnp.inf)), jnp.max(jnp.where(keep, x, -jnp.inf))


def log_ratio(
    logp_BT: jax.Array,
    old_logp_BT: jax.Array,
    loss_mask_BT: jax.Array,
    ratio_type: str = "token",
    segment_ids_BT: jax.Array | None = None,
) -> jax.Array:
    """log ρ per token, clamped to ±20: token-level, or GSPO's sequence-level (see module doc;
    the sequence is the row, or with ``segment_ids_BT`` the packed sequence)."""
    if ratio_type not in RATIO_TYPES:
        raise ValueError(f"unknown ratio_type {ratio_type!r}; valid: {', '.join(RATIO_TYPES)}")
    check_bt("log_ratio", "logp_BT", logp_BT, old_logp_BT=old_logp_BT, loss_mask_BT=loss_mask_BT)
    diff = logp_BT.astype(f32) - old_logp_BT.astype(f32)
    if ratio_type == "token":
        return jnp.clip(diff, -20.0, 20.0)
    if segment_ids_BT is None:
        seq = masked_mean(diff, loss_mask_BT, axis=1)[:, None]
    else:
        ones = jnp.ones(diff.shape, f32)
        n = segment_masked_sum(ones, loss_mask_BT, segment_ids_BT)
        seq = segment_masked_sum(diff, loss_mask_BT, segment_ids_BT) / jnp.maximum(n, 1.0)
    seq = jax.lax.stop_gradient(seq)
    lp = logp_BT.astype(f32)
    return jnp.clip(lp - jax.lax.stop_gradient(lp) + seq, -20.0, 20.0)


def ppo_clip_loss(
    logp_BT: jax.Array,
    old_logp_BT: jax.Array,
    advantages_BT: jax.Array,
    loss_mask_BT: jax.Array,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    dual_clip_c: float | None = None,
    ratio_type: str = "token",
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
    denominator: jax.Array | None = None,
    is_weights_BT: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
) -> LossTerms:
    """Clipped surrogate with decoupled ε bounds, optional dual clip, token or sequence ratio.

    Args:
      logp_BT, old_logp_BT: [B, T] current and behaviour log-probs.
      advantages_BT: [B, T] advantages (sequence-constant for GSPO proper).
      loss_mask_BT: [B, T] 1 on model tokens.
      clip_eps_low, clip_eps_high: ρ is clipped to [1 − ε_low, 1 + ε_high].
      dual_clip_c: c > 1 bounds the loss at −A·c for A < 0; None disables.
      ratio_type: "token" (PPO) or "sequence" (GSPO).
      loss_agg_mode, max_len, denominator: see ``aggregate``.
      is_weights_BT: [B, T] per-token importance weights (``truncated_is_weights``) multiplying
        each token's loss, or None.
      segment_ids_BT: [B, T] the sequence of each token in packed rows (``aggregate``), or None.
    Returns:
      LossTerms; metrics: clipfrac_low, clipfrac_high, clipfrac (either), dual_clipfrac,
      approx_kl (mean of logπ_old − logπ, k1), ratio_mean, ratio_min, ratio_max.
    """
    check_dual_clip(dual_clip_c)
    check_bt(
        "ppo_clip_loss",
        "logp_BT",
        logp_BT,
        old_logp_BT=old_logp_BT,
        advantages_BT=advantages_BT,
        loss_mask_BT=loss_mask_BT,
        is_weights_BT=is_weights_BT,
    )
    check_scalar("ppo_clip_loss", "denominator", denominator)
    A = advantages_BT.astype(f32)
    ratio = jnp.exp(log_ratio(logp_BT, old_logp_BT, loss_mask_BT, ratio_type, segment_ids_BT))
    lo, hi = 1.0 - clip_eps_low, 1.0 + clip_eps_high
    loss1 = -A * ratio
    loss2 = -A * jnp.clip(ratio, lo, hi)
    loss = jnp.maximum(loss1, loss2)
    m = loss_mask_BT
    metrics = {
        "clipfrac_low": masked_mean(((A < 0) & (ratio < lo)).astype(f32), m),
        "clipfrac_high": masked_mean(((A > 0) & (ratio > hi)).astype(f32), m),
        "clipfrac": masked_mean((loss2 > loss1).astype(f32), m),
    }
    if dual_clip_c is not None:
        loss3 = -A * dual_clip_c
        metrics["dual_clipfrac"] = masked_mean(((A < 0) & (loss > loss3)).astype(f32), m)
        loss = jnp.where(A < 0, jnp.minimum(loss3, loss), loss)
    if is_weights_BT is not None:
        loss = jax.lax.stop_gradient(is_weights_BT.astype(f32)) * loss
    diff = logp_BT.astype(f32) - old_logp_BT.astype(f32)
    rmin, rmax = _masked_min_max(ratio, m)
    metrics.update(
        approx_kl=masked_mean(-diff, m),
        ratio_mean=masked_mean(ratio, m),
        ratio_min=rmin,
        ratio_max=rmax,
    )
    metrics = jax.tree.map(jax.lax.stop_gradient, metrics)
    total, denom = aggregate(
        loss,
        m,
        loss_agg_mode,
        max_len=max_len,
        denominator=denominator,
        segment_ids_BT=segment_ids_BT,
    )
    return LossTerms(total, denom, metrics)


def value_loss(
    values_BT: jax.Array,
    old_values_BT: jax.Array,
    returns_BT: jax.Array,
    loss_mask_BT: jax.Array,
    *,
    clip_eps: float | None = 0.2,
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
    denominator: jax.Array | None = None,
) -> LossTerms:
    """½·max((V − R)², (clip(V, V_old ± ε) − R)²) per token, aggregated.

    Args:
      values_BT: [B, T] current critic values. old_values_BT: [B, T] values at rollout time.
      returns_BT: [B, T] targets R. loss_mask_BT: [B, T].
      clip_eps: ε_v; None disables clipping (½(V − R)²).
      loss_agg_mode, max_len, denominator: see ``aggregate``.
    Returns:
      LossTerms; metrics: vf_clipfrac, vpred_mean.
    """
    check_bt(
        "value_loss",
        "values_BT",
        values_BT,
        old_values_BT=old_values_BT,
        returns_BT=returns_BT,
        loss_mask_BT=loss_mask_BT,
    )
    check_scalar("value_loss", "denominator", denominator)
    v = values_BT.astype(f32)
    R = returns_BT.astype(f32)
    l1 = (v - R) ** 2
    if clip_eps is None:
        l2 = l1
    else:
        vo = old_values_BT.astype(f32)
        l2 = (jnp.clip(v, vo - clip_eps, vo + clip_eps) - R) ** 2
    loss = 0.5 * jnp.maximum(l1, l2)
    m = loss_mask_BT
    metrics = {
        "vf_clipfrac": masked_mean((l2 > l1).astype(f32), m),
        "vpred_mean": masked_mean(v, m),
    }
    metrics = jax.tree.map(jax.lax.stop_gradient, metrics)
    total, denom = aggregate(loss, m, loss_agg_mode, max_len=max_len, denominator=denominator)
    return LossTerms(total, denom, metrics)


def entropy_loss(
    entropy_BT: jax.Array,
    loss_mask_BT: jax.Array,
    *,
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
    denominator: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
) -> LossTerms:
    """Aggregated entropy H (a bonus: the objective subtracts coef·H). Metrics: entropy."""
    check_bt("entropy_loss", "entropy_BT", entropy_BT, loss_mask_BT=loss_mask_BT)
    check_scalar("entropy_loss", "denominator", denominator)
    total, denom = aggregate(
        entropy_BT,
        loss_mask_BT,
        loss_agg_mode,
        max_len=max_len,
        denominator=denominator,
        segment_ids_BT=segment_ids_BT,
    )
    return LossTerms(
        total, denom, {"entropy": jax.lax.stop_gradient(masked_mean(entropy_BT, loss_mask_BT))}
    )


def kl_loss(
    logp_BT: jax.Array,
    ref_logp_BT: jax.Array,
    loss_mask_BT: jax.Array,
    *,
    kl_type: str = "k3",
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
    denominator: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
) -> LossTerms:
    """Aggregated per-token KL to the reference (``kl.kl_penalty``). Metrics: kl."""
    check_bt("kl_loss", "logp_BT", logp_BT, ref_logp_BT=ref_logp_BT, loss_mask_BT=loss_mask_BT)
    check_scalar("kl_loss", "denominator", denominator)
    kl = kl_penalty(logp_BT, ref_logp_BT, kl_type)
    total, denom = aggregate(
        kl,
        loss_mask_BT,
        loss_agg_mode,
        max_len=max_len,
        denominator=denominator,
        segment_ids_BT=segment_ids_BT,
    )
    return LossTerms(total, denom, {"kl": jax.lax.stop_gradient(masked_mean(kl, loss_mask_BT))})
