"""The RL update on hand-built batches (fixed trajectories, no engine): it optimises what it
claims, masks what it should."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import VOCAB, fixed_batch, fixed_trajectories, tiny_model_config

from jaxrl_tools import models, run
from jaxrl_tools.config.training import SCHEDULES
from jaxrl_tools.config_loader import config_from_dict
from jaxrl_tools.train import objectives, policy
from jaxrl_tools.train.batch import pad_trajectories
from jaxrl_tools.train.state import accumulate_gradients, make_optimizer
from jaxrl_tools.types import Batch

tiny_config = tiny_model_config


def run_config(**algorithm):
    return config_from_dict(
        {
            "tokenizer": {"path": "unused"},
            "data": {"batch_size": 2},
            "rollout": {"group_size": 4, "max_response_len": 16},
            "algorithm": {"kl_coef": 0.0, **algorithm},
            "reward": [{"name": "math", "kwargs": {"correct": 1.0, "wrong": 0.0}}],
            "optim": {"lr": 1e-2, "micro_batch_size": 4, "grad_clip": None, "weight_decay": 0.0},
            "trainer": {"steps": 10},
        }
    )


class Trainer:
    """An RLTrainer stepped on one fixed batch of trajectories."""

    def __init__(self, cfg, trajectories, seed=0):
        model_cfg = tiny_config()
        params = models.init_params(model_cfg, jax.random.key(seed))
        self.rl = run.make_trainer(cfg, model_cfg, params)
        self.batch = fixed_batch(cfg, self.rl.rows, trajectories, group_size=cfg.rollout.group_size)

    def step(self):
        return self.rl.step(self.batch)

    def __getattr__(self, name):
        return getattr(self.rl, name)


make_trainer = Trainer


def test_pad_aligns_tokens_and_masks():
    trajs = fixed_trajectories()
    b = pad_trajectories(trajs, pad_id=0, rows=8, length_multiple=16)
    assert b["tokens"].shape == (8, 16)
    t = trajs[5]
    p, r = len(t.prompt_ids), len(t.response_ids)
    np.testing.assert_array_equal(b["tokens"][5, : p + r], t.prompt_ids + t.response_ids)
    np.testing.assert_array_equal(b["loss_mask"][5, p : p + r], t.loss_mask)
    assert b["loss_mask"][5, :p].sum() == 0 and b["loss_mask"][5, p + r :].sum() == 0
    assert b["attention"][5].sum() == p + r
    with pytest.raises(ValueError, match="do not fit"):
        pad_trajectories(trajs, pad_id=0, rows=4)


def _mean_logp(trainer, trajs, rows):
    batch = {k: jnp.asarray(v) for k, v in pad_trajectories(trajs, pad_id=0, rows=rows).items()}
    logp, _ = trainer.logprobs(trainer.params, batch)
    per_seq = (logp * batch["loss_mask"]).sum(1) / batch["loss_mask"].sum(1)
    return np.asarray(per_seq)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_updates_raise_likelihood_of_rewarded_responses(estimator):
    trajs = fixed_trajectories()
    trainer = make_trainer(run_config(adv_estimator=estimator), trajs)
    before = _mean_logp(trainer, trajs, 8)
    for _ in range(5):
        metrics = trainer.step()
    after = _mean_logp(trainer, trajs, 8)
    assert np.isfinite(metrics["actor/loss"])
    assert metrics["reward/accuracy"] == pytest.approx(0.5)
    gain = after - before
    # Rewarded responses (0, 1 of each group) gain likelihood, the others lose it.
    assert np.all(gain[[0, 1, 4, 5]] > 0) and np.all(gain[[2, 3, 6, 7]] < 0)


def test_masked_tokens_have_no_effect():
    trajs = fixed_trajectories()
    other = [dataclasses.replace(t, response_ids=list(t.response_ids)) for t in trajs]
    for t in other:  # change only the tokens under mask 0 ... and nothing they influence
        t.response_ids[-1] = t.response_ids[-1]
    # Changing the *last* masked-out position's token cannot change earlier logits; masked
    # positions' own log-probs are excluded: mask a final token and change it.
    for t in trajs + other:
        t.loss_mask[-1] = 0
    for t in other:
        t.response_ids[-1] = (t.response_ids[-1] + 1) % VOCAB
    a = make_trainer(run_config(), trajs)
    b = make_trainer(run_config(), other)
    a.step()
    b.step()
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=0), a.params, b.params)


def test_micro_batching_matches_full_batch():
    trajs = fixed_trajectories()
    full = make_trainer(run_config(), trajs)
    cfg = run_config()
    micro = make_trainer(
        dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, micro_batch_size=2)), trajs
    )
    full.step()
    micro.step()
    # Adam divides by sqrt(v): float32 rounding in near-zero gradients shows up at ~1e-5 of an
    # lr=1e-2 step, far below a real difference (a whole step).
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=5e-5),
        full.params,
        micro.params,
    )


def test_logprob_forward_runs_in_micro_batches_equal_to_one_batch():
    # Old / reference log-probs (and values) run micro-batch by micro-batch, like the update.
    trajs = fixed_trajectories()
    cfg = run_config()
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, micro_batch_size=2))
    trainer = make_trainer(cfg, trajs)
    batch = {k: jnp.asarray(v) for k, v in pad_trajectories(trajs, pad_id=0, rows=8).items()}
    logp_micro, ent_micro = trainer.logprobs(trainer.params, batch)
    one_batch = jax.jit(objectives.sequence_logprobs, static_argnums=(0, 1, 2))
    logp, ent = one_batch(trainer.model_cfg, 1.0, False, trainer.params, batch)
    np.testing.assert_allclose(logp_micro, logp, atol=1e-6)
    np.testing.assert_allclose(ent_micro, ent, atol=1e-6)


def test_chunked_and_plain_logprob_paths_agree_when_chosen_explicitly():
    # Without `chunked`, a tiny batch always takes the plain path; forcing each path must give
    # the same log-probs, entropies and gradients.
    trajs = fixed_trajectories()
    model_cfg = tiny_config()
    params = models.init_params(model_cfg, jax.random.key(0))
    b = {k: jnp.asarray(v) for k, v in pad_trajectories(trajs, pad_id=0, rows=8).items()}

    def logprobs(params, chunked):
        return policy.token_logprobs(
            model_cfg,
            params,
            b["tokens"],
            b["positions"],
            b["attention"],
            b["loss_mask"],
            chunked=chunked,
            chunk_size=4,
            temperature=0.7,
        )

    def grads(chunked):
        return jax.grad(lambda p: jnp.sum(logprobs(p, chunked)[0]))(params)

    (lp_plain, ent_plain), (lp_chunk, ent_chunk) = logprobs(params, False), logprobs(params, True)
    assert float(jnp.abs(lp_plain).sum()) > 0
    np.testing.assert_allclose(lp_chunk, lp_plain, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent_chunk, ent_plain, rtol=1e-5, atol=1e-5)
    jax.tree.map(
        lambda a, c: np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-6),
        grads(False),
        grads(True),
    )


def ppo_config(**critic):
    return config_from_dict(
        {
            "tokenizer": {"path": "unused"},
            "data": {"batch_size": 2},
            "rollout": {"group_size": 4, "max_response_len": 16},
            "algorithm": {"adv_estimator": "gae", "kl_coef": 0.0, "lam": 0.95},
            "critic": {"enabled": True, "lr": 1e-2, **critic},
            "reward": [{"name": "math", "kwargs": {"correct": 1.0, "wrong": 0.0}}],
            "optim": {"lr": 1e-3, "micro_batch_size": 4, "grad_clip": None},
        }
    )


def test_value_pretraining_holds_the_actor():
    trainer = make_trainer(ppo_config(pretrain_steps=2), fixed_trajectories())
    start = jax.tree.map(np.array, trainer.params)
    critic_start = jax.tree.map(np.array, trainer.critic_state.params)
    for _ in range(2):
        metrics = trainer.step()
    assert "actor/loss" not in metrics and "critic/loss" in metrics
    jax.tree.map(np.testing.assert_array_equal, start, trainer.params)
    moved = jax.tree.map(
        lambda a, b: np.abs(a - b).max(), critic_start, trainer.critic_state.params
    )
    assert max(jax.tree.leaves(moved)) > 0
    assert "actor/loss" in trainer.step()


def test_the_critic_uses_the_optim_sections_adamw_at_its_own_lr():
    cfg = ppo_config()
    cfg = dataclasses.replace(
        cfg, optim=dataclasses.replace(cfg.optim, weight_decay=0.3, b2=0.95, schedule="linear")
    )
    trainer = run.make_trainer(
        cfg, tiny_config(), models.init_params(tiny_config(), jax.random.key(0))
    )
    want = make_optimizer(
        cfg.critic.lr,
        total_steps=cfg.trainer.steps,
        schedule="linear",
        weight_decay=0.3,
        b2=0.95,
        grad_clip=None,
    )
    params = {"w": jnp.linspace(-1.0, 1.0, 6)}
    grads = {"w": jnp.asarray([0.5, -1.0, 2.0, 0.0, 1e-3, -3.0])}
    got_state, want_state = trainer.critic_optimizer.init(params), want.init(params)
    for _ in range(3):
        got, got_state = trainer.critic_optimizer.update(grads, got_state, params)
        ref, want_state = want.update(grads, want_state, params)
        np.testing.assert_array_equal(got["w"], ref["w"])


def test_ppo_with_critic_learns_values():
    trajs = fixed_trajectories()
    trainer = make_trainer(ppo_config(), trajs)
    first = trainer.step()
    for _ in range(8):
        last = trainer.step()
    assert np.isfinite(last["critic/loss"]) and last["critic/loss"] < first["critic/loss"]


def test_a_hand_written_batch_trains_and_padding_rows_do_not_count():
    """A Batch written by hand (no trajectories): rows past num_rows change nothing."""
    rng = np.random.default_rng(0)
    R, T = 8, 16
    tokens = rng.integers(1, VOCAB, (R, T)).astype(np.int32)
    mask = np.zeros((R, T), np.float32)
    mask[:, 8:12] = 1
    base = dict(
        tokens_RT=tokens,
        positions_RT=np.tile(np.arange(T, dtype=np.int32), (R, 1)),
        attention_RT=np.ones((R, T), np.int32),
        loss_mask_RT=mask,
        behaviour_logp_RT=np.zeros((R, T), np.float32),
        scores_R=np.array([1, 0, 1, 0, 0, 0, 0, 0], np.float32),
        num_rows=4,
    )
    cfg = run_config()
    params = models.init_params(tiny_config(), jax.random.key(0))
    init = jax.tree.map(np.array, params)
    a = run.make_trainer(cfg, tiny_config(), jax.tree.map(jnp.copy, params))  # updates donate
    b = run.make_trainer(cfg, tiny_config(), jax.tree.map(jnp.copy, params))
    other = dict(base, tokens_RT=tokens.copy())
    other["tokens_RT"][4:] = (tokens[4:] + 1) % VOCAB  # padding rows' tokens differ
    other["loss_mask_RT"] = mask.copy()
    other["loss_mask_RT"][4:] = 0
    base["loss_mask_RT"] = other["loss_mask_RT"]
    ma = a.step(Batch(**base))
    b.step(Batch(**other))
    assert np.isfinite(ma["actor/loss"])
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), a.params, b.params)
    moved = jax.tree.map(lambda x, y: np.abs(np.asarray(x) - y).max(), a.params, init)
    assert max(jax.tree.leaves(moved)) > 0
    # every group filtered out: no update, the batch's metrics come back
    empty = dict(base, num_rows=0, metrics={"reward/mean": 0.5})
    before = jax.tree.map(np.array, a.params)
    assert a.step(Batch(**empty)) == {"reward/mean": 0.5, "time/update_s": 0.0}
    jax.tree.map(np.testing.assert_array_equal, before, a.params)


def test_micro_batch_metrics_are_token_weighted_and_padding_counts_for_nothing():
    """Metrics of accumulated micro-batches: means weighted by each micro-batch's loss-mask
    tokens (a micro-batch of padding rows adds nothing), `*_min` / `*_max` the extremes."""

    def loss_fn(params, micro, denoms):
        m = micro["loss_mask"]
        n = jnp.maximum(jnp.sum(m), 1.0)
        x = micro["x"]
        metrics = {
            "mean": jnp.sum(x * m) / n,
            "x_min": jnp.min(jnp.where(m > 0, x, jnp.inf)),
            "x_max": jnp.max(jnp.where(m > 0, x, -jnp.inf)),
        }
        return jnp.sum(params * x * m) / denoms, metrics

    x = jnp.asarray([[1.0, 1.0, 1.0, 0.0], [5.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = jnp.asarray([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    _, _, metrics = accumulate_gradients(
        loss_fn, jnp.ones(()), {"x": x, "loss_mask": mask}, jnp.asarray(4.0)
    )
    np.testing.assert_allclose(metrics["mean"], (3 * 1.0 + 5.0) / 4, rtol=1e-6)
    assert float(metrics["x_min"]) == 1.0 and float(metrics["x_max"]) == 5.0


def test_every_schedule_the_config_accepts_builds_an_optimizer():
    for schedule in SCHEDULES:  # config.training owns the names; make_optimizer builds them
        make_optimizer(1e-3, total_steps=4, warmup_steps=1, schedule=schedule)
    with pytest.raises(ValueError, match="optim.schedule must be one of"):
        make_optimizer(1e-3, total_steps=4, schedule="step")
