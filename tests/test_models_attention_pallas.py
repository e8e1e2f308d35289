"""models.attention: the "pallas" path (the TPU flash attention kernel behind this module's own
wrapper `_pallas_tpu`: GQA heads repeated, padding and packing as segment ids, the [B, H, T, Dh]
transposes) run on CPU in Pallas TPU interpret mode equals the dense path, value and gradient,
for causal, right- and left-padded, grouped-query and packed rows; requests it cannot serve
(sliding window, queries over a KV cache) fail clearly, and "auto" never sends them to it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxrl_tools.models import attention as A

TOL = 1e-5  # float32, absolute and relative: the tolerance of the chunked path's tests


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    # The interpreter keeps simulated TPU memory in globals; a failing kernel leaves it behind.
    yield
    pltpu.reset_tpu_interpret_mode_state()


def _inputs(B, T, H, K, Dh, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, Dh))
    k = rng.normal(size=(B, T, K, Dh))
    v = rng.normal(size=(B, T, K, Dh))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def _rows(lengths, T, left):
    """[B, T] 1 on the real tokens of rows padded on the left or the right, 0 on padding."""
    pos = np.arange(T)[None]
    n = np.asarray(lengths)[:, None]
    valid = pos >= T - n if left else pos < n
    return valid.astype(np.int32)


def _packed(spans, T):
    """One row of packed sequences: ids 1, 2, ... for the given lengths, then 0 (padding)."""
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(spans)]).astype(np.int32)
    return np.pad(ids, (0, T - len(ids)))


# The kernel's blocks are 128 long (its defaults, as on TPU): T = 128 runs its single-block
# forward, T = 256 the online softmax over kv blocks with the blocks above the diagonal skipped.
# Dh = 128 is what "auto" asks of a TPU. A full-length row is plain causal attention.
CASES = {
    # name: (H, K, segment ids [B, T] (0 padding), packed)
    "causal-two-blocks": (2, 2, np.ones((1, 256), np.int32), False),
    "right-padded": (2, 2, _rows((256, 150, 37), 256, left=False), False),
    "left-padded": (2, 2, _rows((256, 100), 256, left=True), False),
    "gqa-4:1-right-padded": (4, 1, _rows((256, 130), 256, left=False), False),
    "gqa-4:2-one-block": (4, 2, _rows((128, 77), 128, left=False), False),
    "packed-gqa-4:2": (
        4,
        2,
        np.stack([_packed((100, 90, 40), 256), _packed((128, 128), 256), _packed((7,), 256)]),
        True,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pallas_interpreted_equals_dense_value_and_gradient(name):
    H, K, seg, packed = CASES[name]
    B, T = seg.shape
    Dh = 128
    q, k, v = _inputs(B, T, H, K, Dh)
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid = jnp.asarray(seg > 0)  # kv_valid
    segment_ids = jnp.asarray(seg) if packed else None
    # Real tokens: the queries whose output means something. A padding query's keys differ:
    # "dense" gives it the real keys before it (if any), "pallas" the padding keys ("segment" 0).
    m = seg > 0
    rows = jnp.asarray(m, jnp.float32)[:, :, None, None]
    w = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, H, Dh)), jnp.float32)

    def run(impl, q, k, v):
        return A.attention(q, k, v, q_pos, valid, segment_ids_BT=segment_ids, impl=impl)

    def loss(impl, q, k, v):  # padding queries carry no cotangent, as in the model
        return jnp.sum(run(impl, q, k, v) * w * rows)

    grad = jax.grad(loss, argnums=(1, 2, 3))
    dense = jax.jit(functools.partial(run, "dense"))(q, k, v)
    g_dense = jax.jit(functools.partial(grad, "dense"))(q, k, v)
    with pltpu.force_tpu_interpret_mode():  # the pallas_calls traced in here are interpreted
        pallas = jax.jit(functools.partial(run, "pallas"))(q, k, v)
        g_pallas = jax.jit(functools.partial(grad, "pallas"))(q, k, v)

    assert np.all(np.isfinite(np.asarray(pallas)))
    np.testing.assert_allclose(np.asarray(pallas)[m], np.asarray(dense)[m], atol=TOL, rtol=TOL)
    # Every gradient entry, padding positions included (zero in both).
    for gp, gd, what in zip(g_pallas, g_dense, "qkv"):
        np.testing.assert_allclose(gp, gd, atol=TOL, rtol=TOL, err_msg=f"d/d{what}")


def test_pallas_refuses_a_sliding_window_and_kv_cache_queries():
    B, T, H, K, Dh = 1, 128, 2, 1, 128
    q, k, v = _inputs(B, T, H, K, Dh)
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid = jnp.ones((B, T), bool)
    with pytest.raises(ValueError, match="'pallas' has no sliding window; use 'chunked'"):
        A.attention(q, k, v, q_pos, valid, impl="pallas", window=16)
    # Keys from a cache (its [B, K, S, Dh] layout): queries at absolute positions, which the
    # kernel's causal-by-index mask cannot express.
    k_c, v_c = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    with pytest.raises(ValueError, match="'pallas' masks causally by index"):
        A.attention(q, k_c, v_c, q_pos + 5, valid, impl="pallas", kv_heads_first=True)
    with pytest.raises(ValueError, match="'pallas' masks causally by index"):
        A.attention(q[:, :1], k, v, q_pos[:, :1], valid, impl="pallas")


def test_auto_on_tpu_sends_only_training_self_attention_to_pallas():
    pick = functools.partial(
        A.select_impl, "auto", Dh=128, dtype=jnp.bfloat16, has_lengths=False, platform="tpu"
    )
    assert pick(T=256, S=256) == "pallas"
    assert pick(T=256, S=256, packed=True) == "pallas"
    assert pick(T=256, S=256, window=64) == "dense"
    assert pick(T=256, S=256, kv_cache=True) == "dense"
    assert pick(T=200, S=200) == "dense"
    assert pick(T=256, S=512) == "dense"
    assert pick(T=256, S=256, Dh=64) == "dense"


_SHARDED = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.pallas import tpu as pltpu
from jaxrl_tools import sharding
from jaxrl_tools.models import attention as A

B, T, H, K, Dh = 4, 256, 4, 2, 128
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
           for s in ((B, T, H, Dh), (B, T, K, Dh), (B, T, K, Dh)))
seg = np.zeros((B, T), np.int32)
for b, spans in enumerate(((256,), (100, 90), (128, 128), (7,))):
    seg[b, : sum(spans)] = np.repeat(np.arange(1, len(spans) + 1), spans)
seg = jnp.asarray(seg)
q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
w = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.float32) * (seg > 0)[:, :, None, None]

def loss(impl, q, k, v):
    out = A.attention(q, k, v, q_pos, seg > 0, segment_ids_BT=seg, impl=impl)
    return jnp.sum(out * w), out

step = lambda impl: jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), (0, 1, 2), has_aux=True))
(_, dense), g_dense = step("dense")(q, k, v)
mesh = sharding.make_mesh((2, 1, 2), jax.devices()[:4])  # rows over data, heads over tensor
with sharding.use_mesh(mesh), pltpu.force_tpu_interpret_mode():
    lowered = step("pallas").lower(q, k, v)
    (_, out), g = lowered.compile()(q, k, v)
m = np.asarray(seg) > 0
report = dict(
    shard_map="shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text(),
    out=float(np.max(np.abs(np.asarray(out)[m] - np.asarray(dense)[m]))),
    grads=[float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(g, g_dense)],
)
json.dump(report, open(sys.argv[1] + "/report.json", "w"))
"""


