"""The decode engine's jitted kernels and the state they transform.

The decode state (`DecodeState`) is a pytree that every jitted call donates and returns:

- `cache`: KV cache, row b = slot b, entry s = the token at absolute position s.
- `lengths[b]`: tokens written in row b (the next write position).
- `logits[b]`: the pending next-token logits of row b (those of its last written token). A
  generate step samples from them, writes the sampled token at `lengths[b]` and replaces them,
  so prefill and observation appends never sample: all sampling happens in `generate_kernel`,
  from the slot's own RNG key, which advances only when the slot is active.
- per-slot sampling settings (temperature / top_k / top_p), RNG keys, `sampled[b]` (model tokens
  kept in the slot) and `seq[b]` (the caller's id of the sequence in the slot), both fed to an
  optional `logits_hook`, and `active[b]`.

A row can leave its slot and come back in another (`extract_kernel` / `insert_kernel`): the
rollout loop parks a trajectory waiting on a tool so a queued one decodes in its place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxrl_tools import models
from jaxrl_tools.engine.sampling import sample_tokens, split_keys

Params = Any
# logits_hook(logits_BV, sampled_B, seq_B, hook_data) -> logits_BV, applied before sampling
# (jitted). `sampled_B` is the number of model tokens kept in each slot so far, `seq_B` the id of
# the sequence each slot holds (the rollout loop's sample index; the slot for JetStream inserts)
# and `hook_data` the engine's `hook_data` pytree, passed as a traced argument (changing it does
# not recompile). E.g. a test forces a scripted token sequence per sample, or a caller adds a
# per-sequence logit bias.
LogitsHook = Callable[[jax.Array, jax.Array, jax.Array, Any], jax.Array]


@flax.struct.dataclass
class DecodeState:
    """Everything a decode step transforms; see the module docstring. B = slots, V = vocab."""

    cache: Any
    lengths: jax.Array  # int32 [B]
    logits: jax.Array  # float32 [B, V]
    keys: jax.Array  # uint32 [B, 2]
    temperature: jax.Array  # float32 [B]
    top_k: jax.Array  # int32 [B]
    top_p: jax.Array  # float32 [B]
    sampled: jax.Array  # int32 [B]
    seq: jax.Array  # int32 [B]
    active: jax.Array  # bool [B]


@flax.struct.dataclass
class Prefix:
    """The result of a prefill: a one-row cache of a bucketed length plus the slot's metadata."""

    cache: Any  # KVCache with batch 1
    length: jax.Array  # int32 [] tokens written
    logits: jax.Array  # float32 [V] pending logits
    key: jax.Array  # uint32 [2]
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


@flax.struct.dataclass
class Parked:
    """A row lifted out of the decode state: everything that decides its next tokens."""

    prefix: Prefix  # the cache up to a bucketed length, pending logits, key, sampling
    sampled: jax.Array  # int32 []
    seq: jax.Array  # int32 []
    mode: str = flax.struct.field(pytree_node=False, default="sample")  # sampling.MODES


@flax.struct.dataclass
class StepOutput:
    """What `generate_steps` returns besides the state: N steps for every slot."""

    tokens: jax.Array  # int32 [B, N]
    logprobs: jax.Array  # float32 [B, N] behaviour log-probs (see jaxrl_tools.sampling)
    valid: jax.Array  # bool [B, N] False where the slot was inactive (nothing advanced)


def cache_axis(name: str) -> Any:
    """Index of the logical axis `name` ("batch", "cache_length") in each cache leaf (a tree
    like the cache, from the models' logical cache axes)."""
    axes = models.cache_axes()
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str | None) for a in x)
    return jax.tree.map(lambda a: a.index(name), axes, is_leaf=is_axes)


def _take_rows(cache, rows_M, batch_axis):
    return jax.tree.map(lambda x, ax: jnp.take(x, rows_M, axis=ax, mode="clip"), cache, batch_axis)


def _put_rows(cache, sub, rows_M, batch_axis):
    def put(x, s, ax):
        idx = (slice(None),) * ax + (rows_M,)
        return x.at[idx].set(s.astype(x.dtype), mode="drop")

    return jax.tree.map(put, cache, sub, batch_axis)


def _fwd(config, *args, **kwargs):
    return models.forward_cached(config, *args, **kwargs)


@functools.partial(jax.jit, static_argnames=("config", "cache_dtype", "cache_len"))
def prefill_kernel(params, tokens_T, true_length, existing, cache_len, *, config, cache_dtype):
    T = tokens_T.shape[0]
    cache = models.init_cache(config, 1, cache_len, dtype=jnp.dtype(cache_dtype))
    start = jnp.zeros((), jnp.int32)
    if existing is not None:
        # Copy the existing prefix's row into the (longer) new one-row cache: no recompute.
        cache = jax.tree.map(
            lambda new, old: jax.lax.dynamic_update_slice(
                new, old.astype(new.dtype), (0,) * new.ndim
            ),
            cache,
            existing.cache,
        )
        start = existing.length
    pos_1T = (start + jnp.arange(T, dtype=jnp.int32))[None]
    valid_1T = (jnp.arange(T) < true_length)[None]
    last_1 = jnp.maximum(true_length - 1, 0)[None]
    logits_1V, cache = _fwd(
        config, params, tokens_T[None], pos_1T, cache, valid_BT=valid_1T, logits_at_B=last_1
    )
    return cache, start + true_length, logits_1V[0]


