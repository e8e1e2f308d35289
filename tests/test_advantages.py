"""Advantage estimators vs plain NumPy transcriptions of METHODS.md, plus properties and errors."""

import dataclasses
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from fakes import ESTIMATORS

from jaxrl_tools.algorithms import (
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
    gae_advantages,
    gae_step,
    get_advantage_estimator,
    list_advantage_estimators,
    register_advantage_estimator,
)

# float32 against a float64 oracle. Normalising by the std of groups as small as 2 amplifies
# rounding: over 300 random batches GiGPO's step-level advantages differ by up to 2e-5.
RTOL, ATOL = 5e-5, 5e-5
# ------------------------------------------------------------------ NumPy oracles (loops)


def np_group_norm(scores, G, norm_by_std, eps=1e-6):
    scores = np.asarray(scores, np.float64)
    out = np.zeros_like(scores)
    for g0 in range(0, len(scores), G):
        grp = scores[g0 : g0 + G]
        if G == 1:
            mu, sd = 0.0, 1.0
        else:
            mu = sum(grp) / G
            sd = np.sqrt(sum((x - mu) ** 2 for x in grp) / (G - 1))
        for i in range(G):
            out[g0 + i] = (grp[i] - mu) / (sd + eps) if norm_by_std else grp[i] - mu
    return out


def np_rloo(scores, G):
    scores = np.asarray(scores, np.float64)
    out = scores.copy()
    if G == 1:
        return out
    for g0 in range(0, len(scores), G):
        for i in range(G):
            others = [scores[g0 + j] for j in range(G) if j != i]
            out[g0 + i] = scores[g0 + i] - sum(others) / len(others)
    return out


def np_whiten(x, m):
    vals = [x[b, t] for b in range(x.shape[0]) for t in range(x.shape[1]) if m[b, t]]
    n = len(vals)
    mu = sum(vals) / n
    var = sum((v - mu) ** 2 for v in vals) / n * n / (n - 1)
    return (x - mu) / np.sqrt(var + 1e-8) * m


def np_token_rewards(scores, m, kl=None, beta=0.0, token_rewards=None):
    B, T = m.shape
    r = np.zeros((B, T))
    for b in range(B):
        if token_rewards is not None:
            r[b] = token_rewards[b] * m[b]
        else:
            idx = [t for t in range(T) if m[b, t]]
            if idx:
                r[b, idx[-1]] = scores[b]
        if kl is not None:
            r[b] -= beta * kl[b] * m[b]
    return r


def np_returns(r, m, gamma):
    B, T = r.shape
    out = np.zeros((B, T))
    for b in range(B):
        g = 0.0
        for t in reversed(range(T)):
            if m[b, t]:  # masked tokens carry G_{t+1} unchanged
                g = r[b, t] + gamma * g
            out[b, t] = g
    return out


def np_gae(r, v, m, gamma, lam):
    B, T = r.shape
    lam = np.broadcast_to(np.asarray(lam, np.float64), (B,))
    adv = np.zeros((B, T))
    for b in range(B):
        next_v, last_a = 0.0, 0.0
        for t in reversed(range(T)):
            if m[b, t]:
                delta = r[b, t] + gamma * next_v - v[b, t]
                last_a = delta + gamma * lam[b] * last_a
                next_v = v[b, t]
            adv[b, t] = last_a
    return adv


