"""Off-policy corrections (`algorithms.off_policy`) against a NumPy transcription of their
formulas, and their drift figures on a bf16 copy of a policy against the float32 one."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import tiny_model_config

from jaxrl_tools import models
from jaxrl_tools.algorithms.off_policy import OffPolicyConfig, decoupled, off_policy_weights
from jaxrl_tools.train import policy


def _oracle(cfg: OffPolicyConfig, old, behaviour, mask, segments):
    """The module docstring's formulas, token by token, in float64."""
    w = np.ones(old.shape)
    seqs = {}
    for b, t in zip(*np.nonzero(mask)):
        seqs.setdefault((b, segments[b, t]), []).append(t)
    for (b, _), ts in seqs.items():
        log_r = np.clip(old[b, ts] - behaviour[b, ts], -20, 20)
        level = {
            "token": log_r,
            "sequence": np.full(len(ts), np.clip(log_r.sum(), -20, 20)),
            "geometric": np.full(len(ts), log_r.mean()),
        }
        weight = np.exp(level[cfg.weight]) if cfg.weight else np.ones(len(ts))
        if cfg.cap is not None:
            weight = np.minimum(weight, cfg.cap)
        if cfg.mask:
            r = np.exp(level[cfg.mask])
            weight = weight * ((r >= cfg.low) & (r <= cfg.high))
        w[b, ts] = weight
    return w


def _batch(seed=0, packed=False):
    rng = np.random.default_rng(seed)
    B, T = 3, 9
    old = rng.normal(-2.0, 0.5, (B, T))
    behaviour = old + rng.normal(0.0, 0.4, (B, T))  # ratios ~ e^(+-0.4) a token
    mask = (rng.random((B, T)) < 0.8).astype(np.float32)
    mask[2, :] = 0.0
    mask[2, 3] = 1.0  # a one-token sequence
    segments = np.ones((B, T), np.int32)
    if packed:
        segments[:, 5:] = 2  # two sequences a row
    return old, behaviour, mask, segments


CASES = {
    "tis token": OffPolicyConfig(weight="token", cap=2.0),
    "tis sequence": OffPolicyConfig(weight="sequence", cap=2.0),
    "is sequence uncapped": OffPolicyConfig(weight="sequence"),
    "icepop token mask": OffPolicyConfig(mask="token", low=0.8, high=1.25),
    "mis sequence mask": OffPolicyConfig(mask="sequence", low=0.5, high=2.0),
    "geometric mask + tis": OffPolicyConfig(
        weight="token", cap=2.0, mask="geometric", low=0.9, high=1.1
    ),  # fmt: skip
    "decoupled": decoupled(1.3),
}


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_weights_equal_the_numpy_transcription(case, packed):
    cfg = CASES[case]
    old, behaviour, mask, segments = _batch(packed=packed)
    w, metrics = off_policy_weights(
        cfg, jnp.asarray(old, jnp.float32), jnp.asarray(behaviour, jnp.float32),
        jnp.asarray(mask), jnp.asarray(segments) if packed else None,
    )  # fmt: skip
    expected = _oracle(cfg, old, behaviour, mask, segments)
    np.testing.assert_allclose(np.asarray(w), expected, rtol=1e-5, atol=1e-6)
    m = mask > 0
    log_r = (old - behaviour)[m]
    assert float(metrics["logp_diff_mean"]) == pytest.approx(np.abs(log_r).mean(), rel=1e-5)
    assert float(metrics["logp_diff_max"]) == pytest.approx(np.abs(log_r).max(), rel=1e-5)
    k3 = np.exp(log_r) - 1 - log_r
    assert float(metrics["kl_behaviour"]) == pytest.approx(k3.mean(), rel=1e-4)
    assert float(metrics["masked_token_frac"]) == pytest.approx((expected[m] == 0).mean())
    if cfg.mask is None:
        assert (
            float(metrics["masked_token_frac"]) == 0.0 and float(metrics["masked_seq_frac"]) == 0.0
        )


def test_each_correction_acts_where_it_should():
    old, behaviour, mask, segments = _batch()
    args = [jnp.asarray(x, jnp.float32) for x in (old, behaviour, mask)]
    w, m = off_policy_weights(OffPolicyConfig(weight="token", cap=1.2), *args)
    assert 0 < float(m["truncated_frac"]) < 1 and float(jnp.max(w)) == pytest.approx(1.2)
    w, m = off_policy_weights(CASES["icepop token mask"], *args)
    assert 0 < float(m["masked_token_frac"]) < 1 and 0 < float(m["masked_seq_frac"]) <= 1
    w, m = off_policy_weights(CASES["mis sequence mask"], *args)  # whole sequences or none
    for b in range(3):
        kept = np.asarray(w)[b][mask[b] > 0]
        assert (kept == 0).all() or (kept == 1).all()
    same = off_policy_weights(CASES["decoupled"], args[0], args[0], args[2])
    np.testing.assert_array_equal(np.asarray(same[0]), 1.0)  # on-policy: nothing changes
    assert float(same[1]["kl_behaviour"]) == 0.0 and float(same[1]["logp_diff_max"]) == 0.0


