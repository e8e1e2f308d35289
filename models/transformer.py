"""Decoder-only transformer (Qwen2/2.5, Qwen3, Llama 3.x) as Flax linen modules.

Layers are stacked along a leading "layers" axis and run with `nn.scan`, so compile time does
not grow with depth and every layer parameter is one array [layers, ...]. Every parameter
carries logical axis names (`nn.with_logical_partitioning`); activations are constrained with
`sharding.constrain` (a no-op outside `sharding.use_mesh`).

Public functions take `(config, params, ...)` with `params` a plain nested dict; they are pure and
not jitted here: jit them with `config` static (it is hashable). `constrain` reads the mesh of
`sharding.use_mesh` while tracing, and jax's trace cache does not know about it: trace (first call)
a jitted function inside the `use_mesh` block it will run under, and use one jitted function
object per mesh.

Parameter tree (D hidden, H heads, K kv heads, Dh head dim, F mlp, V vocab, L layers):
  embed/embedding [V, D]                      ("vocab", "embed")
  layers/attn/{q}_proj/kernel [L, D, H, Dh]   ("layers", "embed", "heads", "head_dim")
  layers/attn/{k,v}_proj/kernel [L, D, K, Dh] ("layers", "embed", "kv_heads", "head_dim")
  layers/attn/{q,k,v}_proj/bias [L, H|K, Dh]  (only with attention_bias)
  layers/attn/o_proj/kernel [L, H, Dh, D]     ("layers", "heads", "head_dim", "embed")
  layers/attn/{q,k}_norm/scale [L, Dh]        (only with qk_norm, Qwen3)
  layers/mlp/{gate,up}_proj/kernel [L, D, F], layers/mlp/down_proj/kernel [L, F, D]
  layers/{input,post_attention}_norm/scale [L, D], final_norm/scale [D]
  lm_head/kernel [D, V]                       (only when the embeddings are not tied)

LoRA: every function taking `params` also takes a `models.lora.LoraParams`; its adapters are the
"lora" variable collection ({path}/lora_a, lora_b beside each adapted kernel), added to the
projections' outputs (`_lora_delta`).

Unstacked layers (`unstack_layers`): "layers" split into one tree per layer, "layers_0", ...,
which every function also takes; the layers then run one after another instead of in a scan.
XLA:CPU copies each layer's weights out of the stacked arrays on every scan iteration (the
slice is not fused into its matmul): a decode step that reads its weights once is cheaper over
separate arrays. The decode engine serves unstacked copies on CPU.
"""

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl_tools.models import attention as attn_lib
from jaxrl_tools.models.cache import CACHE_AXES, KVCache, from_stored, to_stored
from jaxrl_tools.models.config import ModelConfig, rope_inv_freq
from jaxrl_tools.models.lora import LoraParams
from jaxrl_tools.sharding import constrain, sharded_init

Params = dict[str, Any]

# What a rematerialised layer keeps for the backward pass: "layer" nothing but its input (all
# recomputed), "dots" the outputs of its matmuls (only the cheap elementwise ops recomputed).
REMAT_POLICIES = ("none", "layer", "dots")


def _remat_name(remat: bool | str) -> str:
    name = {False: "none", True: "layer"}.get(remat, remat) if isinstance(remat, bool) else remat
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r} is not one of {list(REMAT_POLICIES)} (or a bool)")
    return name


_INIT_STD = 0.02  # transformers' initializer_range


def _param(module: nn.Module, name: str, init, shape, axes, dtype):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def _lora_delta(module: nn.Module, x, n_in: int):
    """scale * (dropout(x) @ A) @ B of this projection's adapter (`models.lora`; the scale is
    already in B), or None when the "lora" collection has no adapter for it. x [..., *in]."""
    if not module.has_variable("lora", "lora_a"):
        return None
    a = module.get_variable("lora", "lora_a").astype(x.dtype)
    b = module.get_variable("lora", "lora_b").astype(x.dtype)
    rate = module.lora_dropout
    if rate > 0 and module.has_rng("dropout"):
        keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rate, x.shape)
        x = jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
    contract = tuple(range(x.ndim - n_in, x.ndim))
    xa = jnp.tensordot(x, a, axes=(contract, tuple(range(n_in))))
    return jnp.tensordot(xa, b, axes=((xa.ndim - 1,), (0,)))


