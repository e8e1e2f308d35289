"""Advantage estimators, chosen by name from a registry.

Uniform call (what the trainer does for every estimator)::

    fn = get_advantage_estimator(name)          # unknown name -> ValueError listing valid names
    advantages_BT, returns_BT = fn(inputs, config)
    # or: compute_advantages(name, inputs, config); jit with static_argnames=("name", "config")

``inputs`` is an ``AdvantageInputs`` pytree of arrays (fields an estimator does not use may be
None; a missing required field is a ValueError naming it); ``config`` is a frozen, hashable
``AdvantageConfig`` (static under jit). Every estimator returns float32 ``[B, T]`` advantages and
returns, both 0 where ``loss_mask_BT`` is 0. Critic-free estimators return ``returns_BT ==
advantages_BT`` (as verl); ``gae``/``vapo`` return the critic's targets (A + V).

Group layout: rows are responses, ``B = num_groups * G`` with ``G = config.group_size``, and the
G responses of one prompt are contiguous: row ``i`` belongs to group ``i // G``. A group size that
does not divide B is a ValueError at trace time.

Estimators (formulas in /shared/METHODS.md):
  grpo        (s − μ_g)/(σ_g + eps), σ unbiased (ddof=1); G = 1 -> μ = 0, σ = 1; ``norm_by_std``.
  drgrpo      s − μ_g (Dr. GRPO, 2503.20783).
  rloo        s_i − mean_{j≠i} s_j (G = 1 -> s_i).
  reinforce_pp  token rewards (outcome at the last model token, − kl_beta·KL_t if ``kl_BT``),
              G_t = r_t + γ G_{t+1} carried through masked tokens, then batch whitening.
  reinforce_pp_baseline  (s − μ_g) on every model token, then batch whitening.
  remax       G_t − b, b = ``baseline_B`` (reward of the greedy response).
  gae         PPO GAE; observation tokens (m = 0) are skipped: the next value and the running
              advantage are carried across them; returns = A + V; optional batch whitening.
  vapo        GAE with λ_policy = clip(1 − 1/(α·|o|), 0, 1) per response for the advantages and
              λ_critic (1.0) for the returns (decoupled GAE, 2504.05118).
  gigpo       A^E (grpo on episode returns) + ω·A^S, A^S from anchor-state groups of
              (trajectory, step) pairs inside a prompt group (2505.10978).

Notes where sources differ:
  * GRPO σ: verl uses torch.std (unbiased, ddof=1), as METHODS; the DeepSeekMath paper does not
    say which. A population std (ddof=0) would scale advantages by sqrt(G/(G−1)).
  * REINFORCE++ returns: verl resets the running return at mask = 0 positions
    (``running_return *= mask``), which cuts an outcome off from earlier turns when tool
    observations sit in between; here (METHODS) it is carried through, undiscounted, at masked
    positions. Identical for single-turn responses whose mask is a contiguous prefix.
  * GAE: verl whitens the advantages (``masked_whiten``); here that is ``config.whiten`` (True).
  * VAPO: the paper's λ = 1 − 1/(α·l) is negative for l < 1/α = 20 tokens; we clip to [0, 1].
  * GiGPO: verl-agent's step normalisation gives a singleton anchor group mean 0 (so A^S = R_t);
    METHODS/the paper's normalisation gives A^S = 0 for a singleton group, which we follow.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms.kl import apply_kl_penalty
from jaxrl_tools.algorithms.masked import masked_whiten
from jaxrl_tools.algorithms.registry import get_advantage_estimator, register_advantage_estimator

f32 = jnp.float32

_FIELDS = ("scores_B", "loss_mask_BT", "token_rewards_BT", "values_BT", "kl_BT", "baseline_B",
           "step_rewards_BS", "step_mask_BS", "anchor_ids_BS", "token_step_BT")


@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
    """Arrays an estimator may read (a pytree; unused fields stay None).

    Attributes:
      loss_mask_BT: [B, T] 1 on model tokens, 0 on prompt / padding / tool observations.
      scores_B: [B] outcome reward of each response (group-based estimators; placed at the last
        model token by the token-reward estimators when ``token_rewards_BT`` is None).
      token_rewards_BT: [B, T] per-token rewards (reinforce_pp, remax, gae, vapo).
      values_BT: [B, T] critic values V_t (gae, vapo).
      kl_BT: [B, T] per-token KL to the reference; folded into the rewards as −kl_beta·KL_t.
      baseline_B: [B] reward of the greedy response to the same prompt (remax).
      step_rewards_BS: [B, S] per-step environment rewards (gigpo).
      step_mask_BS: [B, S] 1 on real steps (gigpo).
      anchor_ids_BS: [B, S] int id of the environment state at each step, equal ids = same state;
        compared only inside a prompt group (gigpo; the host hashes the state strings).
      token_step_BT: [B, T] int step index (0..S-1) of each token (gigpo).
    """

    loss_mask_BT: jax.Array
    scores_B: jax.Array | None = None
    token_rewards_BT: jax.Array | None = None
    values_BT: jax.Array | None = None
    kl_BT: jax.Array | None = None
    baseline_B: jax.Array | None = None
    step_rewards_BS: jax.Array | None = None
    step_mask_BS: jax.Array | None = None
    anchor_ids_BS: jax.Array | None = None
    token_step_BT: jax.Array | None = None


jax.tree_util.register_dataclass(AdvantageInputs, data_fields=list(_FIELDS), meta_fields=[])


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """Static settings shared by the estimators (hashable: pass as a static jit argument).

    Attributes:
      group_size: G, responses per prompt (contiguous rows).
      norm_by_std: grpo/gigpo divide by the group std (False = Dr. GRPO style mean-centering).
      eps: added to the group std (1e-6).
      gamma: token-level discount (reinforce_pp, remax, gae, vapo).
      lam: GAE λ (gae).
      kl_beta: coefficient of ``kl_BT`` folded into the token rewards.
      whiten: gae/vapo whiten the policy advantages over the batch (verl does).
      vapo_alpha: α of VAPO's length-adaptive λ_policy = 1 − 1/(α·|o|).
      critic_lam: λ for the critic's returns in vapo (1.0).
      step_gamma: γ of GiGPO's discounted step returns (0.95 in the paper).
      gigpo_omega: ω weighting the step-level advantage.
    """

    group_size: int = 1
    norm_by_std: bool = True
    eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 1.0
    kl_beta: float = 0.0
    whiten: bool = True
    vapo_alpha: float = 0.05
    critic_lam: float = 1.0
    step_gamma: float = 0.95
    gigpo_omega: float = 1.0

    def __post_init__(self):
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"AdvantageConfig.group_size must be an int >= 1, got "
                             f"{self.group_size!r}")
        for name in ("gamma", "lam", "critic_lam", "step_gamma"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"AdvantageConfig.{name} must be in [0, 1], got {v}")
        if self.vapo_alpha <= 0:
            raise ValueError(f"AdvantageConfig.vapo_alpha must be > 0, got {self.vapo_alpha}")
        if self.eps < 0:
            raise ValueError(f"AdvantageConfig.eps must be >= 0, got {self.eps}")


# ----------------------------------------------------------------------------------- helpers


def _require(inputs: AdvantageInputs, estimator: str, *fields: str) -> None:
    missing = [f for f in fields if getattr(inputs, f) is None]
    if missing:
        raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs."
                         f"{', '.join(missing)} (got None)")


def _check_shapes(inputs: AdvantageInputs) -> tuple[int, int]:
    m = inputs.loss_mask_BT
    if m is None or m.ndim != 2:
        raise ValueError(f"AdvantageInputs.loss_mask_BT must be [B, T], got "
                         f"{None if m is None else m.shape}")
    B, T = m.shape
    S = None
    for name in _FIELDS:
        x = getattr(inputs, name)
        if x is None:
            continue
        if name.endswith("_BT"):
            want = (B, T)
        elif name.endswith("_BS"):
            S = x.shape[1] if (S is None and x.ndim == 2) else S
            want = (B, S)
        else:
            want = (B,)
        if tuple(x.shape) != want:
            raise ValueError(f"AdvantageInputs.{name} has shape {tuple(x.shape)}, expected {want} "
                             f"(B, T from loss_mask_BT {m.shape})")
    return B, T


def _group(x_B: jax.Array, group_size: int) -> jax.Array:
    B = x_B.shape[0]
    if B % group_size:
        raise ValueError(f"batch size {B} is not a multiple of group_size {group_size} "
                         f"(rows must be num_groups * G, groups contiguous)")
    return x_B.astype(f32).reshape(B // group_size, group_size)


def _group_mean_std(s_NG: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-group mean and unbiased std, [N, 1]; a group of one has mean 0 and std 1."""
    if s_NG.shape[1] == 1:
        return jnp.zeros_like(s_NG), jnp.ones_like(s_NG)
    mu = jnp.mean(s_NG, axis=1, keepdims=True)
    # An all-equal group must give exactly 0, not round-off / (σ≈0 + eps) (XLA's mean is inexact).
    same = jnp.max(s_NG, axis=1, keepdims=True) == jnp.min(s_NG, axis=1, keepdims=True)
    mu = jnp.where(same, s_NG[:, :1], mu)
    return mu, jnp.std(s_NG, axis=1, ddof=1, keepdims=True)


