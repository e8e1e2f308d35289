"""End to end: GRPO and PPO (GAE + critic) steps with the decode engine and the real sandbox.

A tiny random policy cannot call a tool by itself, so an engine logits hook scripts what each
slot samples (per slot: a ReTool `<code>` call of the problem's expression, then a boxed answer,
right or wrong); the sandboxed Python tool really runs the code and its output is appended as
an observation. Everything after the sampler is the real library: `rollout.Sampler`, rewards,
`make_batch`, `RLTrainer` (old log-probs, advantages, critic, jitted updates).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import tiny_model_config

from jaxrl_tools import algorithms, models, run
from jaxrl_tools.config_loader import config_from_dict
from jaxrl_tools.rollout import EngineCore, Sampler
from jaxrl_tools.tasks.tokenizer import build_tokenizer
from jaxrl_tools.tools import ToolExecutor
from jaxrl_tools.train.batch import make_batch, pad_trajectories
from jaxrl_tools.train.scoring import score_trajectories

G = 4
RECORDS = [
    {"prompt": "What is 6*7?", "ground_truth": "42", "expr": "6*7"},
    {"prompt": "What is 25+19?", "ground_truth": "44", "expr": "25+19"},
]
SCRIPT_LEN = 64


def _config(**algorithm):
    critic = algorithm.pop("critic", {})
    return config_from_dict(
        {
            "tokenizer": {"path": "unused"},
            "data": {"batch_size": len(RECORDS)},
            "rollout": {
                "protocol": "retool",
                "group_size": G,
                "max_prompt_len": 64,
                "max_response_len": 64,
                "max_tool_calls": 1,
                "max_turns": 3,
                "chunk_size": 8,
                "slots": 8,
                "max_obs_tokens": 16,
            },
            "tools": [{"class": "python", "config": {"mode": "stateless", "n_workers": 1}}],
            "algorithm": {"kl_coef": 0.0, **algorithm},
            "critic": critic,
            "reward": [{"name": "math", "kwargs": {"correct": 1.0, "wrong": 0.0}}],
            "optim": {"lr": 1e-3, "micro_batch_size": 4, "weight_decay": 0.0},
            "trainer": {"steps": 2, "seed": 1},
        }
    )


def forcing_hook(logits_BV, sampled_B, seq_B, script_BK):
    """Sample b emits script_BK[b] (indexed by the model tokens it has kept so far)."""
    want_B = script_BK[seq_B, jnp.minimum(sampled_B, SCRIPT_LEN - 1)]
    hit = jnp.arange(logits_BV.shape[-1])[None] == want_B[:, None]
    return jnp.where(hit, 0.0, -1e9)


def _scripts(tok) -> np.ndarray:
    """Sample g of each prompt (sample index p * G + g): g = 0, 1 call the tool and answer
    right, g = 2 answers wrong without the tool, g = 3 calls the tool and answers wrong."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    rows = []
    for rec in RECORDS:
        call = enc(f"<code>print({rec['expr']})</code>")
        right, wrong = enc(f" \\boxed{{{rec['ground_truth']}}}"), enc(" \\boxed{0}")
        for script in (call + right, call + right, wrong, call + wrong):
            script = script + eos
            rows.append(script + eos * (SCRIPT_LEN - len(script)))
    return np.asarray(rows, np.int32)


