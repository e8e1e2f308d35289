"""Decode engine over `jaxrl_tools.models`, implementing JetStream's Engine API.

The engine holds a fixed number of slots (rows of one KV cache of `max_len` positions). Its
decode state is a pytree (`DecodeState`) that every jitted call donates and returns:

- `cache`: KV cache, row b = slot b, entry s = the token at absolute position s.
- `lengths[b]`: tokens written in row b (the next write position).
- `logits[b]`: the pending next-token logits of row b (those of its last written token). A
  generate step samples from them, writes the sampled token at `lengths[b]` and replaces them,
  so prefill and observation appends never sample: all sampling happens in `generate_steps`,
  from the slot's own RNG key, which advances only when the slot is active.
- per-slot sampling settings (temperature / top_k / top_p), RNG keys, `sampled[b]` (model tokens
  kept in the slot, fed to an optional `logits_hook`) and `active[b]`.

Lengths are bucketed to powers of two (prefill, appends, rows per append) so that jit compiles a
handful of shapes. JetStream (which imports TensorFlow through seqio and reconfigures the root
logger) is imported lazily, only when `DecodeEngine` or `HFTokenizer` is first used; the core
(`EngineCore`) and the rollout loop do not need it.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_tools.sampling import SamplingParams, sample_tokens, split_keys

Params = Any
# logits_hook(logits_BV, sampled_B, hook_data) -> logits_BV, applied before sampling (jitted).
# `sampled_B` is the number of model tokens kept in each slot so far; `hook_data` is the engine's
# `hook_data` pytree passed as a traced argument (changing it does not recompile). E.g. a test
# forces a scripted token sequence, or a caller adds a per-slot logit bias.
LogitsHook = Callable[[jax.Array, jax.Array, Any], jax.Array]


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


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
class StepOutput:
    """What `generate_steps` returns besides the state: N steps for every slot."""

    tokens: jax.Array  # int32 [B, N]
    logprobs: jax.Array  # float32 [B, N] behaviour log-probs (see jaxrl_tools.sampling)
    valid: jax.Array  # bool [B, N] False where the slot was inactive (nothing advanced)


def _models():
    from jaxrl_tools import models

    return models


def _batch_axis() -> Any:
    """Index of the "batch" axis of each cache leaf (from the models' logical cache axes)."""
    axes = _models().cache_axes()
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str | None) for a in x)
    return jax.tree.map(lambda a: a.index("batch"), axes, is_leaf=is_axes)


def _take_rows(cache, rows_M, batch_axis):
    return jax.tree.map(lambda x, ax: jnp.take(x, rows_M, axis=ax, mode="clip"), cache, batch_axis)


def _put_rows(cache, sub, rows_M, batch_axis):
    def put(x, s, ax):
        idx = (slice(None),) * ax + (rows_M,)
        return x.at[idx].set(s.astype(x.dtype), mode="drop")

    return jax.tree.map(put, cache, sub, batch_axis)


def _fwd(config, *args, **kwargs):
    return _models().forward_cached(config, *args, **kwargs)


@functools.partial(jax.jit, static_argnames=("config", "cache_dtype", "cache_len"))
def _prefill_kernel(params, tokens_T, true_length, existing, cache_len, *, config, cache_dtype):
    T = tokens_T.shape[0]
    cache = _models().init_cache(config, 1, cache_len, dtype=jnp.dtype(cache_dtype))
    start = jnp.zeros((), jnp.int32)
    if existing is not None:
        # Copy the existing prefix's row into the (longer) new one-row cache: no recompute.
        cache = jax.tree.map(
            lambda new, old: jax.lax.dynamic_update_slice(new, old.astype(new.dtype),
                                                          (0,) * new.ndim),
            cache, existing.cache)
        start = existing.length
    pos_1T = (start + jnp.arange(T, dtype=jnp.int32))[None]
    valid_1T = (jnp.arange(T) < true_length)[None]
    last_1 = jnp.maximum(true_length - 1, 0)[None]
    logits_1V, cache = _fwd(config, params, tokens_T[None], pos_1T, cache, valid_BT=valid_1T,
                            logits_at_B=last_1)
    return cache, start + true_length, logits_1V[0]