def _grpo_scores(scores_B, config: AdvantageConfig, norm_by_std: bool) -> jax.Array:
    s = _group(scores_B, config.group_size)
    mu, sigma = _group_mean_std(s)
    a = s - mu
    if norm_by_std:
        a = a / (sigma + config.eps)
    return a.reshape(-1)


def _broadcast(a_B: jax.Array, mask_BT: jax.Array) -> jax.Array:
    return a_B[:, None] * mask_BT.astype(f32)


def last_token_onehot(loss_mask_BT: jax.Array) -> jax.Array:
    """[B, T] float32 one-hot at the last position with mask 1 (all zero for an empty row)."""
    m = loss_mask_BT > 0
    T = m.shape[1]
    last = T - 1 - jnp.argmax(m[:, ::-1], axis=1)
    return jax.nn.one_hot(last, T, dtype=f32) * jnp.any(m, axis=1, keepdims=True)


def token_rewards(inputs: AdvantageInputs, config: AdvantageConfig, estimator: str) -> jax.Array:
    """``token_rewards_BT`` if given, else the outcome score at the last model token; minus
    ``config.kl_beta * kl_BT`` on model tokens when ``kl_BT`` is given; 0 on masked tokens."""
    m = inputs.loss_mask_BT
    if inputs.token_rewards_BT is not None:
        r = inputs.token_rewards_BT.astype(f32)
    else:
        _require(inputs, estimator, "scores_B")
        r = inputs.scores_B.astype(f32)[:, None] * last_token_onehot(m)
    if inputs.kl_BT is not None:
        r = apply_kl_penalty(r, inputs.kl_BT, m, config.kl_beta)
    return jnp.where(m > 0, r, 0.0)