@functools.partial(jax.jit, donate_argnums=(1,))
def insert_kernel(prefix: Prefix, state: DecodeState, slot, sampled, seq):
    def put(x, p, ax):
        start = [0] * x.ndim
        start[ax] = slot
        return jax.lax.dynamic_update_slice(x, p.astype(x.dtype), start)

    cache = jax.tree.map(put, state.cache, prefix.cache, cache_axis("batch"))
    return state.replace(
        cache=cache,
        lengths=state.lengths.at[slot].set(prefix.length),
        logits=state.logits.at[slot].set(prefix.logits),
        keys=state.keys.at[slot].set(prefix.key),
        temperature=state.temperature.at[slot].set(prefix.temperature),
        top_k=state.top_k.at[slot].set(prefix.top_k),
        top_p=state.top_p.at[slot].set(prefix.top_p),
        sampled=state.sampled.at[slot].set(sampled),
        seq=state.seq.at[slot].set(seq),
        active=state.active.at[slot].set(True),
    )


@functools.partial(jax.jit, static_argnames=("cache_len",))
def extract_kernel(state: DecodeState, slot, *, cache_len) -> Parked:
    # Row `slot`'s first `cache_len` positions (>= its length) and metadata; `insert_kernel`
    # puts them back, in any slot, bit for bit.
    def take(x, b_ax, t_ax):
        start = [0] * x.ndim
        start[b_ax] = slot
        sizes = list(x.shape)
        sizes[b_ax], sizes[t_ax] = 1, cache_len
        return jax.lax.dynamic_slice(x, start, sizes)

    prefix = Prefix(
        cache=jax.tree.map(take, state.cache, cache_axis("batch"), cache_axis("cache_length")),
        length=state.lengths[slot],
        logits=state.logits[slot],
        key=state.keys[slot],
        temperature=state.temperature[slot],
        top_k=state.top_k[slot],
        top_p=state.top_p[slot],
    )
    return Parked(prefix=prefix, sampled=state.sampled[slot], seq=state.seq[slot])


@functools.partial(jax.jit, static_argnames=("config", "attend_len"), donate_argnums=(1,))
def write_kernel(
    params,
    state: DecodeState,
    rows_M,
    tokens_MK,
    starts_M,
    n_M,
    sampled_M,
    reset,
    *,
    config,
    attend_len=None,
):
    # Runs each row's K tokens at positions starts..starts+K-1 (the first n are real) on a
    # gathered sub-cache of those rows and scatters it back; rows_M == B marks padding rows.
    # Attention reads the first `attend_len` positions (> every real token's position).
    batch_axis = cache_axis("batch")
    K = tokens_MK.shape[1]
    sub = _take_rows(state.cache, rows_M, batch_axis)
    pos_MK = starts_M[:, None] + jnp.arange(K, dtype=jnp.int32)[None]
    valid_MK = jnp.arange(K)[None] < n_M[:, None]
    last_MV, sub = _fwd(
        config,
        params,
        tokens_MK,
        pos_MK,
        sub,
        valid_BT=valid_MK,
        logits_at_B=jnp.maximum(n_M - 1, 0),
        attend_len=attend_len,
    )
    st = state.replace(
        cache=_put_rows(state.cache, sub, rows_M, batch_axis),
        lengths=state.lengths.at[rows_M].set(starts_M + n_M, mode="drop"),
        logits=state.logits.at[rows_M].set(last_MV, mode="drop"),
        sampled=state.sampled.at[rows_M].set(sampled_M, mode="drop"),
    )
    if reset is not None:
        keys_M, temp_M, topk_M, topp_M, seq_M = reset
        st = st.replace(
            seq=st.seq.at[rows_M].set(seq_M, mode="drop"),
            keys=st.keys.at[rows_M].set(keys_M, mode="drop"),
            temperature=st.temperature.at[rows_M].set(temp_M, mode="drop"),
            top_k=st.top_k.at[rows_M].set(topk_M, mode="drop"),
            top_p=st.top_p.at[rows_M].set(topp_M, mode="drop"),
            active=st.active.at[rows_M].set(True, mode="drop"),
        )
    return st


@functools.partial(
    jax.jit,
    static_argnames=("num_steps", "mode", "config", "max_len", "hook", "attend_len"),
    donate_argnums=(1,),
)
def generate_kernel(
    params,
    state: DecodeState,
    hook_data,
    *,
    num_steps,
    mode,
    config,
    max_len,
    hook,
    attend_len=None,
):
    # Each step attends over the first `attend_len` cache positions only: the engine passes a
    # power-of-two bucket above every active row's length after `num_steps` steps, so a step
    # costs what the live part of the cache costs, not max_len (None: the whole row).
    def step(st: DecodeState, _):
        act_B = st.active & (st.lengths < max_len)
        keys_next, keys_use = split_keys(st.keys)
        logits_BV = st.logits
        if hook is not None:
            logits_BV = hook(logits_BV, st.sampled, st.seq, hook_data)
        tok_B, lp_B = sample_tokens(
            logits_BV, keys_use, st.temperature, st.top_k, st.top_p, mode=mode
        )
        # Inactive rows are not written (valid=0) and keep their length, logits and key.
        new_logits, cache = _fwd(
            config,
            params,
            tok_B[:, None],
            st.lengths[:, None],
            st.cache,
            valid_BT=act_B[:, None],
            attend_len=attend_len,
        )
        st = st.replace(
            cache=cache,
            lengths=st.lengths + act_B,
            logits=jnp.where(act_B[:, None], new_logits[:, 0], st.logits),
            keys=jnp.where(act_B[:, None], keys_next, st.keys),
            sampled=st.sampled + act_B,
        )
        return st, (tok_B, lp_B, act_B)

    state, (tok_NB, lp_NB, act_NB) = jax.lax.scan(step, state, None, length=num_steps)
    return state, StepOutput(tokens=tok_NB.T, logprobs=lp_NB.T, valid=act_NB.T)
