"""The RL objectives as module-level pure functions of (params, micro-batch, denominator).

Static settings come first and are bound with `functools.partial` by the trainer; the arrays are a
micro-batch dict with "tokens", "positions", "attention", "loss_mask", "advantages", "correct" and
optional "old_logp" / "ref_logp" / "behaviour_logp" (actor), "old_values" / "returns" (critic).
With `packed` (`train.packing`), rows hold several sequences, "attention" holds their segment ids
and "correct" is per token; every per-sequence reduction then goes by segment. With shared
prompts (`optim.share_prefix`), "prompt_keys" marks the prompt-slot tokens each sample slot
attends to.
Each loss is a micro-batch's *sum* divided by the whole mini-batch's denominator
(`actor_denominator`), so accumulating micro-batches gives the full mini-batch gradient exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_tools import algorithms, models
from jaxrl_tools.config import AlgorithmSection, CriticSection
from jaxrl_tools.train import policy


def policy_loss_config(a: AlgorithmSection, max_response_len: int) -> algorithms.PolicyLossConfig:
    """The policy loss's settings of `a` (KL in the loss only when not folded into rewards)."""
    return algorithms.PolicyLossConfig(
        clip_eps_low=a.clip_eps_low,
        clip_eps_high=a.clip_eps_high,
        dual_clip_c=a.dual_clip,
        kl_coef=a.kl_coef if a.kl_in_loss else 0.0,
        kl_type=a.kl_type,
        entropy_coef=a.entropy_coef,
        loss_agg_mode=a.loss_agg_mode,
        max_len=max_response_len,
        ratio_type=algorithms.policy_loss_ratio_type(a.policy_loss),
        off_policy=a.correction(),
    )


def advantage_config(
    a: AlgorithmSection, critic: CriticSection, group_size: int
) -> algorithms.AdvantageConfig:
    """The estimators' settings of `a` (KL folded into rewards only with `kl_in_reward`)."""
    return algorithms.AdvantageConfig(
        group_size=group_size,
        norm_by_std=a.norm_adv_by_std,
        gamma=a.gamma,
        lam=a.lam,
        kl_beta=a.kl_coef if a.kl_in_reward else 0.0,
        vapo_alpha=a.vapo_alpha,
        critic_lam=critic.lam,
        gigpo_omega=a.gigpo_omega,
        step_gamma=a.step_gamma,
        turn_gamma=a.turn_gamma,
        turn_group_norm=a.turn_group_norm,
    )


