"""Per-turn advantages of multi-turn episodes: Kevin's normalised turn returns, and turn_rloo's
leave-one-out baseline per turn.

Kevin (Kevin-32B, arXiv 2507.11948): discounted per-turn returns of multi-turn refinement.

Each turn t of a trajectory has a score s_t (the environment's reward of that turn); its return
is R_t = s_t + γ·R_{t+1} (γ = ``config.turn_gamma``, 0.4 in Kevin), so a turn is credited with
the improvements it leads to. Kevin normalises these returns GRPO-style over every turn of every
trajectory of the prompt's group (``config.turn_group_norm``): A_t = (R_t − μ)/(σ + eps), σ
unbiased, ÷σ only with ``norm_by_std``; a group with one real turn keeps R_t (μ = 0, σ = 1, as
GRPO's group of one), an all-equal group gets exactly 0. Every model token of turn t gets A_t.
Turns without an environment step (step mask 0: cut by a limit) get 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms.advantages import (
    AdvantageConfig,
    AdvantageInputs,
    check_inputs,
    discounted_returns,
    group_rows,
)
from jaxrl_tools.algorithms.registry import register_advantage_estimator

f32 = jnp.float32


@register_advantage_estimator(
    "kevin",
    requires=("step_rewards_BS", "step_mask_BS", "token_step_BT"),
    group_baseline=True,
    turn_level=True,
)
def kevin(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """Kevin: discounted per-turn returns, group-normalised over all turns, on their tokens."""
    B, _ = check_inputs("kevin", inputs)
    valid, R = _turn_returns(inputs, config.turn_gamma)
    S = valid.shape[1]
    a = jnp.where(valid, R, 0.0)
    if config.turn_group_norm:
        group_rows(jnp.zeros((B,), f32), config.group_size, "kevin")  # G set and divides B
        G = config.group_size
        r, v = R.reshape(B // G, G * S), valid.reshape(B // G, G * S)
        vf = v.astype(f32)
        n = jnp.sum(vf, axis=1, keepdims=True)
        mean = jnp.sum(r * vf, axis=1, keepdims=True) / jnp.maximum(n, 1.0)
        var = jnp.sum(vf * (r - mean) ** 2, axis=1, keepdims=True) / jnp.maximum(n - 1.0, 1.0)
        std = jnp.sqrt(var)
        single = n <= 1.0
        mean, std = jnp.where(single, 0.0, mean), jnp.where(single, 1.0, std)
        hi = jnp.max(jnp.where(v, r, -jnp.inf), axis=1, keepdims=True)
        lo = jnp.min(jnp.where(v, r, jnp.inf), axis=1, keepdims=True)
        norm = r - mean
        if config.norm_by_std:
            norm = norm / (std + config.eps)
        norm = jnp.where((hi == lo) & ~single, 0.0, norm)  # all-equal group: exactly 0
        a = jnp.where(v, norm, 0.0).reshape(B, S)
    a_tok = _on_turn_tokens(a, inputs)
    return a_tok, a_tok


@register_advantage_estimator(
    "turn_rloo",
    requires=("step_rewards_BS", "step_mask_BS", "token_step_BT"),
    group_baseline=True,
    turn_level=True,
)
def turn_rloo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """Per-turn leave-one-out baseline: A_{i,t} = R_{i,t} − mean of R_{j,t} over the other
    episodes j of the group that reached turn t (0 when none did), R_{i,t} the discounted
    return from turn t on (γ = ``config.step_gamma``). The baseline reads no sample of episode i,
    so the gradient stays unbiased whatever the episodes' turn counts (docs/METHODS.md)."""
    B, _ = check_inputs("turn_rloo", inputs)
    group_rows(jnp.zeros((B,), f32), config.group_size, "turn_rloo")  # G set and divides B
    G = config.group_size
    valid, R = _turn_returns(inputs, config.step_gamma)
    S = valid.shape[1]
    r = jnp.where(valid, R, 0.0).reshape(B // G, G, S)
    n = valid.astype(f32).reshape(B // G, G, S)
    others_sum = jnp.sum(r, axis=1, keepdims=True) - r
    others_n = jnp.sum(n, axis=1, keepdims=True) - n
    baseline = others_sum / jnp.maximum(others_n, 1.0)  # 0 where no other episode reached t
    a_tok = _on_turn_tokens(jnp.where(n > 0, r - baseline, 0.0).reshape(B, S), inputs)
    return a_tok, a_tok


def _turn_returns(inputs: AdvantageInputs, gamma: float) -> tuple[jax.Array, jax.Array]:
    """[B, S] real turns and their discounted returns R_t = r_t + γ·R_{t+1}."""
    valid = inputs.step_mask_BS > 0
    return valid, discounted_returns(inputs.step_rewards_BS, valid, gamma)


def _on_turn_tokens(a_BS: jax.Array, inputs: AdvantageInputs) -> jax.Array:
    """[B, T]: every model token of turn t gets its turn's advantage."""
    idx = jnp.clip(inputs.token_step_BT.astype(jnp.int32), 0, a_BS.shape[1] - 1)
    return jnp.take_along_axis(a_BS, idx, axis=1) * inputs.loss_mask_BT.astype(f32)
