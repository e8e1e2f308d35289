"""Trainer wiring of multi-turn environments: the env section, per-turn advantage inputs
(GiGPO, Kevin) from scripted episodes through make_batch and the trainer, ReMax's greedy
baseline, DAPO resampling. Oracles are NumPy transcriptions of docs/METHODS.md."""

import asyncio

import jax
import numpy as np
import pytest
from fakes import VOCAB, fixed_trajectories, tiny_model_config

from jaxrl_tools import algorithms, models, run
from jaxrl_tools.check.inputs import env_records
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import config_from_dict
from jaxrl_tools.envs import EVAL_SEED_OFFSET, Episodes, FrozenLake
from jaxrl_tools.rewards import CompositeReward
from jaxrl_tools.train.batch import collect_batch, make_batch, step_arrays
from jaxrl_tools.train.scoring import rollout_metrics
from jaxrl_tools.types import Span, Trajectory

G = 4  # samples per prompt
TURN = "<think>t</think><answer>{}</answer>"


def cfg_dict(**algorithm):
    return {
        "tokenizer": {"path": "unused"},
        "data": {"batch_size": 2},
        "rollout": {"group_size": G, "max_response_len": 64},
        "env": {
            "name": "frozenlake",
            "kwargs": {"size": 4},
            "max_turns": 4,
            "train_episodes": 64,
            "eval_episodes": 8,
        },
        "algorithm": {"kl_coef": 0.0, **algorithm},
        "reward": [{"name": "env_return"}],
        "optim": {"lr": 1e-3, "micro_batch_size": 4, "grad_clip": None},
        "trainer": {"steps": 1},
    }


# ------------------------------------------------------------------------ config and episodes


def test_env_section_names_the_field_and_the_registered_envs():
    cfg = config_from_dict(cfg_dict(adv_estimator="gigpo"))
    assert cfg.env.name == "frozenlake" and cfg.env.history == "full"
    known = "['frozenlake', 'gymnasium', 'openenv', 'refine', 'sokoban']"
    bad = [
        ({"name": "sokobn"}, f"env.name='sokobn' is not one of {known}"),
        ({"name": "sokoban", "kwargs": {"size": 4}}, "env.kwargs has unknown key 'size'"),
        ({"name": "refine", "kwargs": {"max_turns": 3}}, "unknown key 'max_turns'"),
        ({"name": "frozenlake", "history": "window"}, "env.history='window' is not one of"),
        ({"name": "frozenlake", "max_turns": 0}, "env.max_turns must be >= 1"),
    ]
    for env, msg in bad:
        with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("(", r"\(")):
            config_from_dict({**cfg_dict(), "env": env})
    no_env = {k: v for k, v in cfg_dict(adv_estimator="gigpo").items() if k != "env"}
    with pytest.raises(ConfigError, match="needs multi-turn environment steps .*env.name"):
        config_from_dict(no_env)
    with pytest.raises(ConfigError, match="max_sampling_rounds must be >= 1"):
        config_from_dict(cfg_dict(filters={"max_sampling_rounds": 0}))
    # ReMax's baseline comes from the sampler: no longer refused.
    assert config_from_dict(cfg_dict(adv_estimator="remax")).algorithm.adv_estimator == "remax"


def test_env_kwargs_no_room_can_satisfy_is_one_config_error():
    for kwargs, msg in [
        ({"min_moves": 60}, r"whose solution takes >= 60 moves .* lower min_moves"),
        ({"dim_room": [3, 3]}, r"needs a room of at least 4x4"),
    ]:
        cfg = config_from_dict({**cfg_dict(), "env": {"name": "sokoban", "kwargs": kwargs}})
        with pytest.raises(ConfigError, match=r"env\.kwargs \{.*\} for 'sokoban': .*" + msg):
            env_records(cfg, "train")


