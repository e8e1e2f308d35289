"""GiGPO (2505.10978): episode-level group advantages plus step-level anchor-state advantages.

A = A^E + ω·A^S. A^E is GRPO on the episode scores; A^S normalises the discounted step returns
R_t = Σ_k γ^k r_{t+k} within anchor-state groups: every (trajectory, step) slot of one prompt
group whose environment state id (``anchor_ids_BS``) is identical. Formulas in docs/METHODS.md.

Note where sources differ: verl-agent's step normalisation gives a singleton anchor group mean 0
(so A^S = R_t); docs/METHODS.md and the paper's normalisation give A^S = 0 for a singleton group,
which we follow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms.advantages import (
    AdvantageConfig,
    AdvantageInputs,
    check_inputs,
    discounted_returns,
    grpo_scores,
)
from jaxrl_tools.algorithms.registry import register_advantage_estimator

f32 = jnp.float32


@register_advantage_estimator(
    "gigpo",
    requires=("step_rewards_BS", "step_mask_BS", "anchor_ids_BS", "token_step_BT"),
    group_baseline=True,
    turn_level=True,
)
def gigpo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """GiGPO: A = A^E + ω·A^S; A^S normalises discounted step returns within anchor-state groups."""
    B, _ = check_inputs("gigpo", inputs, "scores_B")
    G = config.group_size
    a_episode = grpo_scores(inputs.scores_B, config, config.norm_by_std, "gigpo")
    S = inputs.step_rewards_BS.shape[1]
    valid_BS = inputs.step_mask_BS > 0
    R_BS = discounted_returns(inputs.step_rewards_BS, valid_BS, config.step_gamma)
    N = B // G
    R = R_BS.reshape(N, G * S)
    ids = inputs.anchor_ids_BS.reshape(N, G * S)
    valid = valid_BS.reshape(N, G * S)
    # same[n, a, b]: step slots a and b of prompt group n share an anchor state.
    same = (ids[:, :, None] == ids[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    samef = same.astype(f32)
    count = jnp.sum(samef, axis=-1)
    mean = jnp.sum(samef * R[:, None, :], axis=-1) / jnp.maximum(count, 1.0)
    r_max = jnp.max(jnp.where(same, R[:, None, :], -jnp.inf), axis=-1)
    r_min = jnp.min(jnp.where(same, R[:, None, :], jnp.inf), axis=-1)
    mean = jnp.where(r_max == r_min, R, mean)  # all-equal anchor group -> exactly 0
    var = jnp.sum(samef * (R[:, None, :] - mean[:, :, None]) ** 2, axis=-1) / jnp.maximum(
        count - 1.0, 1.0
    )
    a_step = R - mean
    if config.norm_by_std:
        a_step = a_step / (jnp.sqrt(var) + config.eps)
    a_step = jnp.where(valid & (count > 1), a_step, 0.0).reshape(B, S)
    idx = jnp.clip(inputs.token_step_BT.astype(jnp.int32), 0, S - 1)
    a_tok = jnp.take_along_axis(a_step, idx, axis=1)
    a = (a_episode[:, None] + config.gigpo_omega * a_tok) * inputs.loss_mask_BT.astype(f32)
    return a, a
