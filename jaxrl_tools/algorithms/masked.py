"""Masked reductions used by every loss and estimator (float32 inside).

All functions take an explicit ``mask`` of exactly the shape of ``x`` (1 = counted, 0 = ignored;
any other shape is a ValueError, never a broadcast) and never let a masked entry reach the
result, so the gradient at masked entries is exactly zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms._checks import check_like

f32 = jnp.float32


def masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Sum of ``x * mask`` (masked entries are selected away, so NaN/inf there cannot leak)."""
    check_like("masked_sum", "x", x, mask=mask)
    x = jnp.asarray(x, f32)
    return jnp.sum(jnp.where(mask > 0, x, 0.0), axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Mean of ``x`` over entries with mask 1; 0 where there is none."""
    check_like("masked_mean", "x", x, mask=mask)
    n = jnp.sum(jnp.asarray(mask, f32), axis=axis)
    return masked_sum(x, mask, axis) / jnp.maximum(n, 1.0)


def _segment_totals(x_BT, mask_BT, segment_ids_BT):
    B, T = x_BT.shape
    seg = jnp.clip(jnp.asarray(segment_ids_BT, jnp.int32), 0, T)  # a row has at most T segments
    x = jnp.where(mask_BT > 0, jnp.asarray(x_BT, f32), 0.0)
    return seg, jnp.zeros((B, T + 1), f32).at[jnp.arange(B)[:, None], seg].add(x)


def segment_masked_sum(x_BT: jax.Array, mask_BT: jax.Array, segment_ids_BT: jax.Array) -> jax.Array:
    """Per token, the masked sum of ``x`` over its sequence: the tokens of its row with the same
    segment id (rows packed with several sequences; ids in [0, T]). [B, T] float32."""
    check_like("segment_masked_sum", "x_BT", x_BT, mask_BT=mask_BT, segment_ids_BT=segment_ids_BT)
    seg, totals = _segment_totals(x_BT, mask_BT, segment_ids_BT)
    return jnp.take_along_axis(totals, seg, axis=1)


def count_segments(mask_BT: jax.Array, segment_ids_BT: jax.Array) -> jax.Array:
    """How many sequences (row, segment id) have at least one mask entry; a float32 scalar."""
    check_like("count_segments", "mask_BT", mask_BT, segment_ids_BT=segment_ids_BT)
    _, totals = _segment_totals(jnp.ones(mask_BT.shape, f32), mask_BT, segment_ids_BT)
    return jnp.sum((totals > 0).astype(f32))


def masked_var(x: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Variance over all masked entries; unbiased (ddof=1, Bessel n/(n-1)) as verl's masked_var."""
    check_like("masked_var", "x", x, mask=mask)
    mean = masked_mean(x, mask)
    n = jnp.sum(jnp.asarray(mask, f32))
    var = masked_mean((jnp.asarray(x, f32) - mean) ** 2, mask)
    if unbiased:
        var = var * n / jnp.maximum(n - 1.0, 1.0)
    return var


def masked_whiten(x: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
    """(x - mean) * rsqrt(var_unbiased + eps), statistics over the masked entries; result * mask."""
    check_like("masked_whiten", "x", x, mask=mask)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    return (jnp.asarray(x, f32) - mean) * jax.lax.rsqrt(var + eps) * jnp.asarray(mask, f32)
