"""The train state pytree, the optimizer, and a jitted update with exact gradient accumulation.

An update is `(state, batch) -> (state, metrics)`. The batch's leaves carry a leading
micro-batch axis [M, b, ...]; the loss of each micro-batch is its *sum* divided by the whole
mini-batch's denominator, so the accumulated gradient equals the full-batch gradient exactly.
"""

from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_tools.config.training import SCHEDULES

LossFn = Callable[[Any, Any, Any], tuple[jax.Array, dict[str, jax.Array]]]


@flax.struct.dataclass
class TrainState:
    """Everything an update changes. `rng` is a raw uint32 key (checkpointable as an array).

    `params` are the master weights (`models.DTypePolicy.param`, float32 by default) and the
    optimizer state mirrors them; a mixed-precision loss casts them to the compute dtype inside
    itself, so its gradients come back in the master dtype (accumulated in float32).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def make_optimizer(
    lr: float,
    *,
    total_steps: int | None = None,
    warmup_steps: int = 0,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.0,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    grad_clip: float | None = 1.0,
) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine, linear or constant decay, after global-norm clipping.

    The defaults are this library's fine-tuning recipe (cosine decay, clip 1.0, no weight decay),
    not torch's: for ``torch.optim.AdamW`` exactly, use ``torch_adamw``.

    Args:
      lr: the peak learning rate.
      total_steps: optimizer updates of the whole run (the decay's horizon); needed by the
        cosine and linear schedules only.
      warmup_steps: linear warm-up from 0 over this many updates.
      schedule: "cosine" | "linear" (both decay to `lr * min_lr_ratio`) | "constant".
      min_lr_ratio, weight_decay, b1, b2, eps: AdamW / decay settings.
      grad_clip: global-norm clip (None or 0: off).
    """
    if lr <= 0:
        raise ValueError(f"optim.lr must be > 0, got {lr}")
    if schedule in ("cosine", "linear") and total_steps is None:
        raise ValueError(
            f"make_optimizer: schedule {schedule!r} decays over total_steps, which is not set "
            "(give the run's optimizer updates, or use schedule='constant')"
        )
    if schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warmup_steps else lr,
            peak_value=lr,
            warmup_steps=warmup_steps,
            decay_steps=max(total_steps, warmup_steps + 1),
            end_value=lr * min_lr_ratio,
        )
    elif schedule == "constant":
        sched = (
            optax.join_schedules(
                [optax.linear_schedule(0.0, lr, max(warmup_steps, 1)), optax.constant_schedule(lr)],
                [warmup_steps],
            )
            if warmup_steps
            else optax.constant_schedule(lr)
        )
    elif schedule == "linear":
        decay = optax.linear_schedule(lr, lr * min_lr_ratio, max(total_steps - warmup_steps, 1))
        sched = (
            optax.join_schedules(
                [optax.linear_schedule(0.0, lr, warmup_steps), decay], [warmup_steps]
            )
            if warmup_steps
            else decay
        )
    else:
        raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got {schedule!r}")
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
    parts.append(optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*parts)


def torch_adamw(
    lr: float,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> optax.GradientTransformation:
    """``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` exactly, with torch's defaults.

    Constant learning rate, no gradient clipping, no amsgrad. The update is the same formula:
    torch decays p by lr·wd before the Adam step, optax adds wd·p to the Adam direction; both
    read p before the step, and both divide by sqrt(v̂) + eps with bias-corrected moments.
    """
    return make_optimizer(
        lr,
        schedule="constant",
        weight_decay=weight_decay,
        b1=betas[0],
        b2=betas[1],
        eps=eps,
        grad_clip=None,
    )


def create_train_state(
    params: Any,
    optimizer: optax.GradientTransformation,
    seed: int,
    *,
    param_shardings: Any = None,
) -> TrainState:
    """A fresh state: step 0, `optimizer.init(params)`, the raw key of `seed`.

    Args:
      params: the parameters (the state holds these very arrays).
      optimizer: the optax transformation.
      seed: the state's RNG seed.
      param_shardings: NamedShardings like `params` (None: one device). When given, the state is
        created by a jit whose outputs are already placed by `train_state_shardings`: params as
        given, optimizer moments like their params, counters replicated.
    """

    def init(p):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=p,
            opt_state=optimizer.init(p),
            rng=jax.random.key_data(jax.random.key(seed)),
        )

    if param_shardings is None:
        return init(params)
    shapes = jax.eval_shape(init, params)
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    out = train_state_shardings(shapes, param_shardings, mesh)
    params = jax.device_put(params, param_shardings)
    return jax.jit(init, in_shardings=(param_shardings,), out_shardings=out)(params)