def test_pallas_on_a_mesh_runs_per_shard_and_equals_dense(tmp_path):
    # On a mesh the kernel runs inside a shard_map (the TPU compiler cannot partition a Mosaic
    # kernel): rows split over "data", heads over "tensor", each shard's causal attention whole.
    from fakes import run_on_8_devices

    script = tmp_path / "sharded.py"
    script.write_text(_SHARDED)
    r = run_on_8_devices(str(script), tmp_path, timeout=300)
    assert r["shard_map"], r
    assert r["out"] < TOL and max(r["grads"]) < TOL, r


def test_shared_prompt_samples_gathered_into_rows_for_pallas_equal_dense():
    """`optim.share_prefix` rows on a TPU: the samples' attention as rows of their own (the
    prompt keys each sees, then its tokens, 128 wide) through the kernel equals the dense path,
    value and gradient, a sample that sees no prompt and an empty slot included."""
    B, S, N, L, H, K, Dh = 2, 40, 3, 30, 2, 1, 128
    T = S + N * L
    q, k, v = _inputs(B, T, H, K, Dh)
    valid = np.zeros((B, T), bool)
    valid[0, :25], valid[1, :40] = True, True  # prompts of 25 and 40 tokens
    for b, lengths in enumerate(((30, 11, 0), (7, 30, 4))):
        for j, n in enumerate(lengths):
            valid[b, S + j * L : S + j * L + n] = True
    keys = np.zeros((B, N, S), bool)
    keys[0, :2, :25], keys[1, :2, :40] = True, True  # row 1's last sample sees no prompt
    w = jnp.asarray(np.random.default_rng(1).normal(size=(B, N * L, H, Dh)), jnp.float32)
    w = w * valid[:, S:, None, None]

    def dense(q, k, v):
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        return A.attention(q, k, v, pos, valid, prompt_keys_BNS=keys, impl="dense")[:, S:]

    def rows(q, k, v):
        return A._samples_as_rows(q, k, v, jnp.asarray(valid), keys, "pallas", None, 128)

    grad = lambda f: jax.jit(jax.grad(lambda *x: jnp.sum(f(*x) * w), argnums=(0, 1, 2)))  # noqa: E731
    want, g_want = jax.jit(dense)(q, k, v), grad(dense)(q, k, v)
    with pltpu.force_tpu_interpret_mode():
        got, g_got = jax.jit(rows)(q, k, v), grad(rows)(q, k, v)
    m = valid[:, S:]
    np.testing.assert_allclose(np.asarray(got)[m], np.asarray(want)[m], atol=TOL, rtol=TOL)
    for gp, gd, what in zip(g_got, g_want, "qkv"):
        np.testing.assert_allclose(gp, gd, atol=TOL, rtol=TOL, err_msg=f"d/d{what}")