def test_a_correction_that_makes_no_sense_is_refused():
    for bad, match in (
        (dict(weight="row"), "weight 'row'"),
        (dict(mask="tokens"), "mask 'tokens'"),
        (dict(cap=2.0), "cap 2.0 needs a weight level"),
        (dict(weight="token", cap=0.0), "must be > 0"),
        (dict(mask="token", low=1.2, high=2.0), "need 0 <= low < 1 < high"),
        (dict(mask="token", low=0.5, high=1.0), "need 0 <= low < 1 < high"),
    ):
        with pytest.raises(ValueError, match=match):
            OffPolicyConfig(**bad)
    assert not OffPolicyConfig().active and decoupled(2.0).active
    assert decoupled(2.0).high == 2.0 and math.isinf(OffPolicyConfig().high)


def test_tis_cap_is_the_capped_token_weight_and_each_correction_reads_in_one_phrase():
    from jaxrl_tools.config import AlgorithmSection

    tis = AlgorithmSection(tis_cap=2.0).correction()
    assert tis == OffPolicyConfig(weight="token", cap=2.0)
    assert tis.describe() == "token weight (cap 2)"
    assert decoupled(2.0).describe() == "token weight, token mask [0, 2]"
    assert AlgorithmSection().correction().describe() == "none"
    assert not AlgorithmSection().corrects_off_policy


def test_a_bf16_engine_copy_against_the_float32_trainer_moves_the_drift_and_the_masks_respond():
    """The same weights, sampled by a bfloat16 copy (as an engine serving bf16 does) and scored
    by the float32 trainer: no staleness, yet the ratios move off 1 and a tight mask drops
    tokens."""
    cfg = tiny_model_config()
    params = models.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    B, T = 4, 24
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (B, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    attention = jnp.ones((B, T), jnp.int32)
    mask = jnp.asarray(np.arange(T) >= 8, jnp.float32)[None].repeat(B, 0)

    def logp(p):
        return policy.token_logprobs(cfg, p, tokens, positions, attention, mask)[0]

    train = logp(params)
    engine = logp(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)).astype(jnp.float32)
    _, exact = off_policy_weights(CASES["icepop token mask"], train, train, mask)
    _, bf16 = off_policy_weights(OffPolicyConfig(mask="token", low=0.9999, high=1.0001), train,
                                 engine, mask)  # fmt: skip
    assert float(exact["logp_diff_max"]) == 0.0 and float(exact["masked_token_frac"]) == 0.0
    assert float(bf16["logp_diff_max"]) > 1e-4 and float(bf16["kl_behaviour"]) > 0.0
    assert float(bf16["masked_token_frac"]) > 0.0


def test_an_asynchronous_run_with_decoupled_ppo_logs_the_drift_of_its_stale_batches(tmp_path):
    """One-step asynchronous rollouts (tests/test_async_rollouts.py) corrected by AReaL's
    decoupled weights: step 1's batch is on-policy (no drift), steps 2 and 3 are one update stale."""
    import json

    from fakes import tiny_run_config

    from jaxrl_tools import run
    from jaxrl_tools.config_loader import config_from_dict

    cfg = config_from_dict(
        tiny_run_config(
            tmp_path,
            "decoupled",
            "test_async_rollouts:text_reward",
            rollout={"protocol": "none", "max_response_len": 16},
            algorithm={"off_policy": {"weight": "token", "mask": "token", "high": 2.0}},
            trainer={"steps": 3, "checkpoint_every": 0, "max_staleness": 1},
        )
    )
    run.train(cfg)
    lines = (tmp_path / "decoupled" / "logs" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["async/staleness_max"] for r in records] == [0, 1, 1]
    assert records[0]["actor/off_policy/logp_diff_max"] < 1e-4
    for r in records[1:]:
        assert r["actor/off_policy/logp_diff_max"] > 1e-3 and r["actor/off_policy/kl_behaviour"] > 0
        assert 0 <= r["actor/off_policy/masked_token_frac"] < 1
