"""Policy / value / KL / entropy losses vs NumPy transcriptions, masking, micro-batching, errors."""

import dataclasses
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxrl_tools.algorithms import (
    LOSS_AGG_MODES,
    OffPolicyConfig,
    PolicyLossConfig,
    aggregate,
    entropy_loss,
    kl_loss,
    kl_penalty,
    loss_denominator,
    policy_loss,
    ppo_clip_loss,
    value_loss,
)

RTOL, ATOL = 1e-5, 1e-6
L_MAX = 16

# ------------------------------------------------------------------ NumPy oracles (loops)


def np_agg(L, m, mode, L_max=L_MAX):
    """(loss) of METHODS.md's loss_agg_mode definitions, over non-empty rows."""
    B, T = L.shape
    rows = [b for b in range(B) if m[b].sum() > 0]
    if mode == "token-mean":
        return sum(L[b, t] * m[b, t] for b in range(B) for t in range(T)) / m.sum()
    if mode == "seq-mean-token-mean":
        return sum(sum(L[b] * m[b]) / m[b].sum() for b in rows) / len(rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(L[b] * m[b]) for b in rows) / len(rows)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(L[b] * m[b]) for b in rows) / (len(rows) * L_max)
    raise KeyError(mode)


def np_ppo_tokens(logp, old, A, m, eps_lo, eps_hi, c, ratio_type):
    B, T = logp.shape
    L = np.zeros((B, T))
    ratio = np.zeros((B, T))
    for b in range(B):
        if ratio_type == "sequence":
            n = m[b].sum()
            seq = sum((logp[b, t] - old[b, t]) * m[b, t] for t in range(T)) / max(n, 1)
        for t in range(T):
            lr = seq if ratio_type == "sequence" else logp[b, t] - old[b, t]
            rho = np.exp(min(max(lr, -20.0), 20.0))
            a = A[b, t]
            lc = max(-a * rho, -a * min(max(rho, 1 - eps_lo), 1 + eps_hi))
            if c is not None and a < 0:
                lc = min(-a * c, lc)
            L[b, t], ratio[b, t] = lc, rho
    return L, ratio


def np_kl(logp, ref, kind):
    d = np.clip(ref - logp, -20, 20)
    return {
        "k1": -d,
        "k2": 0.5 * d**2,
        "k3": np.clip(np.exp(d) - d - 1, -10, 10),
        "abs": np.abs(d),
    }[kind]


def np_value_tokens(v, vo, R, eps):
    vc = np.clip(v, vo - eps, vo + eps)
    return 0.5 * np.maximum((v - R) ** 2, (vc - R) ** 2)


def make(seed, B=6, T=10, empty_row=True):
    rng = np.random.default_rng(seed)
    m = (rng.random((B, T)) < 0.6).astype(np.float32)
    m[np.arange(B), rng.integers(0, T, B)] = 1.0
    if empty_row:
        m[-1] = 0.0  # an all-padding row
    old = -np.abs(rng.normal(size=(B, T))).astype(np.float32) - 0.5
    logp = (old + rng.normal(scale=0.4, size=(B, T))).astype(np.float32)
    return dict(
        logp=logp,
        old=old,
        ref=(old + rng.normal(scale=0.3, size=(B, T))).astype(np.float32),
        A=rng.normal(size=(B, T)).astype(np.float32),
        m=m,
        ent=np.abs(rng.normal(size=(B, T))).astype(np.float32),
        v=rng.normal(size=(B, T)).astype(np.float32),
        vo=rng.normal(size=(B, T)).astype(np.float32),
        R=rng.normal(size=(B, T)).astype(np.float32),
    )


PPO_CASES = [
    (f"{mode}_{rt}_{'dual' if c else 'nodual'}", mode, rt, c)
    for mode in LOSS_AGG_MODES
    for rt in ("token", "sequence")
    for c in (None, 3.0)
]


class OracleTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*PPO_CASES)
    def test_ppo_clip(self, mode, ratio_type, c):
        d = make(zlib.crc32(f"{mode}{ratio_type}{c}".encode()) % 997)
        if ratio_type == "sequence":  # GSPO: one advantage per sequence
            d["A"] = np.repeat(d["A"][:, :1], d["A"].shape[1], axis=1)
        f = self.variant(
            lambda lp, o, a, m: ppo_clip_loss(
                lp,
                o,
                a,
                m,
                clip_eps_low=0.2,
                clip_eps_high=0.28,
                dual_clip_c=c,
                ratio_type=ratio_type,
                loss_agg_mode=mode,
                max_len=L_MAX,
            )
        )
        out = f(d["logp"], d["old"], d["A"], d["m"])
        chex.assert_shape([out.total, out.denominator, out.loss], ())
        chex.assert_type([out.total, out.loss], jnp.float32)
        L, ratio = np_ppo_tokens(d["logp"], d["old"], d["A"], d["m"], 0.2, 0.28, c, ratio_type)
        np.testing.assert_allclose(out.loss, np_agg(L, d["m"], mode), rtol=RTOL, atol=ATOL)
        m = d["m"] > 0
        mt = out.metrics
        np.testing.assert_allclose(mt["ratio_mean"], ratio[m].mean(), rtol=RTOL)
        np.testing.assert_allclose(mt["ratio_min"], ratio[m].min(), rtol=RTOL)
        np.testing.assert_allclose(mt["ratio_max"], ratio[m].max(), rtol=RTOL)
        np.testing.assert_allclose(
            mt["approx_kl"], (d["old"] - d["logp"])[m].mean(), rtol=RTOL, atol=ATOL
        )
        A = d["A"]
        np.testing.assert_allclose(
            mt["clipfrac_low"], ((A < 0) & (ratio < 0.8))[m].mean(), atol=ATOL
        )
        np.testing.assert_allclose(
            mt["clipfrac_high"], ((A > 0) & (ratio > 1.28))[m].mean(), atol=ATOL
        )

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*LOSS_AGG_MODES)
    def test_value_loss(self, mode):
        d = make(11)
        out = self.variant(
            lambda v, vo, r, m: value_loss(
                v, vo, r, m, clip_eps=0.2, loss_agg_mode=mode, max_len=L_MAX
            )
        )(d["v"], d["vo"], d["R"], d["m"])
        L = np_value_tokens(d["v"], d["vo"], d["R"], 0.2)
        np.testing.assert_allclose(out.loss, np_agg(L, d["m"], mode), rtol=RTOL, atol=ATOL)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("k1", "k2", "k3", "abs", "low_var_kl", "kl", "mse")
    def test_kl(self, kind):
        d = make(12)
        d["ref"][0, :3] = d["logp"][0, :3] + np.array([30.0, -30.0, 5.0])  # clamps
        got = self.variant(lambda a, b: kl_penalty(a, b, kind))(d["logp"], d["ref"])
        canon = {"low_var_kl": "k3", "kl": "k1", "mse": "k2"}.get(kind, kind)
        np.testing.assert_allclose(got, np_kl(d["logp"], d["ref"], canon), rtol=RTOL, atol=ATOL)
        out = kl_loss(d["logp"], d["ref"], d["m"], kl_type=kind, loss_agg_mode="token-mean")
        np.testing.assert_allclose(
            out.loss, np_agg(np_kl(d["logp"], d["ref"], canon), d["m"], "token-mean"), rtol=RTOL
        )

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*LOSS_AGG_MODES)
    def test_policy_loss_combined(self, mode):
        d = make(13)
        cfg = PolicyLossConfig(
            clip_eps_low=0.2,
            clip_eps_high=0.28,
            dual_clip_c=3.0,
            kl_coef=0.01,
            kl_type="k3",
            entropy_coef=0.005,
            loss_agg_mode=mode,
            max_len=L_MAX,
        )
        out = self.variant(lambda *a: policy_loss(cfg, *a[:4], ref_logp_BT=a[4], entropy_BT=a[5]))(
            d["logp"], d["old"], d["A"], d["m"], d["ref"], d["ent"]
        )
        L, _ = np_ppo_tokens(d["logp"], d["old"], d["A"], d["m"], 0.2, 0.28, 3.0, "token")
        L = L + 0.01 * np_kl(d["logp"], d["ref"], "k3") - 0.005 * d["ent"]
        np.testing.assert_allclose(out.loss, np_agg(L, d["m"], mode), rtol=RTOL, atol=ATOL)
        for k in (
            "pg_loss",
            "kl",
            "entropy",
            "clipfrac_low",
            "clipfrac_high",
            "dual_clipfrac",
            "approx_kl",
            "ratio_mean",
            "ratio_min",
            "ratio_max",
        ):
            assert k in out.metrics, k

    def test_entropy_loss(self):
        d = make(14)
        out = entropy_loss(d["ent"], d["m"], loss_agg_mode="seq-mean-token-mean")
        np.testing.assert_allclose(
            out.loss, np_agg(d["ent"], d["m"], "seq-mean-token-mean"), rtol=RTOL
        )

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*LOSS_AGG_MODES)
    def test_truncated_importance_weights(self, mode):
        """TIS (`algorithm.tis_cap` C, a token weight capped at C): each token's clip loss times
        min(π_old / π_behaviour, C); no gradient through the weight; weights of exactly 1 when
        the behaviour policy is the old one."""
        d = make(15)
        behaviour = d["old"] + np.random.default_rng(3).normal(scale=0.7, size=d["old"].shape)
        behaviour = behaviour.astype(np.float32)
        tis = OffPolicyConfig(weight="token", cap=2.0)
        cfg = PolicyLossConfig(loss_agg_mode=mode, max_len=L_MAX, off_policy=tis)
        f = self.variant(lambda lp, o, a, m, b: policy_loss(cfg, lp, o, a, m, behaviour_logp_BT=b))
        out = f(d["logp"], d["old"], d["A"], d["m"], behaviour)
        L, _ = np_ppo_tokens(d["logp"], d["old"], d["A"], d["m"], 0.2, 0.28, 3.0, "token")
        w = np.minimum(np.exp(d["old"] - behaviour), 2.0)
        np.testing.assert_allclose(out.loss, np_agg(w * L, d["m"], mode), rtol=RTOL, atol=ATOL)
        keep = d["m"] > 0
        ratio = np.exp(d["old"] - behaviour)[keep]
        truncated = out.metrics["off_policy/truncated_frac"]
        assert 0 < float(truncated) < 1  # the cap was reached, not always
        np.testing.assert_allclose(truncated, np.mean(ratio > 2.0))
        np.testing.assert_allclose(
            out.metrics["off_policy/is_weight_mean"], np.minimum(ratio, 2.0).mean(), rtol=RTOL
        )
        np.testing.assert_allclose(out.metrics["off_policy/ratio_max"], ratio.max(), rtol=RTOL)
        # Staleness 0 (behaviour = old): weights 1, and the loss of the plain objective.
        same = f(d["logp"], d["old"], d["A"], d["m"], d["old"])
        plain = policy_loss(
            dataclasses.replace(cfg, off_policy=OffPolicyConfig()),
            *[d[k] for k in "logp old A m".split()],
        )
        np.testing.assert_allclose(same.loss, plain.loss, rtol=RTOL, atol=ATOL)
        assert float(same.metrics["off_policy/is_weight_mean"]) == 1
        assert float(same.metrics["off_policy/ratio_max"]) == 1
        # The weight is a constant of the gradient: d loss / d logp = w * (plain gradient).
        grad = lambda c, b: jax.grad(
            lambda lp: policy_loss(c, lp, d["old"], d["A"], d["m"], behaviour_logp_BT=b).loss
        )(jnp.asarray(d["logp"]))
        g_plain = grad(dataclasses.replace(cfg, off_policy=OffPolicyConfig()), None)
        np.testing.assert_allclose(grad(cfg, behaviour), w * g_plain, rtol=1e-5, atol=1e-7)
        with pytest.raises(ValueError, match="off_policy needs behaviour_logp_BT"):
            policy_loss(cfg, d["logp"], d["old"], d["A"], d["m"])


