"""Policy, value, KL and entropy losses that return (sum, denominator, metrics).

Every loss here returns ``LossTerms(total, denominator, metrics)`` with ``loss = total /
denominator`` (``LossTerms.loss``). ``total`` is a plain sum over the micro-batch, so with
gradient accumulation over micro-batches the exact full-batch loss and gradient are

    Σ_k total_k / D,   D = loss_denominator(full_mini_batch_mask, mode, max_len)

Either accumulate ``total`` (and its gradient) and divide once at the end, or pass the global
``denominator=D`` to each call so that ``LossTerms.loss`` is already that micro-batch's share.

Aggregation modes (``loss_agg_mode``; per-token loss L[i, t], mask m):
  token-mean               total = ΣΣ L·m,                 denominator = ΣΣ m          (DAPO)
  seq-mean-token-mean      total = Σ_i (Σ_t L·m / Σ_t m),   denominator = #sequences    (GRPO)
  seq-mean-token-sum       total = ΣΣ L·m,                 denominator = #sequences
  seq-mean-token-sum-norm  total = ΣΣ L·m,                 denominator = #sequences·L_max (Dr.GRPO)
``#sequences`` counts rows with at least one mask token, so all-padding rows added to fill a
fixed-shape batch do not change the result (= B without such rows, as METHODS' mean_i).

Policy loss (per token, ρ = exp(clamp(logπ − logπ_old, ±20))):
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
  * verl's seq-mean-token-sum-norm divides by the mask's T (``loss_mask.shape[-1]``) rather than
    a constant L_max and leaves the B to data-parallel averaging; Dr. GRPO's paper (and
    METHODS) divide by G·L_max with L_max the generation budget, as here.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms.kl import canonical_kl_type, kl_penalty
from jaxrl_tools.algorithms.masked import masked_mean, masked_sum

f32 = jnp.float32

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm")
RATIO_TYPES = ("token", "sequence")


class LossTerms(NamedTuple):
    """A loss as a micro-batch sum and the denominator it is to be divided by."""

    total: jax.Array
    denominator: jax.Array
    metrics: dict

    @property
    def loss(self) -> jax.Array:
        return self.total / jnp.maximum(self.denominator, 1.0)


def _check_mode(mode: str, max_len) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    if mode == "seq-mean-token-sum-norm" and (max_len is None or max_len <= 0):
        raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs max_len (L_max, the "
                         f"generation budget) > 0, got {max_len!r}")


def _check_same_shape(**arrays) -> None:
    shapes = {k: tuple(v.shape) for k, v in arrays.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError("shapes differ: " + ", ".join(f"{k} {s}" for k, s in shapes.items()))
    for k, s in shapes.items():
        if len(s) != 2:
            raise ValueError(f"{k} must be [B, T], got shape {s}")


def loss_denominator(loss_mask_BT: jax.Array, mode: str = "token-mean",
                     max_len: int | None = None) -> jax.Array:
    """Denominator of ``mode`` for this mask (compute it over the whole mini-batch).

    Args:
      loss_mask_BT: [B, T] 1 on model tokens.
      mode: one of LOSS_AGG_MODES.
      max_len: L_max (generation budget) for seq-mean-token-sum-norm.
    Returns:
      float32 scalar.
    """
    _check_mode(mode, max_len)
    m = jnp.asarray(loss_mask_BT > 0, f32)
    if mode == "token-mean":
        return jnp.sum(m)
    n_seq = jnp.sum(jnp.any(loss_mask_BT > 0, axis=1).astype(f32))
    if mode == "seq-mean-token-sum-norm":
        return n_seq * float(max_len)
    return n_seq


def aggregate(loss_BT: jax.Array, loss_mask_BT: jax.Array, mode: str = "token-mean", *,
              max_len: int | None = None, denominator: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array]:
    """(total, denominator) of a per-token loss under ``mode``; loss = total / denominator.

    Args:
      loss_BT: [B, T] per-token loss.
      loss_mask_BT: [B, T] mask.
      mode: one of LOSS_AGG_MODES.
      max_len: L_max for seq-mean-token-sum-norm.
      denominator: a global (mini-batch) denominator to use instead of this mask's.
    Returns:
      (total, denominator) float32 scalars.
    """
    _check_mode(mode, max_len)
    _check_same_shape(loss_BT=loss_BT, loss_mask_BT=loss_mask_BT)
    if mode == "seq-mean-token-mean":
        per_seq = masked_sum(loss_BT, loss_mask_BT, axis=1)
        n_tok = jnp.sum(jnp.asarray(loss_mask_BT > 0, f32), axis=1)
        total = jnp.sum(per_seq / jnp.maximum(n_tok, 1.0))
    else:
        total = masked_sum(loss_BT, loss_mask_BT)
    if denominator is None:
        denominator = loss_denominator(loss_mask_BT, mode, max_len)
    return total, jnp.asarray(denominator, f32)


def _check_dual_clip(c) -> None:
    if c is not None and not c > 1.0:
        raise ValueError(f"dual-clip constant c (clip_ratio_c) must be > 1, got {c}")


def _masked_min_max(x, mask):
    keep = mask > 0
    return jnp.min(jnp.where(keep, x, jnp.inf)), jnp.max(jnp.where(keep, x, -jnp.inf))


def log_ratio(logp_BT: jax.Array, old_logp_BT: jax.Array, loss_mask_BT: jax.Array,
              ratio_type: str = "token") -> jax.Array:
    """log ρ per token, clamped to ±20: token-level, or GSPO's sequence-level (see module doc)."""
    if ratio_type not in RATIO_TYPES:
        raise ValueError(f"unknown ratio_type {ratio_type!r}; valid: {', '.join(RATIO_TYPES)}")
    diff = logp_BT.astype(f32) - old_logp_BT.astype(f32)
    if ratio_type == "token":
        return jnp.clip(diff, -20.0, 20.0)
    seq = jax.lax.stop_gradient(masked_mean(diff, loss_mask_BT, axis=1))[:, None]
    lp = logp_BT.astype(f32)
    return jnp.clip(lp - jax.lax.stop_gradient(lp) + seq, -20.0, 20.0)