def test_episode_records_are_reproducible_and_eval_seeds_disjoint():
    cfg = config_from_dict(cfg_dict())
    eps = Episodes.from_section(cfg.env)
    train = eps.split_records(cfg.env, "train")
    held = eps.split_records(cfg.env, "eval")
    assert len(train) == cfg.env.train_episodes and len(held) == cfg.env.eval_episodes
    assert held[0]["env_seed"] == cfg.env.seed + EVAL_SEED_OFFSET
    assert not {r["env_seed"] for r in train} & {r["env_seed"] for r in held}
    r = train[3]
    assert r == eps.records([3])[0]  # same seed, same prompt
    grid = FrozenLake(size=4).reset(3)
    assert r["prompt"].endswith(grid) and "<answer>" in r["prompt"]
    env = eps.start(3)
    assert env.step(TURN.format("Down")).info["anchor_state"] == grid
    # code-running environments: prompts need no sandbox, episodes do
    refine = Episodes("refine", {"num_tests": 3}, max_turns=2)
    assert "```python" in refine.records([4])[0]["prompt"]
    with pytest.raises(ValueError, match="'refine' runs code: it needs a sandbox pool"):
        refine.start(4)


# --------------------------------------------------------------------- scripted episodes


def _add(t, kind, tokens, reward=None):
    start = len(t.response_ids)
    t.spans.append(Span(kind, start, start + len(tokens), reward))
    t.response_ids += tokens
    t.loss_mask += [int(kind == "model")] * len(tokens)
    t.logprobs += [-1.0 if kind == "model" else 0.0] * len(tokens)


def play(episodes, seed, turns, rng, prompt_index, sample_index, cut=False):
    """A trajectory as the rollout loop records it, from scripted turn texts (the fake policy):
    model spans of random tokens, each followed by the observation span of its env step
    (carrying the step's reward) unless the env ended the episode. With `cut`, a last turn the
    env never saw (cut by a limit) follows the script."""
    env = episodes.start(seed)
    t = Trajectory(prompt_index, sample_index, list(rng.integers(3, VOCAB, size=5)), env_seed=seed)
    for text in turns:
        _add(t, "model", list(rng.integers(3, VOCAB, size=int(rng.integers(2, 5)))))
        res = env.step(text)
        t.env_rewards.append(float(res.reward))
        t.env_states.append(res.info.get("anchor_state"))
        if res.done:
            t.finish_reason = "done"
            return t
        obs = list(rng.integers(3, VOCAB, size=int(rng.integers(2, 4))))
        _add(t, "observation", obs, float(res.reward))
    if cut:
        _add(t, "model", [7, 8, 9])
    t.finish_reason = "length"
    return t


# Per prompt, four scripted players: shared first moves (shared anchor states), invalid turns
# (format penalty, the state does not move), and the winning path on seed 0's lake.
SCRIPTS = [
    ["Right", "Right", "bad", "Down", "Down"],
    ["Right", "Right", "Down", "Down", "Down"],
    ["bad", "Down", "Right", "Down"],
    ["Down", "bad", "bad", "Right"],
]


def scripted_batch(episodes, seeds=(0, 11), last_cut=False):
    rng = np.random.default_rng(0)
    records = episodes.records(seeds)
    trajs = []
    for pi, seed in enumerate(seeds):
        for g, moves in enumerate(SCRIPTS):
            trajs.append(play(episodes, seed, [TURN.format(m) for m in moves], rng, pi, g))
    if last_cut:  # two turns, then one cut by a limit: a model span the env never saw
        moves = [TURN.format(m) for m in SCRIPTS[-1][:2]]
        trajs[-1] = play(episodes, seeds[-1], moves, rng, len(seeds) - 1, G - 1, cut=True)
    return records, trajs


def returns(rewards, gamma):
    out, g = [], 0.0
    for r in reversed(rewards):
        g = r + gamma * g
        out.append(g)
    return out[::-1]


def norm(x, eps=1e-6):
    """GRPO normalisation of one group (unbiased σ); all-equal -> 0, a group of one -> x."""
    x = np.asarray(x, np.float64)
    if len(x) == 1:
        return x
    if np.ptp(x) == 0:
        return np.zeros_like(x)
    return (x - x.mean()) / (x.std(ddof=1) + eps)


def gigpo_oracle(trajs, scores, gamma, omega):
    """Per trajectory, the advantage of each model span (turn), from the trajectories."""
    ep = np.concatenate([norm(scores[i : i + G]) for i in range(0, len(trajs), G)])
    out = []
    for i, t in enumerate(trajs):
        group = range(i - i % G, i - i % G + G)
        R = {j: returns(trajs[j].env_rewards, gamma) for j in group}
        per_turn = []
        for k in range(t.num_turns):
            if k >= len(t.env_rewards):
                per_turn.append(ep[i])
                continue
            peers = [
                R[j][u]
                for j in group
                for u, s in enumerate(trajs[j].env_states)
                if s == t.env_states[k]
            ]
            a_step = 0.0 if len(peers) == 1 else _anchor(R[i][k], peers)
            per_turn.append(ep[i] + omega * a_step)
        out.append(per_turn)
    return out


