"""The RL trainer: one jitted, sharded update step on a `Batch` of scored trajectories.

`RLTrainer.step(batch)`:
  1. the batch's arrays go to the devices (rows split over the logical "batch" axis);
  2. old log-probs (only when there is more than one optimizer step per batch or KL is folded into
     the rewards), reference log-probs (KL on) and critic values (PPO / VAPO) by forward passes,
     in micro-batches of `optim.micro_batch_size` rows like the update (one micro-batch's
     activations at a time, not the whole rollout batch's);
  3. advantages by the configured estimator, over the real rows only (with
     `algorithm.tis_cap`, the batch's behaviour log-probs, the engine's, go to the loss for the
     truncated importance weights);
  4. `ppo_epochs` x `num_mini_batches` actor (and critic) updates, each accumulating gradients
     over micro-batches exactly (`train.state.make_update`).

Packing (`setup.pack`, `train.packing`): the batch's sequences are placed back to back in as few
rows of the same width as hold them (rounded up to mini-batches x micro-batches); the forwards of
step 2 and the updates of step 4 run on those rows, the advantages of step 3 on the padded
layout (the estimators group by row), moved in and out by index. With one mini-batch the update
equals the unpacked one (to float rounding); with several, mini-batches are drawn from packed
rows.

Mixed precision (`setup.dtypes`, a `models.DTypePolicy`): the train state holds the master weights
and AdamW moments in `param` dtype; every forward and backward pass runs on the compute-dtype cast
of the master weights, taken inside the jitted function, so gradients arrive in the master dtype
(accumulated in float32); log-softmax and losses are float32. The reference policy is kept in the
compute dtype (it is only ever run forward).

LoRA (`setup.lora`): the state's params are the adapters (so are the gradients and the AdamW
moments); the policy's params stay frozen as `base`, in the compute dtype, passed to the jitted
update as an argument. The reference policy is the base itself (adapters off, no copy), and
`params` (what the engine decodes with) is the base with the adapters merged in, once per update
(`train.lora`, `models.lora`).

With a mesh, every jitted function has explicit in/out shardings: batches are split over the
logical "batch" axis, params (and the optimizer moments, which mirror them) by
`models.logical_axes`, counters replicated; functions are traced inside `sharding.use_mesh`, so
the models' activation constraints apply, and the updates donate the state. Without a mesh the
same functions are jitted without shardings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_tools import algorithms, models, sharding
from jaxrl_tools.config import AlgorithmSection, ConfigError, CriticSection, OptimSection
from jaxrl_tools.train import lora, objectives, policy
from jaxrl_tools.train.packing import plan_packing, take_tokens
from jaxrl_tools.train.state import (
    create_train_state,
    make_optimizer,
    make_update,
    train_state_shardings,
)
from jaxrl_tools.types import Batch

_ACTOR_KEYS = ("tokens", "positions", "attention", "loss_mask", "advantages", "correct")
_CRITIC_KEYS = ("tokens", "positions", "attention", "loss_mask", "old_values", "returns")
# An update is finite when these of its metrics are (the params and moments then are too).
_WATCHED = ("loss", "grad_norm", "update_norm")


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


@dataclasses.dataclass(frozen=True)
class RLSetup:
    """What the trainer needs to know of the rest of the run.

    Attributes:
      rows: sequences per RL step (prompts x group size; x env.max_turns with windowed history,
        a row per turn): the batch's fixed row count.
      group_size: G samples per prompt (consecutive rows).
      temperature: the sampling temperature (log-probs are of the tempered policy).
      max_response_len: the constant of seq-mean-token-sum-norm aggregation.
      total_steps: RL steps of the run (the learning-rate schedule's horizon).
      seed: shuffles mini-batches.
      remat: rematerialise decoder layers in the update (memory for compute): False, True or
        a `models.transformer.REMAT_POLICIES` name ("layer", "dots").
      dtypes: the policy's dtype policy (master weights, compute).
      attention: the attention implementation (`models.attention.IMPLS`).
      pack: pack sequences back to back into the update's rows (module docstring).
      lora: train LoRA adapters on the frozen policy (`models.LoraConfig`), or None (full
        fine-tuning).
      lora_decode: "merged" (the engine gets base + scale * A @ B, merged once per update) or
        "adapters" (the engine runs the base with the adapters applied: no second copy).
      checkpoint_base: with LoRA, checkpoint the frozen base too (it is not `model.path`'s
        weights, e.g. after an SFT stage); otherwise checkpoints hold the adapters only.
      on_nonfinite: an update with a NaN / inf loss, gradient or update norm: "stop" (the caller
        ends the run: `RLTrainer.diverged`) or "skip_step" (the update is dropped in the jitted
        step, the state kept, and counted in `*/skipped_updates`).
    """

    rows: int
    group_size: int
    temperature: float = 1.0
    max_response_len: int = 1024
    total_steps: int = 1
    seed: int = 0
    remat: bool | str = False
    dtypes: models.DTypePolicy = models.DTypePolicy()
    attention: str = "auto"
    pack: bool = False
    lora: models.LoraConfig | None = None
    lora_decode: str = "merged"
    checkpoint_base: bool = False
    on_nonfinite: str = "stop"


def _select_micro(batch: dict, idx_N: jax.Array, micro_batch_size: int, micro_sharding) -> dict:
    """Rows `idx_N` of a [B, ...] batch, as [M, micro_batch_size, ...] micro-batches."""
    num_micro = idx_N.shape[0] // micro_batch_size
    out = {}
    for k, v in batch.items():
        v = jnp.take(v, idx_N, axis=0)
        v = v.reshape(num_micro, micro_batch_size, *v.shape[1:])
        if micro_sharding is not None:
            v = jax.lax.with_sharding_constraint(v, micro_sharding)
        out[k] = v
    return out


def _micro_mapped(fn: Callable, micro_batch_size: int, micro_sharding) -> Callable:
    """fn(params, batch) over [rows, ...] arrays, run as sequential micro-batches (`lax.map`), so
    a forward holds one micro-batch's activations; outputs are put back as [rows, ...]."""

    def run(params, batch):
        rows = next(iter(batch.values())).shape[0]
        num_micro = rows // micro_batch_size
        if num_micro <= 1:
            return fn(params, batch)
        batch_M = {}
        for k, v in batch.items():
            v = v.reshape(num_micro, micro_batch_size, *v.shape[1:])
            if micro_sharding is not None:
                v = jax.lax.with_sharding_constraint(v, micro_sharding)
            batch_M[k] = v
        out = jax.lax.map(lambda mb: fn(params, mb), batch_M)
        return jax.tree.map(lambda x: x.reshape(rows, *x.shape[2:]), out)

    return run


def _skip_nonfinite(update: Callable) -> Callable:
    """`update`, keeping the old state when the update is not finite (and counting it)."""

    def run(state, *args):
        new, metrics = update(state, *args)
        ok = jnp.all(jnp.isfinite(jnp.stack([metrics[k] for k in _WATCHED])))
        new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)
        return new, {**metrics, "skipped_updates": 1.0 - ok.astype(jnp.float32)}

    return run


