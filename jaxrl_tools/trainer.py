"""The RL trainer: rollout -> rewards -> filters -> advantages -> jitted, sharded updates.

One RL step:
  1. a batch of prompt records, each sampled G times by the rollout (engine + tools);
  2. host rewards per trajectory (a CompositeReward), group filters (DAPO / StarPO-S / ZeroTIR);
  3. trajectories packed into fixed-shape arrays (rows and lengths bucketed: few compiles);
  4. old log-probs recomputed by the training forward, reference log-probs (when KL is on),
     critic values (PPO / VAPO);
  5. advantages by the configured estimator;
  6. `ppo_epochs` x `num_mini_batches` actor (and critic) updates, each accumulating gradients
     over micro-batches exactly (`train_state.make_update`);
  7. the new params go to the engine (the same arrays: no copy), metrics, checkpoint.

With a mesh, every jitted function has explicit in/out shardings: batches are split over the
logical "batch" axis, params (and the optimizer moments, which mirror them) by
`models.logical_axes`, counters replicated; functions are traced inside `sharding.use_mesh`, so
the models' activation constraints apply, and the updates donate the state. Without a mesh the
same functions are jitted without shardings.
"""

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_tools import algorithms, models, policy, sharding
from jaxrl_tools.config import RunConfig
from jaxrl_tools.rewards import CompositeReward, TrajectoryInfo
from jaxrl_tools.train_state import (
    create_train_state,
    make_optimizer,
    make_update,
    train_state_shardings,
)

log = logging.getLogger(__name__)

# A rollout: (records, group_size, params) -> trajectories, G consecutive ones per record.
RolloutFn = Callable[[Sequence[dict], int, Any], Sequence[Any]]