def _anchor(value, peers):
    peers = np.asarray(peers, np.float64)
    if np.ptp(peers) == 0:
        return 0.0
    return (value - peers.mean()) / (peers.std(ddof=1) + 1e-6)


def kevin_oracle(trajs, gamma, group_norm=True):
    out = []
    for g0 in range(0, len(trajs), G):
        group = trajs[g0 : g0 + G]
        R = [returns(t.env_rewards, gamma) for t in group]
        flat = np.concatenate(R)
        if group_norm:
            if len(flat) == 1:
                mu, sd = 0.0, 1.0
            else:
                mu, sd = flat.mean(), flat.std(ddof=1)
        for t, r in zip(group, R):
            per_turn = []
            for k in range(t.num_turns):
                if k >= len(r):
                    per_turn.append(0.0)
                elif not group_norm:
                    per_turn.append(r[k])
                elif np.ptp(flat) == 0:
                    per_turn.append(0.0)
                else:
                    per_turn.append((r[k] - mu) / (sd + 1e-6))
            out.append(per_turn)
    return out


def turn_rloo_oracle(trajs, gamma):
    """Each turn's return minus the mean return at that turn of the group's other episodes."""
    out = []
    for i, t in enumerate(trajs):
        group = [j for j in range(i - i % G, i - i % G + G) if j != i]
        R = {j: returns(trajs[j].env_rewards, gamma) for j in (i, *group)}
        per_turn = []
        for k in range(t.num_turns):
            if k >= len(R[i]):
                per_turn.append(0.0)  # a turn without an environment step
                continue
            peers = [R[j][k] for j in group if k < len(R[j])]
            per_turn.append(R[i][k] - (np.mean(peers) if peers else 0.0))
        out.append(per_turn)
    return out


def trainer_advantages(cfg, batch):
    """The advantages the trainer's step computes for `batch` (captured before the update)."""
    model_cfg = tiny_model_config()
    trainer = run.make_trainer(cfg, model_cfg, models.init_params(model_cfg, jax.random.key(0)))
    adv = trainer.advantages(batch)  # the step's own advantage code, before any update
    metrics = trainer.step(batch)
    assert np.isfinite(metrics["actor/loss"])
    return adv


def per_token(trajs, per_turn):
    """[trajectory] -> the advantage of each response token (0 on observations)."""
    out = []
    for t, turns in zip(trajs, per_turn):
        a = np.zeros(len(t.response_ids))
        for k, sp in enumerate(s for s in t.spans if s.kind == "model"):
            a[sp.start : sp.end] = turns[k]
        out.append(a)
    return out


def check_rows(adv_RT, trajs, expected):
    for i, (t, want) in enumerate(zip(trajs, expected)):
        p = len(t.prompt_ids)
        np.testing.assert_allclose(adv_RT[i, p : p + len(want)], want, rtol=1e-5, atol=1e-5)
        assert not adv_RT[i, :p].any() and not adv_RT[i, p + len(want) :].any()


def test_step_arrays_map_turns_states_and_tokens():
    episodes = Episodes("frozenlake", {"size": 4}, max_turns=5)
    _, trajs = scripted_batch(episodes, last_cut=True)
    out = step_arrays(trajs, rows=10, length=64)
    S = out["step_rewards"].shape[1]
    assert S % 4 == 0 and S >= max(t.num_turns for t in trajs)
    ids = out["anchor_ids"]
    slots = [(j, u) for j, t in enumerate(trajs) for u in range(len(t.env_states))]
    for i, t in enumerate(trajs):
        n = len(t.env_rewards)
        np.testing.assert_allclose(out["step_rewards"][i, :n], t.env_rewards, rtol=1e-6)
        assert out["step_mask"][i, :n].all() and not out["step_mask"][i, n:].any()
        for k in range(n):
            for other, u in slots:
                same_state = t.env_states[k] == trajs[other].env_states[u]
                assert (ids[i, k] == ids[other, u]) == same_state
        p = len(t.prompt_ids)
        for k, sp in enumerate(s for s in t.spans if s.kind == "model"):
            assert (out["token_step"][i, p + sp.start : p + sp.end] == k).all()
    assert trajs[-1].num_turns == len(trajs[-1].env_rewards) + 1  # the cut turn: mask 0
    assert not out["step_mask"][8:].any()  # padding rows
    # a tool turn (its observation carries no env reward) belongs to the env step it leads to
    t = Trajectory(0, 0, [1, 2], env_rewards=[0.5, 1.0], env_states=["a", "b"])
    for kind, reward in [("model", None), ("observation", None), ("model", None)] + [
        ("observation", 0.5),
        ("model", None),
    ]:
        _add(t, kind, [5, 6], reward)
    mixed = step_arrays([t], rows=1, length=16)["token_step"][0]
    assert mixed[[2, 3, 6, 7]].tolist() == [0] * 4 and mixed[[10, 11]].tolist() == [1, 1]


