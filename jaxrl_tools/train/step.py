"""One RL step as one pure, jitted function: `step(state, batch) -> (state, metrics)`.

Inside the step, in order (`rl_step`):
  1. forwards of the step's rows, one micro-batch at a time: old log-probs (only when there is
     more than one optimizer update per batch, or KL folded into the rewards), reference
     log-probs (KL on) and critic values (PPO / VAPO);
  2. advantages by the configured estimator (`algorithms.compute_advantages`) on the estimator's
     view of the batch, padding rows masked by an array (`row_mask_B`: no compile per number of
     real rows), then moved onto the rows' tokens;
  3. `ppo_epochs` x `num_mini_batches` actor (and critic) updates in one `lax.scan`, the
     mini-batches drawn from the state's key (`train.step_updates`);
  4. the next state (step + 1, the next key) and the metrics, as arrays.

Batch layouts are inputs, not branches of the caller (`train.step_inputs` builds them on the
host): "rows" are what the model runs on (packed rows with `optim.pack`), "estimator" what the
advantage estimator reads (the padded rows, or one entry per turn of windowed episodes), and
"layout" the index arrays between them (`train.packing`, `turn_slot_R`).

`make_rl_step(settings, mesh, rules)` jits the step once per settings and mesh, with in/out
shardings derived from `jax.eval_shape` of the state and the trained part of the state donated
(the frozen policy is not: the engine may hold it); the trainer, `plan` and the tests all get
the very same `RLStep` object for the same settings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_tools import algorithms, models, sharding
from jaxrl_tools.config import AlgorithmSection, CriticSection, OptimSection
from jaxrl_tools.train import objectives
from jaxrl_tools.train.packing import take_tokens
from jaxrl_tools.train.step_inputs import full_batch, step_inputs
from jaxrl_tools.train.step_state import RLState, rl_state_shapes, rl_state_shardings
from jaxrl_tools.train.step_updates import (
    SEQUENCE_KEYS,
    StepFunctions,
    run_updates,
    step_functions,
)

NONFINITE_POLICIES = ("stop", "skip_step")


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """Everything that sets the math of a step (frozen, hashable: the step's cache key).

    Attributes:
      model: the policy's architecture.
      algorithm, optim, critic: the run's sections (`optim.pack` packs the rows,
        `optim.share_prefix` also lays each group's shared prompt out once).
      group_size: G samples per prompt (consecutive rows).
      temperature: the sampling temperature (log-probs are of the tempered policy).
      max_response_len: the constant of seq-mean-token-sum-norm aggregation.
      total_steps: RL steps of the run (the learning-rate schedule's horizon).
      remat: rematerialise decoder layers in the backward pass: False, True or a
        `models.transformer.REMAT_POLICIES` name.
      dtypes: master and compute dtypes (`models.DTypePolicy`).
      attention: the attention implementation (`models.attention.IMPLS`).
      lora: train LoRA adapters on the frozen policy, or None (full fine-tuning).
      on_nonfinite: "stop" (the caller ends the run) or "skip_step" (a non-finite update is
        dropped inside the step, the train state kept, and counted in `*/skipped_updates`).
    """

    model: models.ModelConfig
    algorithm: AlgorithmSection
    optim: OptimSection
    critic: CriticSection
    group_size: int
    temperature: float = 1.0
    max_response_len: int = 1024
    total_steps: int = 1
    remat: bool | str = False
    dtypes: models.DTypePolicy = models.DTypePolicy()
    attention: str = "auto"
    lora: models.LoraConfig | None = None
    on_nonfinite: str = "stop"

    def __post_init__(self):
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"on_nonfinite={self.on_nonfinite!r}; valid: {', '.join(NONFINITE_POLICIES)}"
            )

    @property
    def pack(self) -> bool:
        return self.optim.pack or self.optim.share_prefix

    @property
    def share_prefix(self) -> bool:
        return self.optim.share_prefix

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.uses_critic

    @property
    def updates_per_step(self) -> int:
        return self.optim.ppo_epochs * self.optim.num_mini_batches

    @property
    def single_update(self) -> bool:
        """One optimizer update per batch and no KL in the rewards: the policy is still the one
        that sampled, so the old log-probs need no forward of their own (`objectives`)."""
        return self.updates_per_step == 1 and not self.algorithm.kl_in_reward

    @functools.cached_property
    def policy_loss(self) -> algorithms.PolicyLossConfig:
        return objectives.policy_loss_config(self.algorithm, self.max_response_len)

    @functools.cached_property
    def advantage_config(self) -> algorithms.AdvantageConfig:
        return objectives.advantage_config(self.algorithm, self.critic, self.group_size)


def policy_params(settings: StepSettings, state: RLState) -> Any:
    """What the policy's forwards take: the actor's params, or the base with the adapters."""
    if settings.lora is None:
        return state.actor.params
    return models.with_lora(state.frozen, state.actor.params, settings.lora)


def _on_turn_rows(a_ES: jax.Array, slot_R: jax.Array, mask_RT: jax.Array) -> jax.Array:
    """[E, S] per-turn values onto the [R, T] rows of turns (0 on padding rows, slot -1)."""
    a_R = jnp.where(slot_R >= 0, a_ES.reshape(-1)[jnp.maximum(slot_R, 0)], 0.0)
    return a_R[:, None] * mask_RT


def advantages(settings: StepSettings, rows: dict, estimator: dict, layout: dict) -> tuple:
    """(advantages, returns) on the rows' tokens, by the configured estimator.

    Args:
      settings: the step's settings.
      rows: the step's rows, with "old_logp" / "ref_logp" (KL in the rewards) and
        "old_values" (a critic) when the estimator reads them.
      estimator: AdvantageInputs fields of the estimator's view ("loss_mask_BT" absent: the
        padded rows' loss mask).
      layout: "src_PT" / "dst_RT" / "loss_mask_RT" (packed rows), "turn_slot_R" (windowed).
    """
    a = settings.algorithm
    padded_mask = layout.get("loss_mask_RT", rows["loss_mask"])
    to_padded = lambda x: x  # noqa: E731
    to_rows = lambda x: x  # noqa: E731
    if "dst_RT" in layout:  # the estimators group by padded row: packed values go there first
        to_padded = lambda x: take_tokens(x, layout["dst_RT"])  # noqa: E731
        to_rows = lambda x: take_tokens(x, layout["src_PT"])  # noqa: E731
    inputs = {"loss_mask_BT": padded_mask, **estimator}
    if a.kl_in_reward and a.kl_coef > 0:
        kl = algorithms.kl_penalty(rows["old_logp"], rows["ref_logp"], a.kl_type)
        inputs["kl_BT"] = to_padded(kl * rows["loss_mask"])
    if "old_values" in rows:
        inputs["values_BT"] = to_padded(rows["old_values"])
    adv, ret = algorithms.compute_advantages(
        a.adv_estimator, algorithms.AdvantageInputs(**inputs), settings.advantage_config
    )
    if "turn_slot_R" in layout:  # each turn's entry on its row's model tokens
        slot = layout["turn_slot_R"]
        adv, ret = _on_turn_rows(adv, slot, padded_mask), _on_turn_rows(ret, slot, padded_mask)
    return to_rows(adv), to_rows(ret)


def prepare_rows(settings: StepSettings, fns: StepFunctions, state: RLState, batch: dict) -> dict:
    """The batch's rows with everything the losses read: old and reference log-probs, values,
    advantages and returns (steps 1 and 2 of the module docstring)."""
    rows = dict(batch["rows"])
    seqs = {k: rows[k] for k in SEQUENCE_KEYS if k in rows}
    if not settings.single_update:
        rows["old_logp"], _ = fns.logprobs(policy_params(settings, state), seqs)
    if settings.algorithm.kl_coef > 0:  # the reference: LoRA's base or the frozen copy
        rows["ref_logp"], _ = fns.logprobs(state.frozen, seqs)
    if fns.values is not None:
        rows["old_values"] = fns.values(state.critic.params, seqs)
    rows["advantages"], rows["returns"] = advantages(
        settings, rows, batch["estimator"], batch.get("layout", {})
    )
    return rows


def rl_step(
    settings: StepSettings, fns: StepFunctions, micro_sharding, state: RLState, batch: dict
) -> tuple[RLState, dict[str, jax.Array]]:
    """One RL step (module docstring): the next state and the step's metrics (arrays)."""
    key, next_key = jax.random.split(jax.random.wrap_key_data(state.rng))
    rows = prepare_rows(settings, fns, state, batch)
    moves = None
    if settings.uses_critic and settings.critic.pretrain_steps:  # VAPO's value pre-training
        moves = state.step >= settings.critic.pretrain_steps
    actor, critic, metrics = run_updates(
        settings, fns, state.actor, state.critic, state.frozen, rows, key, moves, micro_sharding
    )
    metrics["actor/advantage_mean"] = algorithms.masked_mean(rows["advantages"], rows["loss_mask"])
    new = state.replace(
        actor=actor, critic=critic, step=state.step + 1, rng=jax.random.key_data(next_key)
    )
    return new, metrics


class RLStep:
    """The jitted step of one settings and mesh: call it, or lower it (`plan`).

    Attributes:
      settings: its StepSettings.
      mesh, rules: where it runs (None: one device, no shardings).
      functions: its `StepFunctions` (the same model functions the step runs).
      state_shapes: the RLState's ShapeDtypeStructs.
      state_shardings: the RLState's NamedShardings (None without a mesh).
      batch_sharding: every batch array's sharding: rows over the mesh's batch axes (None
        without a mesh).
    """

    def __init__(self, settings: StepSettings, mesh=None, rules=None):
        self.settings, self.mesh, self.rules = settings, mesh, rules
        self.state_shapes = rl_state_shapes(settings)
        self.state_shardings = self.batch_sharding = micro = None
        if mesh is not None:
            batch_axes = sharding.logical_to_spec(("batch",), rules)[0]
            self.batch_sharding = NamedSharding(mesh, PartitionSpec(batch_axes))
            micro = NamedSharding(mesh, PartitionSpec(None, batch_axes))
            self.state_shardings = rl_state_shardings(settings, self.state_shapes, mesh, rules)
        self.functions = step_functions(settings, micro)
        step = functools.partial(rl_step, settings, self.functions, micro)

        def trained_step(trained: RLState, frozen, batch: dict):
            new, metrics = step(trained.replace(frozen=frozen), batch)
            return new.replace(frozen=None), metrics

        if mesh is None:
            self._jitted = jax.jit(trained_step, donate_argnums=0)
        else:
            trained_sh = self.state_shardings.replace(frozen=None)
            replicated = NamedSharding(mesh, PartitionSpec())
            self._jitted = jax.jit(
                trained_step,
                in_shardings=(trained_sh, self.state_shardings.frozen, self.batch_sharding),
                out_shardings=(trained_sh, replicated),
                donate_argnums=0,
            )

    def __call__(self, state: RLState, batch: dict) -> tuple[RLState, dict[str, jax.Array]]:
        """(next state, metrics): `state`'s trained part is donated (its arrays are invalid
        afterwards); its frozen policy is passed through."""
        trained, metrics = sharding.call_in_mesh(
            self.mesh, self.rules, self._jitted, state.replace(frozen=None), state.frozen, batch
        )
        return trained.replace(frozen=state.frozen), metrics

    def lower(self, state: RLState, batch: dict):
        """The step lowered for `state` and `batch` (arrays or ShapeDtypeStructs)."""
        return sharding.call_in_mesh(
            self.mesh,
            self.rules,
            self._jitted.lower,
            state.replace(frozen=None),
            state.frozen,
            batch,
        )

    def lower_shapes(self, rows: int, seq_len: int, *, step_len: int = 4):
        """The step lowered on its abstract state and a batch of `rows` sequences filling all
        `seq_len` tokens, built by the trainer's own `step_inputs` (packing then leaves each
        sequence a row of its own: the most the step computes). What `plan` compiles."""
        s = self.settings
        baseline = "baseline_B" in algorithms.estimator_inputs(s.algorithm.adv_estimator)
        batch = full_batch(
            rows, seq_len, step_len=step_len, baseline=baseline, group_size=s.group_size
        )
        inputs, _ = step_inputs(batch, s)

        def abstract(tree, shardings):
            if shardings is None or isinstance(shardings, NamedSharding):
                shardings = jax.tree.map(lambda _: shardings, tree)
            struct = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)  # noqa: E731
            return jax.tree.map(struct, tree, shardings)

        state = abstract(self.state_shapes, self.state_shardings)
        return self.lower(state, abstract(inputs, self.batch_sharding))

    def advantages(self, state: RLState, batch: dict) -> jax.Array:
        """The advantages this step computes for `batch` on the rows' tokens (no update)."""
        return sharding.call_in_mesh(self.mesh, self.rules, self._advantages, state, batch)

    def logprobs(self, params: Any, seqs: dict) -> tuple[jax.Array, jax.Array]:
        """The step's micro-batched forward: (log-probs, entropies) [R, T] of `seqs`."""
        return sharding.call_in_mesh(self.mesh, self.rules, self._logprobs, params, seqs)

    @functools.cached_property
    def _advantages(self):
        return jax.jit(lambda s, b: prepare_rows(self.settings, self.functions, s, b)["advantages"])

    @functools.cached_property
    def _logprobs(self):
        return jax.jit(self.functions.logprobs)


def _rules_key(rules) -> tuple | None:
    return None if rules is None else tuple(sorted(rules.items()))


@functools.lru_cache(maxsize=32)
def _cached_step(settings: StepSettings, mesh, rules_key) -> RLStep:
    return RLStep(settings, mesh, None if rules_key is None else dict(rules_key))


def make_rl_step(settings: StepSettings, mesh=None, rules=None) -> RLStep:
    """The `RLStep` of `settings` on `mesh`: one object per (settings, mesh, rules), so that
    every caller (trainer, `plan`, tests) runs and lowers the same jitted function.

    Args:
      settings: the step's StepSettings.
      mesh: the device mesh (None: one device).
      rules: logical -> mesh axes (default `sharding.DEFAULT_RULES`).
    """
    return _cached_step(settings, mesh, _rules_key(rules))