@functools.partial(jax.jit, donate_argnums=(1,))
def _insert_kernel(prefix: Prefix, state: DecodeState, slot):
    def put(x, p, ax):
        start = [0] * x.ndim
        start[ax] = slot
        return jax.lax.dynamic_update_slice(x, p.astype(x.dtype), start)

    cache = jax.tree.map(put, state.cache, prefix.cache, _batch_axis())
    return state.replace(
        cache=cache,
        lengths=state.lengths.at[slot].set(prefix.length),
        logits=state.logits.at[slot].set(prefix.logits),
        keys=state.keys.at[slot].set(prefix.key),
        temperature=state.temperature.at[slot].set(prefix.temperature),
        top_k=state.top_k.at[slot].set(prefix.top_k),
        top_p=state.top_p.at[slot].set(prefix.top_p),
        sampled=state.sampled.at[slot].set(0),
        active=state.active.at[slot].set(True),
    )


@functools.partial(jax.jit, static_argnames=("config",), donate_argnums=(1,))
def _write_kernel(params, state: DecodeState, rows_M, tokens_MK, starts_M, n_M, sampled_M,
                  reset, *, config):
    # Runs each row's K tokens at positions starts..starts+K-1 (the first n are real) on a
    # gathered sub-cache of those rows and scatters it back; rows_M == B marks padding rows.
    batch_axis = _batch_axis()
    K = tokens_MK.shape[1]
    sub = _take_rows(state.cache, rows_M, batch_axis)
    pos_MK = starts_M[:, None] + jnp.arange(K, dtype=jnp.int32)[None]
    valid_MK = jnp.arange(K)[None] < n_M[:, None]
    last_MV, sub = _fwd(config, params, tokens_MK, pos_MK, sub, valid_BT=valid_MK,
                        logits_at_B=jnp.maximum(n_M - 1, 0))
    st = state.replace(
        cache=_put_rows(state.cache, sub, rows_M, batch_axis),
        lengths=state.lengths.at[rows_M].set(starts_M + n_M, mode="drop"),
        logits=state.logits.at[rows_M].set(last_MV, mode="drop"),
        sampled=state.sampled.at[rows_M].set(sampled_M, mode="drop"),
    )
    if reset is not None:
        keys_M, temp_M, topk_M, topp_M = reset
        st = st.replace(
            keys=st.keys.at[rows_M].set(keys_M, mode="drop"),
            temperature=st.temperature.at[rows_M].set(temp_M, mode="drop"),
            top_k=st.top_k.at[rows_M].set(topk_M, mode="drop"),
            top_p=st.top_p.at[rows_M].set(topp_M, mode="drop"),
            active=st.active.at[rows_M].set(True, mode="drop"),
        )
    return st


@functools.partial(jax.jit, static_argnames=("num_steps", "use_filter", "config", "max_len",
                                             "hook"), donate_argnums=(1,))
def _generate_kernel(params, state: DecodeState, hook_data, *, num_steps, use_filter, config,
                     max_len, hook):
    def step(st: DecodeState, _):
        act_B = st.active & (st.lengths < max_len)
        keys_next, keys_use = split_keys(st.keys)
        logits_BV = st.logits
        if hook is not None:
            logits_BV = hook(logits_BV, st.sampled, hook_data)
        tok_B, lp_B = sample_tokens(logits_BV, keys_use, st.temperature, st.top_k, st.top_p,
                                    use_filter=use_filter)
        # Inactive rows are not written (valid=0) and keep their length, logits and key.
        new_logits, cache = _fwd(config, params, tok_B[:, None], st.lengths[:, None], st.cache,
                                 valid_BT=act_B[:, None])
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


