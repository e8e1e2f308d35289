"""The grid-game demos: the oracle's SFT traces are the turns a rollout sees, its plans are
shortest, its noise detours; a smoke run of the GiGPO demo against GRPO from one SFT policy."""

import json
import random

import pytest

from jaxrl_tools import prompts
from jaxrl_tools.cli import main
from jaxrl_tools.envs import Episodes, parse_turn
from jaxrl_tools.envs.episodes import window_text
from jaxrl_tools.envs.oracle import shortest_plan
from jaxrl_tools.tasks import grid_games


def actions_of(messages, actions, k):
    return [parse_turn(m["content"], actions, k) for m in messages if m["role"] == "assistant"]


@pytest.mark.parametrize("name,kwargs,k", [("frozenlake", {"size": 4}, 1), ("sokoban", {}, 2)])
def test_noiseless_oracle_plays_a_shortest_plan_to_the_goal(name, kwargs, k):
    episodes = Episodes(name, kwargs, max_turns=20, max_actions_per_turn=k)
    for seed in range(5):
        plan = shortest_plan(episodes.start(seed).env)
        messages = grid_games.play(episodes, seed, random.Random(0), noise=0.0)
        moves = [a for turn in actions_of(messages, episodes.cls.actions, k) for a in turn]
        assert moves == plan
        env = episodes.start(seed)
        results = [env.step(m["content"]) for m in messages if m["role"] == "assistant"]
        assert results[-1].done and results[-1].info["success"]
        # each observation in the trace is the one the environment gave after that turn
        observations = [m["content"] for m in messages[2::2]]
        assert observations == [r.observation for r in results[:-1]]


def test_noisy_oracle_moves_off_its_plan():
    episodes = Episodes("frozenlake", {"size": 4}, max_turns=8)
    env = episodes.start(3)
    plan = shortest_plan(env.env)
    rng = random.Random(0)
    firsts = [grid_games.oracle_moves(env.env, None, rng, 1.0, 1) for _ in range(20)]
    assert all(moves[0] != plan[0] and rest is None for moves, rest in firsts)
    moves, rest = grid_games.oracle_moves(env.env, None, rng, 0.0, 1)
    assert moves == plan[:1] and rest == plan[1:]


@pytest.mark.parametrize("history,k", [("last_k", 2), ("state", 0)])
def test_windowed_traces_are_the_rollouts_windows(history, k):
    """With windowed history an oracle episode is one conversation a turn: the window the
    rollout would show (the last k pairs of the full-history trace) and the oracle's turn."""
    full = Episodes("sokoban", {}, max_turns=6)
    windowed = Episodes("sokoban", {}, max_turns=6, history=history, history_length=2)
    messages = grid_games.play(full, 4, random.Random(2), noise=0.3)
    convs = grid_games.conversations(windowed, 4, random.Random(2), noise=0.3)
    turns = [m["content"] for m in messages if m["role"] == "assistant"]
    observations = [full.build().reset(4)] + [m["content"] for m in messages[2::2]]
    intro = full.build().instructions()
    assert len(convs) == len(turns) >= 2
    for i, conv in enumerate(convs):
        earlier = list(zip(observations, turns))[max(0, i - k) : i]
        assert conv == [
            {"role": "user", "content": window_text(intro, earlier, observations[i])},
            {"role": "assistant", "content": turns[i]},
        ]
    assert convs[0][0]["content"] == messages[0]["content"] == full.prompt(4)


def test_trace_segments_are_the_rollout_text_with_only_model_turns_trained(tok):
    episodes = Episodes("frozenlake", {"size": 4}, max_turns=8)
    messages = grid_games.play(episodes, 7, random.Random(1), noise=0.25)
    segments = grid_games.chat_segments(tok, messages, "Play well.")
    full = [{"role": "system", "content": "Play well."}, *messages]
    assert "".join(s for s, _ in segments) == tok.apply_chat_template(full, tokenize=False)
    trained = [s for s, t in segments if t]
    turns = [m["content"] for m in messages if m["role"] == "assistant"]
    assert [s.removesuffix("<|im_end|>") for s in trained] == turns
    # between two model turns: the observation's user turn as the rollout appends it after a
    # turn that ended with its end-of-turn token
    observations = [m["content"] for m in messages[2::2]]
    between = [s for s, t in segments if not t][1 : 1 + len(observations)]
    appended = [prompts.chat_continuation(tok, "user", [o]) for o in observations]
    assert between == [a.removeprefix("<|im_end|>") for a in appended]
    assert all(s.endswith("<|im_end|>") for s in trained)