def discounted_returns(rewards_BT: jax.Array, loss_mask_BT: jax.Array, gamma: float) -> jax.Array:
    """G_t = r_t + γ·G_{t+1} on model tokens; masked tokens carry G_{t+1} unchanged (lax.scan)."""
    r_TB = rewards_BT.astype(f32).T
    m_TB = loss_mask_BT.T > 0

    def step(g_next, xs):
        r, m = xs
        g = jnp.where(m, r + gamma * g_next, g_next)
        return g, g

    _, g_TB = jax.lax.scan(step, jnp.zeros(r_TB.shape[1], f32), (r_TB, m_TB), reverse=True)
    return g_TB.T


def gae_step(gamma: float, lam_B: jax.Array, carry, x):
    """One backward GAE step (the ``lax.scan`` body of ``gae_advantages``).

    carry = (next_v_B, last_a_B): value and advantage of the next model token; x = (r_B, v_B, m_B).
    On a masked token (m = 0) the carry passes through unchanged.
    """
    next_v, last_a = carry
    r, v, m = x
    a = r + gamma * next_v - v + gamma * lam_B * last_a
    next_v = jnp.where(m, v, next_v)
    last_a = jnp.where(m, a, last_a)
    return (next_v, last_a), last_a


def gae_advantages(rewards_BT: jax.Array, values_BT: jax.Array, loss_mask_BT: jax.Array,
                   gamma: float, lam) -> jax.Array:
    """Raw GAE (no whitening, not masked), skipping m = 0 positions (verl multi-turn GAE).

    δ_t = r_t + γ·V_next − V_t;  A_t = δ_t + γλ·A_next, where V_next / A_next are those of the next
    model token (carried across masked positions). ``lam`` is a scalar or a [B] array.
    """
    lam_B = jnp.broadcast_to(jnp.asarray(lam, f32), rewards_BT.shape[:1])
    xs = (rewards_BT.astype(f32).T, values_BT.astype(f32).T, loss_mask_BT.T > 0)
    zeros = jnp.zeros(rewards_BT.shape[:1], f32)
    step = functools.partial(gae_step, gamma, lam_B)
    _, a_TB = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
    return a_TB.T


# -------------------------------------------------------------------------------- estimators


@register_advantage_estimator("grpo")
def grpo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """GRPO: (s − μ_group)/(σ_group + eps) (σ only if ``config.norm_by_std``) on model tokens."""
    _check_shapes(inputs)
    _require(inputs, "grpo", "scores_B")
    a = _broadcast(_grpo_scores(inputs.scores_B, config, config.norm_by_std), inputs.loss_mask_BT)
    return a, a


@register_advantage_estimator("drgrpo")
def drgrpo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """Dr. GRPO: s − μ_group on model tokens (pair with loss_agg seq-mean-token-sum-norm)."""
    _check_shapes(inputs)
    _require(inputs, "drgrpo", "scores_B")
    a = _broadcast(_grpo_scores(inputs.scores_B, config, False), inputs.loss_mask_BT)
    return a, a


