"""Environments: deterministic under a seed, solvable, rewards and ends as specified, and RAGEN's
turn protocol."""

import asyncio
import copy
import dataclasses
from pathlib import Path

import pytest
import yaml

from jaxrl_tools.envs import FrozenLake, RagenTurns, Refine, Sokoban, make_env, parse_turn, refine
from jaxrl_tools.envs import sokoban as sk
from jaxrl_tools.envs.oracle import shortest_plan


# --------------------------------------------------------------------------- Sokoban
@pytest.mark.parametrize("seed", range(12))
def test_sokoban_rooms_are_deterministic_and_solvable(seed):
    env = Sokoban(dim_room=(6, 6), num_boxes=1, max_steps=100)
    grid = env.reset(seed)
    assert Sokoban(dim_room=(6, 6)).reset(seed) == grid
    rows = grid.split("\n")
    assert len(rows) == 6 and all(len(r.split(" ")) == 6 for r in rows)
    assert grid.count("P") + grid.count("S") == 1 and grid.count("X") == 1  # box off target
    assert all(c == "#" for c in rows[0].split(" ") + rows[-1].split(" "))
    path = shortest_plan(env)
    assert path is not None, grid
    assert env.render() == grid  # the search copies the room
    results = [env.step(a) for a in path]
    assert results[-1].done and results[-1].info["success"]
    assert results[-1].reward == pytest.approx(sk.STEP_PENALTY + sk.BOX_ON + sk.SOLVED)
    assert all(r.reward == pytest.approx(sk.STEP_PENALTY) for r in results[:-1])


def test_sokoban_seeds_give_different_rooms():
    rooms = {Sokoban().reset(s) for s in range(20)}
    assert len(rooms) >= 15


def test_sokoban_pushes_walls_and_rewards():
    env = Sokoban(dim_room=(5, 7), max_steps=5)
    env.reset(0)
    env.walls = sk.np.ones((5, 7), bool)  # a corridor, and a nook above its left end
    env.walls[2, 1:6] = False
    env.walls[1, 1] = False
    env.targets = frozenset({(2, 3), (1, 1)})
    env.player, env.boxes = (2, 1), frozenset({(2, 2), (2, 5)})
    start = env.render()
    assert start.split("\n")[1:3] == ["# O # # # # #", "# P X O _ X #"]
    res = env.step("Down")  # into a wall: a step, nothing moves
    assert res.reward == pytest.approx(-0.1) and env.player == (2, 1) and not res.done
    assert res.info["anchor_state"] == start and res.observation == start
    res = env.step("Right")  # a box onto a target
    assert res.reward == pytest.approx(0.9) and not res.done
    assert res.observation.split("\n")[2] == "# _ P √ _ X #"
    res = env.step("Right")  # and off it again
    assert res.reward == pytest.approx(-1.1) and env.boxes == {(2, 4), (2, 5)}
    assert res.observation.split("\n")[2] == "# _ _ S X X #"
    res = env.step("Right")  # two boxes in a row do not move
    assert res.reward == pytest.approx(-0.1) and env.player == (2, 3)
    res = env.step("Left")
    assert res.done and not res.info["success"]  # max_steps


def test_sokoban_min_moves_redraws_short_rooms():
    for seed in range(30):
        env = Sokoban(min_moves=3)
        grid = env.reset(seed)
        assert len(shortest_plan(env)) >= 3, grid
    # without it, the same generator gives rooms solved in one or two moves
    short = [s for s in range(30) if len(shortest_plan(_reset(Sokoban(), s))) < 3]
    assert len(short) >= 10


def _reset(env, seed):
    env.reset(seed)
    return env


def test_sokoban_hints_say_where_box_and_target_are():
    env = Sokoban(dim_room=(5, 7), hints=True)
    env.reset(0)
    env.walls = sk.np.ones((5, 7), bool)
    env.walls[1:4, 1:6] = False
    env.targets = frozenset({(1, 5), (3, 1)})
    env.player, env.boxes = (3, 3), frozenset({(2, 2)})
    lines = env.render().split("\n")
    assert lines[:5] == _plain(env).render().split("\n")  # the grid, then the line
    assert lines[5] == "Box from you: 1 above, 1 left. Target from box: 1 below, 1 left."
    env.step("Right")
    assert env.render().split("\n")[5] == (
        "Box from you: 1 above, 2 left. Target from box: 1 below, 1 left."
    )
    env.player, env.boxes = (1, 4), frozenset({(1, 3)})
    assert (
        env.render().split("\n")[5]
        == "Box from you: 0 above, 1 left. Target from box: 0 above, 2 right."
    )
    env.boxes = frozenset({(1, 5)})
    assert env.render().split("\n")[5] == "Every box is on a target."


def _plain(env):
    plain = copy.copy(env)
    plain.hints = False
    return plain


