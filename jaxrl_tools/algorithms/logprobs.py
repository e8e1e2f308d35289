"""Per-token log-probabilities and entropies, plain and memory-efficient (chunked).

Alignment (the kernels here): ``targets_BT[b, t]`` is the token whose log-prob is read from
``logits_BTV[b, t]``; nothing is shifted, so a caller holding a sequence's logits passes
``logits[:, :-1]`` and ``tokens[:, 1:]``. The library's one convention for the log-probs *of a
sequence* is the trainer's, ``jaxrl_tools.train.policy.token_logprobs``: aligned to the token
scored, ``logp[b, t] = log π(tokens[b, t] | tokens[b, <t])``, column 0 = 0; it does the shift
and calls ``target_logprobs``.
``loss_mask_BT`` is 1 on model tokens; results are exactly 0 at masked positions, and so is
their gradient. ``targets_BT`` must be integer token ids and ``loss_mask_BT`` exactly the
logits' [B, T] (else a ValueError).

The chunked variant takes the final hidden states ``h_BTD`` and the LM head ``W_DV``
(logits = h @ W, see ``jaxrl_tools.models.hidden_states`` / ``unembed``) and walks the sequence
in chunks of ``chunk_size`` tokens with ``lax.map``; each chunk is wrapped in ``jax.checkpoint``
so the backward pass recomputes the chunk's logits instead of storing them. Neither pass ever
holds more than one [B, chunk, V] float32 block (plus dW), instead of [B, T, V].
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp

from jaxrl_tools.algorithms._checks import check_int, check_ndim, check_shape, shape_of

f32 = jnp.float32


def _check_inputs(fn: str, name: str, x, layout: str, targets_BT, loss_mask_BT) -> None:
    """``x`` ([B, T, V] logits or [B, T, D] hidden states) and the [B, T] targets and mask."""
    check_ndim(fn, name, x, layout)
    lead = shape_of(x)[:2]
    why = f"the leading [B, T] of {name} {shape_of(x)}"
    if targets_BT is not None:
        check_shape(fn, "targets_BT", targets_BT, lead, why)
        check_int(fn, "targets_BT", targets_BT, "token ids")
    check_shape(fn, "loss_mask_BT", loss_mask_BT, lead, why)


def _logp_entropy_from_logits(logits_BTV, targets_BT, temperature):
    logits = logits_BTV.astype(f32) / temperature
    # Shift by the (constant) row max first: both results are shift-invariant, and H = lse − Σ p·z
    # cancels far less float32 precision on z − max ≤ 0 than on the raw logits.
    z = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(z), axis=-1))
    tgt = jnp.take_along_axis(z, targets_BT[..., None].astype(jnp.int32), axis=-1)[..., 0]
    probs = jnp.exp(z - lse[..., None])
    entropy = lse - jnp.sum(probs * z, axis=-1)
    return tgt - lse, entropy


def target_logprobs(
    logits_BTV: jax.Array,
    targets_BT: jax.Array,
    loss_mask_BT: jax.Array,
    *,
    temperature: float = 1.0,
) -> jax.Array:
    """log softmax(logits / temperature)[target] at the same position, float32, 0 where
    loss_mask is 0 (no shift: see the module doc).

    Args:
      logits_BTV: [B, T, V] logits (any float dtype; cast to float32).
      targets_BT: [B, T] int token ids, ``targets_BT[b, t]`` scored by ``logits_BTV[b, t]``.
      loss_mask_BT: [B, T] 1 on model tokens.
      temperature: sampling temperature the behaviour policy used.
    Returns:
      logp_BT: [B, T] float32.
    """
    _check_inputs(
        "target_logprobs", "logits_BTV", logits_BTV, "[B, T, V]", targets_BT, loss_mask_BT
    )
    logp, _ = _logp_entropy_from_logits(logits_BTV, targets_BT, temperature)
    return jnp.where(loss_mask_BT > 0, logp, 0.0)


def token_entropy(
    logits_BTV: jax.Array, loss_mask_BT: jax.Array, *, temperature: float = 1.0
) -> jax.Array:
    """Entropy logsumexp(z) - sum softmax(z) z per token, float32, 0 where loss_mask is 0.

    Args:
      logits_BTV: [B, T, V] logits.
      loss_mask_BT: [B, T] 1 on model tokens.
      temperature: divides the logits first.
    Returns:
      entropy_BT: [B, T] float32.
    """
    _check_inputs("token_entropy", "logits_BTV", logits_BTV, "[B, T, V]", None, loss_mask_BT)
    dummy = jnp.zeros(loss_mask_BT.shape, jnp.int32)
    _, ent = _logp_entropy_from_logits(logits_BTV, dummy, temperature)
    return jnp.where(loss_mask_BT > 0, ent, 0.0)


def _chunk_logp_entropy(W_DV, temperature, h_BCD, tgt_BC):
    logits = jnp.einsum("bcd,dv->bcv", h_BCD, W_DV, preferred_element_type=f32)
    return _logp_entropy_from_logits(logits, tgt_BC, temperature)


def chunked_token_logprobs_and_entropy(
    h_BTD: jax.Array,
    W_DV: jax.Array,
    targets_BT: jax.Array,
    loss_mask_BT: jax.Array,
    *,
    chunk_size: int = 256,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Token log-probs and entropies from hidden states without materialising [B, T, V].

    Equal (values and gradients wrt ``h_BTD`` and ``W_DV``) to
    ``target_logprobs(h @ W, ...)`` / ``token_entropy(h @ W, ...)``.

    Args:
      h_BTD: [B, T, D] final hidden states (after the final norm).
      W_DV: [D, V] LM head (``unembed``); logits = h @ W computed in float32.
      targets_BT: [B, T] int token ids aligned with ``h_BTD``.
      loss_mask_BT: [B, T] 1 on model tokens.
      chunk_size: tokens per chunk along T (T is padded up to a multiple internally).
      temperature: divides the logits.
    Returns:
      (logp_BT, entropy_BT), both [B, T] float32 and 0 where loss_mask is 0.
    """
    fn = "chunked_token_logprobs_and_entropy"
    _check_inputs(fn, "h_BTD", h_BTD, "[B, T, D]", targets_BT, loss_mask_BT)
    B, T, D = h_BTD.shape
    check_ndim(fn, "W_DV", W_DV, "[D, V]")
    if W_DV.shape[0] != D:
        raise ValueError(
            f"{fn}: W_DV has shape {shape_of(W_DV)}, expected [D, V] with D = {D} "
            f"(the hidden size of h_BTD {shape_of(h_BTD)})"
        )
    if not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be an int >= 1, got {chunk_size!r}")
    C = min(chunk_size, T)
    n = -(-T // C)
    pad = n * C - T
    h = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0)))
    tgt = jnp.pad(targets_BT.astype(jnp.int32), ((0, 0), (0, pad)))
    h_NBCD = h.reshape(B, n, C, D).transpose(1, 0, 2, 3)
    tgt_NBC = tgt.reshape(B, n, C).transpose(1, 0, 2)
    # checkpoint: the backward recomputes each chunk's logits rather than saving [n, B, C, V].
    body = jax.checkpoint(functools.partial(_chunk_logp_entropy, W_DV, temperature))
    logp_NBC, ent_NBC = jax.lax.map(lambda xs: body(*xs), (h_NBCD, tgt_NBC))
    logp = logp_NBC.transpose(1, 0, 2).reshape(B, n * C)[:, :T]
    ent = ent_NBC.transpose(1, 0, 2).reshape(B, n * C)[:, :T]
    keep = loss_mask_BT > 0
    return jnp.where(keep, logp, 0.0), jnp.where(keep, ent, 0.0)


def chunked_token_logprobs(
    h_BTD: jax.Array,
    W_DV: jax.Array,
    targets_BT: jax.Array,
    loss_mask_BT: jax.Array,
    *,
    chunk_size: int = 256,
    temperature: float = 1.0,
) -> jax.Array:
    """Log-probs only; see ``chunked_token_logprobs_and_entropy`` (entropy is dead code, DCE'd)."""
    logp, _ = chunked_token_logprobs_and_entropy(
        h_BTD, W_DV, targets_BT, loss_mask_BT, chunk_size=chunk_size, temperature=temperature
    )
    return logp
