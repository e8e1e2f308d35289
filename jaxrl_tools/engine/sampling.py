"""Token sampling from logits: greedy, temperature, top-k and top-p, one RNG key per slot.

Everything here is a pure, jittable function of fixed-shape arrays. Sampling parameters are
per slot (arrays of shape [B]) so that one compiled decode step serves slots with different
settings; `temperature <= 0` means greedy for that slot.

Log-probability convention: the returned log-prob is that of the sampled token under the
distribution it was actually drawn from (logits / temperature, after the top-k / top-p mask).
For greedy slots it is log_softmax(logits) at the argmax (temperature 1, no mask).
"""

import dataclasses

import jax
import jax.numpy as jnp

NEG_INF = -1e30
# What a decode step computes, cheapest first; a static of the jitted step, which takes the
# last one any of its slots needs: "greedy" only argmaxes (every slot greedy), "sample" also
# draws, "filter" also sorts for top-k / top-p.
MODES = ("greedy", "sample", "filter")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one request (one slot).

    Attributes:
      temperature: softmax temperature; <= 0 means greedy (argmax).
      top_k: keep the k most likely tokens; 0 disables.
      top_p: keep the smallest set of most likely tokens whose mass is >= top_p; 1.0 disables.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def needs_filter(self) -> bool:
        """True when top-k or top-p masking is active (needs a sort over the vocabulary)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def mode(self) -> str:
        """The `MODES` entry a step must run for this request."""
        return "greedy" if self.greedy else "filter" if self.needs_filter else "sample"


def widest_mode(modes) -> str:
    """The `MODES` entry that serves every one of `modes` ("greedy" for none)."""
    return max(modes, key=MODES.index, default="greedy")


GREEDY = SamplingParams(temperature=0.0)


def filter_logits(scaled_BV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Masks tokens outside the top-k / top-p sets to NEG_INF.

    Args:
      scaled_BV: temperature-scaled float32 logits.
      top_k_B: int, 0 disables top-k for that row.
      top_p_B: float in (0, 1], 1.0 disables top-p for that row.

    Returns:
      logits_BV with excluded tokens set to NEG_INF. Ties at the threshold are kept.
    """
    V = scaled_BV.shape[-1]
    sorted_BV = -jnp.sort(-scaled_BV, axis=-1)  # descending
    # top-k: threshold is the k-th largest value.
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
    kth_B = jnp.take_along_axis(sorted_BV, (k_B - 1)[:, None], axis=-1)[:, 0]
    sorted_BV = jnp.where(jnp.arange(V)[None, :] < k_B[:, None], sorted_BV, NEG_INF)
    # top-p over the top-k survivors: keep token i (in sorted order) if the mass strictly before
    # it is < top_p; always keeps the most likely token.
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV = (before_BV < top_p_B[:, None]) | (jnp.arange(V)[None, :] == 0)
    keep_BV = keep_BV & (sorted_BV > NEG_INF / 2)
    n_keep_B = jnp.maximum(keep_BV.sum(-1), 1)
    pth_B = jnp.take_along_axis(sorted_BV, (n_keep_B - 1)[:, None], axis=-1)[:, 0]
    thresh_B = jnp.maximum(kth_B, pth_B)
    return jnp.where(scaled_BV >= thresh_B[:, None], scaled_BV, NEG_INF)


def sample_tokens(
    logits_BV: jax.Array,
    keys_B: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
    *,
    mode: str = "filter",
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row from its own key.

    Args:
      logits_BV: logits (any float dtype; computed in float32).
      keys_B: per-row PRNG keys, uint32 [B, 2] (jax.random.PRNGKey layout).
      temperature_B: float [B]; <= 0 means greedy for that row.
      top_k_B: int [B]; 0 disables.
      top_p_B: float [B]; 1.0 disables.
      mode: static, a `MODES` entry that serves every row: "sample" skips the top-k/top-p sort,
        "greedy" (every row greedy) also the draw.

    Returns:
      tokens_B int32 and logprobs_B float32 (see the module docstring for the convention).
    """
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_tokens_B = argmax_first(logits_BV)
    if mode == "greedy":
        tokens_B, logp_BV = greedy_tokens_B, jax.nn.log_softmax(logits_BV, axis=-1)
    else:
        greedy_B = temperature_B <= 0
        t_B = jnp.where(greedy_B, 1.0, temperature_B).astype(jnp.float32)
        scaled_BV = logits_BV / t_B[:, None]
        if mode == "filter":
            masked_BV = filter_logits(scaled_BV, top_k_B, top_p_B)
            masked_BV = jnp.where(greedy_B[:, None], scaled_BV, masked_BV)
        else:
            masked_BV = scaled_BV
        logp_BV = jax.nn.log_softmax(masked_BV, axis=-1)
        sampled_B = draw_categorical(keys_B, logp_BV)
        tokens_B = jnp.where(greedy_B, greedy_tokens_B, sampled_B).astype(jnp.int32)
    logprobs_B = jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, logprobs_B


def draw_categorical(keys_B: jax.Array, logp_BV: jax.Array) -> jax.Array:
    """One token per row from exp(logp_BV), by inverting the row's CDF at one uniform draw.

    `jax.random.categorical` (the Gumbel-max trick) draws a random number per vocabulary entry:
    B x V threefry values per decode step, which on CPU costs more than the sampling arithmetic.
    This draws B. A token of zero probability is never returned: the first CDF entry above
    u * total is one where the CDF rises, and when u * total rounds up to the total, the token
    is the last one of positive probability.
    """
    u_B = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys_B)
    cdf_BV = jnp.cumsum(jnp.exp(logp_BV), axis=-1)
    total_B1 = cdf_BV[:, -1:]
    first_above_B = jnp.sum(cdf_BV <= u_B[:, None] * total_B1, axis=-1)
    # The first entry reaching the total (the CDF never decreases): what argmax(cdf >= total)
    # gives, as a count, which XLA:CPU runs several times faster than an argmax.
    last_positive_B = jnp.sum(cdf_BV < total_B1, axis=-1)
    return jnp.minimum(first_above_B, last_positive_B).astype(jnp.int32)


def argmax_first(x_BV: jax.Array) -> jax.Array:
    """int32 index of each row's largest entry, the first one on ties (`jnp.argmax`'s rule; rows
    must hold no NaN). A max and a min over indices: XLA:CPU runs these ~4x faster than the
    (value, index) reduction of `jnp.argmax`."""
    hit_BV = x_BV == x_BV.max(axis=-1, keepdims=True)
    index_V = jnp.arange(x_BV.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit_BV, index_V, x_BV.shape[-1]), axis=-1)


def split_keys(keys_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row key split: (next keys to carry, keys to use now), both uint32 [B, 2]."""
    both = jax.vmap(lambda k: jax.random.split(k, 2))(keys_B)
    return both[:, 0], both[:, 1]
