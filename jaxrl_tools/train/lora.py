"""LoRA training pieces of the RL trainer: the adapters' update, with the frozen base as input.

The train state holds the adapters only (so the optimizer's moments are adapter-sized); the base
is an argument of the jitted update, closed over inside the trace, so it is neither a constant
baked into the program nor differentiated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxrl_tools import models, seeds, sharding
from jaxrl_tools.models.lora import DECODE_MODES  # noqa: F401 -- re-exported
from jaxrl_tools.train.state import make_update

log = logging.getLogger(__name__)


def place_adapters(
    model_cfg: models.ModelConfig,
    lora: models.LoraConfig,
    adapters: Any,
    dtypes: models.DTypePolicy,
    seed: int,
    mesh=None,
    rules=None,
) -> tuple[Any, Any]:
    """(adapters, their shardings or None): `adapters` (fresh ones when None: B = 0) in the
    master dtype, placed on `mesh` by the same logical-axis rules as their base kernels."""
    if adapters is None:
        key = jax.random.wrap_key_data(seeds.purpose_key(seed, "adapters"))
        adapters = models.init_lora(
            model_cfg, lora, key, dtype=dtypes.param_dtype, mesh=mesh, rules=rules
        )
    adapters = models.cast_floating(adapters, dtypes.param_dtype)
    if mesh is None:
        return adapters, None
    shardings = sharding.tree_shardings(
        models.lora_logical_axes(lora), mesh, rules, shapes=adapters
    )
    return jax.device_put(adapters, shardings), shardings


def log_setup(lora: models.LoraConfig, adapters: Any, decode: str) -> None:
    """One line: what is trained, and which weights the engine decodes with."""
    log.info(
        "LoRA: rank %d, alpha %g, dropout %g on %s: %d trainable parameters; the engine decodes "
        "with %s",
        lora.rank,
        lora.alpha,
        lora.dropout,
        ",".join(lora.targets),
        sum(x.size for x in jax.tree.leaves(adapters)),
        "merged weights (W + scale * A @ B, merged once per update)"
        if decode == "merged"
        else "the adapters applied (no merged copy of the weights)",
    )


def make_lora_update(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    lora: models.LoraConfig,
    *,
    denoms_fn: Callable,
) -> Callable:
    """`(state, batch_M, base, key) -> (state, metrics)`: `make_update` over the adapters.

    `loss_fn(params, micro_batch, denoms)` is the full model's loss; it receives the
    `models.LoraParams` of `base` and the adapters. Adapter dropout (`lora.dropout` > 0) draws
    its masks from `key` (the RL step's, one per update), folded with the micro-batch.
    """

    def update(state, batch_M, base, key):
        def loss(adapters, mb, denom):
            # The micro-batch scan gives no index: the micro-batch's tokens tell them apart.
            k = jax.random.fold_in(key, jnp.sum(mb["tokens"])) if lora.dropout > 0 else None
            return loss_fn(models.with_lora(base, adapters, lora, k), mb, denom)

        return make_update(loss, optimizer, denoms_fn=denoms_fn)(state, batch_M)

    return update
