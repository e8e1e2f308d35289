"""The decode engine over `jaxrl_tools.models`: a fixed number of slots (rows of one KV cache of
`max_len` positions), prefill, bucketed writes into live slots, N-step generation.

It implements the methods of JetStream's Engine API; `engine.jetstream` adds the JetStream base
class for serving (JetStream imports TensorFlow, so the core and the rollout loop never import
it). Lengths are bucketed to powers of two (prefill, appends, rows per append) so that jit
compiles a handful of shapes. The engine's settings, weights, jitted functions and empty state
are its base's (`engine.base`); the state and kernels are in `engine.kernels`, the
decode step in `engine.decode_step`, the serving copy of the weights in `engine.serving`, the
host side of slot writes in `engine.slot_writes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_tools.engine.base import EngineBase
from jaxrl_tools.engine.kernels import (
    DecodeState,
    Params,
    Parked,
    Prefix,
    StepOutput,
    cache_axis,
    extract_kernel,
)
from jaxrl_tools.engine.sampling import SamplingParams, widest_mode
from jaxrl_tools.engine.slot_writes import pack_writes
from jaxrl_tools.shapes import next_pow2
from jaxrl_tools.sharding.distributed import to_host


def _host_key(rng) -> Any:
    """A PRNG key as given if it is a device array, else as a host uint32 array (passed to a
    jitted call as it is)."""
    return rng if isinstance(rng, jax.Array) else np.asarray(rng, np.uint32)


class EngineCore(EngineBase):
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
      mesh, rules: shard the cache (and loaded params) on this mesh by logical axes. Params
        handed to any method that live on another mesh (the trainer's, when the rollout has a
        mesh of its own) are resharded onto this one by their logical axes, once per new params
        object (with the serving-dtype cast).
      dtype: the serving dtype: params handed to any method are cast to it once per new params
        object (the bf16 rollout copy of fp32 master weights), and `load_params` loads in it.
        None: params are used as given (float32 for `load_params`).
      cache_dtype: KV cache dtype (None: `dtype`, else float32). Its size is logged at start
        (`cache_bytes`).
      sampling: default SamplingParams of a prefill that passes none.
      seed: base seed for prefills that pass no key (folded with a request counter).
      steps_per_generate: tokens per slot per Engine API `generate` call.
      logits_hook: optional jittable f(logits_BV, sampled_B, seq_B, hook_data) -> logits_BV
        applied before sampling (see LogitsHook); hook_data: its data (a pytree of arrays,
        traced).
      eos_token_ids: ids that end a sequence (default: the config's and the tokenizer's EOS).
      live_attention: decode and append steps attend only over the live part of the cache (a
        power-of-two bucket above the longest active row), so a step's cost follows the live
        length, not max_len. False: every step reads whole rows (the old engine; benchmarks).
      unstack_layers: serve a copy of the params with one array per layer
        (`models.unstack_layers`), made once per new params object: XLA:CPU copies every
        layer's weights out of the stacked arrays on each decode step. With tied embeddings the
        copy also holds the LM head as a [D, V] matrix (`models.untie_head`). None: on CPU only
        (one more copy of the weights, where models are small).
    """

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
        params = self.serving_params(params)
        tokens = np.asarray(padded_tokens, np.int32).reshape(-1)[: int(true_length)]
        n = len(tokens)
        bucket = self.prefill_bucket(n)
        start = 0 if existing_prefix is None else int(existing_prefix.length)
        if start + n > self.max_len:
            raise ValueError(f"prefix of {start + n} tokens exceeds max_len={self.max_len}")
        old_len = 0
        if existing_prefix is not None:
            length_axis = jax.tree.leaves(cache_axis("cache_length"))[0]
            old_len = jax.tree.leaves(existing_prefix.cache)[0].shape[length_axis]
        cache_len = min(next_pow2(max(start + bucket, old_len), 16), self.max_len)
        padded = np.zeros((bucket,), np.int32)
        padded[:n] = tokens
        # (host arguments: the jitted call moves them, with no dispatch of their own)
        cache, length, logits = self._prefill_jit(
            params, padded, np.int32(n), existing_prefix, cache_len
        )
        sp = sampling or self.default_sampling
        key = self._next_key() if rng is None else _host_key(rng)
        # Sampling settings stay host values: `insert` reads them without a device sync.
        return Prefix(
            cache=cache,
            length=length,
            logits=logits,
            key=key,
            temperature=np.float32(sp.temperature),
            top_k=np.int32(sp.top_k),
            top_p=np.float32(sp.top_p),
        )

    def insert(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        slot: int,
        *,
        rng: jax.Array | None = None,
        seq_id: int | None = None,
    ) -> DecodeState:
        """Copies `prefix` into row `slot` and activates it (the decode state is donated).

        Args:
          prefix: from `prefill`.
          decode_state: the state (donated).
          slot: row in [0, slots).
          rng: overrides the prefix's key (to insert one prefix as several samples).
          seq_id: the id of the sequence (its `seq` for `logits_hook`); default the slot.

        Returns:
          The new decode state.
        """
        if rng is not None:
            prefix = prefix.replace(key=_host_key(rng))
        self._slot_mode[slot] = SamplingParams(
            float(prefix.temperature), int(prefix.top_k), float(prefix.top_p)
        ).mode
        seq = np.int32(slot if seq_id is None else seq_id)
        return self._insert_jit(prefix, decode_state, np.int32(slot), np.int32(0), seq)

    def park(self, decode_state: DecodeState, slot: int, length: int) -> Parked:
        """Row `slot` copied out of the state (which is not changed) into host memory: its
        first `length` cache positions (bucketed), pending logits, key, sampling and counters.
        `unpark` puts it back into any slot, and the row decodes on as if it had never left.
        (Host memory: parked rows take no accelerator memory; a collective when the cache's
        rows span processes.)"""
        cache_len = min(next_pow2(length, 16), self.max_len)
        parked = extract_kernel(decode_state, jnp.int32(slot), cache_len=cache_len)
        if self._mesh is not None:
            # Whole on every device first: a row left on one process's devices would make
            # `to_host` a collective on the others only.
            parked = self._replicate(parked)
        return jax.tree.map(to_host, parked).replace(mode=self._slot_mode[slot])

    def unpark(self, decode_state: DecodeState, slot: int, parked: Parked) -> DecodeState:
        """Puts a row from `park` into `slot` and activates it (the decode state is donated)."""
        self._slot_mode[slot] = parked.mode
        return self._insert_jit(
            parked.prefix, decode_state, jnp.int32(slot), parked.sampled, parked.seq
        )

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
            mode = widest_mode(m for m, a in zip(self._slot_mode, active) if a)
        else:
            mode = widest_mode(self._slot_mode)
        attend_len = None
        if self.live_attention:
            # The lengths are read back (a few bytes; the caller reads this call's tokens anyway).
            act = to_host(decode_state.active) if active is None else np.asarray(active, bool)
            lengths = to_host(decode_state.lengths)  # a collective when rows span processes
            longest = int(lengths[act].max()) if act.any() else 0
            attend_len = self._attend_len(longest + n)
        return self.decode_step(
            self.serving_params(params),
            decode_state,
            self.hook_data,
            num_steps=n,
            mode=mode,
            attend_len=attend_len,
        )

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
        seq_ids: Sequence[int] | None = None,
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
          seq_ids: with `reset`, the id of each new sequence (its `seq` for `logits_hook`);
            default the slots.

        Returns:
          The new decode state.
        """
        w = pack_writes(
            slots,
            token_lists,
            starts=starts,
            sampled=sampled,
            reset=reset,
            seq_ids=seq_ids,
            num_slots=self.slots,
            max_len=self.max_len,
        )
        if w is None:
            return decode_state
        for slot, mode in w.modes.items():
            self._slot_mode[slot] = mode
        return self._write_jit(
            self.serving_params(params),
            decode_state,
            jnp.asarray(w.rows),
            jnp.asarray(w.tokens),
            jnp.asarray(w.starts),
            jnp.asarray(w.counts),
            jnp.asarray(w.sampled),
            None if w.reset is None else tuple(jnp.asarray(x) for x in w.reset),
            attend_len=self._attend_len(w.end),
        )

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
        return self.write_slots(
            params, decode_state, [slot], [list(tokens)], starts=[start], sampled=[sampled]
        )

    def slot_lengths(self, decode_state: DecodeState) -> np.ndarray:
        return to_host(decode_state.lengths)