def sequence_logprobs(
    model_cfg: models.ModelConfig,
    temperature: float,
    remat: bool,
    params,
    b: dict,
    entropy_grad: bool = False,
    *,
    attention: str = "auto",
    packed: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(log-probs, entropies) [B, T] of the tempered policy on right-padded (or packed) rows."""
    return policy.token_logprobs(
        model_cfg,
        params,
        b["tokens"],
        b["positions"],
        b["attention"],
        b["loss_mask"],
        temperature=temperature,
        remat=remat,
        entropy_grad=entropy_grad,
        attention=attention,
        packed=packed,
        prompt_keys=b.get("prompt_keys"),
    )


def actor_loss(
    model_cfg: models.ModelConfig,
    pcfg: algorithms.PolicyLossConfig,
    temperature: float,
    remat: bool,
    nll_coef: float,
    params,
    mb: dict,
    denom: jax.Array,
    *,
    attention: str = "auto",
    packed: bool = False,
) -> tuple[jax.Array, dict]:
    """`actor_objective` on the policy's own log-probs and entropies of the micro-batch.
    `denom`: `actor_denominator`'s value (a pair with VAPO's NLL term)."""
    denom, nll_denom = denom if isinstance(denom, tuple) else (denom, None)
    logp, ent = sequence_logprobs(
        model_cfg,
        temperature,
        remat,
        params,
        mb,
        entropy_grad=pcfg.entropy_coef > 0,
        attention=attention,
        packed=packed,
    )
    return actor_objective(pcfg, nll_coef, logp, ent, mb, denom, nll_denom=nll_denom, packed=packed)


def actor_objective(
    pcfg: algorithms.PolicyLossConfig,
    nll_coef: float,
    logp: jax.Array,
    ent: jax.Array,
    mb: dict,
    denom: jax.Array,
    *,
    nll_denom: jax.Array | None = None,
    packed: bool = False,
) -> tuple[jax.Array, dict]:
    """The policy loss (PPO clip / GSPO, KL, entropy) plus VAPO's NLL on correct responses.

    Args:
      pcfg: the policy loss's settings (`policy_loss_config`).
      nll_coef: VAPO's weight of the NLL of correct responses (0: none).
      logp, ent: [B, T] the policy's log-probs and entropies of `mb`'s tokens.
      mb: the micro-batch (module docstring); without "old_logp" the update is on-policy.
      denom: the whole mini-batch's denominator (`actor_denominator`).
      nll_denom: the mini-batch's count of correct responses' tokens, the NLL's denominator
        (VAPO 2504.05118, eq. 11); None: this micro-batch's count (one micro-batch).
      packed: rows hold several sequences ("attention" holds their segment ids).

    Returns:
      (loss, metrics).
    """
    segments = mb["attention"] if packed else None
    # One update per rollout batch: the policy is still the behaviour one, and its own
    # log-probs (no gradient) are the old ones; this saves a forward pass.
    old_logp = mb["old_logp"] if "old_logp" in mb else jax.lax.stop_gradient(logp)
    terms = algorithms.policy_loss(
        pcfg,
        logp,
        old_logp,
        mb["advantages"],
        mb["loss_mask"],
        ref_logp_BT=mb.get("ref_logp"),
        entropy_BT=ent,
        denominator=denom,
        behaviour_logp_BT=mb.get("behaviour_logp"),
        segment_ids_BT=segments,
    )
    loss = terms.loss
    metrics = dict(terms.metrics)
    # pg_loss is this micro-batch's share of the mini-batch loss (global denominator): the
    # shares add up to "loss", they do not average, so it is not reported twice.
    metrics.pop("pg_loss", None)
    if nll_coef:
        # VAPO's L_NLL: a token mean over the correct responses only, whatever loss_agg_mode.
        correct_BT = nll_mask(mb, packed)
        if nll_denom is None:
            nll_denom = jnp.sum(correct_BT)
        nll = algorithms.masked_sum(-logp, correct_BT)
        loss = loss + nll_coef * nll / jnp.maximum(nll_denom, 1.0)
    metrics["entropy"] = algorithms.masked_mean(ent, mb["loss_mask"])
    return loss, metrics


def actor_denominator(
    pcfg: algorithms.PolicyLossConfig, batch_M: dict, packed: bool = False
) -> jax.Array:
    """The mini-batch's loss denominator (by the aggregation mode), over all micro-batches."""
    rows = lambda x: x.reshape(-1, x.shape[-1])
    segments = rows(batch_M["attention"]) if packed else None
    denom = algorithms.loss_denominator(
        rows(batch_M["loss_mask"]), pcfg.loss_agg_mode, pcfg.max_len, segments
    )
    if "correct" not in batch_M:  # no NLL term
        return denom
    return denom, jnp.sum(nll_mask(batch_M, packed))


def nll_mask(b: dict, packed: bool = False) -> jax.Array:
    """1 on the model tokens of correct responses ("correct": [..., B] by row, or [..., B, T]
    by token when packed)."""
    correct = b["correct"] if packed else b["correct"][..., None]
    return jnp.asarray(b["loss_mask"] > 0, jnp.float32) * correct


def token_values(
    model_cfg: models.ModelConfig,
    critic_params,
    b: dict,
    *,
    attention: str = "auto",
    packed: bool = False,
    remat: bool | str = False,
) -> jax.Array:
    """The critic's value of every token [B, T]."""
    return policy.token_values(
        model_cfg,
        critic_params,
        b["tokens"],
        b["positions"],
        b["attention"],
        attention=attention,
        packed=packed,
        remat=remat,
        prompt_keys=b.get("prompt_keys"),
    )


def critic_loss(
    model_cfg: models.ModelConfig,
    clip_eps: float,
    critic_params,
    mb: dict,
    denom: jax.Array,
    *,
    attention: str = "auto",
    packed: bool = False,
    remat: bool | str = False,
) -> tuple[jax.Array, dict]:
    """The clipped value loss on response tokens (token-mean over the mini-batch)."""
    values = token_values(
        model_cfg, critic_params, mb, attention=attention, packed=packed, remat=remat
    )
    terms = algorithms.value_loss(
        values,
        mb["old_values"],
        mb["returns"],
        mb["loss_mask"],
        clip_eps=clip_eps,
        loss_agg_mode="token-mean",
        denominator=denom,
    )
    return terms.loss, dict(terms.metrics)


def critic_denominator(batch_M: dict) -> jax.Array:
    return jnp.sum(batch_M["loss_mask"])
