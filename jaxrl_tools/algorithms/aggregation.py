"""Loss aggregation: a per-token loss as (micro-batch sum, denominator), by ``loss_agg_mode``.

Every loss in ``losses`` returns ``LossTerms(total, denominator, metrics)`` with ``loss = total /
denominator`` (``LossTerms.loss``). ``total`` is a plain sum over the micro-batch, so with
gradient accumulation over micro-batches the exact full-batch loss and gradient are

    Σ_k total_k / D,   D = loss_denominator(full_mini_batch_mask, mode, max_len)

Either accumulate ``total`` (and its gradient) and divide once at the end, or pass the global
``denominator=D`` to each call so that ``LossTerms.loss`` is already that micro-batch's share.

Aggregation modes (``LOSS_AGG_MODES``; per-token loss L[i, t], mask m):
  token-mean               total = ΣΣ L·m,                 denominator = ΣΣ m          (DAPO)
  seq-mean-token-mean      total = Σ_i (Σ_t L·m / Σ_t m),   denominator = #sequences    (GRPO)
  seq-mean-token-sum       total = ΣΣ L·m,                 denominator = #sequences
  seq-mean-token-sum-norm  total = ΣΣ L·m,                 denominator = #sequences·L_max (Dr.GRPO)
``#sequences`` counts rows with at least one mask token, so all-padding rows added to fill a
fixed-shape batch do not change the result (= B without such rows, as docs/METHODS.md's
mean_i). Packed rows (several sequences per row, ``segment_ids_BT`` numbering them) count and
average per sequence instead of per row, so packing does not change the loss.

Shapes: the mask must have exactly the loss's [B, T] shape and ``denominator`` must be a scalar
(anything else is a ValueError naming the argument, never a broadcast).

Note where sources differ: verl's seq-mean-token-sum-norm divides by the mask's T
(``loss_mask.shape[-1]``) rather than a constant L_max and leaves the B to data-parallel
averaging; Dr. GRPO's paper (and docs/METHODS.md) divide by G·L_max with L_max the generation
budget, as here.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms._checks import check_like, check_ndim, check_scalar
from jaxrl_tools.algorithms.masked import count_segments, masked_sum, segment_masked_sum

f32 = jnp.float32

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


class LossTerms(NamedTuple):
    """A loss as a micro-batch sum and the denominator it is to be divided by.

    Differentiate ``loss`` (= total / denominator, the objective). ``total`` is the raw sum,
    for accumulating micro-batches only: its gradient is ``denominator`` times too large.
    """

    total: jax.Array
    denominator: jax.Array
    metrics: dict

    @property
    def loss(self) -> jax.Array:
        """The scalar to differentiate: total / max(denominator, 1)."""
        return self.total / jnp.maximum(self.denominator, 1.0)


def check_mode(mode: str, max_len) -> None:
    """``mode`` is one of LOSS_AGG_MODES; seq-mean-token-sum-norm has max_len > 0."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    if mode == "seq-mean-token-sum-norm" and (max_len is None or max_len <= 0):
        raise ValueError(
            "loss_agg_mode 'seq-mean-token-sum-norm' needs max_len (L_max, the "
            f"generation budget) > 0, got {max_len!r}"
        )


def check_bt(fn: str, ref_name: str, ref, **others) -> None:
    """``ref`` is [B, T] and every other (non-None) array has exactly its shape."""
    check_ndim(fn, ref_name, ref, "[B, T]")
    check_like(fn, ref_name, ref, **others)


