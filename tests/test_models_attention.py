"""models.attention: the chunked (online-softmax) path equals the dense one, value and gradient;
the model with chunked attention equals the model with dense attention; "auto" keeps fp32 CPU
on the dense path; the GPU/TPU kernels equal dense where such a device is present."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_tools import models as M
from jaxrl_tools.models import attention as A

TOL = 1e-5


@pytest.fixture(autouse=True)
def _float32_matmuls():
    # The float32 comparisons are of the algorithms in float32: on a GPU, XLA's default matmul
    # precision is TF32 (a 10-bit mantissa), which moves either path by ~1e-3.
    with jax.default_matmul_precision("highest"):
        yield


def _inputs(B, T, S, H, K, Dh, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, Dh)).astype(np.float32)
    k = rng.normal(size=(B, S, K, Dh)).astype(np.float32)
    v = rng.normal(size=(B, S, K, Dh)).astype(np.float32)
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _self_mask(lengths, T, left):
    """Causal self-attention over rows padded on the left or the right."""
    pos = np.arange(T)[None]
    n = np.asarray(lengths)[:, None]
    valid = pos >= T - n if left else pos < n
    return jnp.asarray(np.broadcast_to(pos, valid.shape), jnp.int32), jnp.asarray(valid)


def _rows_with_keys(q_pos, valid, window=None):
    """[B, T] True where a query is allowed at least one key (the rows that mean something)."""
    S = valid.shape[1]
    ok = (np.arange(S)[None, None] <= np.asarray(q_pos)[:, :, None]) & np.asarray(valid)[:, None]
    if window is not None:
        ok &= np.asarray(q_pos)[:, :, None] - np.arange(S)[None, None] < window
    return ok.any(-1)


CASES = {
    # name: (B, T, S, H, K, Dh, lengths, left, window, chunk)
    "right-padded-gqa-4:2": (3, 37, 37, 4, 2, 8, (37, 20, 5), False, None, 8),
    "left-padded-gqa-4:1-sliding-window-9": (2, 40, 40, 4, 1, 8, (40, 13), True, 9, 16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_equals_dense_value_and_gradient(name):
    B, T, S, H, K, Dh, lengths, left, window, chunk = CASES[name]
    q, k, v = _inputs(B, T, S, H, K, Dh)
    q_pos, valid = _self_mask(lengths, T, left)
    rows = jnp.asarray(_rows_with_keys(q_pos, valid, window), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, H, Dh)), jnp.float32)

    def run(impl, q, k, v):
        return A.attention(q, k, v, q_pos, valid, impl=impl, window=window, chunk=chunk)

    def loss(impl, q, k, v):  # padding queries carry no cotangent, as in the model
        return jnp.sum(run(impl, q, k, v) * w * rows[:, :, None, None])

    dense = jax.jit(functools.partial(run, "dense"))(q, k, v)
    chunked = jax.jit(functools.partial(run, "chunked"))(q, k, v)
    m = np.asarray(rows, bool)
    np.testing.assert_allclose(np.asarray(chunked)[m], np.asarray(dense)[m], atol=TOL, rtol=TOL)
    assert np.all(np.isfinite(np.asarray(chunked)))
    g_dense = jax.jit(jax.grad(functools.partial(loss, "dense"), argnums=(0, 1, 2)))(q, k, v)
    g_chunk = jax.jit(jax.grad(functools.partial(loss, "chunked"), argnums=(0, 1, 2)))(q, k, v)
    for gd, gc, what in zip(g_dense, g_chunk, "qkv"):
        np.testing.assert_allclose(gc, gd, atol=TOL, rtol=TOL, err_msg=f"d/d{what}")


def test_chunked_equals_dense_for_decode_queries_over_a_cache_row():
    # 3 new tokens per row at absolute positions 10.. and 21.. of a 29-position row.
    B, T, S, H, K, Dh = 2, 3, 29, 4, 2, 8
    q, k, v = _inputs(B, T, S, H, K, Dh, seed=3)
    q_pos = jnp.asarray([[10, 11, 12], [21, 22, 23]], jnp.int32)
    valid = jnp.ones((B, S), bool)
    dense = A.attention(q, k, v, q_pos, valid, impl="dense")
    chunked = A.attention(q, k, v, q_pos, valid, impl="chunked", chunk=8)
    np.testing.assert_allclose(chunked, dense, atol=TOL, rtol=TOL)
    # Only the live prefix matters: keys past the last position change nothing.
    live = A.attention(q, k[:, :24], v[:, :24], q_pos, valid[:, :24], impl="dense")
    np.testing.assert_allclose(live, dense, atol=TOL, rtol=TOL)


def test_auto_keeps_fp32_cpu_dense_and_goes_chunked_for_long_sequences():
    assert jax.default_backend() == "cpu"
    pick = functools.partial(A.select_impl, "auto", Dh=64, dtype=jnp.float32, has_lengths=True)
    assert pick(T=1024, S=1024) == "dense"
    assert pick(T=2048, S=2048) == "chunked"
    assert pick(T=1, S=1 << 25) == "chunked"
    with pytest.raises(ValueError, match="not one of"):
        A.select_impl("flash", T=1, S=1, Dh=8, dtype=jnp.float32, has_lengths=False)


@pytest.fixture(scope="module")
def tiny():
    cfg = M.ModelConfig(
        model_type="qwen3",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return cfg, M.init_params(cfg, jax.random.key(0))


def test_model_with_chunked_attention_equals_dense(tiny):
    cfg, params = tiny
    B, T = 3, 33
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    mask = np.ones((B, T), np.int32)
    mask[1, :13] = 0  # left padding
    mask[2, 20:] = 0  # right padding
    mask = jnp.asarray(mask)

    fwd = jax.jit(M.forward, static_argnums=0, static_argnames="attention")
    dense = fwd(cfg, params, ids, attention_mask=mask, attention="dense")
    chunked = fwd(cfg, params, ids, attention_mask=mask, attention="chunked")
    m = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(chunked)[m], np.asarray(dense)[m], atol=TOL, rtol=TOL)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (cuDNN)")
def test_cudnn_equals_dense_on_gpu():
    B, T, H, K, Dh = 2, 256, 4, 2, 64
    q, k, v = _inputs(B, T, T, H, K, Dh, dtype=jnp.bfloat16)
    lengths = jnp.asarray([256, 100], jnp.int32)
    q_pos, valid = _self_mask((256, 100), T, left=False)
    assert A.select_impl("auto", T=T, S=T, Dh=Dh, dtype=q.dtype, has_lengths=True) == "cudnn"
    out = A.attention(q, k, v, q_pos, valid, kv_lengths_B=lengths, impl="cudnn")
    ref = A.attention(q, k, v, q_pos, valid, impl="dense")
    m = np.asarray(valid)
    np.testing.assert_allclose(
        np.asarray(out, np.float32)[m], np.asarray(ref, np.float32)[m], atol=2e-2, rtol=2e-2
    )


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU (Pallas)")
def test_pallas_equals_dense_on_tpu():
    B, T, H, K, Dh = 2, 256, 4, 2, 128
    q, k, v = _inputs(B, T, T, H, K, Dh, dtype=jnp.bfloat16)
    q_pos, valid = _self_mask((256, 100), T, left=True)
    assert A.select_impl("auto", T=T, S=T, Dh=Dh, dtype=q.dtype, has_lengths=False) == "pallas"
    out = A.attention(q, k, v, q_pos, valid, impl="pallas")
    ref = A.attention(q, k, v, q_pos, valid, impl="dense")
    m = np.asarray(valid)
    np.testing.assert_allclose(
        np.asarray(out, np.float32)[m], np.asarray(ref, np.float32)[m], atol=2e-2, rtol=2e-2
    )