@register_advantage_estimator("rloo")
def rloo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """RLOO: s_i − mean_{j≠i} s_j (a group of one keeps s_i)."""
    _check_shapes(inputs)
    _require(inputs, "rloo", "scores_B")
    s = _group(inputs.scores_B, config.group_size)
    G = s.shape[1]
    if G > 1:
        s = s - (jnp.sum(s, axis=1, keepdims=True) - s) / (G - 1)
    a = _broadcast(s.reshape(-1), inputs.loss_mask_BT)
    return a, a


@register_advantage_estimator("reinforce_pp")
def reinforce_pp(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++: discounted token returns (outcome − β·KL), whitened over the batch."""
    _check_shapes(inputs)
    m = inputs.loss_mask_BT
    g = discounted_returns(token_rewards(inputs, config, "reinforce_pp"), m, config.gamma)
    return masked_whiten(g, m), g * m.astype(f32)


@register_advantage_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline(inputs: AdvantageInputs,
                          config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++-baseline: (s − μ_group) on each model token, whitened over the batch."""
    _check_shapes(inputs)
    _require(inputs, "reinforce_pp_baseline", "scores_B")
    s = _group(inputs.scores_B, config.group_size)
    mu, _ = _group_mean_std(s)
    a = masked_whiten(_broadcast((s - mu).reshape(-1), inputs.loss_mask_BT), inputs.loss_mask_BT)
    return a, a


@register_advantage_estimator("remax")
def remax(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """ReMax: A_t = G_t − b with b the greedy response's reward (``baseline_B``)."""
    _check_shapes(inputs)
    _require(inputs, "remax", "baseline_B")
    m = inputs.loss_mask_BT.astype(f32)
    g = discounted_returns(token_rewards(inputs, config, "remax"), m, config.gamma) * m
    return g - _broadcast(inputs.baseline_B.astype(f32), m), g


@register_advantage_estimator("gae")
def gae(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """PPO GAE(γ, λ) over model tokens; returns = A + V (before whitening)."""
    _check_shapes(inputs)
    _require(inputs, "gae", "values_BT")
    m = inputs.loss_mask_BT
    a = gae_advantages(token_rewards(inputs, config, "gae"), inputs.values_BT, m,
                       config.gamma, config.lam)
    mf = m.astype(f32)
    returns = (a + inputs.values_BT.astype(f32)) * mf
    return (masked_whiten(a, m) if config.whiten else a * mf), returns


@register_advantage_estimator("vapo")
def vapo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """VAPO decoupled, length-adaptive GAE: policy λ = 1 − 1/(α|o|), critic λ = critic_lam."""
    _check_shapes(inputs)
    _require(inputs, "vapo", "values_BT")
    m = inputs.loss_mask_BT
    mf = m.astype(f32)
    r = token_rewards(inputs, config, "vapo")
    length = jnp.sum(mf, axis=1)
    lam_policy = jnp.clip(1.0 - 1.0 / jnp.maximum(config.vapo_alpha * length, 1e-6), 0.0, 1.0)
    a = gae_advantages(r, inputs.values_BT, m, config.gamma, lam_policy)
    a_critic = gae_advantages(r, inputs.values_BT, m, config.gamma, config.critic_lam)
    returns = (a_critic + inputs.values_BT.astype(f32)) * mf
    return (masked_whiten(a, m) if config.whiten else a * mf), returns


@register_advantage_estimator("gigpo")
def gigpo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """GiGPO: A = A^E + ω·A^S; A^S normalises discounted step returns within anchor-state groups."""
    B, _ = _check_shapes(inputs)
    _require(inputs, "gigpo", "scores_B", "step_rewards_BS", "step_mask_BS", "anchor_ids_BS",
             "token_step_BT")
    G = config.group_size
    a_episode = _grpo_scores(inputs.scores_B, config, config.norm_by_std)
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
        count - 1.0, 1.0)
    a_step = R - mean
    if config.norm_by_std:
        a_step = a_step / (jnp.sqrt(var) + config.eps)
    a_step = jnp.where(valid & (count > 1), a_step, 0.0).reshape(B, S)
    idx = jnp.clip(inputs.token_step_BT.astype(jnp.int32), 0, S - 1)
    a_tok = jnp.take_along_axis(a_step, idx, axis=1)
    a = (a_episode[:, None] + config.gigpo_omega * a_tok) * inputs.loss_mask_BT.astype(f32)
    return a, a


def compute_advantages(name: str, inputs: AdvantageInputs,
                       config: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    """Run the estimator registered as ``name``; returns (advantages_BT, returns_BT)."""
    return get_advantage_estimator(name)(inputs, config)
