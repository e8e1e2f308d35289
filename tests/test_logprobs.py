"""Token log-probs / entropy: NumPy oracle, chunked == plain (values, grads), memory bound."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxrl_tools.algorithms import (
    chunked_token_logprobs,
    chunked_token_logprobs_and_entropy,
    target_logprobs,
    token_entropy,
)


def np_logp_entropy(logits, targets, temperature=1.0):
    z = logits.astype(np.float64) / temperature
    B, T, _ = z.shape
    logp, ent = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            zz = z[b, t]
            lse = zz.max() + np.log(np.sum(np.exp(zz - zz.max())))
            p = np.exp(zz - lse)
            logp[b, t] = zz[targets[b, t]] - lse
            ent[b, t] = lse - np.sum(p * zz)
    return logp, ent


def make(seed, B=2, T=13, D=8, V=37):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(B, T, D)).astype(np.float32)
    W = rng.normal(size=(D, V)).astype(np.float32)
    tgt = rng.integers(0, V, (B, T)).astype(np.int32)
    m = (rng.random((B, T)) < 0.7).astype(np.float32)
    return h, W, tgt, m


class LogprobTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(1.0, 0.7)
    def test_plain_matches_numpy(self, temperature):
        h, W, tgt, m = make(0)
        logits = h @ W
        logp = self.variant(lambda *a: target_logprobs(*a, temperature=temperature))(logits, tgt, m)
        ent = self.variant(lambda *a: token_entropy(*a, temperature=temperature))(logits, m)
        chex.assert_shape([logp, ent], tgt.shape)
        chex.assert_type([logp, ent], jnp.float32)
        want_lp, want_ent = np_logp_entropy(logits, tgt, temperature)
        np.testing.assert_allclose(logp, want_lp * m, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ent, want_ent * m, rtol=1e-5, atol=1e-5)
        assert np.all(np.asarray(logp)[m == 0] == 0) and np.all(np.asarray(ent)[m == 0] == 0)

    def test_bf16_logits_computed_in_float32(self):
        h, W, tgt, m = make(1)
        logits = jnp.asarray(h @ W, jnp.bfloat16)
        logp = target_logprobs(logits, tgt, m)
        chex.assert_type(logp, jnp.float32)
        want, _ = np_logp_entropy(np.asarray(logits.astype(jnp.float32)), tgt)
        np.testing.assert_allclose(logp, want * m, rtol=1e-5, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(5, 64)
    def test_chunked_equals_plain_values_and_grads(self, chunk):
        h, W, tgt, m = make(2)
        ch = jax.random.normal(jax.random.PRNGKey(0), tgt.shape)  # random cotangents

        def plain(h, W):
            lg = jnp.einsum("btd,dv->btv", h, W)
            return target_logprobs(lg, tgt, m), token_entropy(lg, m)

        def chunked(h, W):
            return chunked_token_logprobs_and_entropy(h, W, tgt, m, chunk_size=chunk)

        def scalar(fn):
            def f(h, W):
                lp, en = fn(h, W)
                return jnp.sum(lp * ch) + 0.3 * jnp.sum(en * ch)

            return f

        lp, en = self.variant(chunked)(h, W)
        lp0, en0 = jax.jit(plain)(h, W)
        chex.assert_shape([lp, en], tgt.shape)
        chex.assert_type([lp, en], jnp.float32)
        np.testing.assert_allclose(lp, lp0, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(en, en0, rtol=1e-5, atol=1e-5)
        g = self.variant(jax.grad(scalar(chunked), argnums=(0, 1)))(h, W)
        g0 = jax.jit(jax.grad(scalar(plain), argnums=(0, 1)))(h, W)
        chex.assert_trees_all_close(g, g0, rtol=1e-5, atol=1e-5)
        # a masked position's hidden state gets exactly zero gradient
        assert np.all(np.asarray(g[0])[m == 0] == 0)
        np.testing.assert_allclose(
            jax.jit(chunked_token_logprobs, static_argnames="chunk_size")(
                h, W, tgt, m, chunk_size=chunk
            ),
            lp,
        )

    def test_chunked_memory_bound(self):
        """value_and_grad of the chunked version needs < 1/4 of the plain one's temp memory."""
        B, T, D, V = 1, 2048, 64, 32768
        h = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
        W = jax.ShapeDtypeStruct((D, V), jnp.float32)
        tgt = jax.ShapeDtypeStruct((B, T), jnp.int32)
        m = jax.ShapeDtypeStruct((B, T), jnp.float32)

        def plain(h, W, tgt, m):
            lg = jnp.einsum("btd,dv->btv", h, W)
            return jnp.sum(target_logprobs(lg, tgt, m) + 0.1 * token_entropy(lg, m))

        def chunked(h, W, tgt, m):
            lp, en = chunked_token_logprobs_and_entropy(h, W, tgt, m, chunk_size=256)
            return jnp.sum(lp + 0.1 * en)

        def temp_bytes(fn):  # compile only: never run the big shapes on shared CPUs
            c = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(h, W, tgt, m).compile()
            return c.memory_analysis().temp_size_in_bytes

        full, chunk = temp_bytes(plain), temp_bytes(chunked)
        logits_bytes = B * T * V * 4
        assert full >= logits_bytes  # the plain one holds at least one [B, T, V] float32
        assert chunk < full / 4, (chunk, full)
        # and it is bounded by a few [B, chunk, V] blocks, independent of T
        assert chunk < 8 * B * 256 * V * 4, (chunk, logits_bytes)

    def test_bad_shapes(self):
        h, W, tgt, m = make(3)
        with pytest.raises(ValueError, match="W_DV has shape"):
            chunked_token_logprobs(h, W[:-1], tgt, m)
        with pytest.raises(ValueError, match="targets_BT has shape"):
            target_logprobs(h @ W, tgt[:, :-1], m)
        with pytest.raises(ValueError, match="loss_mask_BT has shape"):
            chunked_token_logprobs(h, W, tgt, m[:1])
        with pytest.raises(ValueError, match="targets_BT has dtype float32"):
            target_logprobs(h @ W, tgt.astype(np.float32), m)
