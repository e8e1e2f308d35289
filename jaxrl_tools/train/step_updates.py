"""The pieces of one RL step that touch the model: forwards in micro-batches, and the
`ppo_epochs` x `num_mini_batches` optimizer updates as one `lax.scan`.

`StepFunctions` binds the objectives (`train.objectives`) to a step's settings once: the policy's
log-probs, the critic's values, and the actor and critic updates `(train_state, batch_M, frozen,
key) -> (train_state, metrics)` (`train.state.make_update`: exact gradient accumulation over
micro-batches). `run_updates` draws the mini-batches from the step's key and scans the updates;
every metric comes back as an array (means over the updates; `*/skipped_updates` a count).

Rows and micro-batches: the step's rows are split into mini-batches of rows / num_mini_batches,
each into micro-batches of `optim.micro_batch_size` rows stacked on a leading axis [M, b, ...]
(placed over the mesh's batch devices on axis 1). With one mini-batch the rows are taken in order:
the gradient of the whole batch does not depend on the order of its micro-batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl_tools import models
from jaxrl_tools.train import lora, objectives
from jaxrl_tools.train.state import TrainState, make_optimizer, make_update

# (+ "prompt_keys": [rows, N, S], the prompt-slot tokens each sample slot attends to,
# `optim.share_prefix`)
SEQUENCE_KEYS = ("tokens", "positions", "attention", "loss_mask", "prompt_keys")
_ACTOR_KEYS = (*SEQUENCE_KEYS, "advantages", "correct", "old_logp", "ref_logp", "behaviour_logp")
_CRITIC_KEYS = (*SEQUENCE_KEYS, "old_values", "returns")
# An update is finite when these of its metrics are (its params and moments then are too).
WATCHED = ("loss", "grad_norm", "update_norm")


class StepFunctions(NamedTuple):
    """A step's model functions, bound to its settings (`step_functions`).

    Attributes:
      logprobs: (policy params, sequences [R, T]) -> (log-probs, entropies) [R, T], in
        micro-batches.
      values: (critic params, sequences) -> values [R, T], in micro-batches (None: no critic).
      actor_update, critic_update: (train state, batch [M, b, ...], frozen, key) -> (train
        state, metrics); critic_update is None without a critic.
      actor_optimizer, critic_optimizer: their optax transformations.
    """

    logprobs: Callable
    values: Callable | None
    actor_update: Callable
    critic_update: Callable | None
    actor_optimizer: optax.GradientTransformation
    critic_optimizer: optax.GradientTransformation | None


def optimizers(settings) -> tuple[optax.GradientTransformation, Any]:
    """(actor AdamW, critic AdamW or None): the optim section's AdamW (schedule, decay, betas,
    clip) over the run's optimizer updates; the critic's at its own lr and warm-up."""
    o = settings.optim
    adamw = functools.partial(
        make_optimizer,
        total_steps=max(1, settings.total_steps * settings.updates_per_step),
        schedule=o.schedule,
        min_lr_ratio=o.min_lr_ratio,
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        grad_clip=o.grad_clip,
    )
    actor = adamw(o.lr, warmup_steps=o.warmup_steps)
    if not settings.uses_critic:
        return actor, None
    return actor, adamw(settings.critic.lr, warmup_steps=settings.critic.warmup_steps)


def in_compute(fn: Callable, dtypes: models.DTypePolicy) -> Callable:
    """fn(params, ...) run on the compute-dtype cast of the (master) params; differentiating it
    gives gradients in the master dtype. `fn` itself when no cast is needed."""
    if not dtypes.mixed:
        return fn
    return lambda params, *args: fn(dtypes.cast_for_compute(params), *args)


def micro_batched(fn: Callable, micro_batch_size: int, micro_sharding) -> Callable:
    """fn(params, rows) over [R, ...] arrays run as sequential micro-batches (`lax.map`), so a
    forward holds one micro-batch's activations; outputs come back as [R, ...]."""

    def run(params, rows):
        R = next(iter(rows.values())).shape[0]
        if R <= micro_batch_size:
            return fn(params, rows)
        out = jax.lax.map(
            lambda mb: fn(params, mb), split_micro(rows, micro_batch_size, micro_sharding)
        )
        return jax.tree.map(lambda x: x.reshape(R, *x.shape[2:]), out)

    return run


