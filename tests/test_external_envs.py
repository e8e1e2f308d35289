"""Environments of the user's through the `env` section: a gymnasium text environment by id and
an OpenEnv `Environment`, both written here with their own APIs, played turn by turn and
trained in a smoke run."""

from __future__ import annotations

import json
import string

import gymnasium
import numpy as np
import pytest
import yaml
from openenv.core.env_server import types as openenv_types
from openenv.core.env_server.interfaces import Environment
from test_rollout_loop import _engine  # the scripted engine

from jaxrl_tools import cli, configs
from jaxrl_tools.config import RolloutSection
from jaxrl_tools.envs import Episodes
from jaxrl_tools.rollout import Sampler

HINT = "Guess the digit (0-9)."


def _answer(seed: int) -> int:
    return seed * 7 % 10


def _judge(guess: str, target: int) -> tuple[str, float, bool]:
    """The game both environments play: the hint, the reward, whether it was found."""
    text = guess.strip()
    if not text.isdigit():
        return f"Not a digit. {HINT}", -0.1, False
    if int(text) == target:
        return "Found it.", 1.0, True
    return ("Higher." if int(text) < target else "Lower."), 0.0, False


class GuessText(gymnasium.Env):
    """A gymnasium environment with text observations and actions."""

    observation_space = gymnasium.spaces.Text(64, charset=string.printable)
    action_space = gymnasium.spaces.Text(64, charset=string.printable)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = _answer(seed)
        return HINT, {}

    def step(self, action):
        hint, reward, found = _judge(action, self.target)
        return hint, reward, found, False, {"success": found}


gymnasium.register("GuessText-v0", entry_point=GuessText)


class GuessAction(openenv_types.Action):
    guess: str


class GuessObservation(openenv_types.Observation):
    hint: str


class GuessEnvironment(Environment[GuessAction, GuessObservation, openenv_types.State]):
    """The same game with OpenEnv's API."""

    def __init__(self, penalty: float = -0.1):
        super().__init__()
        self.penalty = penalty
        self._state = openenv_types.State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target = _answer(seed)
        self._state = openenv_types.State(episode_id=episode_id, step_count=0)
        return GuessObservation(hint=HINT)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        hint, reward, found = _judge(action.guess, self.target)
        reward = self.penalty if reward < 0 else reward
        return GuessObservation(hint=hint, reward=reward, done=found, metadata={"success": found})

    @property
    def state(self):
        return self._state


class TwoTexts(openenv_types.Action):
    a: str
    b: str = ""
    c: str


class TwoTextEnvironment(
    GuessEnvironment, Environment[TwoTexts, GuessObservation, openenv_types.State]
):
    """An action type with two text fields: which one a turn goes in must be named."""

    def step(self, action, timeout_s=None, **kwargs):
        return super().step(GuessAction(guess=getattr(action, "a", action.guess)), timeout_s)


KWARGS = {
    "gymnasium": {"id": "test_external_envs:GuessText-v0", "instructions": "Play."},
    "openenv": {"environment": "test_external_envs:GuessEnvironment", "instructions": "Play."},
}


@pytest.mark.parametrize("name", ["gymnasium", "openenv"])
def test_an_environment_of_the_users_plays_turn_by_turn(name):
    episodes = Episodes(name, KWARGS[name], max_turns=3)
    assert episodes.prompt(4) == f"Play.\n\n{HINT}"
    env = episodes.start(4)  # the answer is 8
    first = env.step("3")
    assert (first.observation, first.reward, first.done) == ("Higher.", 0.0, False)
    assert first.info == {"anchor_state": HINT, "success": False}
    assert env.step("x").reward == pytest.approx(-0.1)
    found = env.step(" 8 ")
    assert (found.observation, found.reward, found.done) == ("Found it.", 1.0, True)
    assert found.info["success"] and found.info["anchor_state"].startswith("Not a digit")
    again = episodes.start(4)  # a new episode of the same seed, and the turn limit
    assert [again.step("0").done for _ in range(3)] == [False, False, True]


def test_openenv_constructor_arguments_action_fields_and_observations_as_json():
    kw = {"environment": "test_external_envs:GuessEnvironment", "kwargs": {"penalty": -1.0}}
    env = Episodes("openenv", kw).start(1)
    assert env.step("no").reward == -1.0
    two = {"environment": "test_external_envs:TwoTextEnvironment"}
    with pytest.raises(ValueError, match=r"env.kwargs.action_field: TwoTexts has 3 str fields"):
        Episodes("openenv", two).start(1)
    named = {**two, "action_field": "a"}
    with pytest.raises(ValueError, match=r"env.kwargs.action: TwoTexts needs \['c'\] besides"):
        Episodes("openenv", named).start(1)
    named["action"] = "test_external_envs:GuessAction"  # an action type other than declared
    with pytest.raises(ValueError, match=r"env.kwargs.action_field='a' is not a field of Gue"):
        Episodes("openenv", named).start(1)
    assert Episodes("openenv", {**named, "action_field": "guess"}).start(1).step("7").done
    shown = {**kw, "observation_field": None}
    assert Episodes("openenv", shown).start(1).step("0").observation == "Higher."
    assert Episodes("openenv", {**kw, "observation_field": "done"}).prompt(1).endswith("False")


def test_environments_that_cannot_be_built_are_one_line_errors():
    with pytest.raises(ValueError, match=r"env.kwargs.id='nope:Missing-v0': gymnasium.make"):
        Episodes("gymnasium", {"id": "nope:Missing-v0"}).start(0)
    with pytest.raises(ValueError, match=r"env.kwargs.environment='test_external_envs': give"):
        Episodes("openenv", {"environment": "test_external_envs"}).start(0)
    with pytest.raises(ValueError, match=r"env.kwargs.environment='test_external_envs:Nope'"):
        Episodes("openenv", {"environment": "test_external_envs:Nope"}).start(0)


@pytest.mark.parametrize("name", ["gymnasium", "openenv"])
def test_the_rollout_loop_plays_an_environment_of_the_users(name, tok_model, tok):
    eng, params = _engine(tok_model, tok, ["3<|im_end|>", "8<|im_end|>"])  # the model's turns
    settings = RolloutSection(protocol="none", max_prompt_len=256, max_response_len=64, slots=2)
    episodes = Episodes(name, KWARGS[name], max_turns=3)
    (t,) = Sampler(eng, tok, None, settings, episodes=episodes)(episodes.records([4]), 1, params)
    assert t.finish_reason == "done" and t.env_success
    assert t.env_rewards == [0.0, 1.0] and t.env_states == [HINT, "Higher."]


@pytest.mark.parametrize("name", ["gymnasium", "openenv"])
def test_an_environment_of_the_users_trains_in_a_smoke_run(name, tmp_path, monkeypatch):
    recipe = yaml.safe_load(configs.path("frozenlake_demo").read_text())
    recipe["env"] = {"name": name, "kwargs": KWARGS[name], "max_turns": 3, "eval_episodes": 4}
    recipe["sft"] = {"enabled": False}
    recipe["reward"] = [{"name": "env_return", "weight": 1.0}]
    path = tmp_path / "guess.yaml"
    path.write_text(yaml.safe_dump(recipe))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--config", str(path), "--smoke"]) == 0
    logs = tmp_path / "runs/smoke/frozenlake_demo/logs/metrics.jsonl"
    steps = [json.loads(line) for line in logs.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    # (a random policy rarely ends its turn: the loop's env steps are the test above's)
    assert all(s["rollout/tokens"] > 0 and np.isfinite(s["actor/loss"]) for s in steps)