def shrunk(tmp_path) -> list[str]:
    """Overrides that shrink a grid demo to a smoke run (a tiny model, 1 step, few episodes)."""
    out = tmp_path / "run"
    return [
        f"tokenizer.path={tmp_path / 'tok'}",
        "tokenizer.vocab_size=400",
        "model.tiny.hidden_size=32",
        "model.tiny.intermediate_size=64",
        "model.tiny.head_dim=8",
        "data.batch_size=2",
        "data.eval_batch_size=4",
        "env.train_episodes=16",
        "env.eval_episodes=4",
        "env.max_turns=3",
        "rollout.group_size=4",
        "rollout.eval_group_size=1",
        "rollout.slots=8",
        "rollout.max_prompt_len=320",
        "optim.micro_batch_size=8",
        "sft.epochs=1",
        "sft.batch_size=8",
        "trainer.steps=1",
        f"trainer.log_dir={out / 'logs'}",
        f"trainer.checkpoint_dir={out / 'ckpt'}",
    ]


def test_gigpo_demo_against_grpo_smoke(tmp_path, capsys):
    """`demo --config sokoban_gigpo_demo --baseline-estimator grpo`, shrunk: oracle SFT, one
    GiGPO and one GRPO step from the same SFT policy, held-out success in one report."""
    out = tmp_path / "run"
    overrides = [
        *shrunk(tmp_path),
        "rollout.max_response_len=96",
        "sft.num_traces=16",
    ]
    argv = ["demo", "--config", "sokoban_gigpo_demo", "--baseline-estimator", "grpo"]
    assert main([*argv, *overrides]) == 0, capsys.readouterr().err
    report = (out / "logs" / "report.md").read_text()
    rows = [line.split(" |")[0] for line in report.splitlines() if line.startswith("| SFT")]
    assert rows == ["| SFT (before RL)", "| SFT + RL (grpo)", "| SFT + RL (gigpo)"]
    summary = json.loads((out / "logs" / "report.json").read_text())
    for row, m in [
        ("SFT (before RL)", summary["before"]),
        ("SFT + RL (grpo)", summary["baseline"]["after"]),
        ("SFT + RL (gigpo)", summary["after"]),
    ]:
        assert m["num_problems"] == 4 and m["env/turns_mean"] <= 3  # env.max_turns
        assert f"| {row} | {m['env/success_rate'] * 100:.1f}% | {m['reward/mean']:.3f} |" in report
    assert "Against grpo at the same budget from the same SFT policy" in report
    assert (out / "ckpt" / "baseline" / "1").is_dir() and (out / "ckpt" / "1").is_dir()


def test_windowed_frozenlake_demo_smoke(tmp_path, capsys):
    """`demo --config frozenlake_demo env.history=state`, shrunk: oracle SFT on one window a
    turn, a GRPO step on packed rows of turns, held-out success before and after."""
    out = tmp_path / "run"
    overrides = [
        *shrunk(tmp_path),
        "env.history=state",
        "rollout.max_response_len=32",
        "optim.ppo_epochs=1",
        "optim.pack=true",
        "sft.num_traces=8",
        "sft.max_len=256",
    ]
    assert main(["demo", "--config", "frozenlake_demo", *overrides]) == 0, capsys.readouterr().err
    summary = json.loads((out / "logs" / "report.json").read_text())
    for m in (summary["before"], summary["after"]):
        assert m["num_problems"] == 4 and m["env/turns_mean"] <= 3
    metrics = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").open()]
    step = next(m for m in metrics if "actor/loss" in m)
    assert "env/success_rate" in step and step["packing/rows"] >= 1
    assert (out / "ckpt" / "1").is_dir()
