"""LoRA adapters on the attention and MLP projections: a parameter tree beside the frozen base.

For a target projection with kernel W [*in, *out] (our layout, see `models.transformer`), the
adapter is A [*in, r] and B [r, *out], stacked over layers like the base:

  y = x @ W + scale * (dropout(x) @ A) @ B,     scale = alpha / rank

A keeps the base kernel's input axes and B its output axes (same logical names, so the one rules
table shards them like W); the rank axis is "lora_rank" (replicated by `DEFAULT_RULES`). A starts
uniform in +-1/sqrt(fan_in) and B at zero (PEFT's default), so a fresh adapter is the base model.

`LoraParams(base, adapters, ...)` is what the model functions take to run with the adapters
applied: it is a pytree (base and adapters are leaves' subtrees; scale and dropout are static)
and reads like the base's dict (`p["embed"]`), so code that looks up the embedding or the LM head
works on it unchanged. `merge` folds the adapters into a copy of the base (W + scale * A @ B):
the engine's weights after each update.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax
import jax
import jax.numpy as jnp

from jaxrl_tools.models.config import ModelConfig
from jaxrl_tools.sharding import sharded_init

Params = dict[str, Any]

# What the engine decodes with (`model.lora.decode`): base + scale * A @ B merged once per update
# (dense decoding, one more copy of the adapted kernels), or the base with the adapters applied
# per token (no copy).
DECODE_MODES = ("merged", "adapters")

# name -> (path of the base kernel under params, logical input axes, logical output axes).
# The names are the HF module names (PEFT's `target_modules`).
LORA_TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "q_proj": (("layers", "attn", "q_proj"), ("embed",), ("heads", "head_dim")),
    "k_proj": (("layers", "attn", "k_proj"), ("embed",), ("kv_heads", "head_dim")),
    "v_proj": (("layers", "attn", "v_proj"), ("embed",), ("kv_heads", "head_dim")),
    "o_proj": (("layers", "attn", "o_proj"), ("heads", "head_dim"), ("embed",)),
    "gate_proj": (("layers", "mlp", "gate_proj"), ("embed",), ("mlp",)),
    "up_proj": (("layers", "mlp", "up_proj"), ("embed",), ("mlp",)),
    "down_proj": (("layers", "mlp", "down_proj"), ("mlp",), ("embed",)),
}
RANK_AXIS = "lora_rank"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Rank, alpha, dropout and target projections of the adapters (hashable).

    Attributes:
      rank: r, the inner dimension of A @ B.
      alpha: scale = alpha / rank (PEFT's `lora_alpha`).
      dropout: dropout on the adapter's input in the training loss (never in decoding or in the
        log-probs of the old / reference policy).
      targets: names of LORA_TARGETS to adapt.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(LORA_TARGETS)

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora rank must be a positive int, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora alpha must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(
                f"lora targets {list(self.targets)} must be distinct names among "
                f"{list(LORA_TARGETS)}"
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _dims(config: ModelConfig) -> dict[str, int]:
    c = config
    return {
        "embed": c.hidden_size,
        "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "mlp": c.intermediate_size,
    }


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def get_path(tree: Any, path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def lora_logical_axes(lora: LoraConfig) -> Params:
    """Logical axes of the adapter tree: {path: {"lora_a": axes, "lora_b": axes}}."""
    out: Params = {}
    for name in lora.targets:
        path, ins, outs = LORA_TARGETS[name]
        _set(out, (*path, "lora_a"), ("layers", *ins, RANK_AXIS))
        _set(out, (*path, "lora_b"), ("layers", RANK_AXIS, *outs))
    return out


def lora_shapes(config: ModelConfig, lora: LoraConfig, dtype=jnp.float32) -> Params:
    """ShapeDtypeStructs of the adapter tree."""
    dims, L, r = _dims(config), config.num_hidden_layers, lora.rank
    out: Params = {}
    for name in lora.targets:
        path, ins, outs = LORA_TARGETS[name]
        a = (L, *(dims[x] for x in ins), r)
        b = (L, r, *(dims[x] for x in outs))
        _set(out, (*path, "lora_a"), jax.ShapeDtypeStruct(a, dtype))
        _set(out, (*path, "lora_b"), jax.ShapeDtypeStruct(b, dtype))
    return out


def init_lora(
    config: ModelConfig,
    lora: LoraConfig,
    rng: jax.Array,
    *,
    dtype=jnp.float32,
    mesh=None,
    rules=None,
) -> Params:
    """Fresh adapters: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PEFT's kaiming-uniform with
    a = sqrt(5)), B = 0, so the adapted model starts as the base. Sharded on `mesh` when given."""
    shapes = lora_shapes(config, lora, dtype)
    names = sorted(lora.targets)

    def init(key):
        out: Params = {}
        for name, k in zip(names, jax.random.split(key, len(names))):
            path = LORA_TARGETS[name][0]
            a, b = get_path(shapes, path)["lora_a"], get_path(shapes, path)["lora_b"]
            bound = 1.0 / math.sqrt(math.prod(a.shape[1:-1]))
            _set(out, (*path, "lora_a"), jax.random.uniform(k, a.shape, dtype, -bound, bound))
            _set(out, (*path, "lora_b"), jnp.zeros(b.shape, dtype))
        return out

    if mesh is None:
        return jax.jit(init)(rng)
    return sharded_init(init, lora_logical_axes(lora), mesh, rng, rules=rules)


def _delta(a: jax.Array, b: jax.Array) -> jax.Array:
    """A [L, *in, r] @ B [L, r, *out] -> [L, *in, *out] (float32)."""
    return jax.vmap(lambda x, y: jnp.tensordot(x, y, axes=1))(
        a.astype(jnp.float32), b.astype(jnp.float32)
    )


def merge(params: Params, adapters: Params, lora: LoraConfig) -> Params:
    """A new base tree with W + scale * A @ B in every target kernel (computed in float32, cast
    to the kernel's dtype); the other leaves are the base's own arrays (no copy)."""
    out = dict(params)
    for name in lora.targets:
        path = LORA_TARGETS[name][0]
        ad = get_path(adapters, path)
        kernel = get_path(params, path)["kernel"]
        merged = kernel.astype(jnp.float32) + lora.scale * _delta(ad["lora_a"], ad["lora_b"])
        node = out
        for p in path:  # copy the dicts on the way down, never mutate the caller's tree
            node[p] = dict(node[p])
            node = node[p]
        node["kernel"] = merged.astype(kernel.dtype)
    return out


@flax.struct.dataclass
class LoraParams:
    """The base params with adapters applied: what `models.forward` & co. take for LoRA.

    Attributes:
      base: the base params (frozen).
      adapters: the adapter tree (`init_lora`).
      scale: alpha / rank (static).
      dropout: adapter input dropout rate (static); applied only when `dropout_key` is given.
      dropout_key: a PRNG key for the dropout masks (training loss only), or None.
    """

    base: Any
    adapters: Any
    scale: float = flax.struct.field(pytree_node=False, default=1.0)
    dropout: float = flax.struct.field(pytree_node=False, default=0.0)
    dropout_key: Any = None

    def __getitem__(self, key):
        # Reads like the base dict: the embedding and LM head are not adapted.
        return self.base[key]

    def module_variables(self) -> tuple[dict, float]:
        """(flax variables {"params", "lora"}, dropout rate in effect). The scale is folded
        into B here (scale * B), so the modules only compute (x @ A) @ B'."""
        scaled = jax.tree_util.tree_map_with_path(
            lambda p, x: x * self.scale if p[-1].key == "lora_b" else x, self.adapters
        )
        rate = self.dropout if self.dropout_key is not None else 0.0
        return {"params": self.base, "lora": scaled}, rate


def with_lora(
    params: Params, adapters: Params, lora: LoraConfig, dropout_key: jax.Array | None = None
) -> LoraParams:
    """The base `params` with `adapters` applied (dropout only with `dropout_key`)."""
    # Without a key there is no dropout: record rate 0, so that such views share one jit trace.
    dropout = lora.dropout if dropout_key is not None else 0.0
    return LoraParams(params, adapters, lora.scale, dropout, dropout_key)