def scripted_engine(tok, model_cfg) -> EngineCore:
    """An engine (8 slots, 128 tokens of context, no weights yet) whose samples follow
    `_scripts(tok)` (`forcing_hook`)."""
    return EngineCore(
        model_cfg,
        None,
        slots=8,
        max_len=128,
        max_prefill_length=64,
        tokenizer=tok,
        logits_hook=forcing_hook,
        hook_data=jnp.asarray(_scripts(tok)),
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = build_tokenizer(tmp_path_factory.mktemp("tok") / "t", vocab_size=300)
    model_cfg = tiny_model_config(
        vocab_size=len(tok),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    cfg = _config()
    tools = run.setup_tools(cfg)
    executor = ToolExecutor(tools, max_concurrency=4, timeout_s=10.0)
    engine = scripted_engine(tok, model_cfg)
    yield tok, model_cfg, engine, executor
    run.close_tools(tools)


class _Trainer:
    """The RL loop's four lines: sampler -> make_batch -> RLTrainer.step (records given)."""

    def __init__(self, cfg, setup, seed=0):
        tok, model_cfg, engine, executor = setup
        params = models.init_params(model_cfg, jax.random.key(seed))
        self.init = jax.tree.map(np.array, params)
        self.cfg, self.pad_id = cfg, tok.pad_token_id or 0
        self.sample = Sampler(engine, tok, executor, cfg.rollout, seed=cfg.trainer.seed)
        self.rl = run.make_trainer(cfg, model_cfg, params)
        self.reward = run.make_reward(cfg)
        self.captured = []

    def step(self, records):
        trajs = self.sample(records, G, self.rl.params)
        self.captured.append(trajs)
        batch = make_batch(
            records,
            trajs,
            self.reward,
            self.cfg.algorithm.filters,
            group_size=G,
            rows=self.rl.rows,
            pad_id=self.pad_id,
        )
        return self.rl.step(batch)


def _trainer(cfg, setup, seed=0):
    t = _Trainer(cfg, setup, seed)
    return t, t.init, t.captured


def _max_change(a, b) -> float:
    return max(
        float(np.abs(np.asarray(x) - y).max())
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


@pytest.fixture(scope="module")
def grpo(setup):
    trainer, init, captured = _trainer(_config(adv_estimator="grpo"), setup)
    metrics = [trainer.step(RECORDS) for _ in range(2)]
    return trainer, init, captured, metrics


def test_grpo_steps_with_the_sandbox(grpo, setup):
    tok = setup[0]
    trainer, init, captured, metrics = grpo
    for m in metrics:
        assert np.isfinite(m["actor/loss"]) and np.isfinite(m["actor/grad_norm"])
        assert m["reward/accuracy"] == pytest.approx(0.5)
        assert m["tools/calls_per_response"] == pytest.approx(0.75)
        assert m["tools/error_rate"] == 0.0
    assert _max_change(trainer.rl.params, init) > 1e-4
    # The sandbox really ran the code: its output is in the observation, which is not trained on.
    t = captured[0][G]  # prompt 1, sample 0
    obs = [s for s in t.spans if s.kind != "model"]
    assert len(obs) == 1 and t.num_tool_calls == 1
    obs_ids = t.response_ids[obs[0].start : obs[0].end]
    assert "44" in tok.decode(obs_ids) and "<interpreter>" in tok.decode(obs_ids)
    assert not any(t.loss_mask[obs[0].start : obs[0].end])
    assert all(t.loss_mask[s.start : s.end] for s in t.spans if s.kind == "model")


def test_objective_has_zero_gradient_at_masked_tokens(grpo):
    """Through the real packed batch: d loss / d logp (and entropy) is 0 wherever mask is 0,
    even where old log-probs and advantages are not (observation and padding tokens)."""
    trainer, _, captured, _ = grpo
    b = {
        k: jnp.asarray(v)
        for k, v in pad_trajectories(captured[-1], pad_id=0, rows=trainer.rl.rows).items()
    }
    logp, ent = trainer.rl.logprobs(trainer.rl.params, b)
    rng = np.random.default_rng(0)
    old = logp + jnp.asarray(0.1 * rng.standard_normal(logp.shape), jnp.float32)
    adv = jnp.asarray(rng.standard_normal(logp.shape), jnp.float32)
    pcfg = dataclasses.replace(trainer.rl.settings.policy_loss, entropy_coef=0.01)

    def loss(lp, e):
        return algorithms.policy_loss(pcfg, lp, old, adv, b["loss_mask"], entropy_BT=e).loss

    g_logp, g_ent = jax.grad(loss, argnums=(0, 1))(logp, ent)
    masked = np.asarray(b["loss_mask"]) == 0
    assert np.asarray(b["attention"])[masked].sum() > 0  # observation tokens are among them
    assert np.all(np.asarray(g_logp)[masked] == 0) and np.all(np.asarray(g_ent)[masked] == 0)
    assert np.abs(np.asarray(g_logp)[~masked]).max() > 0


@pytest.fixture(scope="module")
def ppo(setup):
    cfg = _config(adv_estimator="gae", lam=0.95, critic={"enabled": True, "lr": 1e-3})
    trainer, init, captured = _trainer(cfg, setup)
    # The updates donate the state: keep copies to start again from it.
    start = jax.tree.map(jnp.copy, (trainer.rl.state, trainer.rl.critic_state))
    critic_init = jax.tree.map(np.array, trainer.rl.critic_state.params)
    metrics = [trainer.step(RECORDS) for _ in range(2)]
    return trainer, init, critic_init, start, captured, metrics


def test_ppo_with_critic_steps_with_the_sandbox(ppo):
    trainer, init, critic_init, _, _, metrics = ppo
    for m in metrics:
        assert np.isfinite(m["actor/loss"]) and np.isfinite(m["critic/loss"])
        assert m["tools/calls_per_response"] == pytest.approx(0.75)
    assert _max_change(trainer.rl.params, init) > 1e-4
    assert _max_change(trainer.rl.critic_state.params, critic_init) > 1e-4


def test_a_masked_final_token_changes_nothing(ppo):
    """PPO (actor and critic) on the sandbox trajectories, each ending in one extra mask-0
    token: changing that token leaves every param of both updates bit-identical."""
    trainer, _, _, start, captured, _ = ppo
    results = []
    for token in (5, 6):
        trajs = [
            dataclasses.replace(
                t,
                response_ids=t.response_ids + [token],
                loss_mask=t.loss_mask + [0],
                logprobs=t.logprobs + [0.0],
            )
            for t in captured[0]
        ]
        rl = trainer.rl
        rl.state, rl.critic_state = jax.tree.map(jnp.copy, start)
        rl.step(
            make_batch(
                RECORDS,
                trajs,
                trainer.reward,
                trainer.cfg.algorithm.filters,
                group_size=G,
                rows=rl.rows,
                pad_id=0,
            )
        )
        results.append(jax.tree.map(np.array, (rl.params, rl.critic_state.params)))
    jax.tree.map(np.testing.assert_array_equal, results[0], results[1])


def test_retool_reward_counts_turns_as_verl_does(grpo):
    """From real sandbox rollouts: verl's ReTool reward gives a wrong answer without a tool call
    exactly -1 (prompt + one model turn = 2 turns), and one with a call (prompt, model, tool,
    model = 4 turns) -1 + 0.1, capped at -0.6; right answers +1."""
    _, _, captured, _ = grpo
    reward = run.make_reward(_config())
    retool = type(reward)([("retool", 1.0, {})])
    scores, _ = score_trajectories(retool, RECORDS, captured[0], G)
    # per prompt: call + right, call + right, wrong without a call, call + wrong
    np.testing.assert_allclose(scores, [1.0, 1.0, -1.0, -0.9] * len(RECORDS), atol=1e-6)
