"""Advantage estimators: their inputs, their config, shared helpers and the uniform call.

Uniform call (what the trainer does for every estimator)::

    fn = get_advantage_estimator(name)          # unknown name -> ValueError listing valid names
    advantages_BT, returns_BT = fn(inputs, config)
    # or: compute_advantages(name, inputs, config); jit with static_argnames=("name", "config")

``inputs`` is an ``AdvantageInputs`` pytree of arrays (fields an estimator does not use may be
None; a missing required field is a ValueError naming it, ``estimator_requirements(name)`` lists
them); ``config`` is a frozen, hashable ``AdvantageConfig`` (static under jit). Every estimator
returns float32 ``[B, T]`` advantages and returns, both 0 where ``loss_mask_BT`` is 0.
Critic-free estimators return ``returns_BT == advantages_BT`` (as verl); ``gae``/``vapo`` return
the critic's targets (A + V).

Padding rows: ``row_mask_B`` (1 on real rows, 0 on padding) lets one compiled call serve any
number of real rows. ``compute_advantages`` clears the padding rows' inputs (masks, scores,
rewards, values: 0) before the estimator runs and their outputs after, so padding changes no
real row's advantages, whatever it holds, provided it comes in whole groups (every group of a
group estimator is all real or all padding).

Shapes and dtypes are checked at trace time (static properties only, so it all works under jit):
every ``_BT`` field must be exactly ``loss_mask_BT``'s [B, T], every ``_B`` field [B], the
``_BS`` fields one common [B, S]; ``anchor_ids_BS`` and ``token_step_BT`` must be integers.

Group layout: rows are responses, ``B = num_groups * G`` with ``G = config.group_size``, and the
G responses of one prompt are contiguous: row ``i`` belongs to group ``i // G``. For the
estimators that use groups, a group size that is unset or does not divide B is a ValueError at
trace time. Rows grouped by an id instead (verl's ``uid``): ``contiguous_groups(uid)`` gives the
row order that makes the groups contiguous, and G.

Estimators (formulas in docs/METHODS.md), by module:
  outcome.py   grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline, remax
  critic.py    gae, vapo (need ``values_BT``)
  gigpo.py     gigpo (step-level, anchor-state groups)
  turns.py     kevin (discounted per-turn returns), turn_rloo (a per-turn leave-one-out baseline)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_tools.algorithms._checks import (
    check_int,
    check_like,
    check_ndim,
    check_shape,
    shape_of,
)
from jaxrl_tools.algorithms.kl import apply_kl_penalty
from jaxrl_tools.algorithms.registry import estimator_requirements, get_advantage_estimator

f32 = jnp.float32

_FIELDS = (
    "scores_B",
    "loss_mask_BT",
    "token_rewards_BT",
    "values_BT",
    "kl_BT",
    "baseline_B",
    "step_rewards_BS",
    "step_mask_BS",
    "anchor_ids_BS",
    "token_step_BT",
    "row_mask_B",
)
_INT_FIELDS = {"anchor_ids_BS": "ids of environment states", "token_step_BT": "step indices"}


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
      row_mask_B: [B] 1 on real rows, 0 on padding rows (module docstring); None: all real.
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
    row_mask_B: jax.Array | None = None


jax.tree_util.register_dataclass(AdvantageInputs, data_fields=list(_FIELDS), meta_fields=[])


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """Static settings shared by the estimators (hashable: pass as a static jit argument).

    Attributes:
      group_size: G, responses per prompt (contiguous rows). No default: the group estimators
        (grpo, drgrpo, rloo, reinforce_pp_baseline, gigpo) raise while it is None, rather than
        treat every response as its own group and return raw scores.
      norm_by_std: grpo/gigpo divide by the group std (False = Dr. GRPO style mean-centering).
      eps: added to the group std (1e-6).
      gamma: token-level discount (reinforce_pp, remax, gae, vapo).
      lam: GAE λ (gae).
      kl_beta: coefficient of ``kl_BT`` folded into the token rewards.
      whiten: gae/vapo whiten the policy advantages over the batch (verl does).
      vapo_alpha: α of VAPO's length-adaptive λ_policy = 1 − 1/(α·|o|).
      critic_lam: λ for the critic's returns in vapo (1.0).
      step_gamma: γ of the discounted step returns of gigpo (0.95 in the paper) and turn_rloo.
      gigpo_omega: ω weighting the step-level advantage.
      turn_gamma: γ of Kevin's per-turn returns R_t = s_t + γ·R_{t+1} (0.4 in Kevin).
      turn_group_norm: kevin normalises the turn returns over the prompt's group (Kevin does).
    """

    group_size: int | None = None
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
    turn_gamma: float = 0.4
    turn_group_norm: bool = True

    def __post_init__(self):
        if self.group_size is not None and (
            not isinstance(self.group_size, int) or self.group_size < 1
        ):
            raise ValueError(
                f"AdvantageConfig.group_size must be an int >= 1, got {self.group_size!r}"
            )
        for name in ("gamma", "lam", "critic_lam", "step_gamma", "turn_gamma"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"AdvantageConfig.{name} must be in [0, 1], got {v}")
        if self.vapo_alpha <= 0:
            raise ValueError(f"AdvantageConfig.vapo_alpha must be > 0, got {self.vapo_alpha}")
        if self.eps < 0:
            raise ValueError(f"AdvantageConfig.eps must be >= 0, got {self.eps}")


# --------------------------------------------------------------------------- input checks


def check_inputs(estimator: str, inputs: AdvantageInputs, *also_required: str) -> tuple[int, int]:
    """Validate ``inputs`` for ``estimator`` (static shapes and dtypes only); returns (B, T).

    Raises ValueError when a field the estimator requires (``estimator_requirements`` plus
    ``also_required``) is None, or any given field has the wrong shape or a float dtype where
    ints are meant.
    """
    required = (*estimator_requirements(estimator), *also_required)
    return _check_fields(f"advantage estimator {estimator!r}", inputs, required)


def _check_fields(fn: str, inputs: AdvantageInputs, required: tuple[str, ...]) -> tuple[int, int]:
    missing = [f for f in required if getattr(inputs, f) is None]
    if missing:
        raise ValueError(f"{fn} needs AdvantageInputs.{', '.join(missing)} (got None)")
    m = inputs.loss_mask_BT
    if m is None:
        raise ValueError(f"{fn} needs AdvantageInputs.loss_mask_BT (got None)")
    check_ndim(fn, "AdvantageInputs.loss_mask_BT", m, "[B, T]")
    B, T = shape_of(m)
    why = f"B, T from loss_mask_BT {(B, T)}"
    S, s_from = None, None
    for name in _FIELDS:
        x = getattr(inputs, name)
        if x is None or name == "loss_mask_BT":
            continue
        arg = f"AdvantageInputs.{name}"
        if name.endswith("_BS"):
            check_ndim(fn, arg, x, "[B, S]")
            if S is None:
                S, s_from = shape_of(x)[1], name
            check_shape(fn, arg, x, (B, S), f"{why}, S from {s_from}")
        else:
            check_shape(fn, arg, x, (B, T) if name.endswith("_BT") else (B,), why)
        if name in _INT_FIELDS:
            check_int(fn, arg, x, _INT_FIELDS[name])
    return B, T


def compute_advantages(
    name: str, inputs: AdvantageInputs, config: AdvantageConfig
) -> tuple[jax.Array, jax.Array]:
    """Run the estimator registered as ``name``; returns (advantages_BT, returns_BT).

    Args:
      name: a registered estimator (``list_advantage_estimators()``).
      inputs: the AdvantageInputs; ``estimator_requirements(name)`` fields must be set.
      config: AdvantageConfig.
    Returns:
      (advantages_BT, returns_BT), float32 [B, T], 0 where ``loss_mask_BT`` is 0.
    """
    fn = get_advantage_estimator(name)
    check_inputs(name, inputs)
    if inputs.row_mask_B is None:
        return fn(inputs, config)
    real_B = inputs.row_mask_B > 0
    adv, ret = fn(clear_padding_rows(inputs), config)
    return jnp.where(real_B[:, None], adv, 0.0), jnp.where(real_B[:, None], ret, 0.0)


def clear_padding_rows(inputs: AdvantageInputs) -> AdvantageInputs:
    """``inputs`` with every field 0 on the rows where ``row_mask_B`` is 0 (and no row mask):
    a padding row then has no model token, no score, no step and no reward, so it cannot move
    a real row's batch statistics, and a group of padding rows is a group of equal zeros."""
    real_B = inputs.row_mask_B > 0

    def clear(x):
        if x is None:
            return None
        real = real_B.reshape(real_B.shape + (1,) * (x.ndim - 1))
        return jnp.where(real, x, jnp.zeros((), x.dtype))

    fields = {f: clear(getattr(inputs, f)) for f in _FIELDS if f != "row_mask_B"}
    return AdvantageInputs(**fields)