def _in_compute(fn: Callable, dtypes: models.DTypePolicy) -> Callable:
    """fn(params, ...) run on the compute-dtype cast of the (master) params; differentiating it
    gives gradients in the master dtype. `fn` itself when no cast is needed."""
    if not dtypes.mixed:
        return fn

    def run(params, *args):
        return fn(dtypes.cast_for_compute(params), *args)

    return run


class RLTrainer:
    """Runs RL updates for one policy (and optional critic).

    Args:
      model_cfg: the policy architecture.
      params: the initial policy params (also the frozen reference policy when KL is on).
      algorithm, optim, critic: the run's sections.
      setup: batch shape, temperature, horizon and seed (`RLSetup`).
      mesh: the device mesh (None: one device).
      rules: logical -> mesh axes table (default `sharding.DEFAULT_RULES`).
      adapters: with `setup.lora`, the adapters to start from (e.g. a PEFT import); None: fresh
        ones (B = 0: the policy starts as `params`).

    Raises:
      ValueError: the batch does not split into the mini/micro-batches, or (with a mesh) the
        rows or micro-batches do not split over the mesh's batch devices.
    """

    def __init__(
        self,
        model_cfg: models.ModelConfig,
        params: Any,
        *,
        algorithm: AlgorithmSection,
        optim: OptimSection,
        critic: CriticSection,
        setup: RLSetup,
        mesh=None,
        rules=None,
        adapters: Any = None,
    ):
        self.model_cfg, self.algorithm, self.optim, self.critic = (
            model_cfg,
            algorithm,
            optim,
            critic,
        )
        self.setup, self.mesh, self.rules = setup, mesh, rules
        o, a = optim, algorithm
        self.rows = setup.rows
        if self.rows % (o.num_mini_batches * o.micro_batch_size):
            raise ValueError(
                f"data.batch_size x rollout.group_size (x env.max_turns with windowed history) "
                f"= {self.rows} sequences must split into "
                f"optim.num_mini_batches ({o.num_mini_batches}) x optim.micro_batch_size "
                f"({o.micro_batch_size})"
            )
        updates_total = max(1, setup.total_steps * o.ppo_epochs * o.num_mini_batches)
        # The critic's AdamW is the policy's (schedule, decay, betas, clip) at its own lr/warmup.
        adamw = functools.partial(
            make_optimizer,
            total_steps=updates_total,
            schedule=o.schedule,
            min_lr_ratio=o.min_lr_ratio,
            weight_decay=o.weight_decay,
            b1=o.b1,
            b2=o.b2,
            eps=o.eps,
            grad_clip=o.grad_clip,
        )
        self.optimizer = adamw(o.lr, warmup_steps=o.warmup_steps)
        self._setup_shardings(params)
        if self._param_sh is not None:
            params = jax.device_put(params, self._param_sh)
        full_params = params
        self.lora, self.base, self._decode_params = setup.lora, None, None
        self._base_sh, self._policy_sh = None, self._param_sh
        if self.lora is not None:  # the state (and optimizer) hold the adapters only
            params = self._setup_lora(params, adapters)
        if a.kl_coef <= 0:
            self.ref_params = None
        elif self.lora is not None:
            self.ref_params = self.base  # the reference is the base: no copy (never donated)
        else:
            # The update donates the state: the reference policy needs buffers of its own (in
            # the compute dtype: it only runs forward).
            self.ref_params = jax.tree.map(jnp.copy, setup.dtypes.cast_for_compute(params))
        self.state = create_train_state(
            params, self.optimizer, setup.seed, param_shardings=self._param_sh
        )
        self.pcfg = objectives.policy_loss_config(a, setup.max_response_len)
        # One optimizer step per rollout batch and no KL folded into the rewards: the old
        # log-probs need no separate forward (see objectives.actor_loss).
        self.single_update = o.ppo_epochs == 1 and o.num_mini_batches == 1 and not a.kl_in_reward
        self.acfg = objectives.advantage_config(a, critic, setup.group_size)
        self.critic_state = None
        if a.uses_critic:
            critic_params = policy.init_value_head(model_cfg, full_params)
            self.critic_optimizer = adamw(critic.lr, warmup_steps=critic.warmup_steps)
            if mesh is not None:
                self._critic_sh = sharding.tree_shardings(
                    policy.critic_logical_axes(model_cfg), mesh, rules, shapes=critic_params
                )
            self.critic_state = create_train_state(
                critic_params, self.critic_optimizer, setup.seed, param_shardings=self._critic_sh
            )
            if mesh is not None:
                self._critic_state_sh = train_state_shardings(
                    self.critic_state, self._critic_sh, mesh
                )
        if mesh is not None:
            self._state_sh = train_state_shardings(self.state, self._param_sh, mesh)
        self._adv_fns: dict[int, Callable] = {}
        self._build_fns()

    # ------------------------------------------------------------------ shardings

    def _setup_shardings(self, params) -> None:
        """Shardings of params, batches ([B, ...] rows and [M, b, ...] micro-batches)."""
        self._param_sh = self._critic_sh = self._state_sh = self._critic_state_sh = None
        self._rows_sh = self._micro_sh = self._replicated = None
        mesh = self.mesh
        if mesh is None:
            return
        self._param_sh = sharding.tree_shardings(
            models.logical_axes(self.model_cfg), mesh, self.rules, shapes=params
        )
        batch_axes = sharding.logical_to_spec(("batch",), self.rules)[0]
        self._rows_sh = NamedSharding(mesh, PartitionSpec(batch_axes))
        self._micro_sh = NamedSharding(mesh, PartitionSpec(None, batch_axes))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        names = (
            ()
            if batch_axes is None
            else ((batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes))
        )
        n = int(np.prod([mesh.shape[a] for a in names])) if names else 1
        for what, size in (
            ("data.batch_size x rollout.group_size", self.rows),
            ("optim.micro_batch_size", self.optim.micro_batch_size),
        ):
            if size % n:
                raise ValueError(
                    f"{what} = {size} does not split over the {n} devices of the mesh's batch "
                    f"axes {names} (mesh {dict(mesh.shape)})"
                )

    def _setup_lora(self, params, adapters):
        """Keeps `params` as the frozen base (in the compute dtype: it only runs forward) and
        returns the adapters (master dtype, sharded like their base kernels)."""
        s = self.setup
        self.base, self._base_sh = s.dtypes.cast_for_compute(params), self._param_sh
        adapters, self._param_sh = lora.place_adapters(
            self.model_cfg, self.lora, adapters, s.dtypes, s.seed, self.mesh, self.rules
        )
        if self.mesh is not None:  # shardings shaped like `_policy_params()`, static fields too
            self._policy_sh = models.with_lora(self._base_sh, self._param_sh, self.lora)
        lora.log_setup(self.lora, adapters, s.lora_decode)
        return adapters

    def _policy_params(self):
        """What the policy's forward passes take: the params, or the base with the adapters."""
        if self.lora is None:
            return self.state.params
        return models.with_lora(self.base, self.state.params, self.lora)

    def _jit(self, fn: Callable, *, in_shardings=None, out_shardings=None, **kwargs) -> Callable:
        """jax.jit, with shardings and traced (and run) inside `use_mesh` when there is a mesh."""
        if self.mesh is None:
            return jax.jit(fn, **kwargs)
        jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, **kwargs)

        def call(*args):
            with sharding.use_mesh(self.mesh, self.rules):
                return jitted(*args)

        return call

    def _place(self, x: np.ndarray) -> jax.Array:
        """A host array with a leading batch axis onto the device(s)."""
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, self._rows_sh)

    # ------------------------------------------------------------------ jitted functions

    def _build_fns(self) -> None:
        mcfg, pcfg, s = self.model_cfg, self.pcfg, self.setup
        temperature = max(s.temperature, 1e-6)
        logprobs = _in_compute(
            functools.partial(
                objectives.sequence_logprobs,
                mcfg,
                temperature,
                s.remat,
                attention=s.attention,
                packed=s.pack,
            ),
            s.dtypes,
        )
        actor_loss = _in_compute(
            functools.partial(
                objectives.actor_loss,
                mcfg,
                pcfg,
                temperature,
                s.remat,
                self.algorithm.nll_coef,
                attention=s.attention,
                packed=s.pack,
            ),
            s.dtypes,
        )
        actor_denom = functools.partial(objectives.actor_denominator, pcfg, packed=s.pack)
        rows, micro, rep = self._rows_sh, self._micro_sh, self._replicated
        mbs = self.optim.micro_batch_size
        skip = s.on_nonfinite == "skip_step"

        def with_selection(update):
            update = _skip_nonfinite(update) if skip else update

            # Mini-batch rows are gathered inside the jit: the batch stays where it is placed.
            def run(state, batch, idx_N, *frozen):
                return update(state, _select_micro(batch, idx_N, mbs, micro), *frozen)

            return run

        self._take = self._jit(take_tokens, in_shardings=(rows, rows), out_shardings=rows)
        self._logprobs = self._jit(
            _micro_mapped(logprobs, mbs, micro),
            in_shardings=(self._policy_sh, rows),
            out_shardings=(rows, rows),
        )
        # The reference policy: with LoRA the base alone (adapters off), another structure.
        self._ref_logprobs = self._logprobs
        if self.lora is None:
            update = make_update(actor_loss, self.optimizer, denoms_fn=actor_denom)
            frozen_sh = ()
        else:
            update = lora.make_lora_update(
                actor_loss, self.optimizer, self.lora, denoms_fn=actor_denom
            )
            frozen_sh = (self._base_sh,)
            self._ref_logprobs = self._jit(
                _micro_mapped(logprobs, mbs, micro),
                in_shardings=(self._base_sh, rows),
                out_shardings=(rows, rows),
            )
            lc = self.lora
            self._merge = self._jit(
                lambda base, adapters: models.merge(base, adapters, lc),
                in_shardings=(self._base_sh, self._param_sh),
                out_shardings=self._base_sh,
            )
        self._actor_update = self._jit(
            with_selection(update),
            in_shardings=(self._state_sh, rows, rep, *frozen_sh),
            out_shardings=(self._state_sh, rep),
            donate_argnums=0,
        )
        if self.critic_state is not None:
            values = _in_compute(
                functools.partial(
                    objectives.token_values, mcfg, attention=s.attention, packed=s.pack
                ),
                s.dtypes,
            )
            critic_loss = _in_compute(
                functools.partial(
                    objectives.critic_loss,
                    mcfg,
                    self.critic.value_clip_eps,
                    attention=s.attention,
                    packed=s.pack,
                ),
                s.dtypes,
            )
            self._values = self._jit(
                _micro_mapped(values, mbs, micro),
                in_shardings=(self._critic_sh, rows),
                out_shardings=rows,
            )
            self._critic_update = self._jit(
                with_selection(
                    make_update(
                        critic_loss,
                        self.critic_optimizer,
                        denoms_fn=objectives.critic_denominator,
                    )
                ),
                in_shardings=(self._critic_state_sh, rows, rep),
                out_shardings=(self._critic_state_sh, rep),
                donate_argnums=0,
            )

    def _advantages(self, inputs: dict[str, jax.Array], n_rows: int) -> tuple:
        """(advantages, returns), shaped like `loss_mask_BT`: the estimator sees only the first
        `n_rows` rows (padding rows would form fake groups); the rest are 0. One compile per
        `n_rows` (and input shape)."""
        if n_rows not in self._adv_fns:
            est, acfg = self.algorithm.adv_estimator, self.acfg

            def advantages(x):
                rows = x["loss_mask_BT"].shape[0]
                adv, ret = algorithms.compute_advantages(
                    est,
                    algorithms.AdvantageInputs(**{k: v[:n_rows] for k, v in x.items()}),
                    config=acfg,
                )
                pad = lambda a: jnp.pad(a, ((0, rows - n_rows), (0, 0)))
                return pad(adv), pad(ret)

            self._adv_fns[n_rows] = self._jit(
                advantages,
                in_shardings=(self._rows_sh,),
                out_shardings=(self._rows_sh, self._rows_sh),
            )
        return self._adv_fns[n_rows](inputs)

    # ------------------------------------------------------------------ one RL step

    @property
    def params(self):
        """The policy's weights for the engine, evaluation and export: the state's params; with
        LoRA the base with the adapters merged in (once per update; `setup.lora_decode`
        "adapters": a `models.LoraParams` view instead, no second copy of the weights)."""
        if self.lora is None:
            return self.state.params
        adapters = self.state.params
        if self._decode_params is None or self._decode_params[0] is not adapters:
            if self.setup.lora_decode == "adapters":
                view = models.with_lora(self.base, adapters, self.lora)
            else:
                self._decode_params = None  # drop the previous merged copy first
                view = self._merge(self.base, adapters)
            self._decode_params = (adapters, view)
        return self._decode_params[1]

    def step(self, batch: Batch) -> dict[str, float]:
        """One RL update on a Batch; returns the batch's metrics plus the update's."""
        metrics = dict(batch.metrics)
        if batch.num_rows == 0:  # every group filtered out
            metrics["time/update_s"] = 0.0
            return metrics
        if batch.tokens_RT.shape[0] != self.rows:
            raise ValueError(f"batch has {batch.tokens_RT.shape[0]} rows, the trainer {self.rows}")
        t1 = time.perf_counter()
        host = {
            "tokens": batch.tokens_RT,
            "positions": batch.positions_RT,
            "attention": batch.attention_RT,
            "loss_mask": batch.loss_mask_RT,
        }
        if self.algorithm.tis_cap is not None:  # truncated IS against the sampler's log-probs
            host["behaviour_logp"] = batch.behaviour_logp_RT
        correct_R = (batch.scores_R > 0).astype(np.float32)
        # The forwards and updates run on `b`'s rows; the estimators on the padded rows.
        to_padded = to_packed = lambda x: x
        if self.setup.pack:
            o = self.optim
            layout = plan_packing(
                np.sum(batch.attention_RT > 0, axis=1),
                batch.tokens_RT.shape[1],
                multiple=o.num_mini_batches * o.micro_batch_size,
            )
            host = {k: layout.pack(v) for k, v in host.items()}
            host["attention"] = layout.segments_PT
            host["correct"] = layout.pack_rows(correct_R)
            dst, src = self._place(layout.dst_RT), self._place(layout.src_PT)
            to_padded = lambda x: self._take(x, dst)
            to_packed = lambda x: self._take(x, src)
            metrics["packing/rows"] = float(layout.packed_rows)
            metrics["packing/fill"] = layout.fill_fraction
        else:
            host["correct"] = correct_R
        b = {k: self._place(v) for k, v in host.items()}
        seqs = {k: b[k] for k in ("tokens", "positions", "attention", "loss_mask")}
        if not self.single_update:
            b["old_logp"], _ = self._logprobs(self._policy_params(), seqs)
        if self.ref_params is not None:
            b["ref_logp"], _ = self._ref_logprobs(self.ref_params, seqs)
        windowed = batch.turn_slot_R is not None
        if windowed:  # the estimator runs on the episodes, one entry per turn
            adv_inputs, token_step, n_adv = _turn_inputs(batch)
            adv_inputs = {k: self._place(v) for k, v in adv_inputs.items()}
        else:
            adv_inputs = {
                "loss_mask_BT": (
                    self._place(batch.loss_mask_RT) if self.setup.pack else b["loss_mask"]
                ),
                "scores_B": self._place(batch.scores_R),
            }
            token_step, n_adv = batch.token_step_RT, batch.num_rows
        # Per-turn inputs (GiGPO, Kevin) and the greedy baseline (ReMax), where the estimator
        # reads them; a required one the batch lacks fails in compute_advantages, naming it.
        reads = algorithms.estimator_inputs(self.algorithm.adv_estimator)
        for key, value in (
            ("step_rewards_BS", batch.step_rewards_RS),
            ("step_mask_BS", batch.step_mask_RS),
            ("anchor_ids_BS", batch.anchor_ids_RS),
            ("token_step_BT", token_step),
            ("baseline_B", batch.baseline_R),
        ):
            if value is not None and key in reads:
                adv_inputs[key] = self._place(value)
        a = self.algorithm
        if a.kl_in_reward and self.ref_params is not None:
            adv_inputs["kl_BT"] = to_padded(
                algorithms.kl_penalty(b["old_logp"], b["ref_logp"], a.kl_type) * b["loss_mask"]
            )
        if self.critic_state is not None:
            b["old_values"] = self._values(self.critic_state.params, seqs)
            adv_inputs["values_BT"] = to_padded(b["old_values"])
        advantages, returns = self._advantages(adv_inputs, n_adv)
        if windowed:  # each turn's entry on its row's model tokens
            slot, mask = self._place(batch.turn_slot_R), self._place(batch.loss_mask_RT)
            advantages = _on_turn_rows(advantages, slot, mask)
            returns = _on_turn_rows(returns, slot, mask)
        b["advantages"], b["returns"] = to_packed(advantages), to_packed(returns)
        metrics.update(self._update(b))
        if self.lora is not None:  # which weights the engine decodes with (see `params`)
            metrics["lora/merged_decode"] = float(self.setup.lora_decode == "merged")
        jax.block_until_ready(self.state.params)
        t_update = time.perf_counter() - t1
        n_tokens = float(np.sum(batch.attention_RT))
        metrics["time/update_s"] = t_update
        metrics["throughput/update_tokens_per_s"] = (
            n_tokens * self.optim.ppo_epochs / max(t_update, 1e-9)
        )
        metrics["actor/advantage_mean"] = float(
            algorithms.masked_mean(b["advantages"], b["loss_mask"])
        )
        return metrics

    def _actor_moves(self) -> bool:
        """False during VAPO's value pre-training: the first `critic.pretrain_steps` RL steps
        train only the critic."""
        if self.critic_state is None or not self.critic.pretrain_steps:
            return True
        o = self.optim
        rl_steps_done = int(self.critic_state.step) // (o.ppo_epochs * o.num_mini_batches)
        return rl_steps_done >= self.critic.pretrain_steps

    def _update(self, batch: dict) -> dict[str, float]:
        o = self.optim
        n_mini = o.num_mini_batches
        rows = batch["tokens"].shape[0]  # packed: fewer than self.rows
        mini = rows // n_mini
        rng = np.random.default_rng(int(self.state.step) + self.setup.seed)
        optional = ("old_logp", "ref_logp", "behaviour_logp")
        actor_keys = list(_ACTOR_KEYS) + [k for k in optional if k in batch]
        sums: dict[str, float] = {}
        count = 0
        for _ in range(o.ppo_epochs):
            order = rng.permutation(rows)
            for k in range(n_mini):
                idx = order[k * mini : (k + 1) * mini].astype(np.int32)
                idx = (
                    jnp.asarray(idx) if self.mesh is None else jax.device_put(idx, self._replicated)
                )
                m = {}
                if self._actor_moves():
                    actor_batch = {key: batch[key] for key in actor_keys}
                    frozen = () if self.lora is None else (self.base,)
                    self.state, m = self._actor_update(self.state, actor_batch, idx, *frozen)
                    m = {f"actor/{key}": v for key, v in m.items()}
                if self.critic_state is not None:
                    critic_batch = {key: batch[key] for key in _CRITIC_KEYS}
                    self.critic_state, cm = self._critic_update(
                        self.critic_state, critic_batch, idx
                    )
                    m.update({f"critic/{key}": v for key, v in cm.items()})
                for key, v in m.items():
                    sums[key] = sums.get(key, 0.0) + float(v)
                count += 1
        return {k: v if k.endswith("skipped_updates") else v / count for k, v in sums.items()}

    def diverged(self, metrics: dict) -> str | None:
        """The step's update metrics (loss, gradient and update norms) that are not finite, as
        text; None when all are, or with `on_nonfinite: skip_step` (such updates were dropped)."""
        if self.setup.on_nonfinite != "stop":
            return None
        bad = [
            f"{k}={v}"
            for k, v in sorted(metrics.items())
            if k.startswith(("actor/", "critic/"))
            and k.split("/", 1)[1] in _WATCHED
            and not math.isfinite(v)
        ]
        return ", ".join(bad) or None

    # ------------------------------------------------------------------ checkpoint support

    def checkpoint_state(self) -> dict:
        state = {"actor": self.state}
        if self.critic_state is not None:
            state["critic"] = self.critic_state
        if self.ref_params is not None and self.lora is None:  # LoRA's reference is the base
            state["ref"] = self.ref_params
        if self.lora is not None and self.setup.checkpoint_base:
            state["base"] = self.base
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        self.state = state["actor"]
        if self.critic_state is not None:
            self.critic_state = state["critic"]
        if "base" in state:
            if self.ref_params is self.base:
                self.ref_params = state["base"]
            self.base = state["base"]
        if self.ref_params is not None and self.lora is None:
            self.ref_params = state["ref"]
        self._decode_params = None


def _turn_inputs(batch: Batch) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
    """The estimator's view of windowed episodes: each episode a row of S entries, one per
    turn (the turn's "token"); returns (inputs, token_step_ES, real episodes)."""
    E, S = batch.step_mask_RS.shape
    slots = batch.turn_slot_R[batch.turn_slot_R >= 0]
    turn_mask = np.zeros(E * S, np.float32)
    turn_mask[slots] = 1.0
    inputs = {"loss_mask_BT": turn_mask.reshape(E, S), "scores_B": batch.episode_scores_E}
    return inputs, np.tile(np.arange(S, dtype=np.int32), (E, 1)), batch.num_episodes


@jax.jit
def _on_turn_rows(a_ES: jax.Array, slot_R: jax.Array, mask_RT: jax.Array) -> jax.Array:
    """[E, S] per-turn values onto the [R, T] rows of turns (0 on padding rows)."""
    a_R = jnp.where(slot_R >= 0, a_ES.reshape(-1)[jnp.maximum(slot_R, 0)], 0.0)
    return a_R[:, None] * mask_RT