def np_kevin(step_r, step_m, token_step, m, G, norm, eps, gamma, group_norm=True):
    """Kevin: turn returns R_t = s_t + γR_{t+1}, normalised over every real turn of the group."""
    B, S = step_r.shape
    R = np.zeros((B, S))
    for b in range(B):
        ret = 0.0
        for s in reversed(range(S)):
            if step_m[b, s]:
                ret = step_r[b, s] + gamma * ret
                R[b, s] = ret
    a = np.zeros((B, S))
    for g0 in range(0, B, G):
        vals = [R[b, s] for b in range(g0, g0 + G) for s in range(S) if step_m[b, s]]
        n = len(vals)
        mu = sum(vals) / n if n > 1 else 0.0
        sd = np.sqrt(sum((x - mu) ** 2 for x in vals) / (n - 1)) if n > 1 else 1.0
        for b in range(g0, g0 + G):
            for s in range(S):
                if not step_m[b, s]:
                    continue
                if not group_norm:
                    a[b, s] = R[b, s]
                elif n > 1 and max(vals) == min(vals):
                    a[b, s] = 0.0
                else:
                    a[b, s] = (R[b, s] - mu) / (sd + eps) if norm else R[b, s] - mu
    return a[np.arange(B)[:, None], token_step] * m


def np_turn_rloo(step_r, step_m, token_step, m, G, gamma):
    """turn_rloo: R_{i,t} minus the mean R_{j,t} of the group's other episodes j with a turn t."""
    B, S = step_r.shape
    R = np_returns(step_r, step_m, gamma)
    a = np.zeros((B, S))
    for b in range(B):
        g0 = b - b % G
        for t in range(S):
            if step_m[b, t]:
                others = [R[j, t] for j in range(g0, g0 + G) if j != b and step_m[j, t]]
                a[b, t] = R[b, t] - (sum(others) / len(others) if others else 0.0)
    return a[np.arange(B)[:, None], token_step] * m


def np_gigpo(scores, step_r, step_m, anchors, token_step, m, G, norm, eps, gamma_s, omega):
    B, S = step_r.shape
    a_ep = np_group_norm(scores, G, norm, eps)
    R = np_returns(step_r, step_m, gamma_s)
    a_st = np.zeros((B, S))
    for g0 in range(0, B, G):
        groups = {}
        for b in range(g0, g0 + G):
            for s in range(S):
                if step_m[b, s]:
                    groups.setdefault(int(anchors[b, s]), []).append((b, s))
        for members in groups.values():
            if len(members) == 1:
                continue  # singleton anchor group -> A^S = 0
            vals = [R[b, s] for b, s in members]
            mu = sum(vals) / len(vals)
            sd = np.sqrt(sum((x - mu) ** 2 for x in vals) / (len(vals) - 1))
            for b, s in members:
                a_st[b, s] = (R[b, s] - mu) / (sd + eps) if norm else R[b, s] - mu
    out = np.zeros(m.shape)
    for b in range(B):
        for t in range(m.shape[1]):
            out[b, t] = (a_ep[b] + omega * a_st[b, token_step[b, t]]) * m[b, t]
    return out


def oracle(name, d, cfg):
    """(advantages, returns) from the NumPy transcriptions."""
    m = d["loss_mask_BT"]
    G = cfg.group_size
    s = d["scores_B"]
    if name in ("grpo", "drgrpo"):
        a = np_group_norm(s, G, cfg.norm_by_std and name == "grpo", cfg.eps)[:, None] * m
        return a, a
    if name == "rloo":
        a = np_rloo(s, G)[:, None] * m
        return a, a
    if name == "reinforce_pp_baseline":
        a = np_whiten(np_group_norm(s, G, False)[:, None] * m, m)
        return a, a
    r = np_token_rewards(s, m, d["kl_BT"], cfg.kl_beta)
    if name == "reinforce_pp":
        g = np_returns(r, m, cfg.gamma)
        return np_whiten(g, m), g * m
    if name == "remax":
        g = np_returns(r, m, cfg.gamma) * m
        return g - d["baseline_B"][:, None] * m, g
    v = d["values_BT"]
    if name == "gae":
        a = np_gae(r, v, m, cfg.gamma, cfg.lam)
        return (np_whiten(a, m) if cfg.whiten else a * m), (a + v) * m
    if name == "vapo":
        lam = np.clip(1 - 1 / (cfg.vapo_alpha * m.sum(1)), 0, 1)
        a = np_gae(r, v, m, cfg.gamma, lam)
        ac = np_gae(r, v, m, cfg.gamma, cfg.critic_lam)
        return (np_whiten(a, m) if cfg.whiten else a * m), (ac + v) * m
    if name == "kevin":
        a = np_kevin(
            d["step_rewards_BS"],
            d["step_mask_BS"],
            d["token_step_BT"],
            m,
            G,
            cfg.norm_by_std,
            cfg.eps,
            cfg.turn_gamma,
            cfg.turn_group_norm,
        )
        return a, a
    if name == "turn_rloo":
        a = np_turn_rloo(
            d["step_rewards_BS"], d["step_mask_BS"], d["token_step_BT"], m, G, cfg.step_gamma
        )
        return a, a
    if name == "gigpo":
        a = np_gigpo(
            s,
            d["step_rewards_BS"],
            d["step_mask_BS"],
            d["anchor_ids_BS"],
            d["token_step_BT"],
            m,
            G,
            cfg.norm_by_std,
            cfg.eps,
            cfg.step_gamma,
            cfg.gigpo_omega,
        )
        return a, a
    raise KeyError(name)


