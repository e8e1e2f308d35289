"""The KV cache: one row ("slot") per sequence, indexed by absolute position."""

import flax.struct
import jax
import jax.numpy as jnp

from jaxrl_tools.sharding import sharded_init

# Heads before positions: a layer's keys of one row and head are contiguous, in the order the
# attention matmuls read them (positions first, XLA:CPU transposed every layer's live cache).
CACHE_AXES = ("layers", "batch", "kv_heads", "cache_length", "head_dim")


# A bfloat16 cache is stored as its bits (uint16). XLA's CPU backend widens a bfloat16 scatter
# to float32: every layer's write converted the whole cache to float32 and back (2x the cache in
# temporaries, and the time to convert it), which also made `plan`'s CPU compile overstate the
# decode memory of every bfloat16 recipe. A uint16 scatter is a plain move on every backend.
_STORED = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16)}
_LOGICAL = {v: k for k, v in _STORED.items()}


def stored_dtype(dtype) -> jnp.dtype:
    """The dtype the cache arrays of a `dtype` cache are stored in."""
    return _STORED.get(jnp.dtype(dtype), jnp.dtype(dtype))


def to_stored(x: jax.Array, stored) -> jax.Array:
    """`x` cast to the cache's dtype and put in its storage form (`stored`)."""
    logical = _LOGICAL.get(jnp.dtype(stored))
    if logical is None:
        return x.astype(stored)
    return jax.lax.bitcast_convert_type(x.astype(logical), stored)


def from_stored(x: jax.Array) -> jax.Array:
    """Cache entries (storage form) as values of the cache's dtype."""
    logical = _LOGICAL.get(x.dtype)
    return x if logical is None else jax.lax.bitcast_convert_type(x, logical)


@flax.struct.dataclass
class KVCache:
    """Keys and values, each [layers, batch, kv_heads, max_len, head_dim], in storage form
    (`stored_dtype`: bfloat16 entries are held as uint16 bits; read them with `from_stored`).

    A pytree (jit/donate/shard it like any other). Entry (l, b, k, s) holds kv head k of the
    key/value of the token at absolute position s of the sequence in slot b.
    """

    k: jax.Array
    v: jax.Array

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the entries (bfloat16 or float32)."""
        return _LOGICAL.get(self.k.dtype, self.k.dtype)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def cache_axes() -> KVCache:
    """Logical axes of the cache leaves (a KVCache whose leaves are tuples of axis names)."""
    return KVCache(k=CACHE_AXES, v=CACHE_AXES)


def cache_bytes(config, batch: int, max_len: int, dtype=jnp.float32) -> int:
    """Bytes of a cache of `batch` slots x `max_len` positions (keys and values, all layers)."""
    per = config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return 2 * batch * max_len * per * jnp.dtype(dtype).itemsize


def init_cache(
    config, batch: int, max_len: int, *, dtype=jnp.float32, mesh=None, rules=None
) -> KVCache:
    """An all-zero cache for `batch` slots of `max_len` positions.

    Args:
      config: the ModelConfig.
      batch: number of slots (rows).
      max_len: positions per slot.
      dtype: cache dtype (float32 or bfloat16; stored as `stored_dtype(dtype)`).
      mesh: when given, the cache is created sharded by `cache_axes()`.
      rules: logical -> mesh axes table for `mesh`.

    Returns:
      The KVCache.
    """
    shape = (config.num_hidden_layers, batch, config.num_key_value_heads, max_len, config.head_dim)
    stored = stored_dtype(dtype)
    make = lambda: KVCache(k=jnp.zeros(shape, stored), v=jnp.zeros(shape, stored))
    if mesh is None:
        return make()
    return sharded_init(make, cache_axes(), mesh, rules=rules)
