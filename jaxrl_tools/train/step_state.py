"""`RLState`, everything one RL step reads and changes, and how it is shaped, placed and made.

The state is a pytree: the actor's `TrainState` (params, or LoRA's adapters, and their AdamW
moments), the critic's when there is one, the frozen policy (LoRA's base, which is also the
reference policy; or, for a full fine-tune with KL, a copy of the initial policy in the compute
dtype; None otherwise), the number of RL steps done and one RNG key. The step draws every random
choice (mini-batch permutations, LoRA dropout) from that key and stores the next one; the
`TrainState`s' own keys are the SFT trainer's and stay unused here.

Shapes come from `jax.eval_shape` of the same `init_trained` that makes the real state, so the
step's in/out shardings (`rl_state_shardings`, by the models' logical axes) are derived once from
the settings, before any weight exists (`plan` lowers the step on them).
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_tools import models, seeds, sharding
from jaxrl_tools.models.lora import lora_shapes
from jaxrl_tools.train import lora, policy
from jaxrl_tools.train.state import TrainState, create_train_state, train_state_shardings
from jaxrl_tools.train.step_updates import optimizers


@flax.struct.dataclass
class RLState:
    """One RL run's state (module docstring).

    Attributes:
      actor: the policy's TrainState (with LoRA: the adapters').
      critic: the critic's TrainState, or None (no critic).
      frozen: LoRA's base (compute dtype; also the reference), the reference policy of a full
        fine-tune with KL (compute dtype), or None.
      step: RL steps done (int32).
      rng: the raw uint32 key of the next step.
    """

    actor: TrainState
    critic: TrainState | None
    frozen: Any
    step: jax.Array
    rng: jax.Array


def init_trained(settings, actor_params, params, seed: int) -> RLState:
    """The state without its frozen policy: fresh AdamW states, step 0, the key of `seed`.

    Args:
      settings: a `train.step.StepSettings`.
      actor_params: what the actor trains (the params, or LoRA's adapters).
      params: the full policy params (the critic's trunk is copied from them).
      seed: the run's seed.
    """
    actor_opt, critic_opt = optimizers(settings)
    critic = None
    if settings.uses_critic:
        critic = create_train_state(
            policy.init_value_head(settings.model, params), critic_opt, seed
        )
    return RLState(
        actor=create_train_state(actor_params, actor_opt, seed),
        critic=critic,
        frozen=None,
        step=jnp.zeros((), jnp.int32),
        rng=seeds.purpose_key(seed, "update"),
    )


def frozen_policy(settings, params) -> Any:
    """LoRA's base or a full fine-tune's reference policy (compute dtype), or None."""
    if settings.lora is not None:
        return settings.dtypes.cast_for_compute(params)  # the base: no copy in its own dtype
    if settings.algorithm.kl_coef > 0:
        # The step donates the actor: the reference needs buffers of its own.
        return jax.tree.map(jnp.copy, settings.dtypes.cast_for_compute(params))
    return None


def rl_state_shapes(settings) -> RLState:
    """The state's shapes and dtypes (ShapeDtypeStructs), frozen policy included."""
    params = models.param_shapes(settings.model, settings.dtypes.param_dtype)
    actor = params
    if settings.lora is not None:
        actor = lora_shapes(settings.model, settings.lora, settings.dtypes.param_dtype)
    state = jax.eval_shape(lambda a, p: init_trained(settings, a, p, 0), actor, params)
    return state.replace(frozen=jax.eval_shape(lambda p: frozen_policy(settings, p), params))


def rl_state_shardings(settings, shapes: RLState, mesh, rules=None) -> RLState:
    """The state's NamedShardings on `mesh`: params by `models.logical_axes` (adapters by
    `models.lora_logical_axes`, the critic by `policy.critic_logical_axes`), AdamW moments like
    their params, counters and the key replicated."""
    tree = lambda axes, shapes: sharding.tree_shardings(axes, mesh, rules, shapes=shapes)  # noqa: E731
    model = settings.model
    actor_axes = models.logical_axes(model)
    if settings.lora is not None:
        actor_axes = models.lora_logical_axes(settings.lora)
    actor = shapes.actor
    critic = None
    if shapes.critic is not None:
        critic_sh = tree(policy.critic_logical_axes(model), shapes.critic.params)
        critic = train_state_shardings(shapes.critic, critic_sh, mesh)
    frozen = None if shapes.frozen is None else tree(models.logical_axes(model), shapes.frozen)
    replicated = NamedSharding(mesh, PartitionSpec())
    return RLState(
        actor=train_state_shardings(actor, tree(actor_axes, actor.params), mesh),
        critic=critic,
        frozen=frozen,
        step=replicated,
        rng=replicated,
    )


def create_rl_state(
    settings,
    params: Any,
    *,
    adapters: Any = None,
    seed: int = 0,
    shardings: RLState | None = None,
    mesh=None,
    rules=None,
) -> RLState:
    """The initial state of a run from the policy's `params` (master dtype).

    Args:
      settings: a `train.step.StepSettings`.
      params: the initial policy (a full fine-tune trains these very arrays: the step donates
        them; pass a copy to keep them).
      adapters: with LoRA, the adapters to start from (None: fresh ones, B = 0).
      seed: the state's key, and fresh adapters' (folded differently).
      shardings: `rl_state_shardings` (None: one device).
      mesh, rules: the mesh of `shardings`.
    """
    if shardings is not None:
        params = jax.device_put(params, shardings.frozen or shardings.actor.params)
    actor_params = params
    if settings.lora is not None:
        actor_params, _ = lora.place_adapters(
            settings.model, settings.lora, adapters, settings.dtypes, seed, mesh, rules
        )
    frozen = frozen_policy(settings, params)
    if shardings is None:
        trained = init_trained(settings, actor_params, params, seed)
    else:
        out = shardings.replace(frozen=None)
        init = jax.jit(lambda a, p: init_trained(settings, a, p, seed), out_shardings=out)
        with sharding.use_mesh(mesh, rules):
            trained = init(actor_params, params)
    return trained.replace(frozen=frozen)