class EngineCore:
    """The decode engine without the JetStream base class (no TensorFlow import).

    `DecodeEngine` (this plus `jetstream.engine.engine_api.Engine`) is what serving uses; the
    rollout loop accepts either.

    Args:
      config: the ModelConfig.
      params: parameters (or None and pass `path`, loaded by `load_params`).
      path: HF model folder for `load_params` / `from_pretrained`.
      slots: decode slots (max concurrent sequences).
      max_len: KV cache positions per slot (prompt + response + observations).
      max_prefill_length: longest prefill bucket; a power of two >= 16 (JetStream's buckets).
      tokenizer: an HF tokenizer (for the JetStream tokenizer hooks and the rollout loop).
      mesh, rules: shard the cache (and loaded params) on this mesh by logical axes.
      dtype: parameter dtype for `load_params`; cache_dtype: KV cache dtype.
      sampling: default SamplingParams of a prefill that passes none.
      seed: base seed for prefills that pass no key (folded with a request counter).
      steps_per_generate: tokens per slot per Engine API `generate` call.
      logits_hook: optional jittable f(logits_BV, sampled_B, hook_data) -> logits_BV applied
        before sampling (see LogitsHook); hook_data: its data (a pytree of arrays, traced).
      eos_token_ids: ids that end a sequence (default: the config's and the tokenizer's EOS).
    """

    def __init__(
        self,
        config,
        params: Params | None = None,
        *,
        path: str | os.PathLike | None = None,
        slots: int = 8,
        max_len: int = 1024,
        max_prefill_length: int = 512,
        tokenizer: Any = None,
        mesh: jax.sharding.Mesh | None = None,
        rules: Any = None,
        dtype: Any = jnp.float32,
        cache_dtype: Any = jnp.float32,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        steps_per_generate: int = 1,
        logits_hook: LogitsHook | None = None,
        hook_data: Any = None,
        eos_token_ids: Sequence[int] | None = None,
    ):
        if max_prefill_length < 16 or max_prefill_length & (max_prefill_length - 1):
            raise ValueError(
                f"max_prefill_length must be a power of two >= 16, got {max_prefill_length}"
            )
        if max_prefill_length > max_len:
            raise ValueError(f"max_prefill_length={max_prefill_length} exceeds max_len={max_len}")
        self.config = config
        self.params = params
        self.path = path
        self.slots = int(slots)
        self.max_len = int(max_len)
        self._max_prefill_length = int(max_prefill_length)
        self.tokenizer = tokenizer
        self._mesh = mesh
        self.rules = rules
        self.dtype = dtype
        self.cache_dtype = cache_dtype
        self.default_sampling = sampling or SamplingParams()
        self.seed = seed
        self.steps_per_generate = int(steps_per_generate)
        self.logits_hook = logits_hook
        self.hook_data = hook_data
        self.eos_token_ids = tuple(self._default_eos() if eos_token_ids is None else eos_token_ids)
        self._request_counter = 0
        # Host mirror of which slots need the top-k/top-p sort (a static flag of the decode jit).
        self._slot_filter = [False] * self.slots
        self._build_jits()

    def _default_eos(self) -> list[int]:
        ids = []
        eos = getattr(self.config, "eos_token_id", None)
        ids += [eos] if isinstance(eos, int) else list(eos or [])
        tok_eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer else None
        if tok_eos is not None and tok_eos not in ids:
            ids.append(tok_eos)
        return ids

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        """Loads config + params from an HF folder (sharded on `mesh` when given)."""
        m = _models()
        config, params = m.from_pretrained(
            path, dtype=kwargs.get("dtype", jnp.float32), mesh=kwargs.get("mesh"),
            rules=kwargs.get("rules"),
        )
        return cls(config, params, path=path, **kwargs)

    # ------------------------------------------------------------------ JetStream properties
    @property
    def max_concurrent_decodes(self) -> int:
        return self.slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill_length

    @property
    def mesh(self):
        return self._mesh

    @property
    def colocated_cpus(self):
        return jax.local_devices(backend="cpu")

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def get_prefix_destination_sharding(self) -> Any:
        """Prefixes are small; they are replicated on the mesh (or left on the default device)."""
        if self._mesh is None:
            return None
        return jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())

    def load_params(self, *args, **kwargs) -> Params:
        """The engine's params, loading them from `path` (sharded on the mesh) on first use."""
        if self.params is None:
            if self.path is None:
                raise ValueError("load_params: the engine was built without params or path")
            _, self.params = _models().from_pretrained(
                self.path, dtype=self.dtype, mesh=self._mesh, rules=self.rules
            )
        return self.params

    # ------------------------------------------------------------------ decode state
    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """An empty decode state: `slots` rows of `max_len` cache positions, all inactive."""
        B, V = self.slots, self.config.vocab_size
        cache = _models().init_cache(
            self.config, B, self.max_len, dtype=self.cache_dtype, mesh=self._mesh,
            **({"rules": self.rules} if self.rules is not None else {}),
        )
        self._slot_filter = [False] * B
        return DecodeState(
            cache=cache,
            lengths=jnp.zeros((B,), jnp.int32),
            logits=jnp.zeros((B, V), jnp.float32),
            keys=jnp.zeros((B, 2), jnp.uint32),
            temperature=jnp.ones((B,), jnp.float32),
            top_k=jnp.zeros((B,), jnp.int32),
            top_p=jnp.ones((B,), jnp.float32),
            sampled=jnp.zeros((B,), jnp.int32),
            active=jnp.zeros((B,), bool),
        )

    def _next_key(self) -> jax.Array:
        self._request_counter += 1
        return jax.random.fold_in(jax.random.PRNGKey(self.seed), self._request_counter)

    def prefill_bucket(self, n: int) -> int:
        """The padded length used for `n` prompt tokens (power of two, >= 16)."""
        if n > self._max_prefill_length:
            raise ValueError(
                f"prompt of {n} tokens exceeds max_prefill_length={self._max_prefill_length}"
            )
        return next_pow2(n, 16)

    # ------------------------------------------------------------------ jitted kernels
    def _build_jits(self):
        # Module-level jits keyed by hashable statics: engines with the same config share compiles.
        statics = dict(config=self.config, cache_dtype=jnp.dtype(self.cache_dtype).name,
                       max_len=self.max_len, hook=self.logits_hook)
        self._prefill_jit = functools.partial(
            _prefill_kernel, config=self.config, cache_dtype=statics["cache_dtype"])
        self._insert_jit = _insert_kernel
        self._write_jit = functools.partial(_write_kernel, config=self.config)
        self._generate_jit = lambda params, state, n, use_filter: _generate_kernel(
            params, state, self.hook_data, num_steps=n, use_filter=use_filter,
            config=statics["config"],
            max_len=statics["max_len"], hook=statics["hook"])

    # ------------------------------------------------------------------ Engine API
    def prefill(
        self,
        *,
        params: Params,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array,
        true_length: int,
        sampling: SamplingParams | None = None,
        rng: jax.Array | None = None,
    ) -> Prefix:
        """KV cache of `padded_tokens[:true_length]`, appended after `existing_prefix` if given.

        Args:
          params: model params.
          existing_prefix: a Prefix the tokens continue (its cache is copied, not recomputed).
          padded_tokens: int [T] (any T; re-padded to a power-of-two bucket).
          true_length: number of real tokens.
          sampling: SamplingParams for the slot this prefix is inserted into.
          rng: the slot's PRNG key (default: engine seed folded with a request counter).

        Returns:
          A Prefix (one-row cache of a bucketed length, pending logits, key, sampling).
        """
        tokens = np.asarray(padded_tokens, np.int32).reshape(-1)[: int(true_length)]
        n = len(tokens)
        bucket = self.prefill_bucket(n)
        start = 0 if existing_prefix is None else int(existing_prefix.length)
        if start + n > self.max_len:
            raise ValueError(f"prefix of {start + n} tokens exceeds max_len={self.max_len}")
        old_len = 0 if existing_prefix is None else jax.tree.leaves(existing_prefix.cache)[0].shape[
            self._cache_len_axis()]
        cache_len = min(next_pow2(max(start + bucket, old_len), 16), self.max_len)
        padded = np.zeros((bucket,), np.int32)
        padded[:n] = tokens
        cache, length, logits = self._prefill_jit(
            params, jnp.asarray(padded), jnp.int32(n), existing_prefix, cache_len
        )
        sp = sampling or self.default_sampling
        key = self._next_key() if rng is None else jnp.asarray(rng)
        return Prefix(
            cache=cache, length=length, logits=logits, key=key,
            temperature=jnp.float32(sp.temperature), top_k=jnp.int32(sp.top_k),
            top_p=jnp.float32(sp.top_p),
        )

    def _cache_len_axis(self) -> int:
        axes = _models().cache_axes()
        first = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))[0]
        return first.index("cache_length")

    def insert(
        self, prefix: Prefix, decode_state: DecodeState, slot: int, *, rng: jax.Array | None = None
    ) -> DecodeState:
        """Copies `prefix` into row `slot` and activates it (the decode state is donated).

        Args:
          prefix: from `prefill`.
          decode_state: the state (donated).
          slot: row in [0, slots).
          rng: overrides the prefix's key (to insert one prefix as several samples).
        """
        if rng is not None:
            prefix = prefix.replace(key=jnp.asarray(rng))
        self._slot_filter[slot] = bool(
            float(prefix.temperature) > 0 and (int(prefix.top_k) > 0 or float(prefix.top_p) < 1)
        )
        return self._insert_jit(prefix, decode_state, jnp.int32(slot))

    def generate_steps(
        self,
        params: Params,
        decode_state: DecodeState,
        num_steps: int | None = None,
        *,
        active: np.ndarray | None = None,
    ) -> tuple[DecodeState, StepOutput]:
        """`num_steps` decode steps for every active slot in one jitted scan (state donated).

        Args:
          params: model params.
          decode_state: the state (donated).
          num_steps: tokens per slot (static; default `steps_per_generate`).
          active: optional bool [slots] replacing the state's active mask (paused / finished
            slots do not advance: no cache write, no length or key change).

        Returns:
          (new state, StepOutput with tokens / logprobs / valid of shape [slots, num_steps]).
        """
        n = self.steps_per_generate if num_steps is None else int(num_steps)
        if active is not None:
            decode_state = decode_state.replace(active=jnp.asarray(active, bool))
            use_filter = any(f for f, a in zip(self._slot_filter, active) if a)
        else:
            use_filter = any(self._slot_filter)
        return self._generate_jit(params, decode_state, n, use_filter)

    def generate(self, params: Params, decode_state: DecodeState):
        """Engine API step: `steps_per_generate` tokens per slot as JetStream ResultTokens.

        Lengths reported per slot are the number of tokens sampled in it so far.
        """
        from jetstream.engine import engine_api

        decode_state, out = self.generate_steps(params, decode_state)
        n = out.tokens.shape[1]
        data = jnp.concatenate(
            [out.tokens, out.valid.astype(jnp.int32), decode_state.sampled[:, None]], axis=1
        )
        result = engine_api.ResultTokens(
            data=data, tokens_idx=(0, n), valid_idx=(n, 2 * n), length_idx=(2 * n, 2 * n + 1),
            samples_per_slot=1,
        )
        return decode_state, result

    # ------------------------------------------------------------------ host-side helpers
    def write_slots(
        self,
        params: Params,
        decode_state: DecodeState,
        slots: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        *,
        starts: Sequence[int] | None = None,
        sampled: Sequence[int] | None = None,
        reset: Sequence[tuple[jax.Array, SamplingParams]] | None = None,
    ) -> DecodeState:
        """Writes tokens into several slots' caches in one jitted call (no prefix recompute).

        Row `slots[i]` gets `token_lists[i]` at positions `starts[i]..`; its length becomes
        `starts[i] + len(token_lists[i])` (positions past that are stale and never attended to,
        so this also rolls back tokens sampled after a host-side stop) and its pending logits
        those of its last new token. Row count and token count are bucketed to powers of two.

        Args:
          params: model params.
          decode_state: the state (donated).
          slots: rows to write.
          token_lists: tokens per row (each non-empty).
          starts: first position per row (required; 0 loads a new prompt into a free slot).
          sampled: model tokens kept in the row so far (for `logits_hook`), default 0.
          reset: per row (key, SamplingParams): a new sequence; sets its key and sampling and
            activates it. None keeps the rows' keys/sampling/active flags.

        Returns:
          The new decode state.
        """
        m = len(slots)
        if m == 0:
            return decode_state
        if starts is None:
            raise ValueError("write_slots: `starts` (first position per row) is required")
        lens = [len(t) for t in token_lists]
        if min(lens) < 1:
            raise ValueError("write_slots: every token list must be non-empty")
        for s, st, n in zip(slots, starts, lens):
            if st + n > self.max_len:
                raise ValueError(
                    f"write_slots: slot {s} would hold {st + n} tokens > max_len={self.max_len}"
                )
        M = next_pow2(m)
        K = min(next_pow2(max(lens), 16), self.max_len)
        rows = np.full((M,), self.slots, np.int32)
        rows[:m] = slots
        toks = np.zeros((M, K), np.int32)
        for i, t in enumerate(token_lists):
            toks[i, : len(t)] = t
        st_M = np.zeros((M,), np.int32)
        st_M[:m] = starts
        n_M = np.zeros((M,), np.int32)
        n_M[:m] = lens
        sm_M = np.zeros((M,), np.int32)
        if sampled is not None:
            sm_M[:m] = sampled
        rs = None
        if reset is not None:
            keys = np.zeros((M, 2), np.uint32)
            temp = np.ones((M,), np.float32)
            topk = np.zeros((M,), np.int32)
            topp = np.ones((M,), np.float32)
            for i, (key, sp) in enumerate(reset):
                keys[i] = np.asarray(key, np.uint32)
                temp[i], topk[i], topp[i] = sp.temperature, sp.top_k, sp.top_p
                self._slot_filter[slots[i]] = sp.needs_filter
            rs = tuple(jnp.asarray(x) for x in (keys, temp, topk, topp))
        return self._write_jit(params, decode_state, jnp.asarray(rows), jnp.asarray(toks),
                               jnp.asarray(st_M), jnp.asarray(n_M), jnp.asarray(sm_M), rs)

    def append(
        self,
        params: Params,
        decode_state: DecodeState,
        slot: int,
        tokens: Sequence[int],
        *,
        start: int,
        sampled: int = 0,
    ) -> DecodeState:
        """Appends `tokens` (e.g. a tool observation) to a live slot at position `start`.

        One jitted call over the slot's row only, bucketed length; no recompute of the prefix.
        See `write_slots` (this is its one-row case).
        """
        return self.write_slots(params, decode_state, [slot], [list(tokens)], starts=[start],
                                sampled=[sampled])

    def slot_lengths(self, decode_state: DecodeState) -> np.ndarray:
        return np.asarray(decode_state.lengths)