# -------------------------------------------------------------------------------- helpers


def group_rows(x_B: jax.Array, group_size: int | None, estimator: str) -> jax.Array:
    """[B] -> [B // G, G] float32; a group size that is None or does not divide B is a
    ValueError."""
    check_ndim(f"advantage estimator {estimator!r}", "x_B", x_B, "[B]")
    B = shape_of(x_B)[0]
    if group_size is None:
        raise ValueError(
            f"advantage estimator {estimator!r} compares each response with the others of its "
            "prompt: set AdvantageConfig.group_size to G, the responses per prompt (rows grouped "
            "by an id: contiguous_groups(ids) gives the row order and G)"
        )
    if B % group_size:
        raise ValueError(
            f"advantage estimator {estimator!r}: batch size {B} is not a multiple "
            f"of group_size {group_size} (rows must be num_groups * G, groups "
            f"contiguous)"
        )
    return x_B.astype(f32).reshape(B // group_size, group_size)


def contiguous_groups(group_ids) -> tuple[np.ndarray, int]:
    """The row order that makes groups contiguous, and G, from one group id per row.

    verl groups responses by a ``uid`` per row, in any order; the estimators here want the G
    rows of a group next to each other. Groups keep the order of their first row and rows their
    order within a group, so ids that are already contiguous give the identity.

    Args:
      group_ids: [B] ids (strings or ints), equal for the responses to one prompt.
    Returns:
      (order_B, G): ``x[order_B]`` has contiguous groups; ``np.argsort(order_B)`` undoes it.
    Raises:
      ValueError: groups of different sizes (the estimators need one G).
    """
    ids = list(np.asarray(group_ids).reshape(-1).tolist())
    rows: dict = {}
    for i, g in enumerate(ids):
        rows.setdefault(g, []).append(i)
    sizes = sorted({len(r) for r in rows.values()})
    if len(sizes) > 1:
        raise ValueError(
            f"group ids give groups of sizes {sizes}; the group estimators need every prompt "
            "to have the same number of responses (drop or pad the short groups)"
        )
    order = np.asarray([i for r in rows.values() for i in r], np.int64)
    return order, (sizes[0] if sizes else 1)


def group_mean_std(s_NG: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-group mean and unbiased std, [N, 1]; a group of one has mean 0 and std 1."""
    if s_NG.shape[1] == 1:
        return jnp.zeros_like(s_NG), jnp.ones_like(s_NG)
    mu = jnp.mean(s_NG, axis=1, keepdims=True)
    # An all-equal group must give exactly 0, not round-off / (σ≈0 + eps) (XLA's mean is inexact).
    same = jnp.max(s_NG, axis=1, keepdims=True) == jnp.min(s_NG, axis=1, keepdims=True)
    mu = jnp.where(same, s_NG[:, :1], mu)
    return mu, jnp.std(s_NG, axis=1, ddof=1, keepdims=True)


def grpo_scores(scores_B, config: AdvantageConfig, norm_by_std: bool, estimator: str) -> jax.Array:
    """[B] group-normalised scores: (s − μ_g), divided by (σ_g + eps) if ``norm_by_std``."""
    s = group_rows(scores_B, config.group_size, estimator)
    mu, sigma = group_mean_std(s)
    a = s - mu
    if norm_by_std:
        a = a / (sigma + config.eps)
    return a.reshape(-1)


def broadcast_rows(a_B: jax.Array, mask_BT: jax.Array) -> jax.Array:
    """A per-row value on every model token: a_B[:, None] · mask, float32."""
    check_ndim("broadcast_rows", "mask_BT", mask_BT, "[B, T]")
    check_shape("broadcast_rows", "a_B", a_B, shape_of(mask_BT)[:1], "the rows of mask_BT")
    return a_B[:, None] * mask_BT.astype(f32)


def last_token_onehot(loss_mask_BT: jax.Array) -> jax.Array:
    """[B, T] float32 one-hot at the last position with mask 1 (all zero for an empty row)."""
    check_ndim("last_token_onehot", "loss_mask_BT", loss_mask_BT, "[B, T]")
    m = loss_mask_BT > 0
    T = m.shape[1]
    last = T - 1 - jnp.argmax(m[:, ::-1], axis=1)
    return jax.nn.one_hot(last, T, dtype=f32) * jnp.any(m, axis=1, keepdims=True)


def token_rewards(inputs: AdvantageInputs, config: AdvantageConfig, estimator: str) -> jax.Array:
    """``token_rewards_BT`` if given, else the outcome score at the last model token; minus
    ``config.kl_beta * kl_BT`` on model tokens when ``kl_BT`` is given; 0 on masked tokens."""
    need = () if inputs.token_rewards_BT is not None else ("scores_B",)
    _check_fields(f"advantage estimator {estimator!r}", inputs, need)
    m = inputs.loss_mask_BT
    if inputs.token_rewards_BT is not None:
        r = inputs.token_rewards_BT.astype(f32)
    else:
        r = inputs.scores_B.astype(f32)[:, None] * last_token_onehot(m)
    if inputs.kl_BT is not None:
        r = apply_kl_penalty(r, inputs.kl_BT, m, config.kl_beta)
    return jnp.where(m > 0, r, 0.0)


def discounted_returns(rewards_BT: jax.Array, loss_mask_BT: jax.Array, gamma: float) -> jax.Array:
    """G_t = r_t + γ·G_{t+1} on model tokens; masked tokens carry G_{t+1} unchanged (lax.scan).

    Args:
      rewards_BT: [B, T] rewards (also [B, S] step rewards).
      loss_mask_BT: [B, T] 1 where a reward counts; exactly the shape of ``rewards_BT``.
      gamma: discount.
    Returns:
      [B, T] float32 returns.
    """
    check_ndim("discounted_returns", "rewards_BT", rewards_BT, "[B, T]")
    check_like("discounted_returns", "rewards_BT", rewards_BT, loss_mask_BT=loss_mask_BT)
    r_TB = rewards_BT.astype(f32).T
    m_TB = loss_mask_BT.T > 0

    def step(g_next, xs):
        r, m = xs
        g = jnp.where(m, r + gamma * g_next, g_next)
        return g, g

    _, g_TB = jax.lax.scan(step, jnp.zeros(r_TB.shape[1], f32), (r_TB, m_TB), reverse=True)
    return g_TB.T
