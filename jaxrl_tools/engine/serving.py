"""The engine's serving copy of the weights: params in the serving dtype, on the engine's mesh
and (`unstack_layers`) one array per layer, made once per new params object
(`EngineCore.serving_params` / `serving_copy`)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_tools import models, sharding
from jaxrl_tools.engine.kernels import Params


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


# The CPU serving layout: one array per layer, and a [D, V] LM head for tied embeddings.
_cpu_layout_jit = jax.jit(lambda params: models.untie_head(models.unstack_layers(params)))


class ServingWeights:
    """Makes and keeps the engine's serving copy of the last params handed to it.

    Args:
      config: the ModelConfig.
      mesh, rules: params on another mesh (or on one device) are resharded onto `mesh` by their
        logical axes (None: left where they are).
      dtype: the serving dtype floating params are cast to (None: as given).
      unstack_layers: serve one array per layer (`models.unstack_layers`, with a [D, V] head
        for tied embeddings).
    """

    def __init__(self, config, *, mesh=None, rules=None, dtype=None, unstack_layers=False):
        self.config, self.mesh, self.rules = config, mesh, rules
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.unstack_layers = bool(unstack_layers)
        self._served: tuple[Any, Any] | None = None  # (params given, their serving copy)

    def params(self, params: Params) -> Params:
        """`params` as the engine serves them. Cast (the cast keeps each array's sharding),
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
        if self.mesh is not None and not _on_mesh(served, self.mesh):
            shardings = sharding.tree_shardings(
                models.logical_axes(self.config), self.mesh, self.rules, shapes=served
            )
            served = jax.device_put(served, shardings)
        if self.unstack_layers and models.has_stacked_layers(served):
            served = _cpu_layout_jit(served)
        if served is not params:
            self._served = (params, served)
        return served

    def copy(self, params: Params) -> Params:
        """`params(params)` in buffers of its own: the rollout's weights survive the trainer's
        next (donating) update (asynchronous rollouts)."""
        served = self.params(params)
        if served is params:
            served = jax.tree.map(jnp.copy, params)
            self._served = (params, served)
        return served