class Weight(nn.Module):
    """A module holding one named matrix (embed/embedding, lm_head/kernel); returns it."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    param_name: str
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self):
        return _param(
            self,
            self.param_name,
            nn.initializers.normal(_INIT_STD),
            self.shape,
            self.axes,
            self.param_dtype,
        )


def _matmul(x, kernel, n_in: int):
    """x[..., *in] @ kernel[*in, *out] (n_in contracted axes) as one [rows, in] @ [in, out]
    matmul. Left as a >2-D contraction inside the layer scan, XLA:CPU wrote the backward pass's
    elementwise outputs transposed for it: the GRPO update's MLP gradients took 2x as long."""
    n_out = kernel.ndim - n_in
    rows = x.reshape(-1, math.prod(kernel.shape[:n_in]))
    y = rows @ kernel.reshape(rows.shape[1], -1)
    return y.reshape(*x.shape[: x.ndim - n_in], *kernel.shape[kernel.ndim - n_out :])


class RMSNorm(nn.Module):
    """RMS norm as in transformers: normalise in float32, cast back, then scale."""

    eps: float
    axis: str = "embed"
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = _param(
            self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis,), self.param_dtype
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(x.dtype) * y.astype(x.dtype)


class Projection(nn.Module):
    """x[..., in] @ kernel[in, *out] (+ bias[*out]), kernel in its logical layout."""

    in_features: int
    out_shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axes of the kernel
    use_bias: bool = False
    param_dtype: Any = jnp.float32
    lora_dropout: float = 0.0

    @nn.compact
    def __call__(self, x):
        kernel = _param(
            self,
            "kernel",
            nn.initializers.normal(_INIT_STD),
            (self.in_features, *self.out_shape),
            self.axes,
            self.param_dtype,
        )
        y = _matmul(x, kernel.astype(x.dtype), 1)
        delta = _lora_delta(self, x, 1)
        if delta is not None:
            y = y + delta
        if self.use_bias:
            bias = _param(
                self, "bias", nn.initializers.zeros, self.out_shape, self.axes[1:], self.param_dtype
            )
            y = y + bias.astype(x.dtype)
        return y


class OutProjection(nn.Module):
    """x[..., H, Dh] @ kernel[H, Dh, D]."""

    features: int
    param_dtype: Any = jnp.float32
    lora_dropout: float = 0.0

    @nn.compact
    def __call__(self, x_BTHK):
        h, dh = x_BTHK.shape[-2:]
        kernel = _param(
            self,
            "kernel",
            nn.initializers.normal(_INIT_STD),
            (h, dh, self.features),
            ("heads", "head_dim", "embed"),
            self.param_dtype,
        )
        y = _matmul(x_BTHK, kernel.astype(x_BTHK.dtype), 2)
        delta = _lora_delta(self, x_BTHK, 2)
        return y if delta is None else y + delta


def _rotate(x_BTNK, cos_BTK, sin_BTK):
    """Rotary embedding, rotate-half layout (as the HF checkpoints expect), in float32."""
    half = x_BTNK.shape[-1] // 2
    x = x_BTNK.astype(jnp.float32)
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos_BTK[:, :, None, :], sin_BTK[:, :, None, :]
    return (x * cos + rotated * sin).astype(x_BTNK.dtype)