def test_anchor_metrics_count_shared_states_within_each_prompt_group():
    ep = lambda states, n=None: Trajectory(
        0, 0, [1], env_rewards=[0.0] * (len(states) if n is None else n), env_states=states
    )
    # group 1: "a" met 3 times, "b" once, a None state (its own group), and a state after the
    # last env step (not a step: no reward) that is not counted; group 2: "a" again (another
    # group's "a" does not count) and an unhashable state met twice.
    trajs = [ep(["a", "b"]), ep(["a", None]), ep(["a", "c"], n=1)]
    trajs += [ep(["a", [1, 2]]), ep([[1, 2]]), ep([])]
    m = rollout_metrics(trajs, np.zeros(6), {}, group_size=3)
    sizes = [3, 1, 3, 1, 3] + [1, 2, 2]
    assert m["env/anchor_group_size"] == pytest.approx(np.mean(sizes))
    assert m["env/anchor_shared_frac"] == pytest.approx(5 / 8)


def test_an_envs_numeric_step_info_is_logged_as_its_mean_over_the_batchs_steps():
    # What step_environment records: info entries other than the anchor state and success.
    from jaxrl_tools.envs import StepResult
    from jaxrl_tools.rollout.resolver import step_environment

    class Scripted:
        def __init__(self, infos):
            self.infos = iter(infos)

        def step(self, text):
            return StepResult("obs", 0.0, False, next(self.infos))

    trajs = [Trajectory(0, i, [1]) for i in range(2)]
    infos = [
        [{"anchor_state": "s", "success": True, "hacking": 1.0, "note": "text"}, {"hacking": 0.0}],
        [{"hacking": 0.0, "tests": 3}],
    ]
    for t, steps in zip(trajs, infos):
        env = Scripted(steps)
        for _ in steps:
            asyncio.run(step_environment(env, "turn", t))
    assert trajs[0].env_metrics == [{"hacking": 1.0}, {"hacking": 0.0}]
    m = rollout_metrics(trajs, np.zeros(2), {}, group_size=2)
    assert m["env/hacking"] == pytest.approx(1 / 3)
    assert m["env/tests"] == pytest.approx(1.0)  # a step without it counts 0