def _bucket(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def pack_trajectories(
    trajectories: Sequence[Any], *, pad_id: int, rows: int, length_multiple: int = 16
) -> dict[str, np.ndarray]:
    """Packs trajectories into right-padded [rows, T] arrays aligned to tokens.

    Each trajectory gives `prompt_ids`, `response_ids`, `loss_mask` and `logprobs` (the last two
    over the response). Rows beyond the trajectories are all padding (mask 0): they change no
    sum and no denominator. T is rounded up to `length_multiple`.
    """
    if len(trajectories) > rows:
        raise ValueError(f"{len(trajectories)} trajectories do not fit in {rows} rows")
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    T = _bucket(max(lengths, default=1), length_multiple)
    out = {
        "tokens": np.full((rows, T), pad_id, np.int32),
        "positions": np.zeros((rows, T), np.int32),
        "attention": np.zeros((rows, T), np.int32),
        "loss_mask": np.zeros((rows, T), np.float32),
        "behaviour_logp": np.zeros((rows, T), np.float32),
    }
    for i, traj in enumerate(trajectories):
        p, r = len(traj.prompt_ids), len(traj.response_ids)
        out["tokens"][i, : p + r] = np.concatenate([traj.prompt_ids, traj.response_ids])
        out["positions"][i, : p + r] = np.arange(p + r)
        out["attention"][i, : p + r] = 1
        out["loss_mask"][i, p : p + r] = traj.loss_mask
        out["behaviour_logp"][i, p : p + r] = np.asarray(traj.logprobs) * np.asarray(traj.loss_mask)
    return out


def policy_loss_config(cfg: RunConfig) -> algorithms.PolicyLossConfig:
    a = cfg.algorithm
    return algorithms.PolicyLossConfig(
        clip_eps_low=a.clip_eps_low,
        clip_eps_high=a.clip_eps_high,
        dual_clip_c=a.dual_clip_c,
        kl_coef=a.kl_coef if a.kl_in_loss else 0.0,
        kl_type=a.kl_type,
        entropy_coef=a.entropy_coef,
        loss_agg_mode=a.loss_agg_mode,
        max_len=cfg.rollout.max_response_len,
        ratio_type="sequence" if a.policy_loss == "gspo" else "token",
    )


def advantage_config(cfg: RunConfig) -> algorithms.AdvantageConfig:
    a = cfg.algorithm
    return algorithms.AdvantageConfig(
        group_size=cfg.rollout.group_size,
        norm_by_std=a.norm_adv_by_std,
        gamma=a.gamma,
        lam=a.lam,
        kl_beta=a.kl_coef if a.kl_in_reward else 0.0,
        vapo_alpha=a.vapo_alpha,
        critic_lam=cfg.critic.lam,
        gigpo_omega=a.gigpo_omega,
    )


def critic_logical_axes(model_cfg: models.ModelConfig) -> dict:
    """Logical axes of the critic of `policy.init_value_head`: the trunk's are the model's."""
    return {
        "trunk": models.logical_axes(model_cfg),
        "value_head": {"kernel": ("embed",), "bias": ()},
    }


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


class RLTrainer:
    """Runs RL steps for one policy (and optional critic).

    Args:
      cfg: the run config.
      model_cfg: the policy architecture.
      params: the initial policy params (also the frozen reference policy when KL is on).
      rollout: samples trajectories for prompt records (see `RolloutFn`).
      reward: the composite reward.
      pad_id: the padding token id.
      mesh: the device mesh (None: one device).
      rules: logical -> mesh axes table (default `sharding.DEFAULT_RULES`).

    Raises:
      ValueError: the batch does not split into the mini/micro-batches, or (with a mesh) the
        rows or micro-batches do not split over the mesh's batch devices.
    """

    def __init__(
        self,
        cfg: RunConfig,
        model_cfg: models.ModelConfig,
        params: Any,
        rollout: RolloutFn,
        reward: CompositeReward,
        *,
        pad_id: int,
        mesh=None,
        rules=None,
    ):
        self.cfg, self.model_cfg, self.rollout, self.reward = cfg, model_cfg, rollout, reward
        self.pad_id, self.mesh, self.rules = pad_id, mesh, rules
        o, a = cfg.optim, cfg.algorithm
        self.group_size = cfg.rollout.group_size
        self.rows = cfg.data.batch_size * self.group_size
        if self.rows % (o.num_mini_batches * o.micro_batch_size):
            raise ValueError(
                f"data.batch_size x rollout.group_size = {self.rows} sequences must split into "
                f"optim.num_mini_batches ({o.num_mini_batches}) x optim.micro_batch_size "
                f"({o.micro_batch_size})"
            )
        updates_total = max(1, cfg.trainer.steps * o.ppo_epochs * o.num_mini_batches)
        self.optimizer = make_optimizer(
            o.lr,
            total_steps=updates_total,
            warmup_steps=o.warmup_steps,
            schedule=o.schedule,
            min_lr_ratio=o.min_lr_ratio,
            weight_decay=o.weight_decay,
            b1=o.b1,
            b2=o.b2,
            eps=o.eps,
            grad_clip=o.grad_clip,
        )
        self._setup_shardings(params)
        if self._param_sh is not None:
            params = jax.device_put(params, self._param_sh)
        # The update donates the state: the reference policy needs buffers of its own.
        self.ref_params = jax.tree.map(jnp.copy, params) if cfg.use_reference_model else None
        self.state = create_train_state(
            params, self.optimizer, cfg.trainer.seed, param_shardings=self._param_sh
        )
        self.pcfg = policy_loss_config(cfg)
        # One optimizer step per rollout batch and no KL folded into the rewards: the old
        # log-probs need no separate forward (see actor_loss).
        self.single_update = o.ppo_epochs == 1 and o.num_mini_batches == 1 and not a.kl_in_reward
        self.acfg = advantage_config(cfg)
        self.temperature = max(cfg.rollout.temperature, 1e-6)
        self.critic_state = None
        if a.uses_critic:
            critic = policy.init_value_head(model_cfg, params)
            self.critic_optimizer = make_optimizer(
                cfg.critic.lr,
                total_steps=updates_total,
                warmup_steps=cfg.critic.warmup_steps,
                grad_clip=o.grad_clip,
            )
            if mesh is not None:
                self._critic_sh = sharding.tree_shardings(
                    critic_logical_axes(model_cfg), mesh, rules, shapes=critic
                )
            self.critic_state = create_train_state(
                critic, self.critic_optimizer, cfg.trainer.seed, param_shardings=self._critic_sh
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
        o = self.cfg.optim
        for what, size in (
            ("data.batch_size x rollout.group_size", self.rows),
            ("optim.micro_batch_size", o.micro_batch_size),
        ):
            if size % n:
                raise ValueError(
                    f"{what} = {size} does not split over the {n} devices of the mesh's batch "
                    f"axes {names} (mesh {dict(mesh.shape)})"
                )

    def _mesh_context(self):
        if self.mesh is None:
            return contextlib.nullcontext()
        return sharding.use_mesh(self.mesh, self.rules)

    def _jit(self, fn: Callable, *, in_shardings=None, out_shardings=None, **kwargs) -> Callable:
        """jax.jit, with shardings and traced (and run) inside `use_mesh` when there is a mesh."""
        if self.mesh is None:
            return jax.jit(fn, **kwargs)
        jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, **kwargs)

        def call(*args):
            with self._mesh_context():
                return jitted(*args)

        return call

    def _place(self, x: np.ndarray) -> jax.Array:
        """A host array with a leading batch axis onto the device(s)."""
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, self._rows_sh)

    # ------------------------------------------------------------------ jitted functions

    def _build_fns(self) -> None:
        mcfg, pcfg, T = self.model_cfg, self.pcfg, self.temperature
        nll_coef = self.cfg.algorithm.nll_coef
        remat = self.cfg.model.remat

        def logprobs(params, b, entropy_grad=False):
            return policy.token_logprobs(
                mcfg,
                params,
                b["tokens"],
                b["positions"],
                b["attention"],
                b["loss_mask"],
                temperature=T,
                remat=remat,
                entropy_grad=entropy_grad,
            )

        def actor_loss(params, mb, denom):
            logp, ent = logprobs(params, mb, entropy_grad=pcfg.entropy_coef > 0)
            # One update per rollout batch: the policy is still the behaviour one, and its own
            # log-probs (no gradient) are the old ones; this saves a forward pass.
            old_logp = mb["old_logp"] if "old_logp" in mb else jax.lax.stop_gradient(logp)
            terms = algorithms.policy_loss(
                pcfg,
                logp,
                old_logp,
                mb["advantages"],
                mb["loss_mask"],
                ref_logp_BT=mb.get("ref_logp"),
                entropy_BT=ent,
                denominator=denom,
            )
            loss = terms.loss
            metrics = dict(terms.metrics)
            # pg_loss is this micro-batch's share of the mini-batch loss (global denominator):
            # the shares add up to "loss", they do not average, so it is not reported twice.
            metrics.pop("pg_loss", None)
            if nll_coef:  # VAPO: NLL on the tokens of correct responses
                pos = mb["loss_mask"] * mb["correct"][:, None]
                nll, _ = algorithms.aggregate(
                    -logp, pos, pcfg.loss_agg_mode, max_len=pcfg.max_len, denominator=denom
                )
                loss = loss + nll_coef * nll / jnp.maximum(denom, 1.0)
            metrics["entropy"] = algorithms.masked_mean(ent, mb["loss_mask"])
            return loss, metrics

        def actor_denom(batch_M):
            mask = batch_M["loss_mask"].reshape(-1, batch_M["loss_mask"].shape[-1])
            return algorithms.loss_denominator(mask, pcfg.loss_agg_mode, pcfg.max_len)

        rows, micro, rep = self._rows_sh, self._micro_sh, self._replicated
        mbs = self.cfg.optim.micro_batch_size

        def with_selection(update):
            # Mini-batch rows are gathered inside the jit: the batch stays where it is placed.
            def run(state, batch, idx_N):
                return update(state, _select_micro(batch, idx_N, mbs, micro))

            return run

        self._logprobs = self._jit(
            logprobs, in_shardings=(self._param_sh, rows), out_shardings=(rows, rows)
        )
        self._actor_update = self._jit(
            with_selection(make_update(actor_loss, self.optimizer, denoms_fn=actor_denom)),
            in_shardings=(self._state_sh, rows, rep),
            out_shardings=(self._state_sh, rep),
            donate_argnums=0,
        )
        if self.critic_state is not None:
            clip_v = self.cfg.critic.value_clip_eps

            def values(critic_params, b):
                return policy.token_values(
                    mcfg, critic_params, b["tokens"], b["positions"], b["attention"]
                )

            def critic_loss(critic_params, mb, denom):
                v = values(critic_params, mb)
                terms = algorithms.value_loss(
                    v,
                    mb["old_values"],
                    mb["returns"],
                    mb["loss_mask"],
                    clip_eps=clip_v,
                    loss_agg_mode="token-mean",
                    denominator=denom,
                )
                return terms.loss, dict(terms.metrics)

            def critic_denom(batch_M):
                return jnp.sum(batch_M["loss_mask"])

            self._values = self._jit(
                values, in_shardings=(self._critic_sh, rows), out_shardings=rows
            )
            self._critic_update = self._jit(
                with_selection(
                    make_update(critic_loss, self.critic_optimizer, denoms_fn=critic_denom)
                ),
                in_shardings=(self._critic_state_sh, rows, rep),
                out_shardings=(self._critic_state_sh, rep),
                donate_argnums=0,
            )

    def _advantages(self, inputs: dict[str, jax.Array], n_rows: int) -> tuple:
        """(advantages, returns), [rows, T]: the estimator sees only the first `n_rows` rows
        (padding rows would form fake groups); the rest are 0. One compile per `n_rows`."""
        if n_rows not in self._adv_fns:
            est, acfg, rows = self.cfg.algorithm.adv_estimator, self.acfg, self.rows

            def advantages(x):
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
        return self.state.params

    def score(
        self, records: Sequence[dict], trajectories: Sequence[Any]
    ) -> tuple[np.ndarray, dict]:
        """Rewards of trajectories (G consecutive ones per record) and their components."""
        return score_trajectories(self.reward, records, trajectories, self.group_size)

    def _filter(self, scores: np.ndarray) -> np.ndarray:
        """Indices of the groups to keep, by the configured filters."""
        f = self.cfg.algorithm.filters
        keep = np.arange(len(scores) // self.group_size)
        sel = lambda idx: keep[np.isin(keep, idx)]
        grouped = scores.reshape(-1, self.group_size)
        if f.dynamic_sampling:
            keep = sel(algorithms.dynamic_sampling_filter(grouped))
        if f.zerotir:
            keep = sel(
                algorithms.accuracy_band_filter(
                    (grouped > 0).astype(float), low=f.zerotir_low, high=f.zerotir_high
                )
            )
        if f.starpo_s:
            keep = sel(algorithms.starpo_s_filter(grouped, keep_fraction=f.starpo_keep_frac))
        return keep

    def step(self, records: Sequence[dict]) -> dict[str, float]:
        """One RL step on a batch of prompt records; returns its metrics."""
        cfg, G = self.cfg, self.group_size
        t0 = time.perf_counter()
        trajectories = list(self.rollout(records, G, self.state.params))
        t_rollout = time.perf_counter() - t0
        scores, parts = self.score(records, trajectories)
        keep_groups = self._filter(scores)
        keep = [g * G + j for g in keep_groups for j in range(G)]
        metrics = rollout_metrics(trajectories, scores, parts)
        metrics["filter/kept_groups_frac"] = len(keep_groups) / max(1, len(records))
        metrics["time/rollout_s"] = t_rollout
        metrics["throughput/rollout_tokens_per_s"] = sum(
            len(t.response_ids) for t in trajectories
        ) / max(t_rollout, 1e-9)
        if not keep:
            metrics["time/update_s"] = 0.0
            return metrics
        t1 = time.perf_counter()
        batch = pack_trajectories(
            [trajectories[i] for i in keep], pad_id=self.pad_id, rows=self.rows
        )
        n_rows = len(keep)
        scores_kept = np.zeros(self.rows, np.float32)
        scores_kept[:n_rows] = scores[keep]
        batch["correct"] = (scores_kept > 0).astype(np.float32)
        batch = {k: self._place(v) for k, v in batch.items()}
        seqs = {k: batch[k] for k in ("tokens", "positions", "attention", "loss_mask")}
        if not self.single_update:
            batch["old_logp"], _ = self._logprobs(self.state.params, seqs)
        if self.ref_params is not None:
            batch["ref_logp"], _ = self._logprobs(self.ref_params, seqs)
        adv_inputs = {"loss_mask_BT": batch["loss_mask"], "scores_B": self._place(scores_kept)}
        if self.cfg.algorithm.kl_in_reward and self.ref_params is not None:
            adv_inputs["kl_BT"] = (
                algorithms.kl_penalty(
                    batch["old_logp"], batch["ref_logp"], self.cfg.algorithm.kl_type
                )
                * batch["loss_mask"]
            )
        if self.critic_state is not None:
            batch["old_values"] = self._values(self.critic_state.params, seqs)
            adv_inputs["values_BT"] = batch["old_values"]
        batch["advantages"], batch["returns"] = self._advantages(adv_inputs, n_rows)
        update_metrics = self._update(batch)
        jax.block_until_ready(self.state.params)
        t_update = time.perf_counter() - t1
        n_tokens = float(jnp.sum(batch["attention"]))
        metrics.update(update_metrics)
        metrics["time/update_s"] = t_update
        metrics["throughput/update_tokens_per_s"] = (
            n_tokens * cfg.optim.ppo_epochs / max(t_update, 1e-9)
        )
        metrics["actor/advantage_mean"] = float(
            algorithms.masked_mean(batch["advantages"], batch["loss_mask"])
        )
        return metrics

    def _actor_moves(self) -> bool:
        """False during VAPO's value pre-training: the first `critic.pretrain_steps` RL steps
        train only the critic."""
        if self.critic_state is None or not self.cfg.critic.pretrain_steps:
            return True
        o = self.cfg.optim
        rl_steps_done = int(self.critic_state.step) // (o.ppo_epochs * o.num_mini_batches)
        return rl_steps_done >= self.cfg.critic.pretrain_steps

    def _update(self, batch: dict) -> dict[str, float]:
        o = self.cfg.optim
        n_mini = o.num_mini_batches
        mini = self.rows // n_mini
        rng = np.random.default_rng(int(self.state.step) + self.cfg.trainer.seed)
        actor_keys = [
            "tokens",
            "positions",
            "attention",
            "loss_mask",
            "advantages",
            "correct",
        ] + [key for key in ("old_logp", "ref_logp") if key in batch]
        critic_keys = ["tokens", "positions", "attention", "loss_mask", "old_values", "returns"]
        sums: dict[str, float] = {}
        count = 0
        for _ in range(o.ppo_epochs):
            order = rng.permutation(self.rows)
            for k in range(n_mini):
                idx = order[k * mini : (k + 1) * mini].astype(np.int32)
                idx = (
                    jnp.asarray(idx) if self.mesh is None else jax.device_put(idx, self._replicated)
                )
                m = {}
                if self._actor_moves():
                    actor_batch = {key: batch[key] for key in actor_keys}
                    self.state, m = self._actor_update(self.state, actor_batch, idx)
                    m = {f"actor/{key}": v for key, v in m.items()}
                if self.critic_state is not None:
                    critic_batch = {key: batch[key] for key in critic_keys}
                    self.critic_state, cm = self._critic_update(
                        self.critic_state, critic_batch, idx
                    )
                    m.update({f"critic/{key}": v for key, v in cm.items()})
                for key, v in m.items():
                    sums[key] = sums.get(key, 0.0) + float(v)
                count += 1
        return {k: v / count for k, v in sums.items()}

    # ------------------------------------------------------------------ checkpoint support

    def checkpoint_state(self) -> dict:
        state = {"actor": self.state}
        if self.critic_state is not None:
            state["critic"] = self.critic_state
        if self.ref_params is not None:
            state["ref"] = self.ref_params
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        self.state = state["actor"]
        if self.critic_state is not None:
            self.critic_state = state["critic"]
        if self.ref_params is not None:
            self.ref_params = state["ref"]


def score_trajectories(
    reward: CompositeReward, records: Sequence[dict], trajectories: Sequence[Any], group_size: int
) -> tuple[np.ndarray, dict]:
    """(rewards_N, {term: values_N}) of trajectories, `group_size` consecutive ones per record."""
    infos = [
        TrajectoryInfo(
            tool_calls=t.tool_calls,
            num_calls=t.num_tool_calls,
            num_turns=t.num_turns,
            response_length=len(t.response_ids),
        )
        for t in trajectories
    ]
    group_ids = [i // group_size for i in range(len(trajectories))]
    gts = [records[g].get("ground_truth") for g in group_ids]
    return reward.batch([t.response_text for t in trajectories], gts, infos, group_ids=group_ids)


def rollout_metrics(trajectories: Sequence[Any], scores: np.ndarray, parts: dict) -> dict:
    """Reward, accuracy, tool-use and length statistics of a batch of trajectories."""
    calls = np.array([t.num_tool_calls for t in trajectories], np.float32)
    records = [r for t in trajectories for r in t.tool_calls]
    errors = sum(1 for r in records if not _ok(r))
    lengths = np.array([len(t.response_ids) for t in trajectories], np.float32)
    out = {
        "reward/mean": float(np.mean(scores)),
        "reward/std": float(np.std(scores)),
        "tools/calls_per_response": float(calls.mean()),
        "tools/error_rate": errors / max(1, len(records)),
        "tools/used_frac": float((calls > 0).mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max(initial=0)),
    }
    for name, values in parts.items():
        out[f"reward/{name}"] = float(np.mean(values))
    if "math" in parts or "qa_em" in parts:
        key = "math" if "math" in parts else "qa_em"
        out["reward/accuracy"] = float(np.mean(np.asarray(parts[key]) > 0))
    finish: dict[str, int] = {}
    for t in trajectories:
        finish[t.finish_reason] = finish.get(t.finish_reason, 0) + 1
    for reason, n in finish.items():
        out[f"response/finish_{reason}"] = n / len(trajectories)
    return out


def _ok(record: Any) -> bool:
    if isinstance(record, dict):
        return bool(record.get("ok", True))
    return bool(getattr(record, "ok", True))