def _full_policy_loss(cfg, d, denominator=None, sl=slice(None)):
    return policy_loss(
        cfg,
        d["logp"][sl],
        d["old"][sl],
        d["A"][sl],
        d["m"][sl],
        ref_logp_BT=d["ref"][sl],
        entropy_BT=d["ent"][sl],
        denominator=denominator,
    )


class GradientTest(chex.TestCase):
    @parameterized.parameters(
        *[(mode, rt) for mode in LOSS_AGG_MODES for rt in ("token", "sequence")]
    )
    def test_grad_zero_at_masked_positions(self, mode, ratio_type):
        d = {k: jnp.asarray(v) for k, v in make(21).items()}
        cfg = PolicyLossConfig(
            kl_coef=0.1, entropy_coef=0.01, loss_agg_mode=mode, max_len=L_MAX, ratio_type=ratio_type
        )

        def f(logp, ent, v):
            pl = policy_loss(
                cfg, logp, d["old"], d["A"], d["m"], ref_logp_BT=d["ref"], entropy_BT=ent
            ).loss
            vl = value_loss(v, d["vo"], d["R"], d["m"], loss_agg_mode=mode, max_len=L_MAX).loss
            return pl + vl

        grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(d["logp"], d["ent"], d["v"])
        masked = np.asarray(d["m"]) == 0
        for g in grads:
            assert np.all(np.asarray(g)[masked] == 0.0)
            assert np.any(np.asarray(g)[~masked] != 0.0)

    @parameterized.parameters(*LOSS_AGG_MODES)
    def test_microbatch_accumulation_equals_full_batch(self, mode):
        d = {k: jnp.asarray(v) for k, v in make(22, B=6).items()}
        cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01, loss_agg_mode=mode, max_len=L_MAX)

        @jax.jit
        def full(logp):
            return _full_policy_loss(cfg, dict(d, logp=logp)).loss

        @jax.jit
        def micro(logp_mb, mb, denom):  # the trainer's view: only the micro-batch's arrays
            return policy_loss(
                cfg,
                logp_mb,
                mb["old"],
                mb["A"],
                mb["m"],
                ref_logp_BT=mb["ref"],
                entropy_BT=mb["ent"],
                denominator=denom,
            ).loss

        full_l, full_g = jax.value_and_grad(full)(d["logp"])
        D = loss_denominator(d["m"], mode, L_MAX)
        acc_l, acc_g = 0.0, []
        for a, b in ((0, 2), (2, 4), (4, 6)):
            mb = {k: v[a:b] for k, v in d.items()}
            li, gi = jax.value_and_grad(micro)(mb["logp"], mb, D)
            acc_l, acc_g = acc_l + li, acc_g + [gi]
        np.testing.assert_allclose(acc_l, full_l, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(jnp.concatenate(acc_g), full_g, rtol=1e-5, atol=1e-8)
        # the other way: accumulate (total, local denominator) and divide once
        totals = [_full_policy_loss(cfg, d, None, sl) for sl in (slice(0, 4), slice(4, 6))]
        np.testing.assert_allclose(
            sum(t.total for t in totals) / sum(t.denominator for t in totals), full_l, rtol=1e-5
        )

    @parameterized.parameters(*LOSS_AGG_MODES)
    def test_value_loss_microbatch(self, mode):
        d = {k: jnp.asarray(v) for k, v in make(23).items()}

        def loss(v, sl, denom):
            return value_loss(
                v[sl],
                d["vo"][sl],
                d["R"][sl],
                d["m"][sl],
                loss_agg_mode=mode,
                max_len=L_MAX,
                denominator=denom,
            ).loss

        full_l, full_g = jax.value_and_grad(loss)(d["v"], slice(None), None)
        D = loss_denominator(d["m"], mode, L_MAX)
        parts = [jax.value_and_grad(loss)(d["v"], sl, D) for sl in (slice(0, 3), slice(3, 6))]
        np.testing.assert_allclose(sum(p[0] for p in parts), full_l, rtol=1e-5)
        np.testing.assert_allclose(sum(p[1] for p in parts), full_g, rtol=1e-5, atol=1e-8)

    def test_gspo_gradient_is_sequence_level(self):
        """GSPO-token with seq-mean-token-mean == grad of mean_i max(-A_i s_i, -A_i clip(s_i))."""
        d = {k: jnp.asarray(v) for k, v in make(24, empty_row=False).items()}
        A_B = d["A"][:, 0]
        A = jnp.repeat(A_B[:, None], d["A"].shape[1], axis=1)

        def token_version(logp):
            return ppo_clip_loss(
                logp,
                d["old"],
                A,
                d["m"],
                clip_eps_low=3e-2,
                clip_eps_high=4e-2,
                ratio_type="sequence",
                loss_agg_mode="seq-mean-token-mean",
            ).loss

        def seq_version(logp):
            m = d["m"]
            s = jnp.exp(jnp.sum((logp - d["old"]) * m, 1) / jnp.sum(m, 1))
            return jnp.mean(jnp.maximum(-A_B * s, -A_B * jnp.clip(s, 1 - 3e-2, 1 + 4e-2)))

        np.testing.assert_allclose(token_version(d["logp"]), seq_version(d["logp"]), rtol=1e-5)
        np.testing.assert_allclose(
            jax.grad(token_version)(d["logp"]),
            jax.grad(seq_version)(d["logp"]),
            rtol=1e-4,
            atol=1e-7,
        )


class ErrorTest(chex.TestCase):
    def test_dual_clip_c_must_exceed_one(self):
        d = make(0)
        for c in (1.0, 0.5):
            with pytest.raises(ValueError, match="must be > 1"):
                PolicyLossConfig(dual_clip_c=c)
            with pytest.raises(ValueError, match="must be > 1"):
                jax.jit(lambda a, b, e, m, c=c: ppo_clip_loss(a, b, e, m, dual_clip_c=c))(
                    d["logp"], d["old"], d["A"], d["m"]
                )

    def test_mismatched_shapes(self):
        d = make(0)
        with pytest.raises(ValueError, match="ppo_clip_loss: advantages_BT has shape"):
            jax.jit(ppo_clip_loss)(d["logp"], d["old"], d["A"][:, :-1], d["m"])
        with pytest.raises(ValueError, match="value_loss: old_values_BT has shape"):
            value_loss(d["v"], d["vo"][:-1], d["R"], d["m"])

    def test_bad_config_names(self):
        with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'.*token-mean"):
            PolicyLossConfig(loss_agg_mode="mean")
        with pytest.raises(ValueError, match="needs max_len"):
            PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm")
        with pytest.raises(ValueError, match="unknown kl_type 'k4'"):
            PolicyLossConfig(kl_type="k4")
        with pytest.raises(ValueError, match="ratio_type"):
            PolicyLossConfig(ratio_type="seq")

    def test_missing_inputs(self):
        d = make(0)
        cfg = dataclasses.replace(PolicyLossConfig(), kl_coef=0.1)
        with pytest.raises(ValueError, match="needs ref_logp_BT"):
            policy_loss(cfg, d["logp"], d["old"], d["A"], d["m"])

    def test_aggregate_empty_batch_is_zero(self):
        L = jnp.ones((2, 3))
        total, denom = aggregate(L, jnp.zeros((2, 3)), "token-mean")
        assert float(total) == 0.0 and float(denom) == 0.0


def np_vapo_nll(logp, m, correct):
    """VAPO (2504.05118) eq. 11: -(1 / sum_{o_i in T} |o_i|) sum_{o_i in T} sum_t log pi, T the
    correct responses; a loop transcription."""
    num = den = 0.0
    for b in range(logp.shape[0]):
        if correct[b]:
            for t in range(logp.shape[1]):
                num -= logp[b, t] * m[b, t]
                den += m[b, t]
    return num / den


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_vapo_nll_is_a_token_mean_over_correct_responses(mode):
    """The NLL term divides by the correct responses' tokens in the whole mini-batch (not by all
    its tokens), and micro-batches add up to it."""
    from jaxrl_tools.train import objectives  # noqa: PLC0415

    d = make(31, B=6)
    correct = np.asarray([1, 0, 0, 1, 1, 0], np.float32)  # token counts differ from the total
    cfg = PolicyLossConfig(loss_agg_mode=mode, max_len=L_MAX)
    mb = {"loss_mask": jnp.asarray(d["m"]), "correct": jnp.asarray(correct),
          "advantages": jnp.asarray(d["A"]), "old_logp": jnp.asarray(d["old"])}  # fmt: skip
    logp, ent = jnp.asarray(d["logp"]), jnp.asarray(d["ent"])

    def loss(coef, mb, denom):
        return objectives.actor_objective(
            cfg, coef, logp[mb["rows"]], ent[mb["rows"]], mb, denom[0], nll_denom=denom[1]
        )[0]

    whole = {k: v[None] for k, v in mb.items()}
    denom = objectives.actor_denominator(cfg, whole)
    assert float(denom[1]) == float((d["m"] * correct[:, None]).sum())
    full = dict(mb, rows=np.arange(6))
    nll = (loss(0.1, full, denom) - loss(0.0, full, denom)) / 0.1
    np.testing.assert_allclose(nll, np_vapo_nll(d["logp"], d["m"], correct), rtol=1e-5)
    parts = [{k: v[a:b] for k, v in full.items()} for a, b in ((0, 2), (2, 4), (4, 6))]
    summed = sum(loss(0.1, p, denom) - loss(0.0, p, denom) for p in parts) / 0.1
    np.testing.assert_allclose(summed, nll, rtol=1e-5)
