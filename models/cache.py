"""The KV cache: one row ("slot") per sequence, indexed by absolute position."""

import flax.struct
import jax
import jax.numpy as jnp

from jaxrl_tools.sharding import sharded_init

CACHE_AXES = ("layers", "batch", "cache_length", "kv_heads", "head_dim")


@flax.struct.dataclass
class KVCache:
    """Keys and values, each [layers, batch, max_len, kv_heads, head_dim].

    A pytree (jit/donate/shard it like any other). Entry (l, b, s) holds the key/value of the token
    at absolute position s of the sequence in slot b.
    """

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

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
      dtype: cache dtype (float32 or bfloat16).
      mesh: when given, the cache is created sharded by `cache_axes()`.
      rules: logical -> mesh axes table for `mesh`.

    Returns:
      The KVCache.
    """
    shape = (config.num_hidden_layers, batch, max_len, config.num_key_value_heads, config.head_dim)
    make = lambda: KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    if mesh is None:
        return make()
    return sharded_init(make, cache_axes(), mesh, rules=rules)