# ---------------------------------------------------------------------- lazy JetStream side
def _import_jetstream():
    """Imports JetStream's engine API, keeping the root logger and TF's log level as they were."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2
    finally:
        root.setLevel(level)
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
    return engine_api, token_utils, tokenizer_api, tokenizer_pb2


def import_orchestrator():
    """`jetstream.core.orchestrator` (it reconfigures the root logger on import; undone here)."""
    _import_jetstream()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        from jetstream.core import orchestrator
    finally:
        root.setLevel(level)
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
    if not hasattr(jax, "tree_map"):
        # JetStream 0.2.2 frees prefixes with jax.tree_map, removed in current JAX.
        def delete_pytree(p):
            jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, p)

        orchestrator.delete_pytree = delete_pytree
    return orchestrator


@functools.cache
def _classes():
    engine_api, token_utils, tokenizer_api, tokenizer_pb2 = _import_jetstream()

    class HFTokenizer(tokenizer_api.Tokenizer):
        """JetStream Tokenizer over a Hugging Face tokenizer.

        Args:
          tokenizer: the HF tokenizer.
          stop_ids: token ids that end generation (default: EOS).
        """

        def __init__(self, tokenizer, stop_ids: Sequence[int] | None = None):
            self.hf = tokenizer
            self._stop = set(stop_ids) if stop_ids else {self.eos_id}

        def encode(self, s: str, **kwargs):
            is_bos = kwargs.pop("is_bos", False) and self.bos_id is not None
            ids = np.asarray(self.hf.encode(s, add_special_tokens=False), np.int32)
            return token_utils.pad_tokens(
                ids, self.bos_id if is_bos else 0, self.pad_id, is_bos=is_bos,
                prefill_lengths=kwargs.pop("prefill_lengths", None),
                max_prefill_length=kwargs.pop("max_prefill_length", None),
                jax_padding=kwargs.pop("jax_padding", True),
            )

        def decode(self, token_ids: list[int], **kwargs) -> str:
            return self.hf.decode(list(token_ids), skip_special_tokens=False)

        @property
        def pad_id(self) -> int:
            pad = self.hf.pad_token_id
            return self.eos_id if pad is None else pad

        @property
        def eos_id(self) -> int:
            return self.hf.eos_token_id

        @property
        def bos_id(self):
            return self.hf.bos_token_id

        @property
        def stop_tokens(self) -> set[int]:
            return set(self._stop)

    class DecodeEngine(EngineCore, engine_api.Engine):
        """`EngineCore` as a `jetstream.engine.engine_api.Engine` (servable by its Driver)."""

        def get_tokenizer(self):
            path = getattr(self.tokenizer, "name_or_path", "") if self.tokenizer else ""
            return tokenizer_pb2.TokenizerParameters(path=str(path or self.path or ""))

        def build_tokenizer(self, metadata) -> HFTokenizer:
            tok = self.tokenizer
            if tok is None:
                if not metadata.path:
                    raise ValueError("build_tokenizer: the engine has no tokenizer and no path")
                import transformers

                tok = transformers.AutoTokenizer.from_pretrained(metadata.path)
            return HFTokenizer(tok, stop_ids=self.eos_token_ids or None)

    return DecodeEngine, HFTokenizer


def __getattr__(name: str):
    # `DecodeEngine` / `HFTokenizer` subclass JetStream classes: built on first access only.
    if name == "DecodeEngine":
        return _classes()[0]
    if name == "HFTokenizer":
        return _classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Also `DecodeEngine` and `HFTokenizer`, built lazily by the module __getattr__ above.
__all__ = [
    "DecodeState",
    "EngineCore",
    "Prefix",
    "StepOutput",
    "import_orchestrator",
    "next_pow2",
]