class Attention(nn.Module):
    """Self-attention; `mask` = (q_pos_BT, kv_valid_BS, kv_lengths_B, segment_ids_BT,
    prompt_keys_BNS), the last three optional (None), see `models.attention`. With a cache, the
    keys attended are the first kv_valid_BS.shape[1] positions of each row (the live part), not
    the whole row."""

    config: ModelConfig
    param_dtype: Any
    impl: str = "auto"
    lora_dropout: float = 0.0

    @nn.compact
    def __call__(self, x_BTD, cos_BTK, sin_BTK, mask, cache, layer_idx, write_pos_BT):
        cfg = self.config
        D, H, K = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        Dh, pd, drop = cfg.head_dim, self.param_dtype, self.lora_dropout
        bias = cfg.attention_bias
        q = Projection(D, (H, Dh), ("embed", "heads", "head_dim"), bias, pd, drop, name="q_proj")(
            x_BTD
        )
        k = Projection(
            D, (K, Dh), ("embed", "kv_heads", "head_dim"), bias, pd, drop, name="k_proj"
        )(x_BTD)
        v = Projection(
            D, (K, Dh), ("embed", "kv_heads", "head_dim"), bias, pd, drop, name="v_proj"
        )(x_BTD)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, "head_dim", pd, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, "head_dim", pd, name="k_norm")(k)
        q = constrain(_rotate(q, cos_BTK, sin_BTK), ("batch", "length", "heads", "head_dim"))
        k = constrain(_rotate(k, cos_BTK, sin_BTK), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))

        if cache is not None:
            # Write this chunk's K/V into each row at its absolute positions (invalid tokens were
            # given an out-of-range position and are dropped), then attend over the live prefix
            # of the row only: decode cost follows the live length, not max_len.
            B = x_BTD.shape[0]
            rows = jnp.arange(B)[:, None]
            ck, cv = cache
            at = (layer_idx, rows, slice(None), write_pos_BT)  # k/v [B, T, K, Dh] go to [B, T]
            # (constrained: left to itself, the partitioner may pick a layout for the written
            # uint16 cache that no mesh axis assignment describes)
            ck = constrain(ck.at[at].set(to_stored(k, ck.dtype), mode="drop"), CACHE_AXES)
            cv = constrain(cv.at[at].set(to_stored(v, cv.dtype), mode="drop"), CACHE_AXES)
            cache = (ck, cv)
            live = mask[1].shape[1]
            k = from_stored(ck[layer_idx, :, :, :live]).astype(q.dtype)  # [B, K, live, Dh]
            v = from_stored(cv[layer_idx, :, :, :live]).astype(q.dtype)

        q_pos_BT, kv_valid_BS, kv_lengths_B, segment_ids_BT, prompt_keys_BNS = mask
        out = attn_lib.attention(
            q,
            k,
            v,
            q_pos_BT,
            kv_valid_BS,
            kv_lengths_B=kv_lengths_B,
            segment_ids_BT=segment_ids_BT,
            prompt_keys_BNS=prompt_keys_BNS,
            impl=self.impl,
            kv_heads_first=cache is not None,
        )
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        return OutProjection(D, pd, drop, name="o_proj")(out), cache


class MLP(nn.Module):
    config: ModelConfig
    param_dtype: Any
    lora_dropout: float = 0.0

    @nn.compact
    def __call__(self, x_BTD):
        cfg, pd, drop = self.config, self.param_dtype, self.lora_dropout
        D, F = cfg.hidden_size, cfg.intermediate_size
        gate = Projection(D, (F,), ("embed", "mlp"), False, pd, drop, name="gate_proj")(x_BTD)
        up = Projection(D, (F,), ("embed", "mlp"), False, pd, drop, name="up_proj")(x_BTD)
        h = constrain(nn.silu(gate) * up, ("batch", "length", "mlp"))
        return Projection(F, (D,), ("mlp", "embed"), False, pd, drop, name="down_proj")(h)