def train_state_shardings(state_shapes: TrainState, param_shardings: Any, mesh: Mesh) -> TrainState:
    """Shardings of a TrainState: params by `param_shardings`, optimizer state mirroring them.

    Optax states hold param-shaped subtrees (Adam's mu and nu, ...) next to scalars (counts):
    every subtree of `opt_state` with the params' tree structure and shapes takes the params'
    shardings; every other leaf is replicated (they are counters and small statistics).

    Args:
      state_shapes: the state's shapes (`jax.eval_shape` of its creation, or the state itself).
      param_shardings: NamedShardings like the params.
      mesh: the mesh (for the replicated leaves).

    Returns:
      A TrainState of NamedShardings.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    params_def = jax.tree.structure(state_shapes.params)
    param_shapes = [tuple(x.shape) for x in jax.tree.leaves(state_shapes.params)]

    def like_params(x) -> bool:
        if jax.tree.structure(x) != params_def:
            return False
        return [tuple(y.shape) for y in jax.tree.leaves(x)] == param_shapes

    opt = jax.tree.map(
        lambda x: param_shardings if like_params(x) else replicated,
        state_shapes.opt_state,
        is_leaf=like_params,
    )
    return TrainState(step=replicated, params=param_shardings, opt_state=opt, rng=replicated)


# Metrics named *_min / *_max: how two micro-batches' values combine, and the neutral start.
_EXTREMES = {"_min": (jnp.minimum, jnp.inf), "_max": (jnp.maximum, -jnp.inf)}


def accumulate_gradients(
    loss_fn: LossFn, params: Any, batch_M: Any, denoms: Any
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """Sums loss and gradient over the micro-batches of `batch_M` with `lax.scan`.

    `loss_fn(params, micro_batch, denoms) -> (loss, metrics)` must already divide by the whole
    mini-batch's denominators `denoms`. Metrics (each a mean over its micro-batch's tokens) are
    combined weighted by the micro-batches' `loss_mask` tokens when the batch has one (equal
    weights otherwise), so a micro-batch of padding rows counts for nothing; metrics named
    `*_min` / `*_max` are the extremes over micro-batches.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def combine(name, acc, m, w):
        extreme = _EXTREMES.get(name[-4:])
        return extreme[0](acc, m) if extreme else acc + w * m

    def body(carry, micro):
        loss_acc, grad_acc, met_acc, w_acc = carry
        (loss, metrics), grads = grad_fn(params, micro, denoms)
        grad_acc = jax.tree.map(jnp.add, grad_acc, grads)
        w = jnp.sum(micro["loss_mask"]).astype(jnp.float32) if "loss_mask" in micro else 1.0
        met_acc = {k: combine(k, met_acc[k], metrics[k], w) for k in met_acc}
        return (loss_acc + loss, grad_acc, met_acc, w_acc + w), None

    first = jax.tree.map(lambda x: x[0], batch_M)
    met_shape = jax.eval_shape(lambda: loss_fn(params, first, denoms)[1])
    start = {k: _EXTREMES.get(k[-4:], (None, 0.0))[1] for k in met_shape}
    zeros_met = {k: jnp.full(s.shape, start[k], jnp.float32) for k, s in met_shape.items()}
    zeros_grad = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    carry = (jnp.zeros((), jnp.float32), zeros_grad, zeros_met, jnp.zeros((), jnp.float32))
    (loss, grads, sums, total), _ = jax.lax.scan(body, carry, batch_M)
    metrics = {
        k: v if k[-4:] in _EXTREMES else v / jnp.maximum(total, 1e-9) for k, v in sums.items()
    }
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return loss, grads, metrics


def apply_update(
    state: TrainState, grads: Any, optimizer: optax.GradientTransformation
) -> tuple[TrainState, dict[str, jax.Array]]:
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"grad_norm": optax.tree.norm(grads), "update_norm": optax.tree.norm(updates)}
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_update(
    loss_fn: LossFn, optimizer: optax.GradientTransformation, *, denoms_fn: Callable[[Any], Any]
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """The update `(state, batch_M) -> (state, metrics)`, to be jitted by the caller.

    `denoms_fn(batch_M)` computes the mini-batch denominators from the whole batch (token count,
    sequence count, ...) before the micro-batch scan.
    """

    def update(state: TrainState, batch_M: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        denoms = denoms_fn(batch_M)
        loss, grads, metrics = accumulate_gradients(loss_fn, state.params, batch_M, denoms)
        state, opt_metrics = apply_update(state, grads, optimizer)
        return state, {"loss": loss, **metrics, **opt_metrics}

    return update
