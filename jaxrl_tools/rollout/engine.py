"""The decode engine over `jaxrl_tools.models`: a fixed number of slots (rows of one KV cache of
`max_len` positions), prefill, bucketed writes into live slots, N-step generation.

It implements the methods of JetStream's Engine API; `rollout.jetstream` adds the JetStream base
class for serving (JetStream imports TensorFlow, so the core and the rollout loop never import
it). Lengths are bucketed to powers of two (prefill, appends, rows per append) so that jit
compiles a handful of shapes. The state and kernels are in `rollout.kernels`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_tools import models, sharding
from jaxrl_tools.rollout.kernels import (
    DecodeState,
    LogitsHook,
    Params,
    Parked,
    Prefix,
    StepOutput,
    cache_axis,
    extract_kernel,
    generate_kernel,
    insert_kernel,
    next_pow2,
    prefill_kernel,
    write_kernel,
)
from jaxrl_tools.rollout.sampling import SamplingParams, widest_mode
from jaxrl_tools.sharding.distributed import to_host

log = logging.getLogger(__name__)


def _on_mesh(params: Params, mesh) -> bool:
    """Whether every array of `params` is sharded on `mesh` (not on another mesh, e.g. the
    trainer's, or on one device)."""
    for leaf in jax.tree.leaves(params):
        sh = getattr(leaf, "sharding", None)
        if not isinstance(sh, jax.sharding.NamedSharding) or sh.mesh != mesh:
            return False
    return True


@functools.partial(jax.jit, static_argnums=1)
def _cast_jit(params, dtype: str):
    return models.cast_floating(params, dtype)


def _host_key(rng) -> Any:
    """A PRNG key as given if it is a device array, else as a host uint32 array (passed to a
    jitted call as it is)."""
    return rng if isinstance(rng, jax.Array) else np.asarray(rng, np.uint32)


# The CPU serving layout: one array per layer, and a [D, V] LM head for tied embeddings.
_cpu_layout_jit = jax.jit(lambda params: models.untie_head(models.unstack_layers(params)))


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
        dtype: Any = None,
        cache_dtype: Any = None,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        steps_per_generate: int = 1,
        logits_hook: LogitsHook | None = None,
        hook_data: Any = None,
        eos_token_ids: Sequence[int] | None = None,
        live_attention: bool = True,
        unstack_layers: bool | None = None,
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
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.cache_dtype = jnp.dtype(
            cache_dtype if cache_dtype is not None else (dtype if dtype is not None else "float32")
        )
        self.live_attention = bool(live_attention)
        if unstack_layers is None:
            unstack_layers = jax.default_backend() == "cpu"
        self.unstack_layers = bool(unstack_layers)
        self._served: tuple[Any, Any] | None = None  # (params given, their serving copy)
        self.default_sampling = sampling or SamplingParams()
        self.seed = seed
        self.steps_per_generate = int(steps_per_generate)
        self.logits_hook = logits_hook
        self.hook_data = hook_data
        self.eos_token_ids = tuple(self._default_eos() if eos_token_ids is None else eos_token_ids)
        self._request_counter = 0
        # Host mirror of each slot's sampling mode (`sampling.MODES`): the decode jit's static
        # mode is the widest among the active slots. A slot never set samples at temperature 1.
        self._slot_mode = ["sample"] * self.slots
        self._build_jits()
        if mesh is not None:
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self._replicate = jax.jit(lambda x: x, out_shardings=replicated)
        log.info(
            "KV cache: %d slots x %d positions, %s: %.3f GiB",
            self.slots,
            self.max_len,
            self.cache_dtype.name,
            self.cache_bytes / 2**30,
        )

    @property
    def cache_bytes(self) -> int:
        """Bytes of the decode state's KV cache (all slots, all layers, keys and values)."""
        return models.cache_bytes(self.config, self.slots, self.max_len, self.cache_dtype)

    def serving_params(self, params: Params) -> Params:
        """`params` as the engine serves them: in the serving dtype, on the engine's mesh and
        (`unstack_layers`) one array per layer. Cast (the cast keeps each array's sharding),
        resharded and unstacked once per new params object, so the rollout of an RL step does it
        once; the params themselves when nothing changes."""
        if params is None:
            return params
        if self._served is not None:
            if params is self._served[0] or params is self._served[1]:  # (the copy handed back)
                return self._served[1]
            self._served = None  # drop the previous copy before making the next
        served = params
        if self.dtype is not None and models.cast_floating(params, self.dtype) is not params:
            served = _cast_jit(params, self.dtype.name)
        if self._mesh is not None and not _on_mesh(served, self._mesh):
            shardings = sharding.tree_shardings(
                models.logical_axes(self.config), self._mesh, self.rules, shapes=served
            )
            served = jax.device_put(served, shardings)
        if self.unstack_layers and models.has_stacked_layers(served):
            served = _cpu_layout_jit(served)
        if served is not params:
            self._served = (params, served)
        return served

    def serving_copy(self, params: Params) -> Params:
        """`serving_params(params)` in buffers of its own: the rollout's weights survive the
        trainer's next (donating) update (asynchronous rollouts)."""
        served = self.serving_params(params)
        if served is params:
            served = jax.tree.map(jnp.copy, params)
            self._served = (params, served)
        return served

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
        m = models
        config, params = m.from_pretrained(
            path,
            dtype=jnp.float32 if kwargs.get("dtype") is None else kwargs["dtype"],
            mesh=kwargs.get("mesh"),
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
            _, self.params = models.from_pretrained(
                self.path,
                dtype=jnp.float32 if self.dtype is None else self.dtype,
                mesh=self._mesh,
                rules=self.rules,
            )
        return self.params

    # ------------------------------------------------------------------ decode state
    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """An empty decode state: `slots` rows of `max_len` cache positions, all inactive."""
        B, V = self.slots, self.config.vocab_size
        cache = models.init_cache(
            self.config,
            B,
            self.max_len,
            dtype=self.cache_dtype,
            mesh=self._mesh,
            **({"rules": self.rules} if self.rules is not None else {}),
        )
        self._slot_mode = ["sample"] * B
        return DecodeState(
            cache=cache,
            lengths=jnp.zeros((B,), jnp.int32),
            logits=jnp.zeros((B, V), jnp.float32),
            keys=jnp.zeros((B, 2), jnp.uint32),
            temperature=jnp.ones((B,), jnp.float32),
            top_k=jnp.zeros((B,), jnp.int32),
            top_p=jnp.ones((B,), jnp.float32),
            sampled=jnp.zeros((B,), jnp.int32),
            seq=jnp.arange(B, dtype=jnp.int32),
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
        statics = dict(
            config=self.config,
            cache_dtype=jnp.dtype(self.cache_dtype).name,
            max_len=self.max_len,
            hook=self.logits_hook,
        )
        self._prefill_jit = functools.partial(
            prefill_kernel, config=self.config, cache_dtype=statics["cache_dtype"]
        )
        self._insert_jit = insert_kernel
        self._write_jit = functools.partial(write_kernel, config=self.config)
        self._generate_jit = lambda params, state, n, mode, attend_len: generate_kernel(
            params,
            state,
            self.hook_data,
            num_steps=n,
            mode=mode,
            config=statics["config"],
            max_len=statics["max_len"],
            hook=statics["hook"],
            attend_len=attend_len,
        )

    def _attend_len(self, longest: int) -> int | None:
        """The cache positions a step reads when no live row reaches `longest` tokens: a power
        of two (>= 16, few compiles), at most max_len; None (whole rows) without live_attention."""
        if not self.live_attention:
            return None
        return min(next_pow2(longest, 16), self.max_len)

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
        return self._generate_jit(self.serving_params(params), decode_state, n, mode, attend_len)

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
            seq = np.zeros((M,), np.int32)
            seq[:m] = slots if seq_ids is None else seq_ids
            for i, (key, sp) in enumerate(reset):
                keys[i] = np.asarray(key, np.uint32)
                temp[i], topk[i], topp[i] = sp.temperature, sp.top_k, sp.top_p
                self._slot_mode[slots[i]] = sp.mode
            rs = tuple(jnp.asarray(x) for x in (keys, temp, topk, topp, seq))
        return self._write_jit(
            self.serving_params(params),
            decode_state,
            jnp.asarray(rows),
            jnp.asarray(toks),
            jnp.asarray(st_M),
            jnp.asarray(n_M),
            jnp.asarray(sm_M),
            rs,
            attend_len=self._attend_len(int(np.max(st_M[:m] + n_M[:m]))),
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