class DecoderLayer(nn.Module):
    """One pre-norm block; scanned over layers. carry = (h_BTD, cache or None)."""

    config: ModelConfig
    param_dtype: Any
    attention: str = "auto"
    lora_dropout: float = 0.0

    @nn.compact
    def __call__(self, carry, layer_idx, cos_BTK, sin_BTK, mask, write_pos_BT):
        cfg, pd = self.config, self.param_dtype
        h, cache = carry
        x = RMSNorm(cfg.rms_norm_eps, "embed", pd, name="input_norm")(h)
        attn, cache = Attention(cfg, pd, self.attention, self.lora_dropout, name="attn")(
            x, cos_BTK, sin_BTK, mask, cache, layer_idx, write_pos_BT
        )
        h = constrain(h + attn, ("batch", "length", "embed"))
        x = RMSNorm(cfg.rms_norm_eps, "embed", pd, name="post_attention_norm")(h)
        h = constrain(
            h + MLP(cfg, pd, self.lora_dropout, name="mlp")(x), ("batch", "length", "embed")
        )
        return (h, cache), None


class Decoder(nn.Module):
    """Embedding -> scanned layers -> final norm. Returns hidden states (compute dtype)."""

    config: ModelConfig
    param_dtype: Any = jnp.float32
    remat: bool | str = False  # REMAT_POLICIES name (True: "layer"); see `hidden_states`
    attention: str = "auto"  # a `models.attention.IMPLS` name
    lora_dropout: float = 0.0  # adapter input dropout (needs a "dropout" rng; `models.lora`)
    stacked: bool = True  # False: the layers' params are "layers_0", ... (`unstack_layers`)

    @nn.compact
    def __call__(self, ids_BT, positions_BT, mask, cache=None, write_pos_BT=None):
        cfg, pd = self.config, self.param_dtype
        embedding = Weight(
            (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), "embedding", pd, name="embed"
        )()
        # The compute dtype follows the parameters (bfloat16 params -> bfloat16 compute).
        h = constrain(jnp.take(embedding, ids_BT, axis=0), ("batch", "length", "embed"))

        inv_freq = jnp.asarray(rope_inv_freq(cfg))
        freqs = positions_BT.astype(jnp.float32)[..., None] * inv_freq
        freqs = jnp.concatenate([freqs, freqs], axis=-1)
        cos, sin = jnp.cos(freqs), jnp.sin(freqs)
        if h.dtype != jnp.float32:
            # transformers casts cos/sin to the compute dtype before rotating.
            cos, sin = (
                cos.astype(h.dtype).astype(jnp.float32),
                sin.astype(h.dtype).astype(jnp.float32),
            )

        layer_cls = DecoderLayer
        remat = _remat_name(self.remat)
        if remat == "layer":
            layer_cls = nn.remat(DecoderLayer, prevent_cse=False)
        elif remat == "dots":
            layer_cls = nn.remat(
                DecoderLayer,
                prevent_cse=False,
                policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            )
        if not self.stacked:  # one module per layer, run in order: no per-layer weight slices
            for i in range(cfg.num_hidden_layers):
                layer = layer_cls(cfg, pd, self.attention, self.lora_dropout, name=f"layers_{i}")
                (h, cache), _ = layer((h, cache), i, cos, sin, mask, write_pos_BT)
            return self._final(h), cache
        layers = nn.scan(
            layer_cls,
            # Adapters ("lora", `models.lora`) are stacked over layers like the params.
            variable_axes={"params": 0, "lora": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_hidden_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(cfg, pd, self.attention, self.lora_dropout, name="layers")
        (h, cache), _ = layers(
            (h, cache), jnp.arange(cfg.num_hidden_layers), cos, sin, mask, write_pos_BT
        )
        return self._final(h), cache

    def _final(self, h):
        cfg, pd = self.config, self.param_dtype
        h = RMSNorm(cfg.rms_norm_eps, "embed", pd, name="final_norm")(h)
        if not cfg.tie_word_embeddings:  # created here, applied by `forward` (see `unembed`)
            Weight(
                (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), "kernel", pd, name="lm_head"
            )()
        return h


def _self_mask(
    attention_mask_BT, right_padded: bool = False, packed: bool = False, prompt_keys_BNS=None
):
    """The attention mask spec of a causal forward over (padded) rows: query t sees key s <= t
    that is not padding (and, `packed`, of the same segment, the mask's value; with
    `prompt_keys_BNS`, the shared-prompt rows of `models.attention`)."""
    B, T = attention_mask_BT.shape
    valid = attention_mask_BT > 0
    lengths = jnp.sum(valid, axis=-1, dtype=jnp.int32) if right_padded and not packed else None
    segments = attention_mask_BT.astype(jnp.int32) if packed else None
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return (q_pos, valid, lengths, segments, prompt_keys_BNS)


def _boxed_shapes(config: ModelConfig, dtype) -> Params:
    ids = jnp.zeros((1, 1), jnp.int32)
    mask = _self_mask(jnp.ones((1, 1), jnp.int32))
    return jax.eval_shape(
        lambda: Decoder(config, dtype).init(jax.random.key(0), ids, ids, mask)["params"]
    )


@functools.lru_cache(maxsize=64)
def _logical_axes_cached(config: ModelConfig):
    boxed = _boxed_shapes(config, jnp.float32)
    is_box = lambda x: isinstance(x, nn.Partitioned)

    def names(path, leaf):
        if not is_box(leaf):
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} has no logical axes")
        return tuple(leaf.names)

    return jax.tree_util.tree_map_with_path(names, boxed, is_leaf=is_box)


def logical_axes(config: ModelConfig) -> Params:
    """Logical axis names of every parameter: a tree like the params, leaves tuples of names.

    Raises:
      ValueError: a parameter was declared without logical axes.
    """
    # A copy: the cached tree must not be mutated by callers.
    return jax.tree.map(
        lambda x: x, _logical_axes_cached(config), is_leaf=lambda x: isinstance(x, tuple)
    )


def param_shapes(config: ModelConfig, dtype=jnp.float32) -> Params:
    """ShapeDtypeStructs of the parameters (no memory allocated)."""
    return nn.unbox(_boxed_shapes(config, dtype))


def init_params(
    config: ModelConfig, rng: jax.Array, *, dtype=jnp.float32, mesh=None, rules=None
) -> Params:
    """Random parameters (normal(0.02) kernels, ones norms, zero biases), as transformers does.

    Args:
      config: the architecture.
      rng: a PRNG key.
      dtype: parameter dtype (float32 or bfloat16); the compute dtype follows it.
      mesh: when given, every parameter is created already sharded on it (no full copy).
      rules: logical -> mesh axes table (default `sharding.DEFAULT_RULES`).

    Returns:
      A plain nested dict of arrays.
    """
    ids = jnp.zeros((1, 1), jnp.int32)
    mask = _self_mask(jnp.ones((1, 1), jnp.int32))

    def init(key):
        boxed = Decoder(config, dtype).init(key, ids, ids, mask)["params"]
        return nn.unbox(boxed)

    if mesh is None:
        return jax.jit(init)(rng)
    return sharded_init(init, logical_axes(config), mesh, rng, rules=rules)


def _apply(
    config,
    params,
    ids_BT,
    positions_BT,
    mask,
    cache=None,
    write_pos_BT=None,
    remat=False,
    attention="auto",
):
    variables, rngs, lora_dropout = {"params": params}, None, 0.0
    if isinstance(params, LoraParams):  # the base with adapters applied
        variables, lora_dropout = params.module_variables()
        if lora_dropout > 0:
            rngs = {"dropout": params.dropout_key}
    dtype = params["embed"]["embedding"].dtype
    stacked = has_stacked_layers(variables["params"])
    return Decoder(config, dtype, remat, attention, lora_dropout, stacked).apply(
        variables, ids_BT, positions_BT, mask, cache, write_pos_BT, rngs=rngs
    )


def has_stacked_layers(params: Params) -> bool:
    """Whether `params` (or a `LoraParams`) hold their layers stacked ("layers"), not unstacked."""
    return "layers" in _base(params)


def unstack_layers(params: Params) -> Params:
    """`params` (or a `LoraParams`, base and adapters) with "layers" split into "layers_0", ...:
    one tree per layer, each array a copy (jit it: see the module docstring for why)."""
    if isinstance(params, LoraParams):
        return params.replace(
            base=unstack_layers(params.base), adapters=unstack_layers(params.adapters)
        )
    params = dict(params)
    stacked = params.pop("layers")
    n = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(n):
        params[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return params


def default_positions(attention_mask_BT: jax.Array) -> jax.Array:
    """Positions for a (left-)padded batch: cumsum(mask) - 1, clipped at 0 on padding."""
    return jnp.maximum(jnp.cumsum((attention_mask_BT > 0).astype(jnp.int32), axis=-1) - 1, 0)


def hidden_states(
    config: ModelConfig,
    params: Params,
    input_ids_BT: jax.Array,
    *,
    attention_mask=None,
    positions=None,
    remat: bool | str = False,
    attention: str = "auto",
    right_padded: bool = False,
    packed: bool = False,
    prompt_keys=None,
) -> jax.Array:
    """Hidden states after the final norm, h_BTD in the compute dtype (= the params' dtype).

    Token t attends to tokens t' <= t of its row whose attention_mask is 1; `positions` only
    feed the rotary embedding, so a left-padded row gives the same values as the unpadded one.

    Args:
      config: the architecture.
      params: the parameters, or a `models.lora.LoraParams` (the base with adapters applied).
      input_ids_BT: int token ids [B, T].
      attention_mask: [B, T], 1 for real tokens, 0 for padding (default all ones).
      positions: [B, T] rotary positions (default cumsum(attention_mask) - 1).
      remat: rematerialise each layer in the backward pass (less memory, more compute):
        False / "none", True / "layer" (keep only each layer's input), "dots" (keep the matmul
        outputs, recompute the elementwise ops).
      attention: the attention implementation (`models.attention.IMPLS`; "auto" by platform).
      right_padded: every row's real tokens come first (lets "auto" use cuDNN on GPU).
      packed: rows hold several sequences: `attention_mask` numbers them (1, 2, ...; 0 on
        padding) and a token attends only within its own; `positions` restart per sequence.
      prompt_keys: bool [B, N, S], packed rows whose samples share their prompt
        (`train.packing.plan_shared_packing`): a prompt slot of S tokens, then N sample slots,
        slot j seeing the prompt-slot tokens marked in [b, j] (`models.attention`).

    Returns:
      h_BTD with logits = h_BTD @ unembed(config, params).
    """
    B, T = input_ids_BT.shape
    if attention_mask is None:
        attention_mask = jnp.ones((B, T), jnp.int32)
    if positions is None:
        if packed:
            raise ValueError("hidden_states: packed rows need their positions (0 at each start)")
        positions = default_positions(attention_mask)
    if prompt_keys is not None and not packed:
        raise ValueError("hidden_states: prompt_keys need packed rows")
    mask = _self_mask(attention_mask, right_padded, packed, prompt_keys)
    h, _ = _apply(config, params, input_ids_BT, positions, mask, remat=remat, attention=attention)
    return h


def unembed(config: ModelConfig, params: Params) -> jax.Array:
    """The LM head matrix W_DV (tied embeddings -> embedding.T, unless the params carry it as a
    matrix of its own: `untie_head`)."""
    if config.tie_word_embeddings and "lm_head" not in _base(params):
        return params["embed"]["embedding"].T
    return params["lm_head"]["kernel"]


def untie_head(params: Params) -> Params:
    """`params` (or a `LoraParams`) of a model with tied embeddings plus `lm_head/kernel`, a
    copy of embedding.T laid out [D, V] (jit it): XLA:CPU multiplies decode's 16-32 rows by the
    transposed embedding ~1.5x slower than by a [D, V] matrix. Params with an LM head of their
    own are returned as they are."""
    if isinstance(params, LoraParams):
        return params.replace(base=untie_head(params.base))
    if "lm_head" in params:
        return params
    return {**params, "lm_head": {"kernel": jnp.copy(params["embed"]["embedding"].T)}}


def _base(params: Params) -> Params:
    return params.base if isinstance(params, LoraParams) else params


def _logits(config, params, h_BTD):
    w_DV = unembed(config, params).astype(h_BTD.dtype)
    logits = jnp.einsum("btd,dv->btv", h_BTD, w_DV, preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "length", "vocab"))


def forward(
    config: ModelConfig,
    params: Params,
    input_ids_BT: jax.Array,
    *,
    attention_mask=None,
    positions=None,
    remat: bool = False,
    attention: str = "auto",
    packed: bool = False,
) -> jax.Array:
    """Logits of a (possibly left-padded, or packed: see `hidden_states`) batch.

    Args:
      config: the architecture.
      params: the parameters, or a `models.lora.LoraParams` (the base with adapters applied).
      input_ids_BT: int token ids [B, T].
      attention_mask: [B, T], 1 for real tokens, 0 for padding (default all ones).
      positions: [B, T] rotary positions (default cumsum(attention_mask) - 1).
      remat: rematerialise each layer in the backward pass (less memory, more compute).
      attention: the attention implementation (`models.attention.IMPLS`; "auto" by platform).
      packed: `attention_mask` numbers the sequences packed into each row (`hidden_states`).

    Returns:
      logits_BTV in float32 (rows at padding positions are meaningless but finite).
    """
    h = hidden_states(
        config,
        params,
        input_ids_BT,
        attention_mask=attention_mask,
        positions=positions,
        remat=remat,
        attention=attention,
        packed=packed,
    )
    return _logits(config, params, h)


def forward_cached(
    config: ModelConfig,
    params: Params,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    cache: KVCache,
    *,
    valid_BT=None,
    logits_at_B=None,
    attend_len: int | None = None,
    attention: str = "auto",
) -> tuple[jax.Array, KVCache]:
    """Runs a chunk of tokens per row against the KV cache and writes their K/V into it.

    Row b of the cache is a slot holding one sequence from position 0. Token (b, t) is written at
    cache position positions_BT[b, t] (unless valid_BT[b, t] == 0, then nothing is written) and
    attends to cache entries s <= positions_BT[b, t] of row b, including the tokens of this chunk.
    Positions of the valid tokens of a row must be distinct and < cache.max_len.

    Only the first `attend_len` positions of each row are read: a decode step's cost follows the
    live length (the engine passes a bucket above the longest live row), not max_len.

    Args:
      config: the architecture.
      params: the parameters, or a `models.lora.LoraParams` (the base with adapters applied).
      tokens_BT: int token ids [B, T].
      positions_BT: int absolute positions [B, T].
      cache: the KVCache (donate it when jitting).
      valid_BT: [B, T] 1 for tokens to write, 0 for filler (default all ones).
      logits_at_B: when given, only the logits of chunk index logits_at_B[b] of each row are
        computed (a prefill needs only its last token's; with a large vocabulary the others'
        unembedding is much of the prefill's arithmetic).
      attend_len: static; positions >= attend_len are not attended (default: cache.max_len).
        Every valid token's position must be < attend_len.
      attention: the attention implementation (`models.attention.IMPLS`).

    Returns:
      (logits float32, the updated cache): logits_BTV, or logits_BV with `logits_at_B`.
    """
    B, T = tokens_BT.shape
    S = cache.max_len
    positions_BT = positions_BT.astype(jnp.int32)
    if valid_BT is None:
        valid_BT = jnp.ones((B, T), bool)
    write_pos = jnp.where(valid_BT > 0, positions_BT, S)  # S is out of range: dropped
    live = S if attend_len is None else min(int(attend_len), S)
    # Every written position of the live prefix is a real token: only the causal bound masks.
    mask = (positions_BT, jnp.ones((B, live), bool), None, None, None)
    h, (k, v) = _apply(
        config,
        params,
        tokens_BT,
        positions_BT,
        mask,
        (cache.k, cache.v),
        write_pos,
        attention=attention,
    )
    if logits_at_B is not None:
        h_B1D = jnp.take_along_axis(h, logits_at_B[:, None, None].astype(jnp.int32), axis=1)
        return _logits(config, params, h_B1D)[:, 0], KVCache(k=k, v=v)
    return _logits(config, params, h), KVCache(k=k, v=v)