# --------------------------------------------------------------------------- FrozenLake
def test_frozenlake_is_deterministic_and_rewards_the_goal():
    env = make_env("frozenlake", size=4, slippery=False)
    grid = env.reset(3)
    assert FrozenLake(size=4).reset(3) == grid
    assert grid.split("\n")[0].split(" ")[0] == "P" and grid.count("G") == 1
    path = shortest_plan(env)
    assert path is not None and len(path) == 6  # start and goal are opposite corners
    results = [env.step(a) for a in path]
    assert [r.reward for r in results] == [0.0] * (len(path) - 1) + [1.0]
    assert results[-1].done and "√" in results[-1].observation


def test_frozenlake_hole_ends_the_episode():
    env = FrozenLake(size=4, slippery=False)
    for seed in range(50):
        env.reset(seed)
        desc = env._env.unwrapped.desc.astype(str)
        if desc[0][1] == "H":
            res = env.step("Right")
            assert res.done and res.reward == 0.0 and not res.info["success"]
            assert res.observation.split("\n")[0].split(" ")[1] == "X"
            return
    pytest.fail("no map with a hole right of the start in 50 seeds")


def test_slippery_frozenlake_replays_under_a_seed():
    def play(seed):
        env = FrozenLake(size=4, slippery=True, max_steps=8)
        env.reset(seed)
        return [env.step(a).observation for a in ("Down", "Right", "Down", "Right")]

    assert play(5) == play(5)
    assert len({tuple(play(s)) for s in range(10)}) > 1


def test_a_copied_lake_slips_as_the_original_and_alone():
    env = FrozenLake(size=4, slippery=True, max_steps=20)
    env.reset(5)
    twin = copy.deepcopy(env)
    moves = ["Down", "Right"] * 4
    assert [env.step(a).observation for a in moves] == [twin.step(a).observation for a in moves]
    env.reset(5)
    twin2 = copy.deepcopy(env)
    twin2.step("Down")
    assert env.render() == FrozenLake(size=4).reset(5)  # the copy's move left it alone


# --------------------------------------------------------------------------- RAGEN turns
def test_parse_turn():
    acts = Sokoban.actions
    assert parse_turn("<think>go</think><answer>Up</answer>", acts, 1) == ["Up"]
    assert parse_turn(" <think>a</think>\n<answer>up || LEFT</answer> ", acts, 3) == [
        "Up",
        "Left",
    ]
    assert parse_turn("<think>a</think><answer>Up || Up || Down</answer>", acts, 2) == [
        "Up",
        "Up",
    ]
    for bad in (
        "<answer>Up</answer>",  # no think
        "<think>a</think><answer>Jump</answer>",  # not an action
        "<think>a</think><answer>Up ||</answer>",
        "<think>a</think><answer>Up</answer> and more",
        "Up",
    ):
        assert parse_turn(bad, acts, 3) is None, bad


def test_ragen_turns_penalise_format_and_take_several_actions():
    env = RagenTurns(FrozenLake(size=4), max_actions_per_turn=2, format_penalty=-0.1, max_turns=3)
    start = env.reset(3)
    assert "<answer>" in env.instructions() and "Left, Down, Right, Up" in env.instructions()
    res = env.step("Down")  # no tags: penalised, nothing moves
    assert res.reward == -0.1 and not res.done and res.info["valid"] is False
    assert res.observation.endswith(start) and env.state_key == start
    res = env.step("<think>x</think><answer>Left || Up</answer>")  # both bump the edge
    assert res.info["actions"] == ["Left", "Up"] and res.info["anchor_state"] == start
    assert res.observation == start and not res.done
    res = env.step("<think>x</think><answer>Left</answer>")
    assert res.done and not res.info["success"]  # the third turn is the last
    obs, reward, done = res  # the rollout loop unpacks three values
    assert done and reward == 0.0


# --------------------------------------------------------------------------- refinement
@pytest.fixture(scope="module")
def pool():
    from jaxrl_tools.tools import SandboxConfig, SandboxPool

    with SandboxPool(1, SandboxConfig(timeout_s=5.0, preload=("math",))) as p:
        yield p


def test_refine_scores_the_fraction_of_hidden_tests_and_ends_when_all_pass(pool):
    env = make_env("refine", pool=pool, num_tests=6, max_turns=3)
    seed = next(s for s in range(100) if refine.TASKS[0] is _task_of(s))
    prompt = env.reset(seed)
    assert "def digit_sum(n: int) -> int" in prompt and "```python" in prompt
    wrong = "```python\ndef digit_sum(n):\n    return n % 10\n```"  # right for one-digit n only
    res = asyncio.run(env.step("No code here."))
    assert res.reward == 0.0 and not res.done and "No ```python block" in res.observation
    res = asyncio.run(env.step(wrong))
    expected = sum(len(str(args[0])) == 1 for args in env.inputs) / 6
    assert res.reward == pytest.approx(expected) and not res.done
    assert "First failure: digit_sum(" in res.observation and "expected" in res.observation
    right = "Here:\n```python\ndef digit_sum(n):\n    return sum(map(int, str(n)))\n```"
    res = asyncio.run(env.step(right))
    assert res.reward == pytest.approx(2.0) and res.done and res.info["success"]
    assert res.observation.startswith("6 of 6 tests passed")