def split_micro(rows: dict, micro_batch_size: int, micro_sharding) -> dict:
    """[R, ...] rows as [R / b, b, ...] micro-batches (b = micro_batch_size)."""

    def split(x):
        x = x.reshape(x.shape[0] // micro_batch_size, micro_batch_size, *x.shape[1:])
        return x if micro_sharding is None else jax.lax.with_sharding_constraint(x, micro_sharding)

    return {k: split(v) for k, v in rows.items()}


def skip_nonfinite(update: Callable) -> Callable:
    """`update`, keeping the old train state when the update is not finite (and counting it)."""

    def run(state, *args):
        new, metrics = update(state, *args)
        ok = jnp.all(jnp.isfinite(jnp.stack([metrics[k] for k in WATCHED])))
        new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)
        return new, {**metrics, "skipped_updates": 1.0 - ok.astype(jnp.float32)}

    return run


def step_functions(settings, micro_sharding=None) -> StepFunctions:
    """The model functions of a step with `settings` (a `train.step.StepSettings`).

    Args:
      settings: the step's settings.
      micro_sharding: how [M, b, ...] micro-batches lie on the mesh (None: one device).
    """
    s, mbs = settings, settings.optim.micro_batch_size
    packed, attention = s.pack, s.attention
    temperature = max(s.temperature, 1e-6)
    logprobs = functools.partial(
        objectives.sequence_logprobs,
        s.model,
        temperature,
        s.remat,
        attention=attention,
        packed=packed,
    )
    actor_loss = functools.partial(
        objectives.actor_loss,
        s.model,
        s.policy_loss,
        temperature,
        s.remat,
        s.algorithm.nll_coef,
        attention=attention,
        packed=packed,
    )
    denominator = functools.partial(objectives.actor_denominator, s.policy_loss, packed=packed)
    actor_opt, critic_opt = optimizers(s)
    if s.lora is None:
        full = make_update(in_compute(actor_loss, s.dtypes), actor_opt, denoms_fn=denominator)
        actor_update = lambda state, batch_M, frozen, key: full(state, batch_M)  # noqa: E731
    else:
        actor_update = lora.make_lora_update(
            in_compute(actor_loss, s.dtypes), actor_opt, s.lora, denoms_fn=denominator
        )
    skip = s.on_nonfinite == "skip_step"
    values = critic_update = None
    if s.uses_critic:
        values = functools.partial(
            objectives.token_values, s.model, attention=attention, packed=packed
        )
        values = micro_batched(in_compute(values, s.dtypes), mbs, micro_sharding)
        critic_loss = functools.partial(
            objectives.critic_loss,
            s.model,
            s.critic.value_clip_eps,
            attention=attention,
            packed=packed,
            remat=s.remat,
        )
        critic = make_update(
            in_compute(critic_loss, s.dtypes),
            critic_opt,
            denoms_fn=objectives.critic_denominator,
        )
        critic_update = lambda state, batch_M, frozen, key: critic(state, batch_M)  # noqa: E731
        critic_update = skip_nonfinite(critic_update) if skip else critic_update
    return StepFunctions(
        logprobs=micro_batched(in_compute(logprobs, s.dtypes), mbs, micro_sharding),
        values=values,
        actor_update=skip_nonfinite(actor_update) if skip else actor_update,
        critic_update=critic_update,
        actor_optimizer=actor_opt,
        critic_optimizer=critic_opt,
    )