def loss_denominator(
    loss_mask_BT: jax.Array,
    mode: str = "token-mean",
    max_len: int | None = None,
    segment_ids_BT: jax.Array | None = None,
) -> jax.Array:
    """Denominator of ``mode`` for this mask (compute it over the whole mini-batch).

    Args:
      loss_mask_BT: [B, T] 1 on model tokens.
      mode: one of LOSS_AGG_MODES.
      max_len: L_max (generation budget) for seq-mean-token-sum-norm.
      segment_ids_BT: [B, T] the sequence of each token in packed rows, or None (one per row).
    Returns:
      float32 scalar.
    """
    check_mode(mode, max_len)
    check_ndim("loss_denominator", "loss_mask_BT", loss_mask_BT, "[B, T]")
    m = jnp.asarray(loss_mask_BT > 0, f32)
    if mode == "token-mean":
        return jnp.sum(m)
    if segment_ids_BT is None:
        n_seq = jnp.sum(jnp.any(loss_mask_BT > 0, axis=1).astype(f32))
    else:
        n_seq = count_segments(m, segment_ids_BT)
    if mode == "seq-mean-token-sum-norm":
        return n_seq * float(max_len)
    return n_seq


def verl_loss_denominator(
    loss_mask_BT: jax.Array, mode: str = "token-mean", max_len: int | None = None
) -> jax.Array:
    """The denominator verl's ``agg_loss`` divides by, on one rank with one micro-batch.

    Pass it as ``denominator=`` to reproduce verl's loss. It differs from ``loss_denominator``
    in two places: the seq-mean modes count every row (torch.mean over rows, empty ones too), and
    seq-mean-token-sum-norm divides by L_max alone (verl's ``loss_mask.shape[-1]``, the response
    width), leaving the number of sequences to data-parallel and accumulation averaging.

    Args:
      loss_mask_BT: [B, T] 1 on model tokens.
      mode: one of LOSS_AGG_MODES.
      max_len: L_max for seq-mean-token-sum-norm (verl: the response width).
    Returns:
      float32 scalar.
    """
    check_mode(mode, max_len)
    check_ndim("verl_loss_denominator", "loss_mask_BT", loss_mask_BT, "[B, T]")
    if mode == "token-mean":
        return jnp.sum(jnp.asarray(loss_mask_BT > 0, f32))
    if mode == "seq-mean-token-sum-norm":
        return jnp.asarray(float(max_len), f32)
    return jnp.asarray(float(loss_mask_BT.shape[0]), f32)


def aggregate(
    loss_BT: jax.Array,
    loss_mask_BT: jax.Array,
    mode: str = "token-mean",
    *,
    max_len: int | None = None,
    denominator: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(total, denominator) of a per-token loss under ``mode``; loss = total / denominator.

    Args:
      loss_BT: [B, T] per-token loss.
      loss_mask_BT: [B, T] mask.
      mode: one of LOSS_AGG_MODES.
      max_len: L_max for seq-mean-token-sum-norm.
      denominator: a global (mini-batch) denominator to use instead of this mask's (a scalar).
      segment_ids_BT: [B, T] the sequence of each token in packed rows, or None (one per row).
    Returns:
      (total, denominator) float32 scalars.
    """
    check_mode(mode, max_len)
    check_bt("aggregate", "loss_BT", loss_BT, loss_mask_BT=loss_mask_BT)
    check_scalar("aggregate", "denominator", denominator)
    if mode == "seq-mean-token-mean" and segment_ids_BT is not None:
        ones = jnp.ones(loss_mask_BT.shape, f32)
        n_tok = segment_masked_sum(ones, loss_mask_BT, segment_ids_BT)
        total = masked_sum(jnp.asarray(loss_BT, f32) / jnp.maximum(n_tok, 1.0), loss_mask_BT)
    elif mode == "seq-mean-token-mean":
        per_seq = masked_sum(loss_BT, loss_mask_BT, axis=1)
        n_tok = jnp.sum(jnp.asarray(loss_mask_BT > 0, f32), axis=1)
        total = jnp.sum(per_seq / jnp.maximum(n_tok, 1.0))
    else:
        total = masked_sum(loss_BT, loss_mask_BT)
    if denominator is None:
        denominator = loss_denominator(loss_mask_BT, mode, max_len, segment_ids_BT)
    return total, jnp.asarray(denominator, f32)
