"""Per-token log-probabilities and entropies, plain and memory-efficient (chunked).

Alignment: ``targets_BT[b, t]`` is the token whose log-prob is read from ``logits_BTV[b, t]``
(the caller shifts: logits at position t predict token t+1). ``loss_mask_BT`` is 1 on model
tokens; results are exactly 0 at masked positions, and so is their gradient.

The chunked variant takes the final hidden states ``h_BTD`` and the LM head ``W_DV``
(logits = h @ W, see ``jaxrl_tools.models.hidden_states`` / ``unembed``) and walks the sequence
in chunks of ``chunk_size`` tokens with ``lax.map``; each chunk is wrapped in ``jax.checkpoint``
so the backward pass recomputes the chunk's logits instead of storing them. Neither pass ever
holds more than one [B, chunk, V] float32 block (plus dW), instead of [B, T, V].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

f32 = jnp.float32


def _check_targets(name: str, targets_BT, loss_mask_BT, lead_shape) -> None:
    if targets_BT.shape != tuple(lead_shape):
        raise ValueError(f"targets_BT shape {targets_BT.shape} != {name} leading shape "
                         f"{tuple(lead_shape)}")
    if loss_mask_BT.shape != targets_BT.shape:
        raise ValueError(f"loss_mask_BT shape {loss_mask_BT.shape} != targets_BT shape "
                         f"{targets_BT.shape}")


def _logp_entropy_from_logits(logits_BTV, targets_BT, temperature):
    logits = logits_BTV.astype(f32) / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets_BT[..., None].astype(jnp.int32), axis=-1)[..., 0]
    probs = jnp.exp(logits - lse[..., None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return tgt - lse, entropy


def token_logprobs(logits_BTV: jax.Array, targets_BT: jax.Array, loss_mask_BT: jax.Array, *,
                   temperature: float = 1.0) -> jax.Array:
    """log softmax(logits / temperature)[target] per token, float32, 0 where loss_mask is 0.

    Args:
      logits_BTV: [B, T, V] logits (any float dtype; cast to float32).
      targets_BT: [B, T] int token ids aligned with the logits.
      loss_mask_BT: [B, T] 1 on model tokens.
      temperature: sampling temperature the behaviour policy used.
    Returns:
      logp_BT: [B, T] float32.
    """
    _check_targets("logits_BTV", targets_BT, loss_mask_BT, logits_BTV.shape[:2])
    logp, _ = _logp_entropy_from_logits(logits_BTV, targets_BT, temperature)
    return jnp.where(loss_mask_BT > 0, logp, 0.0)


def token_entropy(logits_BTV: jax.Array, loss_mask_BT: jax.Array, *,
                  temperature: float = 1.0) -> jax.Array:
    """Entropy logsumexp(z) - sum softmax(z) z per token, float32, 0 where loss_mask is 0.

    Args:
      logits_BTV: [B, T, V] logits.
      loss_mask_BT: [B, T] 1 on model tokens.
      temperature: divides the logits first.
    Returns:
      entropy_BT: [B, T] float32.
    """
    if loss_mask_BT.shape != logits_BTV.shape[:2]:
        raise ValueError(f"loss_mask_BT shape {loss_mask_BT.shape} != logits_BTV leading shape "
                         f"{logits_BTV.shape[:2]}")
    dummy = jnp.zeros(loss_mask_BT.shape, jnp.int32)
    _, ent = _logp_entropy_from_logits(logits_BTV, dummy, temperature)
    return jnp.where(loss_mask_BT > 0, ent, 0.0)


def _chunk_logp_entropy(W_DV, temperature, h_BCD, tgt_BC):
    logits = jnp.einsum("bcd,dv->bcv", h_BCD, W_DV, preferred_element_type=f32)
    return _logp_entropy_from_logits(logits, tgt_BC, temperature)


def chunked_token_logprobs_and_entropy(h_BTD: jax.Array, W_DV: jax.Array, targets_BT: jax.Array,
                                       loss_mask_BT: jax.Array, *, chunk_size: int = 256,
                                       temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Token log-probs and entropies from hidden states without materialising [B, T, V].

    Equal (values and gradients wrt ``h_BTD`` and ``W_DV``) to
    ``token_logprobs(h @ W, ...)`` / ``token_entropy(h @ W, ...)``.

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
    B, T, D = h_BTD.shape
    if W_DV.ndim != 2 or W_DV.shape[0] != D:
        raise ValueError(f"W_DV shape {W_DV.shape} does not match h_BTD hidden size {D}")
    _check_targets("h_BTD", targets_BT, loss_mask_BT, (B, T))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
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


def chunked_token_logprobs(h_BTD: jax.Array, W_DV: jax.Array, targets_BT: jax.Array,
                           loss_mask_BT: jax.Array, *, chunk_size: int = 256,
                           temperature: float = 1.0) -> jax.Array:
    """Log-probs only; see ``chunked_token_logprobs_and_entropy`` (entropy is dead code, DCE'd)."""
    logp, _ = chunked_token_logprobs_and_entropy(h_BTD, W_DV, targets_BT, loss_mask_BT,
                                                 chunk_size=chunk_size, temperature=temperature)
    return logp