def test_refine_reports_code_that_does_not_run_and_stops_after_max_turns(pool):
    env = Refine(pool, num_tests=3, max_turns=2)
    env.reset(1)
    res = asyncio.run(env.step("```python\ndef broken(:\n```"))
    assert res.reward == 0.0 and "did not run: SyntaxError" in res.observation and not res.done
    res = asyncio.run(env.step(f"```python\ndef {env.task.name}(*a):\n    raise KeyError(1)\n```"))
    assert res.reward == 0.0 and res.done and "raised KeyError" in res.observation


def test_refine_never_sends_expected_values_to_the_sandbox():
    """What runs in the sandbox depends on the code and the inputs only: with another reference
    (other expected values) the harness is byte-identical."""
    env = Refine(pool=None, num_tests=8)
    for seed in range(12):
        env.reset(seed)
        harness = env._harness("pass", "mark")
        env.task = dataclasses.replace(env.task, reference=lambda *a: "other")
        assert env._harness("pass", "mark") == harness


HACKS = {
    "import os\ndef f(n):\n    os._exit(0)": "it imports os",
    "from sys import exit\ndef f(n):\n    exit()": "it imports sys",
    "def f(n):\n    quit()": "it uses quit",
    "def f(n):\n    return open(__file__).read()": "it uses open",
    "def f(n):\n    return ().__class__": "it reaches the attribute __class__",
    "def f(n):\n    return globals()['_outs']": "it uses globals",
    "def f(n):\n    return __import__('subprocess')": "it uses __import__",
    "from . import x": "it imports from a relative module",
}


@pytest.mark.parametrize("code", sorted(HACKS))
def test_hacking_checks_name_what_they_refuse(code):
    assert refine.hacking(code) == HACKS[code]


def test_hacking_checks_pass_plain_solutions():
    plain = (
        "import math\nfrom collections import Counter\nimport itertools as it\n"
        "def f(xs):\n    c = Counter(xs)\n    return math.prod(c.values()) + len(list(it.chain(xs)))"
    )
    assert refine.hacking(plain) is None
    assert refine.hacking("def broken(:") is None  # the sandbox reports what does not parse


def test_refine_refuses_hacking_before_running_it_and_counts_it(pool):
    env = Refine(pool, num_tests=3, max_turns=3)
    env.reset(1)
    name = env.task.name
    forged = f"```python\nimport sys\ndef {name}(*a):\n    sys.exit(0)\n```"
    res = asyncio.run(env.step(forged))
    assert res.reward == 0.0 and res.info["hacking"] == 1.0 and not res.done
    assert res.observation.startswith("Your code was not run: it imports sys, which the tests")
    penalised = Refine(pool, num_tests=3, max_turns=3, hacking_penalty=-1.0)
    penalised.reset(1)
    assert asyncio.run(penalised.step(forged)).reward == -1.0
    # Printing a marker of its own gets nothing: the harness's is drawn per run.
    fake = (
        f"```python\ndef {name}(*a):\n    return None\n"
        'print(\'__refine_outputs__\' + \'[["ok", 1], ["ok", 1], ["ok", 1]]\')\n```'
    )
    res = asyncio.run(env.step(fake))
    assert res.info["hacking"] == 0.0 and res.reward < 1.0
    # With the check off, the same code runs.
    unchecked = Refine(pool, num_tests=3, max_turns=3, hacking_penalty=None)
    unchecked.reset(1)
    assert asyncio.run(unchecked.step(forged)).info["hacking"] == 0.0


def test_refine_summaries_keep_code_summary_and_result_not_the_reasoning(pool):
    env = make_env("refine", pool=pool, num_tests=4, max_turns=3, summaries=True)
    seed = next(s for s in range(100) if refine.TASKS[0] is _task_of(s))
    statement = env.reset(seed)
    assert statement.endswith("summary of your reasoning in <summary>...</summary>.")
    wrong = (
        "A long line of reasoning that should not be kept. "
        "```python\ndef digit_sum(n):\n    return n % 10\n```"
        "<summary>took the last digit</summary>"
    )
    first = asyncio.run(env.step(wrong)).observation
    assert first.startswith(statement + "\n\nAttempt 1:\n```python\ndef digit_sum(n):")
    assert "Summary: took the last digit\nResult: " in first and "long line" not in first
    second = asyncio.run(env.step("no code, no summary")).observation
    assert second.startswith(first + "\n\nAttempt 2:\n(no code)\nResult: No ```python block")


def _task_of(seed):
    import numpy as np

    return refine.TASKS[int(np.random.default_rng(seed).integers(len(refine.TASKS)))]


def test_the_ragen_frozenlake_recipe_plays_slippery_lakes():
    """RAGEN's FrozenLake is slippery: from the same start, the same move lands in different
    places across seeds' slips."""
    recipe = Path(__file__).resolve().parent.parent / "configs" / "frozenlake_grpo.yaml"
    env_cfg = yaml.safe_load(recipe.read_text())["env"]
    landed = set()
    for seed in range(20):
        env = make_env(env_cfg["name"], **env_cfg["kwargs"])
        env.reset(seed)
        env.step("Right")
        landed.add(env.position)
    assert len(landed) > 1
