"""Sampling: greedy, temperature statistics (chi-square), top-k / top-p exclusion, log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_tools.engine.sampling import (
    MODES,
    SamplingParams,
    argmax_first,
    draw_categorical,
    filter_logits,
    sample_tokens,
    split_keys,
    widest_mode,
)

V = 8


def _keys(n, seed=0):
    return jax.random.split(jax.random.PRNGKey(seed), n)


def _draw(logits_V, n, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    logits_BV = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, V))
    fn = jax.jit(sample_tokens, static_argnames="mode")
    return fn(
        logits_BV,
        _keys(n, seed),
        jnp.full((n,), temperature, jnp.float32),
        jnp.full((n,), top_k, jnp.int32),
        jnp.full((n,), top_p, jnp.float32),
        mode=SamplingParams(temperature, top_k, top_p).mode,
    )


LOGITS = np.array([1.5, 0.2, -0.7, 0.9, 2.1, -1.3, 0.0, 0.6], np.float32)


def test_greedy_is_argmax_and_logprob():
    tok, lp = _draw(LOGITS, 4, temperature=0.0)
    assert np.all(np.asarray(tok) == int(np.argmax(LOGITS)))
    ref = jax.nn.log_softmax(LOGITS)[np.argmax(LOGITS)]
    np.testing.assert_allclose(np.asarray(lp), ref, rtol=1e-6)


def test_greedy_mode_equals_greedy_rows_of_the_other_modes():
    """The argmax-only step ("greedy", every slot greedy) gives what the sampling steps give
    their greedy rows, bit for bit; `argmax_first` is `jnp.argmax`, ties included."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 300)).astype(np.float32)
    logits[1, [5, 40, 299]] = logits[1].max() + 1  # a tie: the first one wins
    logits[2, -1] = logits[2].max() + 1  # the last entry
    args = (jnp.zeros(6), jnp.zeros(6, jnp.int32), jnp.ones(6))
    outs = [sample_tokens(logits, _keys(6), *args, mode=m) for m in MODES]
    for tok, lp in outs[1:]:
        np.testing.assert_array_equal(tok, outs[0][0])
        np.testing.assert_array_equal(lp, outs[0][1])
    np.testing.assert_array_equal(outs[0][0], np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(argmax_first(jnp.asarray(logits)), np.argmax(logits, axis=-1))
    assert widest_mode(["greedy", "filter", "sample"]) == "filter" and widest_mode([]) == "greedy"


def test_temperature_one_matches_softmax_chi_square():
    n = 20000
    tok, lp = _draw(LOGITS, n, temperature=1.0, seed=1)
    counts = np.bincount(np.asarray(tok), minlength=V)
    p = np.asarray(jax.nn.softmax(LOGITS))
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    # 7 degrees of freedom: the 0.999 quantile is 24.3.
    assert chi2 < 24.3, (chi2, counts, n * p)
    np.testing.assert_allclose(np.asarray(lp), np.log(p)[np.asarray(tok)], rtol=1e-5)


def test_temperature_scales_distribution():
    n = 20000
    tok, lp = _draw(LOGITS, n, temperature=0.5, seed=2)
    counts = np.bincount(np.asarray(tok), minlength=V)
    p = np.asarray(jax.nn.softmax(LOGITS / 0.5))
    mask = n * p > 5
    chi2 = float(((counts[mask] - n * p[mask]) ** 2 / (n * p[mask])).sum())
    assert chi2 < 24.3
    np.testing.assert_allclose(np.asarray(lp), np.log(p)[np.asarray(tok)], rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_top_k_never_emits_excluded(k):
    tok, lp = _draw(LOGITS, 4000, temperature=2.0, top_k=k, seed=3)
    allowed = set(np.argsort(-LOGITS)[:k].tolist())
    assert set(np.asarray(tok).tolist()) <= allowed
    assert len(set(np.asarray(tok).tolist())) == k
    # log-probs are those of the renormalised top-k distribution
    z = LOGITS / 2.0
    idx = sorted(allowed)
    ref = jax.nn.log_softmax(z[idx])
    ref_map = dict(zip(idx, np.asarray(ref)))
    np.testing.assert_allclose(np.asarray(lp), [ref_map[t] for t in np.asarray(tok)], rtol=1e-5)


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_top_p_never_emits_excluded(p):
    tok, _ = _draw(LOGITS, 4000, temperature=1.0, top_p=p, seed=4)
    probs = np.asarray(jax.nn.softmax(LOGITS))
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    allowed = set(order[before < p].tolist())
    got = set(np.asarray(tok).tolist())
    assert got <= allowed
    assert got == allowed  # 4000 draws see every kept token


def test_top_k_and_top_p_combined_and_per_row():
    logits_BV = jnp.broadcast_to(jnp.asarray(LOGITS), (3, V))
    out = filter_logits(
        logits_BV, jnp.array([0, 2, 5], jnp.int32), jnp.array([1.0, 1.0, 0.5], jnp.float32)
    )
    kept = np.asarray(out) > -1e29
    assert kept[0].all()
    assert kept[1].sum() == 2
    probs5 = np.sort(np.asarray(jax.nn.softmax(np.sort(LOGITS)[::-1][:5])))[::-1]
    assert kept[2].sum() == int((np.cumsum(probs5) - probs5 < 0.5).sum())


def test_per_slot_keys_are_independent_and_reproducible():
    logits_BV = jnp.zeros((4, V))
    keys = jnp.stack([jax.random.PRNGKey(7)] * 2 + [jax.random.PRNGKey(8)] * 2)
    args = (jnp.ones(4), jnp.zeros(4, jnp.int32), jnp.ones(4))
    toks = []
    for _ in range(10):
        keys, use = split_keys(keys)
        t, _ = sample_tokens(logits_BV, use, *args, mode="sample")
        toks.append(np.asarray(t))
    toks = np.stack(toks)
    np.testing.assert_array_equal(toks[:, 0], toks[:, 1])
    np.testing.assert_array_equal(toks[:, 2], toks[:, 3])
    assert not np.array_equal(toks[:, 0], toks[:, 2])


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=5).needs_filter


def test_draw_categorical_skips_zero_probability_tokens():
    """The CDF inversion never lands on a token of probability 0, wherever it sits (first, in
    the middle, last), and a one-hot row always gives its token."""
    n = 4000
    p = np.array([0.0, 0.3, 0.0, 0.5, 0.2, 0.0, 0.0, 0.0], np.float32)
    logp = jnp.broadcast_to(jnp.log(jnp.asarray(p)), (n, V))
    tokens = np.asarray(jax.jit(draw_categorical)(_keys(n), logp))
    assert set(tokens.tolist()) == {1, 3, 4}
    freq = np.bincount(tokens, minlength=V) / n
    np.testing.assert_allclose(freq, p, atol=0.03)
    one_hot = jnp.broadcast_to(jnp.log(jnp.eye(V)[7]), (n, V))
    assert (np.asarray(draw_categorical(_keys(n, 1), one_hot)) == 7).all()
