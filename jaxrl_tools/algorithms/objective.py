"""The actor objective: clip loss + kl_coef·KL − entropy_coef·H under one aggregation (the clip
loss optionally weighted by truncated importance weights against the behaviour policy).

``POLICY_LOSSES`` names the policy losses a run can choose (``algorithm.policy_loss``):
``ppo_clip`` (token ratio; PPO / GRPO / DAPO) and ``gspo`` (sequence ratio, 2507.18071);
``policy_loss_ratio_type`` and ``policy_loss_dual_clip`` give a name's ratio and default dual
clip (``PolicyLossConfig.ratio_type`` / ``dual_clip_c``). The pieces are in
``losses``, the aggregation modes in ``aggregation``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms._checks import check_scalar
from jaxrl_tools.algorithms.aggregation import LossTerms, check_bt, check_mode, loss_denominator
from jaxrl_tools.algorithms.kl import canonical_kl_type
from jaxrl_tools.algorithms.losses import (
    RATIO_TYPES,
    check_dual_clip,
    entropy_loss,
    kl_loss,
    ppo_clip_loss,
)
from jaxrl_tools.algorithms.off_policy import OffPolicyConfig, off_policy_weights

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class PolicyLossSpec:
    """A policy loss: the importance ratio it clips and the dual clip it has by default."""

    ratio_type: str
    dual_clip_c: float | None


# Policy losses by name (the run config's ``algorithm.policy_loss``). PPO's dual clip is Ye et
# al.'s c = 3 (1912.09729; verl's clip_ratio_c); GSPO's objective (2507.18071) has none, nor has
# verl's gspo loss: there a dual clip is the config's choice only.
_POLICY_LOSSES = {
    "ppo_clip": PolicyLossSpec(ratio_type="token", dual_clip_c=3.0),
    "gspo": PolicyLossSpec(ratio_type="sequence", dual_clip_c=None),
}
POLICY_LOSSES = tuple(_POLICY_LOSSES)


def _spec(name: str) -> PolicyLossSpec:
    if name not in _POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {', '.join(POLICY_LOSSES)}")
    return _POLICY_LOSSES[name]


def policy_loss_ratio_type(name: str) -> str:
    """``PolicyLossConfig.ratio_type`` of policy loss ``name`` (ppo_clip -> token, gspo ->
    sequence); unknown names raise ValueError listing POLICY_LOSSES."""
    return _spec(name).ratio_type


def policy_loss_dual_clip(name: str) -> float | None:
    """The dual-clip constant policy loss ``name`` has by default (ppo_clip 3.0, gspo none)."""
    return _spec(name).dual_clip_c


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
      ratio_type: "token" (PPO/GRPO/DAPO) or "sequence" (GSPO); from a policy loss name,
        ``policy_loss_ratio_type(name)``.
      off_policy: a correction against the behaviour log-probs (``off_policy_weights``:
        truncated or masked importance sampling, decoupled PPO), or inactive (off).
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
    off_policy: OffPolicyConfig = OffPolicyConfig()

    def __post_init__(self):
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ValueError(
                f"PolicyLossConfig clip_eps_low/high must be >= 0, got "
                f"{self.clip_eps_low}, {self.clip_eps_high}"
            )
        check_dual_clip(self.dual_clip_c)
        canonical_kl_type(self.kl_type)
        check_mode(self.loss_agg_mode, self.max_len)
        if self.ratio_type not in RATIO_TYPES:
            raise ValueError(
                f"PolicyLossConfig.ratio_type {self.ratio_type!r}; valid: {', '.join(RATIO_TYPES)}"
            )


def policy_loss(
    config: PolicyLossConfig,
    logp_BT: jax.Array,
    old_logp_BT: jax.Array,
    advantages_BT: jax.Array,
    loss_mask_BT: jax.Array,
    *,
    ref_logp_BT: jax.Array | None = None,
    entropy_BT: jax.Array | None = None,
    denominator: jax.Array | None = None,
    behaviour_logp_BT: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
) -> LossTerms:
    """The actor objective: clip loss + kl_coef·KL − entropy_coef·H, one aggregation.

    Args:
      config: PolicyLossConfig (static under jit).
      logp_BT, old_logp_BT, advantages_BT, loss_mask_BT: [B, T].
      ref_logp_BT: [B, T] reference log-probs; required when config.kl_coef != 0.
      entropy_BT: [B, T] token entropies; required when config.entropy_coef != 0.
      denominator: global mini-batch denominator (``loss_denominator``) for micro-batching.
      behaviour_logp_BT: [B, T] log-probs of the policy that sampled the tokens; required when
        config.off_policy is active (each token's clip loss is then weighted by the
        correction, e.g. min(π_old / π_behaviour, cap)).
      segment_ids_BT: [B, T] the sequence of each token when rows are packed with several
        (seq-mean aggregation and GSPO's ratio then work per sequence, not per row), or None.
    Returns:
      LossTerms whose ``loss`` is the scalar to differentiate; metrics: pg_loss, the clip
      metrics of ``ppo_clip_loss``, the correction's drift metrics (``off_policy/...``,
      ``off_policy_weights``), and kl / entropy when used.
    """
    check_bt(
        "policy_loss",
        "logp_BT",
        logp_BT,
        old_logp_BT=old_logp_BT,
        advantages_BT=advantages_BT,
        loss_mask_BT=loss_mask_BT,
        ref_logp_BT=ref_logp_BT,
        entropy_BT=entropy_BT,
        behaviour_logp_BT=behaviour_logp_BT,
        segment_ids_BT=segment_ids_BT,
    )
    check_scalar("policy_loss", "denominator", denominator)
    mode, L = config.loss_agg_mode, config.max_len
    if denominator is None:
        denominator = loss_denominator(loss_mask_BT, mode, L, segment_ids_BT)
    is_weights, is_metrics = None, {}
    if config.off_policy.active:
        if behaviour_logp_BT is None:
            raise ValueError("policy_loss: config.off_policy needs behaviour_logp_BT")
        is_weights, drift = off_policy_weights(
            config.off_policy, old_logp_BT, behaviour_logp_BT, loss_mask_BT, segment_ids_BT
        )
        is_metrics = {f"off_policy/{k}": v for k, v in drift.items()}
    pg = ppo_clip_loss(
        logp_BT,
        old_logp_BT,
        advantages_BT,
        loss_mask_BT,
        clip_eps_low=config.clip_eps_low,
        clip_eps_high=config.clip_eps_high,
        dual_clip_c=config.dual_clip_c,
        ratio_type=config.ratio_type,
        loss_agg_mode=mode,
        max_len=L,
        denominator=denominator,
        is_weights_BT=is_weights,
        segment_ids_BT=segment_ids_BT,
    )
    total = pg.total
    metrics = dict(pg.metrics, **is_metrics, pg_loss=jax.lax.stop_gradient(pg.loss))
    if config.kl_coef != 0.0:
        if ref_logp_BT is None:
            raise ValueError("policy_loss: config.kl_coef != 0 needs ref_logp_BT")
        kl = kl_loss(
            logp_BT,
            ref_logp_BT,
            loss_mask_BT,
            kl_type=config.kl_type,
            loss_agg_mode=mode,
            max_len=L,
            denominator=denominator,
            segment_ids_BT=segment_ids_BT,
        )
        total = total + config.kl_coef * kl.total
        metrics.update(kl.metrics)
    if config.entropy_coef != 0.0:
        if entropy_BT is None:
            raise ValueError("policy_loss: config.entropy_coef != 0 needs entropy_BT")
        ent = entropy_loss(
            entropy_BT,
            loss_mask_BT,
            loss_agg_mode=mode,
            max_len=L,
            denominator=denominator,
            segment_ids_BT=segment_ids_BT,
        )
        total = total - config.entropy_coef * ent.total
        metrics.update(ent.metrics)
    return LossTerms(total, jnp.asarray(denominator, f32), metrics)
