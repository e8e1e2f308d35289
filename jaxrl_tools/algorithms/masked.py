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