# ------------------------------------------------------------------------------ inputs


def make_data(seed, num_groups, G, T=12, S=4):
    rng = np.random.default_rng(seed)
    B = num_groups * G
    # prompt-like zeros, model tokens, tool-observation gaps, padding: a random binary mask.
    m = (rng.random((B, T)) < 0.6).astype(np.float32)
    m[:, 0] = 0.0
    m[np.arange(B), rng.integers(1, T, B)] = 1.0  # every row has a model token
    d = dict(
        loss_mask_BT=m,
        scores_B=rng.choice([-1.0, 0.0, 0.5, 1.0], B).astype(np.float32),
        values_BT=rng.normal(size=(B, T)).astype(np.float32),
        kl_BT=np.abs(rng.normal(size=(B, T))).astype(np.float32) * 0.1,
        baseline_B=rng.normal(size=B).astype(np.float32),
        step_rewards_BS=rng.choice([0.0, 0.1, 1.0], (B, S)).astype(np.float32),
        step_mask_BS=(np.arange(S)[None] < rng.integers(1, S + 1, B)[:, None]).astype(np.float32),
        anchor_ids_BS=rng.integers(0, 3, (B, S)).astype(np.int32),
        token_step_BT=np.sort(rng.integers(0, S, (B, T)), axis=1).astype(np.int32),
    )
    return d


def to_inputs(d):
    return AdvantageInputs(**{k: jnp.asarray(v) for k, v in d.items()})


def make_config(name, G):
    return AdvantageConfig(
        group_size=G,
        gamma=0.9 if name in ("gae", "vapo", "reinforce_pp", "remax") else 1.0,
        lam=0.8,
        kl_beta=0.05,
        step_gamma=0.95,
        gigpo_omega=0.7,
    )


# group-free estimators (token returns, GAE) need one group size only
GROUPED = ["drgrpo", "grpo", "reinforce_pp_baseline", "rloo", "turn_rloo"]
CASES = (
    [(f"{n}_G{G}", n, G) for n in GROUPED for G in (1, 3)]
    + [(f"{n}_G2", n, 2) for n in ESTIMATORS if n not in GROUPED]
    + [
        ("grpo_nostd_G4", "grpo_nostd", 4),
        ("gae_nowhiten_G2", "gae_nowhiten", 2),
        ("vapo_nowhiten_G2", "vapo_nowhiten", 2),
        ("gigpo_nostd_G4", "gigpo_nostd", 4),
        ("kevin_nostd_G4", "kevin_nostd", 4),
        ("kevin_G1", "kevin", 1),
    ]
)


class AdvantageOracleTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*CASES)
    def test_matches_numpy(self, name, G):
        cfg = make_config(name.split("_no")[0], G)
        if name.endswith("nostd"):
            cfg = dataclasses.replace(cfg, norm_by_std=False)
        if name.endswith("nowhiten"):
            cfg = dataclasses.replace(cfg, whiten=False)
        name = name.split("_no")[0]
        d = make_data(zlib.crc32(f"{name}{G}".encode()) % 1000, num_groups=3, G=G)
        fn = get_advantage_estimator(name)
        adv, ret = self.variant(lambda x: fn(x, cfg))(to_inputs(d))
        B, T = d["loss_mask_BT"].shape
        chex.assert_shape([adv, ret], (B, T))
        chex.assert_type([adv, ret], jnp.float32)
        want_a, want_r = oracle(name, d, cfg)
        np.testing.assert_allclose(adv, want_a, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(ret, want_r, rtol=RTOL, atol=ATOL)
        # nothing leaks onto masked tokens
        assert np.all(np.asarray(adv)[d["loss_mask_BT"] == 0] == 0)


class PropertyTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_shift_invariant(self):
        d = make_data(1, 4, 4)
        cfg = AdvantageConfig(group_size=4)
        f = self.variant(lambda x: compute_advantages("grpo", x, cfg)[0])
        a0 = f(to_inputs(d))
        d2 = dict(d, scores_B=d["scores_B"] + 3.25)
        np.testing.assert_allclose(f(to_inputs(d2)), a0, rtol=1e-5, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_drgrpo_linear(self):
        d = make_data(2, 3, 4)
        rng = np.random.default_rng(0)
        s1, s2 = rng.normal(size=(2, 12)).astype(np.float32)
        cfg = AdvantageConfig(group_size=4)
        f = self.variant(
            lambda s: compute_advantages("drgrpo", to_inputs(dict(d, scores_B=s)), cfg)[0]
        )
        np.testing.assert_allclose(
            f(2.0 * s1 - 0.5 * s2), 2.0 * f(s1) - 0.5 * f(s2), rtol=1e-5, atol=1e-5
        )

    @parameterized.parameters("grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "gigpo")
    def test_identical_rewards_zero_advantage(self, name):
        d = make_data(3, 3, 4)
        d["scores_B"] = np.full(12, 0.7, np.float32)
        d["step_rewards_BS"] = np.full_like(d["step_rewards_BS"], 0.3)
        d["step_mask_BS"] = np.ones_like(d["step_mask_BS"])
        d["anchor_ids_BS"] = np.tile(np.arange(4, dtype=np.int32), (12, 1))  # same state per step
        a, _ = jax.jit(lambda x: compute_advantages(name, x, AdvantageConfig(group_size=4)))(
            to_inputs(d)
        )
        np.testing.assert_allclose(a, 0.0, atol=1e-6)

    def test_rloo_sums_to_zero_in_group(self):
        d = make_data(4, 5, 4)
        d["scores_B"] = np.random.default_rng(1).normal(size=20).astype(np.float32)
        d["loss_mask_BT"] = np.ones_like(d["loss_mask_BT"])
        a, _ = compute_advantages("rloo", to_inputs(d), AdvantageConfig(group_size=4))
        per_seq = np.asarray(a)[:, 0].reshape(5, 4)
        np.testing.assert_allclose(per_seq.sum(1), 0.0, atol=1e-5)

    def test_gae_scan_equals_python_loop_exactly(self):
        d = make_data(5, 2, 3, T=17)
        r = np.random.default_rng(2).normal(size=d["values_BT"].shape).astype(np.float32)
        v, m = d["values_BT"], d["loss_mask_BT"]
        got = np.asarray(jax.jit(gae_advantages, static_argnums=(3, 4))(r, v, m, 0.99, 0.95))
        # cleanrl-style oracle: the same step, compiled the same way, driven by a Python loop.
        # (A float64 NumPy transcription is checked to 1e-5 in AdvantageOracleTest; bitwise
        # equality with NumPy is impossible because XLA:CPU contracts a*b+c into FMAs.)
        lam_B = jnp.full((r.shape[0],), 0.95, jnp.float32)
        step = jax.jit(lambda c, x: gae_step(0.99, lam_B, c, x))
        carry = (jnp.zeros(r.shape[0]), jnp.zeros(r.shape[0]))
        want = np.zeros_like(r)
        for t in reversed(range(r.shape[1])):
            carry, a = step(carry, (r[:, t], v[:, t], m[:, t] > 0))
            want[:, t] = a
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got, np_gae(r, v, m, 0.99, 0.95), rtol=1e-5, atol=1e-5)

    def test_reinforce_pp_uses_given_token_rewards(self):
        d = make_data(6, 2, 2)
        tr = np.random.default_rng(3).normal(size=d["values_BT"].shape).astype(np.float32)
        d["token_rewards_BT"] = tr
        cfg = AdvantageConfig(group_size=2, gamma=0.9, kl_beta=0.1)
        a, _ = compute_advantages("reinforce_pp", to_inputs(d), cfg)
        m = d["loss_mask_BT"]
        r = np_token_rewards(None, m, d["kl_BT"], 0.1, token_rewards=tr)
        np.testing.assert_allclose(a, np_whiten(np_returns(r, m, 0.9), m), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("seed", range(3))
def test_padding_rows_change_no_real_rows_advantages(name, seed):
    """Property: appending padding groups (any content, NaN included) with row_mask_B 0 leaves
    every estimator's advantages and returns on the real rows as they are without them, and
    gives 0 on the padding rows; the number of real rows is an array (no recompile)."""
    assert sorted(ESTIMATORS) == list_advantage_estimators()  # a new estimator joins this test
    cfg = make_config(name, 4)
    real = make_data(seed, num_groups=2, G=4)
    junk = make_data(seed + 100, num_groups=3, G=4)
    junk["values_BT"][0, :] = np.nan
    junk["scores_B"][1] = np.inf
    padded = {k: np.concatenate([real[k], junk[k]]) for k in real}
    mask = np.r_[np.ones(8), np.zeros(12)].astype(np.float32)
    run = jax.jit(lambda x: compute_advantages(name, x, cfg))
    want = run(to_inputs(real))
    got = run(to_inputs(dict(padded, row_mask_B=mask)))
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.asarray(g)[:8], w, rtol=1e-6, atol=1e-6)
        assert not np.asarray(g)[8:].any()
    # Another count of real rows (here one group fewer) runs the same compiled function.
    fewer = run(to_inputs(dict(padded, row_mask_B=np.r_[mask[:4], np.zeros(16, np.float32)])))
    assert run._cache_size() == 2  # the unpadded shape and the padded one, not one per count
    first = run(to_inputs({k: v[:4] for k, v in real.items()}))
    np.testing.assert_allclose(np.asarray(fewer[0])[:4], first[0], rtol=1e-6, atol=1e-6)


class ErrorTest(chex.TestCase):
    def test_unknown_estimator_lists_valid(self):
        with pytest.raises(ValueError, match="unknown advantage estimator 'nope'.*grpo.*rloo"):
            get_advantage_estimator("nope")
        assert set(ESTIMATORS) <= set(list_advantage_estimators())

    def test_group_size_not_dividing_batch(self):
        d = make_data(0, 2, 5)  # B = 10
        with pytest.raises(ValueError, match="batch size 10 is not a multiple of group_size 4"):
            jax.jit(lambda x: compute_advantages("grpo", x, AdvantageConfig(group_size=4)))(
                to_inputs(d)
            )

    def test_mismatched_shapes(self):
        d = make_data(0, 2, 2)
        d["values_BT"] = d["values_BT"][:, :-1]
        with pytest.raises(ValueError, match="values_BT has shape"):
            compute_advantages("gae", to_inputs(d), AdvantageConfig(group_size=2))
        d = make_data(0, 2, 2)
        d["scores_B"] = d["scores_B"][:-1]
        with pytest.raises(ValueError, match="scores_B has shape"):
            compute_advantages("grpo", to_inputs(d), AdvantageConfig(group_size=2))

    def test_missing_field(self):
        d = make_data(0, 2, 2)
        d["baseline_B"] = None
        with pytest.raises(ValueError, match="'remax' needs AdvantageInputs.baseline_B"):
            compute_advantages(
                "remax",
                AdvantageInputs(**{k: v for k, v in d.items()}),
                AdvantageConfig(group_size=2),
            )

    def test_bad_config(self):
        with pytest.raises(ValueError, match="group_size"):
            AdvantageConfig(group_size=0)
        with pytest.raises(ValueError, match="gamma"):
            AdvantageConfig(gamma=1.5)

    def test_register_duplicate_rejected(self):
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("grpo")(lambda i, c: None)


# Episodes of two lengths: turn 0 stops (reward 0.5) or goes on (0); turn 1 then earns 1 or 0.
# (actions, rewards) of each of the three possible episodes.
TOY_EPISODES = (((0,), (0.5,)), ((1, 0), (0.0, 0.0)), ((1, 1), (0.0, 1.0)))


def _expected_gradient(name, G, logits):
    """The policy gradient of `name`'s advantages, (1/G) Σ_i Σ_t A_{i,t} ∇log π(a_{i,t}), summed
    exactly over every group of G toy episodes with its probability; and the objective's own
    gradient Σ_e P(e) R(e) ∇log P(e)."""
    import itertools

    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)  # [turn, action]

    def grad_logp(t, a):
        g = np.zeros_like(logits)
        g[t] = -p[t]
        g[t, a] += 1.0
        return g

    prob = [np.prod([p[t, a] for t, a in enumerate(acts)]) for acts, _ in TOY_EPISODES]
    true = sum(
        pe * sum(rew) * sum(grad_logp(t, a) for t, a in enumerate(acts))
        for pe, (acts, rew) in zip(prob, TOY_EPISODES, strict=True)
    )
    groups = list(itertools.product(range(len(TOY_EPISODES)), repeat=G))
    B, S = len(groups) * G, 2
    step_r, step_m = np.zeros((B, S), np.float32), np.zeros((B, S), np.float32)
    for i, e in enumerate(np.ravel(groups)):
        acts, rew = TOY_EPISODES[e]
        step_r[i, : len(rew)], step_m[i, : len(acts)] = rew, 1.0
    inputs = AdvantageInputs(
        loss_mask_BT=jnp.asarray(step_m),  # one token per turn
        scores_B=jnp.asarray(step_r.sum(1)),
        step_rewards_BS=jnp.asarray(step_r),
        step_mask_BS=jnp.asarray(step_m),
        token_step_BT=jnp.tile(jnp.arange(S, dtype=jnp.int32), (B, 1)),
    )
    cfg = AdvantageConfig(group_size=G, step_gamma=1.0)
    adv = np.asarray(compute_advantages(name, inputs, cfg)[0], np.float64).reshape(-1, G, S)
    got = np.zeros_like(logits)
    for group, a in zip(groups, adv, strict=True):
        pg = np.prod([prob[e] for e in group])
        for i, e in enumerate(group):
            for t, act in enumerate(TOY_EPISODES[e][0]):
                got += pg * a[i, t] * grad_logp(t, act) / G
    return got, true


@pytest.mark.parametrize("G", [2, 3])
def test_turn_rloo_gradient_is_unbiased_over_episodes_of_different_lengths(G):
    logits = np.array([[0.3, -0.2], [-0.4, 0.5]])
    got, true = _expected_gradient("turn_rloo", G, logits)
    np.testing.assert_allclose(got, true, rtol=1e-5, atol=1e-7)
    # GRPO's group baseline holds the episode's own score: its expectation is off.
    grpo, _ = _expected_gradient("grpo", G, logits)
    assert np.abs(grpo - true).max() > 0.05 * np.abs(true).max()
