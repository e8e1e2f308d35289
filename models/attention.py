"""Attention behind one function: dense, chunked (online softmax), cuDNN flash, Pallas TPU flash.

Every implementation computes the same masked, grouped-query attention:

  out[b, t, h] = softmax_s(q[b, t, h] . k[b, s, h // G] / sqrt(Dh) over allowed s) @ v[b, s, h // G]
  allowed(b, t, s) = kv_valid[b, s] and s <= q_pos[b, t] (and q_pos[b, t] - s < window)
                     (and segment[b, s] == segment[b, t] for packed rows)

`q_pos[b, t]` is the key index query t sits at: `t` in a training forward (causal), the absolute
position in a decode step over a cache row. `kv_valid` marks real keys (padding is False).
`segment` (optional, self-attention only) numbers the sequences packed into one row: a token sees
only the earlier tokens of its own sequence.

Rows with a shared prompt (`prompt_keys`, `train.packing.plan_shared_packing`) are a prompt slot
of S tokens, then N sample slots of L: the prompt slot attends causally to itself, and sample
slot j's queries to the prompt-slot keys `prompt_keys[b, j]` marks and causally to their own
slot (a sample's tokens fill its slot from the start). They run as two attentions of the kinds
below: the prompt slot's self-attention (any implementation, kernels included), and the N
samples' queries over [the prompt's keys, their own] (dense or chunked), so no score is computed
that a sample hides from another. Where "auto" would take a kernel (cuDNN, Pallas TPU), each
sample is instead gathered into a right-padded row of its own, [the prompt keys it sees, its own
tokens], for the kernel's causal self-attention: the prompt's queries are recomputed per
sample, but in the fused kernel.

Implementations (`impl`):
  "dense"    the [B, H, T, S] float32 score matrix, as the model has always computed it; the
             reference, and what fp32 runs on CPU use (the demo's numbers depend on it).
  "chunked"  online softmax over key chunks inside a scan over query chunks, in XLA; memory
             O(chunk^2) per head instead of O(T S); blocks above the causal diagonal are skipped;
             equal to "dense" to float32 rounding (tests: 1e-5, value and gradient).
  "cudnn"    `jax.nn.dot_product_attention(implementation="cudnn")`: cuDNN flash attention on
             NVIDIA GPUs. It takes causal + right padding (per-row lengths), bf16/fp16, Dh <= 128;
             only used when the caller passes `kv_lengths` (right-padded rows) and T == S; no
             packed rows (jax's API takes no segment ids); of shared-prompt rows, the prompt
             slot, and the samples gathered into rows of their own.
  "pallas"   `jax.experimental.pallas.ops.tpu.flash_attention` on TPU, causal, padding and
             packed sequences by segment ids, kv heads repeated for GQA; no sliding window.
             The kernel masks causally by index (query t sees keys s <= t), so it takes only
             self-attention (T == S) with q_pos[b, t] == t, the training forward: never the
             queries of a KV-cache read (`kv_heads_first`), which sit at absolute positions.
             Its sequence length must be a multiple of 128 (the kernel's blocks); of
             shared-prompt rows, the prompt slot, and the samples gathered into rows of
             their own (rounded up to 128). On a mesh
             (`sharding.use_mesh`) it runs inside a `shard_map`, rows over the batch axes and
             heads over "tensor": the TPU compiler cannot partition a Mosaic kernel. Tested on
             CPU in Pallas TPU interpret mode (`pltpu.force_tpu_interpret_mode()`: the same
             kernel and this module's wrapper, interpreted), equal to "dense" to 1e-5 in
             float32, value and gradient, on one device and a mesh
             (tests/test_models_attention_pallas.py); compiled inside the RL step by the TPU
             compiler without a TPU (tests/test_targets.py).
  "auto"     picks per call from the shapes and the platform of the devices the computation
             is placed on (`select_impl`, `compute_platform`).

Queries whose row allows no key (padding) get an arbitrary finite output (mean of some values,
or 0): they differ between implementations and are never used.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxrl_tools.sharding import current_mesh, logical_to_spec

IMPLS = ("auto", "dense", "chunked", "cudnn", "pallas")
# Finite, so that a fully masked row stays NaN-free (its softmax is uniform).
NEG_INF = -0.7 * float(np.finfo(np.float32).max)
# "auto" keeps the dense path while a score matrix (per batch row and head) is at most this many
# entries: fp32 CPU runs (tests, the demos' rows of <= 1,024) keep their exact numbers, long
# sequences go chunked. On a 2-core CPU, forward + backward of causal self-attention (4 heads of
# 64) ran at T = 512 dense 0.10 s (8 rows), chunked 0.09-0.15; T = 1,024: 0.12 s, 0.07-0.10;
# T = 2,048: 0.37 s, 0.09-0.13.
DENSE_MAX_SCORES = 1 << 20
CHUNK = 512  # query and key chunk of the chunked path
# ... on CPU, where smaller blocks run faster. Forward + backward (4 heads of 64), chunks of 128 /
# 256 / 512: 8 rows of 1,280 0.34 / 0.41 / 0.81 s; a row of 2,048 0.14 / 0.09 / 0.13 s.
CPU_CHUNK = 256


def select_impl(
    impl: str,
    *,
    T: int,
    S: int,
    Dh: int,
    dtype,
    has_lengths: bool,
    packed: bool = False,
    window: int | None = None,
    kv_cache: bool = False,
    platform: str | None = None,
) -> str:
    """The implementation "auto" resolves to for these shapes on `platform` ("gpu", "tpu",
    "cpu"; None: `compute_platform()`, where the traced computation will run).

    GPU: cuDNN flash for bf16/fp16 causal self-attention over right-padded rows (T == S, lengths
    given, not packed, Dh <= 128 and a multiple of 8). TPU: the Pallas flash kernel for causal
    self-attention (T == S, not over a KV cache: `kv_cache`, keys read in the cache's layout,
    whose queries sit at absolute positions) when T is a multiple of 128, Dh of 128 and there is
    no sliding window. Otherwise dense while T * S <= DENSE_MAX_SCORES, else chunked.
    """
    if impl not in IMPLS:
        raise ValueError(f"attention implementation {impl!r} is not one of {list(IMPLS)}")
    if impl == "cudnn" and packed:
        raise ValueError(
            "attention impl 'cudnn' takes no packed rows (jax's API has no segment ids); use "
            "'auto' or 'chunked', or turn packing off"
        )
    if impl != "auto":
        return impl
    backend = platform or compute_platform()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    cudnn_ok = has_lengths and not packed and T == S and Dh <= 128 and Dh % 8 == 0
    if backend == "gpu" and half and cudnn_ok:
        return "cudnn"
    pallas_ok = not kv_cache and window is None and T == S and T % 128 == 0 and Dh % 128 == 0
    if backend == "tpu" and pallas_ok:
        return "pallas"
    return "dense" if T * S <= DENSE_MAX_SCORES else "chunked"


def compute_platform() -> str:
    """The platform of the devices the traced computation is placed on: the mesh of
    `sharding.use_mesh` (a target's compile-only devices when `plan` compiles for a GPU or TPU
    from a CPU host), else jax's default backend."""
    ctx = current_mesh()
    return ctx[0].devices.flat[0].platform if ctx is not None else jax.default_backend()