def run_updates(
    settings,
    fns: StepFunctions,
    actor: TrainState,
    critic: TrainState | None,
    frozen: Any,
    rows: dict,
    key: jax.Array,
    actor_moves: jax.Array | None,
    micro_sharding=None,
) -> tuple[TrainState, TrainState | None, dict]:
    """`ppo_epochs` x `num_mini_batches` actor (and critic) updates on `rows` (module docstring).

    Args:
      settings: the step's settings.
      fns: its `StepFunctions`.
      actor, critic: the train states (critic None without one).
      frozen: LoRA's base (passed to the actor update), or anything (unused).
      rows: the step's [R, ...] rows with "advantages" and the other loss inputs.
      key: draws the mini-batches (each epoch a permutation of the rows) and LoRA's dropout.
      actor_moves: a boolean scalar: False keeps the actor (VAPO's value pre-training); None:
        the actor always moves.
      micro_sharding: as in `step_functions`.

    Returns:
      (actor, critic, metrics): metrics "actor/<name>" and "critic/<name>", means over the
      updates (`*/skipped_updates`: how many were dropped as not finite).
    """
    o = settings.optim
    R, n_mini, mbs = rows["tokens"].shape[0], o.num_mini_batches, o.micro_batch_size
    n_updates = o.ppo_epochs * n_mini
    order_key, dropout_key = jax.random.split(key)
    # Each epoch a permutation of the rows, cut into mini-batches: [updates, rows per update].
    order_UN = None
    if n_mini > 1:
        keys = jax.random.split(order_key, o.ppo_epochs)
        order_UN = jax.vmap(lambda k: jax.random.permutation(k, R))(keys)
        order_UN = order_UN.reshape(n_updates, R // n_mini).astype(jnp.int32)
    actor_rows = {k: rows[k] for k in _ACTOR_KEYS if k in rows}
    critic_rows = {k: rows[k] for k in _CRITIC_KEYS if k in rows}

    def micro(part: dict, idx_N) -> dict:
        if idx_N is not None:  # this mini-batch's rows, gathered inside the step
            part = {k: jnp.take(v, idx_N, axis=0) for k, v in part.items()}
        return split_micro(part, mbs, micro_sharding)

    def actor_step(state, batch_M, key_u):
        return fns.actor_update(state, batch_M, frozen, key_u)

    def one_update(carry, xs):
        actor, critic = carry
        u, idx_N = xs
        key_u = jax.random.fold_in(dropout_key, u)
        batch_M = micro(actor_rows, idx_N)
        if actor_moves is None:
            actor, am = actor_step(actor, batch_M, key_u)
        else:  # the kept branch reports zeros (the host drops them: "actor/moved" is 0)
            shapes = jax.eval_shape(actor_step, actor, batch_M, key_u)[1]
            zeros = {k: jnp.zeros(v.shape, v.dtype) for k, v in shapes.items()}
            actor, am = jax.lax.cond(
                actor_moves,
                lambda a: actor_step(a, batch_M, key_u),
                lambda a: (a, zeros),
                actor,
            )
        metrics = {f"actor/{k}": v for k, v in am.items()}
        if critic is not None:
            critic, cm = fns.critic_update(critic, micro(critic_rows, idx_N), None, key_u)
            metrics.update({f"critic/{k}": v for k, v in cm.items()})
        return (actor, critic), metrics

    if n_updates == 1:
        (actor, critic), metrics = one_update((actor, critic), (0, None))
    else:
        xs = (jnp.arange(n_updates), order_UN)
        (actor, critic), per_update = jax.lax.scan(one_update, (actor, critic), xs)
        metrics = {
            k: jnp.sum(v, 0) if k.endswith("skipped_updates") else jnp.mean(v, 0)
            for k, v in per_update.items()
        }
    if actor_moves is not None:
        metrics["actor/moved"] = actor_moves.astype(jnp.float32)
    return actor, critic, metrics
