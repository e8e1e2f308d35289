"""The RL trainer: places each `Batch` on the devices and runs the one jitted RL step on it.

`RLTrainer.step(batch)` turns the host batch into the step's inputs (`train.step_inputs`: packed
rows with `optim.pack`, the estimator's view, windowed turns), places them (rows split over the
mesh's logical "batch" axis), calls `train.step.make_rl_step(settings)` on the trainer's
`RLState`, and reads the metrics once. Everything else (old and reference log-probs, values,
advantages, epochs and mini-batches) happens inside the step (`train.step`).

Mixed precision (`settings.dtypes`, a `models.DTypePolicy`): the state holds the master weights
and AdamW moments in `param` dtype; every forward and backward pass runs on the compute-dtype
cast of the master weights, taken inside the step, so gradients arrive in the master dtype;
log-softmax and losses are float32. The reference policy is kept in the compute dtype.

LoRA (`settings.lora`): the actor's params are the adapters (so are the gradients and AdamW
moments); the policy's weights stay frozen as the state's base, in the compute dtype, which is
also the reference policy (adapters off, no copy). `params` (what the engine decodes with) is the
base with the adapters merged in, once per update, or a view applying them (`lora_decode`).

With a mesh the step has explicit in/out shardings (params and moments by `models.logical_axes`,
counters replicated) and donates the trained part of the state; without one it is jitted
without shardings.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_tools import models, sharding
from jaxrl_tools.config import ConfigError, OptimSection
from jaxrl_tools.train import lora
from jaxrl_tools.train.state import TrainState
from jaxrl_tools.train.step import RLState, RLStep, StepSettings, make_rl_step
from jaxrl_tools.train.step_inputs import shared_slots, step_inputs
from jaxrl_tools.train.step_state import create_rl_state
from jaxrl_tools.train.step_updates import WATCHED
from jaxrl_tools.types import Batch


class NonFiniteUpdate(ConfigError):
    """A diverged update ended the run (`trainer.on_nonfinite: stop`): one line, the fix."""

    def __init__(self, step: int, what: str, last_saved: int | None, directory: str):
        last = (
            f"the last checkpoint, step {last_saved} in {directory}, is intact: lower optim.lr "
            "(or set optim.grad_clip) and continue with --resume"
            if last_saved is not None
            else "lower optim.lr (or set optim.grad_clip) and start again"
        )
        super().__init__(
            f"step {step}: the update is not finite ({what}); the run stopped without saving "
            f"it; {last}, or set trainer.on_nonfinite=skip_step to drop such updates"
        )


class RLTrainer:
    """Runs RL steps for one policy (and optional critic).

    Args:
      model_cfg: the policy architecture.
      params: the initial policy params (a full fine-tune trains these very arrays: the step
        donates them); also the frozen reference policy when KL is on.
      settings: the step's math (`StepSettings`: architecture, sections, G, temperature,
        horizon, remat, dtypes, attention, LoRA, what a non-finite update does).
      rows: sequences per RL step (prompts x group size; x env.max_turns with windowed
        history, a row per turn): the batch's fixed row count.
      seed: the RL state's key (mini-batch permutations, LoRA dropout) and fresh adapters'.
      lora_decode: "merged" (the engine gets base + scale * A @ B, merged once per update) or
        "adapters" (the engine runs the base with the adapters applied: no second copy).
      checkpoint_base: with LoRA, checkpoint the frozen base too (it is not `model.path`'s
        weights, e.g. after an SFT stage); otherwise checkpoints hold the adapters only.
      mesh: the device mesh (None: one device).
      rules: logical -> mesh axes table (default `sharding.DEFAULT_RULES`).
      adapters: with `setup.lora`, the adapters to start from (e.g. a PEFT import); None: fresh
        ones (B = 0: the policy starts as `params`).

    Attributes:
      settings: the step's `StepSettings`; step_fn: the jitted `RLStep` (the very object `plan`
        lowers for the same run); rl_state: the `RLState`.

    Raises:
      ValueError: the batch does not split into the mini/micro-batches, or (with a mesh) the
        rows or micro-batches do not split over the mesh's batch devices.
    """

    def __init__(
        self,
        settings: StepSettings,
        params: Any,
        *,
        rows: int,
        seed: int = 0,
        lora_decode: str = "merged",
        checkpoint_base: bool = False,
        mesh=None,
        rules=None,
        adapters: Any = None,
    ):
        self.settings, self.rows, self.mesh, self.rules = settings, rows, mesh, rules
        self.lora_decode, self.checkpoint_base = lora_decode, checkpoint_base
        self._slots = (0, 0)  # shared prompts: the widest slots so far (`_inputs`)
        _check_rows(rows, settings.optim, mesh, rules)
        self.step_fn: RLStep = make_rl_step(self.settings, mesh, rules)
        self.rl_state: RLState = create_rl_state(
            self.settings,
            params,
            adapters=adapters,
            seed=seed,
            shardings=self.step_fn.state_shardings,
            mesh=mesh,
            rules=rules,
        )
        if self.lora is not None:
            lora.log_setup(self.lora, self.rl_state.actor.params, lora_decode)
        self._merge = None
        if self.lora is not None and lora_decode == "merged":
            frozen_sh = None if mesh is None else self.step_fn.state_shardings.frozen
            merge = lambda base, adapters: models.merge(base, adapters, self.lora)  # noqa: E731
            self._merge = jax.jit(merge, out_shardings=frozen_sh)
        self._decode_params = None

    # ------------------------------------------------------------------ views of the state

    model_cfg = property(lambda self: self.settings.model)
    algorithm = property(lambda self: self.settings.algorithm)
    optim = property(lambda self: self.settings.optim)
    critic = property(lambda self: self.settings.critic)
    lora = property(lambda self: self.settings.lora)
    optimizer = property(lambda self: self.step_fn.functions.actor_optimizer)
    critic_optimizer = property(lambda self: self.step_fn.functions.critic_optimizer)

    @property
    def state(self) -> TrainState:
        """The actor's TrainState (with LoRA: the adapters'); settable (e.g. a saved copy)."""
        return self.rl_state.actor

    @state.setter
    def state(self, actor: TrainState) -> None:
        self.rl_state = self.rl_state.replace(actor=actor)

    @property
    def critic_state(self) -> TrainState | None:
        """The critic's TrainState, or None; settable."""
        return self.rl_state.critic

    @critic_state.setter
    def critic_state(self, critic: TrainState | None) -> None:
        self.rl_state = self.rl_state.replace(critic=critic)

    @property
    def base(self) -> Any:
        """LoRA's frozen base (None without LoRA)."""
        return self.rl_state.frozen if self.lora is not None else None

    @property
    def ref_params(self) -> Any:
        """The reference policy (LoRA: the base itself), or None without KL."""
        return self.rl_state.frozen if self.algorithm.kl_coef > 0 else None

    @property
    def params(self):
        """The policy's weights for the engine, evaluation and export: the actor's params; with
        LoRA the base with the adapters merged in (once per update; `setup.lora_decode`
        "adapters": a `models.LoraParams` view instead, no second copy of the weights)."""
        if self.lora is None:
            return self.state.params
        adapters = self.state.params
        if self._decode_params is None or self._decode_params[0] is not adapters:
            self._decode_params = None  # drop the previous merged copy first
            if self._merge is None:
                view = models.with_lora(self.base, adapters, self.lora)
            else:
                view = sharding.call_in_mesh(
                    self.mesh, self.rules, self._merge, self.base, adapters
                )
            self._decode_params = (adapters, view)
        return self._decode_params[1]

    # ------------------------------------------------------------------ one RL step

    def _inputs(self, batch: Batch) -> tuple[dict, dict[str, float]]:
        """The step's inputs of `batch`, placed (rows over the mesh's batch axes), and the host
        metrics of building them."""
        if batch.tokens_RT.shape[0] != self.rows:
            raise ValueError(f"batch has {batch.tokens_RT.shape[0]} rows, the trainer {self.rows}")
        inputs, metrics = step_inputs(batch, self.settings, self._slots)
        # Shared prompts: the slots only grow, in coarse steps, so that steps reuse a compiled
        # step (a batch's own longest prompt and sample would give a new shape almost each time).
        self._slots = shared_slots(inputs, self._slots)
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, inputs), metrics
        return jax.device_put(inputs, self.step_fn.batch_sharding), metrics

    def step(self, batch: Batch) -> dict[str, float]:
        """One RL step on a Batch; returns the batch's metrics plus the step's."""
        return self.finish(self.dispatch(batch))

    def dispatch(self, batch: Batch) -> tuple:
        """Places the batch and dispatches the step's device work (asynchronously: the update
        runs while the host goes on); `finish` reads its metrics."""
        t0 = time.perf_counter()
        if batch.num_rows == 0:  # every group filtered out
            return batch, {}, None, t0
        inputs, host_metrics = self._inputs(batch)
        self.rl_state, step_metrics = self.step_fn(self.rl_state, inputs)
        return batch, host_metrics, step_metrics, t0

    def finish(self, dispatched: tuple) -> dict[str, float]:
        """The metrics of a dispatched step (waits for it)."""
        batch, host_metrics, step_metrics, t0 = dispatched
        metrics = dict(batch.metrics)
        if step_metrics is None:
            metrics["time/update_s"] = 0.0
            return metrics
        step_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
        if step_metrics.pop("actor/moved", 1.0) == 0.0:  # VAPO's value pre-training
            step_metrics = {k: v for k, v in step_metrics.items() if not k.startswith("actor/")}
        metrics.update(host_metrics, **step_metrics)
        if self.lora is not None:  # which weights the engine decodes with (see `params`)
            metrics["lora/merged_decode"] = float(self.lora_decode == "merged")
        t_update = time.perf_counter() - t0
        metrics["time/update_s"] = t_update
        metrics["throughput/update_tokens_per_s"] = (
            float(np.sum(batch.attention_RT)) * self.optim.ppo_epochs / max(t_update, 1e-9)
        )
        return metrics

    def advantages(self, batch: Batch) -> np.ndarray:
        """The advantages the step computes for `batch` on its rows' tokens (no update)."""
        inputs, _ = self._inputs(batch)
        return np.asarray(self.step_fn.advantages(self.rl_state, inputs))

    def logprobs(self, params: Any, seqs: dict) -> tuple[jax.Array, jax.Array]:
        """The step's micro-batched forward: (log-probs, entropies) [R, T] of `seqs`
        ("tokens", "positions", "attention", "loss_mask") under `params`."""
        return self.step_fn.logprobs(params, seqs)

    def diverged(self, metrics: dict) -> str | None:
        """The step's update metrics (loss, gradient and update norms) that are not finite, as
        text; None when all are, or with `on_nonfinite: skip_step` (such updates were dropped)."""
        if self.settings.on_nonfinite != "stop":
            return None
        bad = [
            f"{k}={v}"
            for k, v in sorted(metrics.items())
            if k.startswith(("actor/", "critic/"))
            and k.split("/", 1)[1] in WATCHED
            and not math.isfinite(v)
        ]
        return ", ".join(bad) or None

    # ------------------------------------------------------------------ checkpoint support

    def checkpoint_state(self) -> dict:
        """What a checkpoint holds: the train states, the step count and key, and the frozen
        policy where it is not `model.path`'s weights (a full fine-tune's reference; LoRA's base
        with `checkpoint_base`)."""
        s = self.rl_state
        state = {"actor": s.actor, "step": s.step, "rng": s.rng}
        if s.critic is not None:
            state["critic"] = s.critic
        if s.frozen is not None and self.lora is None:
            state["ref"] = s.frozen
        if self.lora is not None and self.checkpoint_base:
            state["base"] = s.frozen
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        """Takes the state of `checkpoint_state`'s structure (restored)."""
        self.rl_state = self.rl_state.replace(
            actor=state["actor"],
            critic=state.get("critic"),
            frozen=state.get("ref", state.get("base", self.rl_state.frozen)),
            step=state["step"],
            rng=state["rng"],
        )
        self._decode_params = None


def _check_rows(rows: int, optim: OptimSection, mesh, rules) -> None:
    """The step's rows split into mini- and micro-batches, and those over the mesh's batch axes."""
    o = optim
    if rows % (o.num_mini_batches * o.micro_batch_size):
        raise ValueError(
            f"data.batch_size x rollout.group_size (x env.max_turns with windowed history) "
            f"= {rows} sequences must split into "
            f"optim.num_mini_batches ({o.num_mini_batches}) x optim.micro_batch_size "
            f"({o.micro_batch_size})"
        )
    if mesh is None:
        return
    batch_axes = sharding.logical_to_spec(("batch",), rules)[0]
    names = (
        () if batch_axes is None else (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    )
    n = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    for what, size in (
        ("data.batch_size x rollout.group_size", rows),
        ("optim.micro_batch_size", o.micro_batch_size),
    ):
        if size % n:
            raise ValueError(
                f"{what} = {size} does not split over the {n} devices of the mesh's batch "
                f"axes {tuple(names)} (mesh {dict(mesh.shape)})"
            )