def attention(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    q_pos_BT: jax.Array,
    kv_valid_BS: jax.Array,
    *,
    kv_lengths_B: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
    prompt_keys_BNS: jax.Array | None = None,
    impl: str = "auto",
    window: int | None = None,
    chunk: int | None = None,
    kv_heads_first: bool = False,
) -> jax.Array:
    """Masked grouped-query attention (see the module docstring for the mask).

    Args:
      q_BTHD: queries [B, T, H, Dh] (rotary already applied).
      k_BSKD, v_BSKD: keys and values [B, S, K, Dh], H a multiple of K.
      q_pos_BT: int, the key index each query may attend up to (inclusive).
      kv_valid_BS: bool, real keys.
      kv_lengths_B: optional per-row lengths when rows are right-padded self-attention
        (kv_valid[b] = [s < kv_lengths[b]], q_pos[b, t] = t): lets "auto" choose cuDNN.
      segment_ids_BT: int, packed self-attention (T == S): a query attends only to keys of the
        same segment id (0 on padding); None: one sequence per row.
      prompt_keys_BNS: bool [B, N, S]: rows with a shared prompt (module docstring), a prompt
        slot of S tokens and N sample slots of (T - S) / N; sample slot j sees the prompt-slot
        keys marked in [b, j]. Each slot holds one sequence: `segment_ids_BT` is not read.
      impl: one of IMPLS.
      window: sliding window (a query sees the `window` keys ending at its own position).
      chunk: query/key chunk of the chunked path (None: CPU_CHUNK on a CPU, else CHUNK).
      kv_heads_first: k and v are [B, K, S, Dh] (the KV cache's layout) instead.

    Returns:
      out_BTHD in the dtype of `v_BSKD`.
    """
    B, T, H, Dh = q_BTHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    if kv_heads_first:
        K, S = S, K
    if H % K:
        raise ValueError(f"attention: {H} query heads are not a multiple of {K} kv heads")
    if chunk is None:
        chunk = CPU_CHUNK if compute_platform() == "cpu" else CHUNK
    if prompt_keys_BNS is not None:
        if window is not None:
            raise ValueError("attention: a sliding window is not supported with prompt_keys_BNS")
        return _shared_prompt(q_BTHD, k_BSKD, v_BSKD, kv_valid_BS, prompt_keys_BNS, impl, chunk)
    packed = segment_ids_BT is not None
    if packed and T != S:
        raise ValueError(f"attention: segment ids need self-attention (T == S), got {T} vs {S}")
    impl = select_impl(
        impl,
        T=T,
        S=S,
        Dh=Dh,
        dtype=q_BTHD.dtype,
        has_lengths=kv_lengths_B is not None,
        packed=packed,
        window=window,
        kv_cache=kv_heads_first,
    )
    if impl == "pallas" and (kv_heads_first or T != S):
        raise ValueError(
            "attention impl 'pallas' masks causally by index (query t sees keys s <= t): it "
            "takes self-attention (T == S) with q_pos[b, t] == t, not queries over a KV cache; "
            "use 'auto', 'dense' or 'chunked'"
        )
    seg = None if not packed else segment_ids_BT.astype(jnp.int32)
    if kv_heads_first:
        if impl == "dense" and not packed:
            return _dense_heads_first(q_BTHD, k_BSKD, v_BSKD, q_pos_BT, kv_valid_BS, window)
        k_BSKD, v_BSKD = jnp.swapaxes(k_BSKD, 1, 2), jnp.swapaxes(v_BSKD, 1, 2)
    if impl == "dense":
        return _dense(q_BTHD, k_BSKD, v_BSKD, q_pos_BT, kv_valid_BS, window, seg)
    if impl == "chunked":
        return _chunked(q_BTHD, k_BSKD, v_BSKD, q_pos_BT, kv_valid_BS, window, chunk, seg)
    if impl == "cudnn":
        if kv_lengths_B is None or T != S:
            raise ValueError("attention impl 'cudnn' needs right-padded self-attention lengths")
        return jax.nn.dot_product_attention(
            q_BTHD,
            k_BSKD,
            v_BSKD,
            is_causal=True,
            query_seq_lengths=kv_lengths_B.astype(jnp.int32),
            key_value_seq_lengths=kv_lengths_B.astype(jnp.int32),
            local_window_size=None if window is None else (window - 1, 0),
            implementation="cudnn",
        ).astype(v_BSKD.dtype)
    if seg is None:  # segments = validity: padding 0, the row's tokens 1
        seg = kv_valid_BS.astype(jnp.int32)
    return _pallas_tpu(q_BTHD, k_BSKD, v_BSKD, seg, window)