@pytest.mark.parametrize("last_cut,step_gamma", [(False, 0.95), (True, 0.95), (True, 0.5)])
def test_gigpo_end_to_end_matches_numpy_oracle(last_cut, step_gamma):
    algorithm = dict(adv_estimator="gigpo", gigpo_omega=0.7, step_gamma=step_gamma)
    cfg = config_from_dict(cfg_dict(**algorithm))
    episodes = Episodes.from_section(cfg.env)
    records, trajs = scripted_batch(episodes, last_cut=last_cut)
    reward = run.make_reward(cfg)
    batch = make_batch(
        records, trajs, reward, cfg.algorithm.filters, group_size=G, rows=8, pad_id=0
    )
    scores = batch.scores_R[:8]
    np.testing.assert_allclose(scores, [sum(t.env_rewards) for t in trajs], rtol=1e-6)
    assert len({s for t in trajs[:G] for s in t.env_states}) < sum(
        len(t.env_states) for t in trajs[:G]
    )
    adv = trainer_advantages(cfg, batch)
    expected = per_token(trajs, gigpo_oracle(trajs, scores, step_gamma, 0.7))
    check_rows(adv, trajs, expected)
    # ... and the same as the estimator itself on hand-built inputs of those trajectories
    acfg = algorithms.AdvantageConfig(group_size=G, gigpo_omega=0.7, step_gamma=step_gamma)
    direct, _ = algorithms.compute_advantages(
        "gigpo",
        algorithms.AdvantageInputs(
            loss_mask_BT=batch.loss_mask_RT,
            scores_B=batch.scores_R,
            step_rewards_BS=batch.step_rewards_RS,
            step_mask_BS=batch.step_mask_RS,
            anchor_ids_BS=batch.anchor_ids_RS,
            token_step_BT=batch.token_step_RT,
        ),
        acfg,
    )
    np.testing.assert_allclose(adv, direct, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gamma,group_norm", [(0.4, True), (0.9, False)])
def test_kevin_turn_returns_end_to_end_match_numpy_loop(gamma, group_norm):
    cfg = config_from_dict(
        cfg_dict(adv_estimator="kevin", turn_gamma=gamma, turn_group_norm=group_norm)
    )
    episodes = Episodes.from_section(cfg.env)
    records, trajs = scripted_batch(episodes, last_cut=True)
    batch = make_batch(
        records, trajs, run.make_reward(cfg), cfg.algorithm.filters, group_size=G, rows=8, pad_id=0
    )
    adv = trainer_advantages(cfg, batch)
    check_rows(adv, trajs, per_token(trajs, kevin_oracle(trajs, gamma, group_norm)))


def windowed(trajs, rng):
    """The scripted episodes as windowed history records them: every model span a turn of its
    own, with a prompt of its own; the episode holds the turns' tokens back to back."""
    out = []
    for t in trajs:
        ep = Trajectory(t.prompt_index, t.sample_index, t.prompt_ids, env_seed=t.env_seed)
        ep.env_rewards, ep.env_states, ep.turns = t.env_rewards, t.env_states, []
        for sp in (s for s in t.spans if s.kind == "model"):
            toks = t.response_ids[sp.start : sp.end]
            prompt = list(rng.integers(3, VOCAB, size=int(rng.integers(4, 9))))
            ep.turns.append(
                Trajectory(
                    t.prompt_index,
                    t.sample_index,
                    prompt,
                    toks,
                    [1] * len(toks),
                    [-1.0] * len(toks),
                )
            )
            _add(ep, "model", toks)
        out.append(ep)
    return out


@pytest.mark.parametrize("estimator", ["gigpo", "kevin", "turn_rloo", "grpo"])
def test_windowed_turn_rows_get_their_episodes_turn_advantages(estimator):
    """With windowed history every turn is a row of its own; each row's tokens get the
    advantage the estimator gives that turn of its episode (the NumPy oracles above)."""
    cfg = config_from_dict(
        {
            **cfg_dict(adv_estimator=estimator, gigpo_omega=0.7, turn_gamma=0.4),
            "env": {**cfg_dict()["env"], "history": "last_k"},
        }
    )
    assert cfg.update_rows == 2 * G * cfg.env.max_turns
    episodes = Episodes.from_section(cfg.env)
    records, trajs = scripted_batch(episodes, last_cut=True)
    eps = windowed(trajs, np.random.default_rng(1))
    reward = run.make_reward(cfg)
    batch = make_batch(
        records, eps, reward, cfg.algorithm.filters, group_size=G, rows=8, pad_id=0,
        turn_rows=cfg.update_rows,
    )  # fmt: skip
    turns = [turn for ep in eps for turn in ep.turns]
    assert batch.num_rows == len(turns) and batch.num_episodes == 8
    scores = batch.episode_scores_E[:8]
    np.testing.assert_allclose(scores, [sum(t.env_rewards) for t in trajs], rtol=1e-6)
    if estimator == "gigpo":
        per_turn = gigpo_oracle(eps, scores, 0.95, 0.7)
    elif estimator == "kevin":
        per_turn = kevin_oracle(eps, 0.4)
    elif estimator == "turn_rloo":
        per_turn = turn_rloo_oracle(eps, 0.95)
    else:
        ep = np.concatenate([norm(scores[i : i + G]) for i in range(0, 8, G)])
        per_turn = [[ep[i]] * t.num_turns for i, t in enumerate(eps)]
    adv = trainer_advantages(cfg, batch)
    flat = sum(per_turn, [])
    expected = [np.full(len(t.response_ids), a) for t, a in zip(turns, flat, strict=True)]
    check_rows(adv, turns, expected)
    assert not adv[len(turns) :].any()


def test_windowed_history_refuses_per_token_estimators_and_tools():
    env = {**cfg_dict()["env"], "history": "state"}
    with pytest.raises(ConfigError, match="algorithm.adv_estimator is 'gae', which gives each"):
        config_from_dict({**cfg_dict(adv_estimator="gae"), "env": env, "critic": {"enabled": True}})
    with pytest.raises(ConfigError, match="tools are not supported with env.history='state'"):
        config_from_dict(
            {
                **cfg_dict(),
                "env": env,
                "tools": [{"cls": "python"}],
                "rollout": {"protocol": "torl"},
            }
        )
    with pytest.raises(ConfigError, match="env.history_length must be >= 1"):
        config_from_dict({**cfg_dict(), "env": {**env, "history_length": 0}})


def test_kevin_estimator_matches_numpy_loop_on_random_inputs():
    rng = np.random.default_rng(1)
    B, S, T, gamma = 6, 5, 12, 0.4
    n_steps = rng.integers(1, S + 1, size=B)
    mask = (np.arange(S)[None] < n_steps[:, None]).astype(np.float32)
    r = rng.normal(size=(B, S)).astype(np.float32) * mask
    tok_step = rng.integers(0, S, size=(B, T)).astype(np.int32)
    lm = (rng.random((B, T)) < 0.8).astype(np.float32)
    acfg = algorithms.AdvantageConfig(group_size=3, turn_gamma=gamma)
    adv, _ = algorithms.compute_advantages(
        "kevin",
        algorithms.AdvantageInputs(
            loss_mask_BT=lm, step_rewards_BS=r, step_mask_BS=mask, token_step_BT=tok_step
        ),
        acfg,
    )
    want = np.zeros((B, T))
    for g0 in (0, 3):
        R = {}
        for i in range(g0, g0 + 3):
            ret = 0.0
            for k in reversed(range(n_steps[i])):
                ret = r[i, k] + gamma * ret
                R[i, k] = ret
        vals = np.array(list(R.values()), np.float64)
        for i in range(g0, g0 + 3):
            for t in range(T):
                k = tok_step[i, t]
                if lm[i, t] and k < n_steps[i]:
                    want[i, t] = (R[i, k] - vals.mean()) / (vals.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- ReMax and DAPO resampling


def answer_traj(pi, g, text, n=4):
    return Trajectory(
        pi,
        g,
        [1, 2, 3],
        [5] * n,
        [1] * n,
        [-1.0] * n,
        [Span("model", 0, n)],
        response_text=text,
        model_text=text,
    )


class FakeSampler:
    """Scripted rollouts: record r's sample j answers `answers(r, j)`; the greedy one (temperature
    0, one sample) answers `greedy(r)`."""

    def __init__(self, answers, greedy=None):
        self.answers, self.greedy, self.calls = answers, greedy, []

    def __call__(self, records, group_size, temperature=None):
        self.calls.append((len(records), group_size, temperature))
        out = []
        for pi, rec in enumerate(records):
            for g in range(group_size):
                if temperature == 0.0:
                    text = self.greedy(rec)
                else:
                    text = self.answers(rec, g)
                out.append(answer_traj(pi, g, f"\\boxed{{{text}}}"))
        return out


def math_cfg(batch_size=4, **algorithm):
    return config_from_dict(
        {
            "tokenizer": {"path": "unused"},
            "data": {"batch_size": batch_size},
            "rollout": {"group_size": G, "max_response_len": 16},
            "algorithm": {"kl_coef": 0.0, **algorithm},
            "reward": [{"name": "math", "kwargs": {"correct": 1.0, "wrong": 0.0}}],
            "optim": {"lr": 1e-3, "micro_batch_size": 4, "grad_clip": None},
            "trainer": {"steps": 1},
        }
    )


def record_stream():
    i = 0
    while True:
        yield [{"prompt": "q", "ground_truth": "7", "id": i + k} for k in range(4)]
        i += 4


def test_remax_baseline_is_the_greedy_rollouts_reward():
    cfg = math_cfg(batch_size=2, adv_estimator="remax")
    # greedy: right on even ids, wrong on odd; samples: right for j < id % 3
    sampler = FakeSampler(
        lambda rec, j: 7 if j < rec["id"] % 3 else 8,
        greedy=lambda rec: 7 if rec["id"] % 2 == 0 else 9,
    )
    stream = record_stream()
    batch = collect_batch(
        lambda: next(stream),
        sampler,
        run.make_reward(cfg),
        cfg.algorithm.filters,
        group_size=G,
        rows=2 * G,
        pad_id=0,
        greedy_baseline=True,
    )
    # one greedy rollout per prompt of the batch (2 groups of the 4 sampled fill it)
    assert sampler.calls == [(4, G, None), (2, 1, 0.0)]
    greedy_reward = np.repeat([1.0, 0.0], G)
    np.testing.assert_array_equal(batch.baseline_R, greedy_reward)
    adv = trainer_advantages(cfg, batch)
    want = (batch.scores_R - greedy_reward)[:, None] * batch.loss_mask_RT
    np.testing.assert_allclose(adv, want, atol=1e-6)


def test_dapo_resampling_fills_the_batch_when_half_the_groups_are_uniform():
    # even ids: every sample right (a uniform group); odd ids: half right
    answers = lambda rec, j: 7 if rec["id"] % 2 == 0 or j < 2 else 8  # noqa: E731
    rows = 4 * G
    reward = CompositeReward([("math", 1.0, {"correct": 1.0, "wrong": 0.0})])
    for rounds, want_rounds, want_rows in ((4, 2, rows), (1, 1, rows // 2)):
        cfg = math_cfg(filters={"dynamic_sampling": True, "max_sampling_rounds": rounds})
        stream, sampler = record_stream(), FakeSampler(answers)
        batch = collect_batch(
            lambda s=stream: next(s), sampler, reward, cfg.algorithm.filters,
            group_size=G, rows=rows, pad_id=0,
        )  # fmt: skip
        assert batch.num_rows == want_rows
        assert batch.metrics["filter/sampling_rounds"] == want_rounds
        assert batch.metrics["filter/kept_groups_frac"] == pytest.approx(0.5)
        kept = batch.scores_R[: batch.num_rows].reshape(-1, G)
        assert (np.ptp(kept, axis=1) > 0).all()
    # nothing but uniform groups: stops at max_sampling_rounds with an empty batch
    cfg = math_cfg(filters={"dynamic_sampling": True, "max_sampling_rounds": 3})
    stream, sampler = record_stream(), FakeSampler(lambda rec, j: 7)
    batch = collect_batch(
        lambda: next(stream), sampler, reward, cfg.algorithm.filters, group_size=G, rows=rows,
        pad_id=0,
    )  # fmt: skip
    assert batch.num_rows == 0 and batch.metrics["filter/sampling_rounds"] == 3
    assert len(sampler.calls) == 3
    # without dynamic sampling, other filters never resample
    cfg = math_cfg(filters={"starpo_s": True, "max_sampling_rounds": 3})
    stream, sampler = record_stream(), FakeSampler(answers)
    batch = collect_batch(
        lambda: next(stream), sampler, reward, cfg.algorithm.filters, group_size=G, rows=rows,
        pad_id=0,
    )  # fmt: skip
    assert len(sampler.calls) == 1 and batch.metrics["filter/sampling_rounds"] == 1


def test_a_batch_with_no_env_step_still_feeds_gigpo_as_grpo():
    # every turn cut by a limit (a random model that never ends a turn): masks 0, A = A^E
    trajs = fixed_trajectories()
    cfg = config_from_dict(cfg_dict(adv_estimator="gigpo"))
    records = [{"prompt": "q", "ground_truth": "7"}] * 2
    reward = CompositeReward([("math", 1.0, {"correct": 1.0, "wrong": 0.0})])
    batch = make_batch(
        records, trajs, reward, cfg.algorithm.filters, group_size=G, rows=8, pad_id=0
    )
    assert batch.step_mask_RS is not None and not batch.step_mask_RS.any()
    inputs = dict(loss_mask_BT=batch.loss_mask_RT, scores_B=batch.scores_R)
    acfg = algorithms.AdvantageConfig(group_size=G)
    gigpo, _ = algorithms.compute_advantages(
        "gigpo",
        algorithms.AdvantageInputs(
            **inputs,
            step_rewards_BS=batch.step_rewards_RS,
            step_mask_BS=batch.step_mask_RS,
            anchor_ids_BS=batch.anchor_ids_RS,
            token_step_BT=batch.token_step_RT,
        ),
        acfg,
    )
    grpo, _ = algorithms.compute_advantages("grpo", algorithms.AdvantageInputs(**inputs), acfg)
    np.testing.assert_allclose(gigpo, grpo, atol=1e-6)
