"""What a decode engine is built from (`EngineBase`, the base of `engine.EngineCore`): its
settings, its serving copy of the weights (`engine.serving`), its jitted functions (the kernels
of `engine.kernels`, the decode step of `engine.decode_step`), its empty decode state, and the
descriptive part of JetStream's Engine API (slots, buckets, mesh, params). The operations on a
decode state (prefill, insert, generate, writes) are `EngineCore`'s.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_tools import models
from jaxrl_tools.engine.decode_step import DecodeStep, make_decode_step
from jaxrl_tools.engine.kernels import (
    DecodeState,
    LogitsHook,
    Params,
    insert_kernel,
    prefill_kernel,
    write_kernel,
)
from jaxrl_tools.engine.sampling import SamplingParams
from jaxrl_tools.engine.serving import ServingWeights
from jaxrl_tools.shapes import next_pow2

log = logging.getLogger("jaxrl_tools.engine.core")  # the engine's log


class EngineBase:
    """A decode engine's settings, weights, jitted functions and empty state: `EngineCore`
    without its operations (see `EngineCore` for the arguments)."""

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
        self.cache_dtype = jnp.dtype(
            cache_dtype if cache_dtype is not None else (dtype if dtype is not None else "float32")
        )
        self.live_attention = bool(live_attention)
        if unstack_layers is None:
            unstack_layers = jax.default_backend() == "cpu"
        self._serving = ServingWeights(
            config, mesh=mesh, rules=rules, dtype=dtype, unstack_layers=unstack_layers
        )
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

    @property
    def dtype(self):
        """The serving dtype (None: params are served as given)."""
        return self._serving.dtype

    @property
    def unstack_layers(self) -> bool:
        """Whether params are served one array per layer (`models.unstack_layers`)."""
        return self._serving.unstack_layers

    def view(self) -> EngineBase:
        """Another handle on this engine (its compiled steps and settings) with slot modes and
        a serving copy of the weights of its own: for a second decode state used while the
        first is mid-rollout (an evaluation inside a rollout ahead of the update)."""
        other = copy.copy(self)
        other._slot_mode = ["sample"] * self.slots
        s = self._serving
        other._serving = ServingWeights(
            self.config, mesh=s.mesh, rules=s.rules, dtype=s.dtype, unstack_layers=s.unstack_layers
        )
        return other

    def serving_params(self, params: Params) -> Params:
        """`params` as the engine serves them: in the serving dtype, on the engine's mesh and
        (`unstack_layers`) one array per layer. Cast (the cast keeps each array's sharding),
        resharded and unstacked once per new params object, so the rollout of an RL step does it
        once; the params themselves when nothing changes (`serving.ServingWeights`)."""
        return self._serving.params(params)

    def serving_copy(self, params: Params) -> Params:
        """`serving_params(params)` in buffers of its own: the rollout's weights survive the
        trainer's next (donating) update (asynchronous rollouts)."""
        return self._serving.copy(params)

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
        self._prefill_jit = functools.partial(
            prefill_kernel, config=self.config, cache_dtype=jnp.dtype(self.cache_dtype).name
        )
        self._insert_jit = insert_kernel
        self._write_jit = functools.partial(write_kernel, config=self.config)
        # The decode step `generate_steps` calls (and `plan` lowers): one object per (config,
        # max_len, hook, mesh, rules), traced inside this engine's mesh.
        self.decode_step: DecodeStep = make_decode_step(
            self.config, self.max_len, self.logits_hook, self._mesh, self.rules
        )

    def _attend_len(self, longest: int) -> int | None:
        """The cache positions a step reads when no live row reaches `longest` tokens: a power
        of two (>= 16, few compiles), at most max_len; None (whole rows) without live_attention."""
        if not self.live_attention:
            return None
        return min(next_pow2(longest, 16), self.max_len)