def ppo_clip_loss(logp_BT: jax.Array, old_logp_BT: jax.Array, advantages_BT: jax.Array,
                  loss_mask_BT: jax.Array, *, clip_eps_low: float = 0.2,
                  clip_eps_high: float = 0.28, dual_clip_c: float | None = None,
                  ratio_type: str = "token", loss_agg_mode: str = "token-mean",
                  max_len: int | None = None, denominator: jax.Array | None = None
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
    Returns:
      LossTerms; metrics: clipfrac_low, clipfrac_high, clipfrac (either), dual_clipfrac,
      approx_kl (mean of logπ_old − logπ, k1), ratio_mean, ratio_min, ratio_max.
    """
    _check_dual_clip(dual_clip_c)
    _check_same_shape(logp_BT=logp_BT, old_logp_BT=old_logp_BT, advantages_BT=advantages_BT,
                      loss_mask_BT=loss_mask_BT)
    A = advantages_BT.astype(f32)
    ratio = jnp.exp(log_ratio(logp_BT, old_logp_BT, loss_mask_BT, ratio_type))
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
    diff = logp_BT.astype(f32) - old_logp_BT.astype(f32)
    rmin, rmax = _masked_min_max(ratio, m)
    metrics.update(approx_kl=masked_mean(-diff, m), ratio_mean=masked_mean(ratio, m),
                   ratio_min=rmin, ratio_max=rmax)
    metrics = jax.tree.map(jax.lax.stop_gradient, metrics)
    total, denom = aggregate(loss, m, loss_agg_mode, max_len=max_len, denominator=denominator)
    return LossTerms(total, denom, metrics)


def value_loss(values_BT: jax.Array, old_values_BT: jax.Array, returns_BT: jax.Array,
               loss_mask_BT: jax.Array, *, clip_eps: float | None = 0.2,
               loss_agg_mode: str = "token-mean", max_len: int | None = None,
               denominator: jax.Array | None = None) -> LossTerms:
    """½·max((V − R)², (clip(V, V_old ± ε) − R)²) per token, aggregated.

    Args:
      values_BT: [B, T] current critic values. old_values_BT: [B, T] values at rollout time.
      returns_BT: [B, T] targets R. loss_mask_BT: [B, T].
      clip_eps: ε_v; None disables clipping (½(V − R)²).
      loss_agg_mode, max_len, denominator: see ``aggregate``.
    Returns:
      LossTerms; metrics: vf_clipfrac, vpred_mean.
    """
    _check_same_shape(values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT,
                      loss_mask_BT=loss_mask_BT)
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
    metrics = {"vf_clipfrac": masked_mean((l2 > l1).astype(f32), m),
               "vpred_mean": masked_mean(v, m)}
    metrics = jax.tree.map(jax.lax.stop_gradient, metrics)
    total, denom = aggregate(loss, m, loss_agg_mode, max_len=max_len, denominator=denominator)
    return LossTerms(total, denom, metrics)


def entropy_loss(entropy_BT: jax.Array, loss_mask_BT: jax.Array, *,
                 loss_agg_mode: str = "token-mean", max_len: int | None = None,
                 denominator: jax.Array | None = None) -> LossTerms:
    """Aggregated entropy H (a bonus: the objective subtracts coef·H). Metrics: entropy."""
    total, denom = aggregate(entropy_BT, loss_mask_BT, loss_agg_mode, max_len=max_len,
                             denominator=denominator)
    return LossTerms(total, denom, {"entropy": jax.lax.stop_gradient(
        masked_mean(entropy_BT, loss_mask_BT))})


def kl_loss(logp_BT: jax.Array, ref_logp_BT: jax.Array, loss_mask_BT: jax.Array, *,
            kl_type: str = "k3", loss_agg_mode: str = "token-mean", max_len: int | None = None,
            denominator: jax.Array | None = None) -> LossTerms:
    """Aggregated per-token KL to the reference (``kl.kl_penalty``). Metrics: kl."""
    _check_same_shape(logp_BT=logp_BT, ref_logp_BT=ref_logp_BT, loss_mask_BT=loss_mask_BT)
    kl = kl_penalty(logp_BT, ref_logp_BT, kl_type)
    total, denom = aggregate(kl, loss_mask_BT, loss_agg_mode, max_len=max_len,
                             denominator=denominator)
    return LossTerms(total, denom, {"kl": jax.lax.stop_gradient(masked_mean(kl, loss_mask_BT))})


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of ``policy_loss`` (frozen, hashable; validated on construction).

    Attributes:
      clip_eps_low, clip_eps_high: ratio clip bounds (DAPO clip-higher 0.2 / 0.28).
      dual_clip_c: dual-clip constant c > 1 (3.0), or None to disable.
      kl_coef: β of the KL-to-reference term in the loss (0 disables; GRPO uses 0.001, k3).
      kl_type: k1|kl, k2|mse, k3|low_var_kl, abs.
      entropy_coef: coefficient of the entropy bonus (loss −= coef·H).
      loss_agg_mode: one of LOSS_AGG_MODES.
      max_len: L_max for seq-mean-token-sum-norm.
      ratio_type: "token" (PPO/GRPO/DAPO) or "sequence" (GSPO).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    dual_clip_c: float | None = 3.0
    kl_coef: float = 0.0
    kl_type: str = "k3"
    entropy_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    max_len: int | None = None
    ratio_type: str = "token"

    def __post_init__(self):
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ValueError(f"PolicyLossConfig clip_eps_low/high must be >= 0, got "
                             f"{self.clip_eps_low}, {self.clip_eps_high}")
        _check_dual_clip(self.dual_clip_c)
        canonical_kl_type(self.kl_type)
        _check_mode(self.loss_agg_mode, self.max_len)
        if self.ratio_type not in RATIO_TYPES:
            raise ValueError(f"PolicyLossConfig.ratio_type {self.ratio_type!r}; valid: "
                             f"{', '.join(RATIO_TYPES)}")


def policy_loss(config: PolicyLossConfig, logp_BT: jax.Array, old_logp_BT: jax.Array,
                advantages_BT: jax.Array, loss_mask_BT: jax.Array, *,
                ref_logp_BT: jax.Array | None = None, entropy_BT: jax.Array | None = None,
                denominator: jax.Array | None = None) -> LossTerms:
    """The actor objective: clip loss + kl_coef·KL − entropy_coef·H, one aggregation.

    Args:
      config: PolicyLossConfig (static under jit).
      logp_BT, old_logp_BT, advantages_BT, loss_mask_BT: [B, T].
      ref_logp_BT: [B, T] reference log-probs; required when config.kl_coef != 0.
      entropy_BT: [B, T] token entropies; required when config.entropy_coef != 0.
      denominator: global mini-batch denominator (``loss_denominator``) for micro-batching.
    Returns:
      LossTerms whose ``loss`` is the scalar to differentiate; metrics: pg_loss, the clip
      metrics of ``ppo_clip_loss``, and kl / entropy when used.
    """
    mode, L = config.loss_agg_mode, config.max_len
    if denominator is None:
        denominator = loss_denominator(loss_mask_BT, mode, L)
    pg = ppo_clip_loss(logp_BT, old_logp_BT, advantages_BT, loss_mask_BT,
                       clip_eps_low=config.clip_eps_low, clip_eps_high=config.clip_eps_high,
                       dual_clip_c=config.dual_clip_c, ratio_type=config.ratio_type,
                       loss_agg_mode=mode, max_len=L, denominator=denominator)
    total = pg.total
    metrics = dict(pg.metrics, pg_loss=jax.lax.stop_gradient(pg.loss))
    if config.kl_coef != 0.0:
        if ref_logp_BT is None:
            raise ValueError("policy_loss: config.kl_coef != 0 needs ref_logp_BT")
        kl = kl_loss(logp_BT, ref_logp_BT, loss_mask_BT, kl_type=config.kl_type,
                     loss_agg_mode=mode, max_len=L, denominator=denominator)
        total = total + config.kl_coef * kl.total
        metrics.update(kl.metrics)
    if config.entropy_coef != 0.0:
        if entropy_BT is None:
            raise ValueError("policy_loss: config.entropy_coef != 0 needs entropy_BT")
        ent = entropy_loss(entropy_BT, loss_mask_BT, loss_agg_mode=mode, max_len=L,
                           denominator=denominator)
        total = total - config.entropy_coef * ent.total
        metrics.update(ent.metrics)
    return LossTerms(total, jnp.asarray(denominator, f32), metrics)
