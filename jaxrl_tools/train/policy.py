"""The policy and critic as functions of token batches.

A batch holds prompt + response tokens per row, right-padded: `tokens_BT`, `positions_BT`
(0, 1, 2, ... on real tokens) and `attention_BT` (1 on real tokens). With `packed=True` a row
holds several sequences back to back (`train.packing`): `attention_BT` numbers them (1, 2, ...)
and the positions restart at each; the samples of one prompt may share it (`prompt_keys`:
the prompt laid out once in a slot of its own, which each of them attends to). Per-token
quantities are aligned to the token they score:
`logp_BT[b, t] = log pi(tokens[b, t] | tokens[b, <t])`, so the first column is always 0 and
`loss_mask_BT` marks the same positions as the rollout's mask.
"""

import jax
import jax.numpy as jnp

from jaxrl_tools import algorithms, models


def _shift_right(x_BT: jax.Array) -> jax.Array:
    return jnp.pad(x_BT[:, :-1], ((0, 0), (1, 0)))


# Below this many logits per batch ([B, T, V] float32 = 4 bytes each) the plain path is used:
# chunking and recomputing in the backward pass only cost time when the logits fit anyway.
PLAIN_LOGITS_MAX = 1 << 25


def token_logprobs(
    model_cfg: models.ModelConfig,
    params,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    attention_BT: jax.Array,
    loss_mask_BT: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    chunked: bool | None = None,
    remat: bool = False,
    entropy_grad: bool = False,
    attention: str = "auto",
    packed: bool = False,
    prompt_keys: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies of each token under the policy, aligned to the tokens.

    The logits are divided by `temperature`, as the sampler did (so PPO ratios compare like with
    like). Large batches work in chunks over the sequence, so no [B, T, V] float32 array is
    materialised; small ones (< PLAIN_LOGITS_MAX logits) take the plain, faster path.
    `chunked` (True / False) picks the path explicitly; both give the same numbers.
    `remat` recomputes each decoder layer in the backward pass (memory for compute). The
    entropy carries no gradient unless `entropy_grad` (an entropy bonus needs it).
    `attention` picks the attention implementation (`models.attention.IMPLS`); `packed` rows hold
    several sequences (module docstring), whose shared prompts `prompt_keys` mark. The compute
    dtype is the params' (pass the compute-dtype cast of master weights, `models.DTypePolicy`);
    logits, log-softmax and entropy are float32 whatever it is.

    Returns:
      (logp_BT, entropy_BT), float32, 0 where `loss_mask_BT` is 0 and at t = 0.
    """
    h_BTD = models.hidden_states(
        model_cfg,
        params,
        tokens_BT,
        attention_mask=attention_BT,
        positions=positions_BT,
        remat=remat,
        attention=attention,
        right_padded=True,  # packed batches are right-padded (module docstring)
        packed=packed,
        prompt_keys=prompt_keys,
    )
    h, W = h_BTD[:, :-1], models.unembed(model_cfg, params)
    targets, mask = tokens_BT[:, 1:], loss_mask_BT[:, 1:]
    if chunked is None:
        chunked = h.shape[0] * h.shape[1] * W.shape[1] > PLAIN_LOGITS_MAX
    if not chunked:
        logits = jnp.einsum("btd,dv->btv", h, W.astype(h.dtype), preferred_element_type=jnp.float32)
        logp = algorithms.target_logprobs(logits, targets, mask, temperature=temperature)
        ent = algorithms.token_entropy(
            logits if entropy_grad else jax.lax.stop_gradient(logits),
            mask,
            temperature=temperature,
        )
    else:
        logp, ent = algorithms.chunked_token_logprobs_and_entropy(
            h, W, targets, mask, chunk_size=chunk_size, temperature=temperature
        )
        if not entropy_grad:
            ent = jax.lax.stop_gradient(ent)
    pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
    return pad(logp), pad(ent)


def init_value_head(model_cfg: models.ModelConfig, params) -> dict:
    """A critic: a copy of the policy trunk and a zero-initialised scalar head (every value
    starts at 0, so nothing random is needed)."""
    dtype = params["embed"]["embedding"].dtype
    return {
        "trunk": jax.tree.map(jnp.array, params),
        "value_head": {
            "kernel": jnp.zeros((model_cfg.hidden_size,), dtype),
            "bias": jnp.zeros((), dtype),
        },
    }


def token_values(
    model_cfg: models.ModelConfig,
    critic_params,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    attention_BT: jax.Array,
    *,
    attention: str = "auto",
    packed: bool = False,
    remat: bool | str = False,
    prompt_keys: jax.Array | None = None,
) -> jax.Array:
    """V_t, the value of the state in which token t is chosen, aligned to the tokens (float32).
    `remat` recomputes each layer of the trunk in the backward pass, as the policy's does."""
    h_BTD = models.hidden_states(
        model_cfg,
        critic_params["trunk"],
        tokens_BT,
        attention_mask=attention_BT,
        positions=positions_BT,
        attention=attention,
        right_padded=True,
        packed=packed,
        remat=remat,
        prompt_keys=prompt_keys,
    )
    head = critic_params["value_head"]
    v_BT = jnp.einsum("btd,d->bt", h_BTD.astype(jnp.float32), head["kernel"].astype(jnp.float32))
    return _shift_right(v_BT + head["bias"].astype(jnp.float32))


def critic_logical_axes(model_cfg: models.ModelConfig) -> dict:
    """Logical axes of the critic of `policy.init_value_head`: the trunk's are the model's."""
    return {
        "trunk": models.logical_axes(model_cfg),
        "value_head": {"kernel": ("embed",), "bias": ()},
    }