def _shared_prompt(q, k, v, kv_valid_BT, prompt_keys_BNS, impl, chunk):
    """Rows of a prompt slot and N sample slots (see `attention`): the prompt slot's causal
    self-attention, then the samples' attention: where "auto" (or `impl`) takes a kernel for
    rows of S + L, each sample in a row of its own (`_samples_as_rows`), else in XLA
    (`_samples_over_prompt`)."""
    B, T, H, Dh = q.shape
    _, N, S = prompt_keys_BNS.shape
    L = (T - S) // N
    if S + N * L != T:
        raise ValueError(f"attention: {T} tokens are not a prompt slot of {S} and {N} equal slots")
    valid_BT = kv_valid_BT.astype(bool)
    # The prompt slot is right-padded: its lengths let "auto" take cuDNN (at least 1: a row of
    # whole samples has an empty prompt slot, whose outputs are never read).
    prompt_lengths = jnp.maximum(jnp.sum(valid_BT[:, :S], axis=1, dtype=jnp.int32), 1)
    q_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    out_prompt = attention(
        q[:, :S], k[:, :S], v[:, :S], q_pos, valid_BT[:, :S],
        kv_lengths_B=prompt_lengths, impl=impl, chunk=chunk,
    )  # fmt: skip

    W = -(-(S + L) // 128) * 128  # rows the Pallas kernel's 128-blocks take
    rows = select_impl(impl, T=W, S=W, Dh=Dh, dtype=q.dtype, has_lengths=True)
    if rows in ("cudnn", "pallas"):
        width = W if rows == "pallas" else S + L
        out_samples = _samples_as_rows(q, k, v, valid_BT, prompt_keys_BNS, rows, chunk, width)
    else:
        xla = impl if impl in ("dense", "chunked") else "auto"
        out_samples = _samples_over_prompt(q, k, v, valid_BT, prompt_keys_BNS, xla, chunk)
    return jnp.concatenate([out_prompt, out_samples], axis=1)


def _samples_over_prompt(q, k, v, valid_BT, prompt_keys_BNS, impl, chunk):
    """The samples' attention of `_shared_prompt` in XLA: each sample's queries over [the
    prompt's keys, broadcast over the samples; its own]."""
    B, T, H, Dh = q.shape
    _, N, S = prompt_keys_BNS.shape
    L = (T - S) // N

    def keys(x):  # [B, S + N L, n, Dh] -> the keys each sample sees, [B N, S + L, n, Dh]
        n = x.shape[2]
        prompt = jnp.broadcast_to(x[:, None, :S], (B, N, S, n, Dh))
        own = x[:, S:].reshape(B, N, L, n, Dh)
        return jnp.concatenate([prompt, own], axis=2).reshape(B * N, S + L, n, Dh)

    own = valid_BT[:, S:].reshape(B, N, L)
    seen = jnp.concatenate([prompt_keys_BNS.astype(bool), own], axis=2).reshape(B * N, S + L)
    q_pos = jnp.broadcast_to(S + jnp.arange(L, dtype=jnp.int32), (B * N, L))  # after the prompt
    out = attention(
        q[:, S:].reshape(B * N, L, H, Dh), keys(k), keys(v), q_pos, seen, impl=impl, chunk=chunk
    )
    return out.reshape(B, N * L, H, Dh)


def _samples_as_rows(q, k, v, valid_BT, prompt_keys_BNS, impl, chunk, width=None):
    """The samples' attention of `_shared_prompt` for a kernel that takes only right-padded
    causal self-attention (cuDNN, Pallas TPU): each sample gathered into a row of its own of
    `width` (at least S + L), the prompt keys it sees then its own tokens, and attended with
    lengths. The prompt's queries are gathered too (their outputs are dropped): more attention
    work than the queries-over-keys block, but in one fused kernel, where that block's XLA path
    reads and writes every score block. The gathers' transposes add up the prompt's gradients
    over the samples."""
    B, T, H, Dh = q.shape
    _, N, S = prompt_keys_BNS.shape
    L = (T - S) // N
    W = width or S + L
    seen_BNS = prompt_keys_BNS.astype(bool)
    h_BN = jnp.sum(seen_BNS, axis=2, dtype=jnp.int32)
    own_BN = jnp.sum(valid_BT[:, S:].reshape(B, N, L), axis=2, dtype=jnp.int32)
    seen_first = jnp.argsort(~seen_BNS, axis=2, stable=True).astype(jnp.int32)  # seen, in order
    t = jnp.arange(W, dtype=jnp.int32)
    own_at = S + jnp.arange(N, dtype=jnp.int32)[None, :, None] * L + t - h_BN[..., None]
    prompt_at = jnp.take_along_axis(seen_first, jnp.minimum(t, S - 1)[None, None], axis=2)
    src_BNW = jnp.where(t < h_BN[..., None], prompt_at, jnp.clip(own_at, 0, T - 1))

    def gather(x):  # [B, T, n, Dh] -> [B N, W, n, Dh]
        flat = src_BNW.reshape(B, N * W)[..., None, None]
        return jnp.take_along_axis(x, flat, axis=1).reshape(B * N, W, *x.shape[2:])

    lengths = jnp.maximum(h_BN + own_BN, 1).reshape(B * N)
    out = attention(
        gather(q), gather(k), gather(v), jnp.broadcast_to(t, (B * N, W)),
        t[None] < lengths[:, None], kv_lengths_B=lengths, impl=impl, chunk=chunk,
    )  # fmt: skip
    back = jnp.minimum(h_BN.reshape(B * N, 1) + jnp.arange(L), W - 1)  # each own token's place
    out = jnp.take_along_axis(out, back[..., None, None], axis=1)
    return out.reshape(B, N * L, H, Dh)


def _allowed(q_pos_BT, kv_pos_S, kv_valid_BS, window, q_seg_BT=None, kv_seg_BS=None):
    ok = (kv_pos_S[None, None, :] <= q_pos_BT[:, :, None]) & kv_valid_BS[:, None, :]
    if window is not None:
        ok &= q_pos_BT[:, :, None] - kv_pos_S[None, None, :] < window
    if q_seg_BT is not None:
        ok &= q_seg_BT[:, :, None] == kv_seg_BS[:, None, :]
    return ok


def _dense(q, k, v, q_pos_BT, kv_valid_BS, window, seg_BT=None):
    B, T, H, Dh = q.shape
    K = k.shape[2]
    S = jnp.arange(k.shape[1])
    mask_BTS = _allowed(q_pos_BT, S, kv_valid_BS, window, seg_BT, seg_BT)
    q = q.reshape(B, T, K, H // K, Dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (Dh**-0.5)
    scores = jnp.where(mask_BTS[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(B, T, H, Dh)


def _dense_heads_first(q, k_BKSD, v_BKSD, q_pos_BT, kv_valid_BS, window):
    # `_dense` over keys and values in the cache's layout, its matmuls written in the operand
    # order XLA:CPU runs without copying them: scores = q @ k^T and out = probs @ v, batched over
    # (B, K) with the G query heads of each kv head and the T queries as the matmul's rows.
    B, T, H, Dh = q.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    G = H // K
    mask_BTS = _allowed(q_pos_BT, jnp.arange(S), kv_valid_BS, window)
    q = q.reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, Dh)
    batch = ((0, 1), (0, 1))
    scores = jax.lax.dot_general(
        q, k_BKSD, (((3,), (3,)), batch), preferred_element_type=jnp.float32
    ).reshape(B, K, G, T, S)
    scores = jnp.where(mask_BTS[:, None, None], scores * (Dh**-0.5), NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BKSD.dtype).reshape(B, K, G * T, S)
    out = jax.lax.dot_general(probs, v_BKSD, (((3,), (2,)), batch))
    return out.reshape(B, K, G, T, Dh).transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)


def _pad_axis(x, axis, size, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _chunked(q, k, v, q_pos_BT, kv_valid_BS, window, chunk, seg_BT=None):
    B, T, H, Dh = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    qc, kc = min(chunk, T), min(chunk, S)
    nq, nk = -(-T // qc), -(-S // kc)
    # Padded queries allow nothing (q_pos -1); padded keys are invalid.
    q = _pad_axis(q, 1, nq * qc).reshape(B, nq, qc, K, G, Dh)
    q_pos = _pad_axis(q_pos_BT.astype(jnp.int32), 1, nq * qc, -1).reshape(B, nq, qc)
    k = _pad_axis(k, 1, nk * kc).reshape(B, nk, kc, K, Dh)
    v = _pad_axis(v, 1, nk * kc).reshape(B, nk, kc, K, Dh)
    valid = _pad_axis(kv_valid_BS.astype(bool), 1, nk * kc, False).reshape(B, nk, kc)
    kv_pos = jnp.arange(nk * kc, dtype=jnp.int32).reshape(nk, kc)
    # Without packing every (query, key) pair is of the same segment: all zeros.
    seg_BT = jnp.zeros((B, T), jnp.int32) if seg_BT is None else seg_BT
    q_seg = _pad_axis(seg_BT, 1, nq * qc).reshape(B, nq, qc)
    kv_seg = _pad_axis(seg_BT, 1, nk * kc).reshape(B, nk, kc)
    scale = Dh**-0.5
    kv_xs = (*(x.swapaxes(0, 1) for x in (k, v, valid, kv_seg)), kv_pos)

    @jax.checkpoint
    def q_block(q_bqkgd, qp_bq, qs_bq):
        # Only the running max / sum / output of the online softmax are carried; the backward
        # pass recomputes each block's scores (checkpoint) instead of storing them.
        @jax.checkpoint
        def kv_block(carry, xs):
            k_c, v_c, valid_c, seg_c, pos_c = xs
            ok_BTS = _allowed(qp_bq, pos_c, valid_c, window, qs_bq, seg_c)

            def update(carry):
                m, denom, acc = carry
                f32 = jnp.float32
                s = jnp.einsum("btkgd,bskd->bkgts", q_bqkgd, k_c, preferred_element_type=f32)
                s = jnp.where(ok_BTS[:, None, None], s * scale, NEG_INF)
                # The result does not depend on the shift m (exactly): no gradient through it.
                m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(-1)))
                corr = jnp.exp(m - m_new)
                p = jnp.exp(s - m_new[..., None])
                pv = jnp.einsum(
                    "bkgts,bskd->bkgtd", p.astype(v_c.dtype), v_c, preferred_element_type=f32
                )
                return m_new, denom * corr + p.sum(-1), acc * corr[..., None] + pv

            # Blocks wholly above the causal diagonal (or all padding) are skipped.
            return jax.lax.cond(jnp.any(ok_BTS), update, lambda c: c, carry), None

        init = (
            jnp.full((B, K, G, qc), NEG_INF, jnp.float32),
            jnp.zeros((B, K, G, qc), jnp.float32),
            jnp.zeros((B, K, G, qc, Dh), jnp.float32),
        )
        (_, denom, acc), _ = jax.lax.scan(kv_block, init, kv_xs)
        out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # rows that allowed nothing: 0
        return jnp.einsum("bkgtd->btkgd", out).astype(v.dtype)

    def q_step(_, xs):
        return None, q_block(*xs)

    xs = (q.swapaxes(0, 1), q_pos.swapaxes(0, 1), q_seg.swapaxes(0, 1))
    _, out = jax.lax.scan(q_step, None, xs)
    # out: [nq, B, qc, K, G, Dh] -> [B, T, H, Dh]
    return out.swapaxes(0, 1).reshape(B, nq * qc, H, Dh)[:, :T]


def _pallas_tpu(q, k, v, seg_BT, window):
    # Self-attention with q_pos[b, t] == t (the caller's part; `attention` refuses T != S and
    # cache reads): the kernel's causal mask is by index. Padding and packing are its segment
    # ids (equal ids see each other): kv_valid itself is not read when packed (ids 0 on padding).
    if window is not None:
        raise ValueError("attention impl 'pallas' has no sliding window; use 'chunked'")
    # Imported lazily: Pallas takes seconds to import and is only useful on a TPU (or in its
    # interpret mode on CPU, the tests: `pltpu.force_tpu_interpret_mode()` around the call).
    from jax.experimental.pallas.ops.tpu import flash_attention as fa  # noqa: PLC0415

    H, K, Dh = q.shape[2], k.shape[2], q.shape[3]
    rep = functools.partial(jnp.repeat, repeats=H // K, axis=2)
    to_bhtd = lambda x: jnp.swapaxes(x, 1, 2)

    def kernel(q, k, v, seg):
        out = fa.flash_attention(
            to_bhtd(q),
            to_bhtd(k),
            to_bhtd(v),
            segment_ids=fa.SegmentIds(q=seg, kv=seg),
            causal=True,
            sm_scale=Dh**-0.5,
        )
        return jnp.swapaxes(out, 1, 2)

    out_dtype = v.dtype
    k, v = rep(k).astype(q.dtype), rep(v).astype(q.dtype)
    ctx = current_mesh()
    if ctx is not None and ctx[0].size > 1:
        # A Mosaic kernel cannot be partitioned by the compiler: each device runs it on its
        # own rows and heads (whole rows: causal attention needs every earlier key).
        mesh, rules = ctx
        qkv = logical_to_spec(("batch", None, "heads", None), rules)
        rows = PartitionSpec(qkv[0], None)
        kernel = jax.shard_map(
            kernel, mesh=mesh, in_specs=(qkv, qkv, qkv, rows), out_specs=qkv, check_vma=False
        )
    return kernel(q, k, v, seg_BT).astype(out_dtype)
