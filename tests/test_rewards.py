"""Tests for jaxrl_tools.rewards against hand-computed cases."""

import math

import numpy as np
import pytest

from jaxrl_tools import rewards as R
from jaxrl_tools.rewards import CompositeReward, TrajectoryInfo
from jaxrl_tools.train.scoring import score_trajectories
from jaxrl_tools.types import Span, Trajectory


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\left\{1,2\right\}}", r"\left\{1,2\right\}"),
        (r"\boxed{\{a\}}", r"\{a\}"),
        (r"\boxed{{x}^{2}}", "{x}^{2}"),
        (r"\fbox{7}", "7"),
        (r"\boxed 9 is it", "9"),
        (r"\boxed{3} and an unclosed \boxed{4", "3"),
        ("no answer", None),
    ],
)
def test_last_boxed(text, expected):
    assert R.last_boxed(text) == expected


@pytest.mark.parametrize(
    "resp,gt,ok",
    [
        (r"\boxed{1914937}", "1914937", True),
        (r"\boxed{1,914,937}", 1914937, True),
        (r"\boxed{\frac{1}{2}}", "0.5", True),
        (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", True),
        (r"\boxed{(x+1)^2}", "x^2+2x+1", True),
        (r"\boxed{41}", "42", False),
        (r"the answer is 42", "42", False),  # no \boxed{}: wrong
        (r"\boxed{42} ... no wait \boxed{43}", "42", False),  # the LAST box counts
    ],
)
def test_math_reward(resp, gt, ok):
    assert R.math_reward(resp, gt) == (1.0 if ok else -1.0)
    assert R.math_reward(resp, gt, correct=1.0, wrong=0.0) == float(ok)


def test_qa_em_normalisation():
    assert R.normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert (
        R.qa_em_reward("<answer>wrong</answer> <answer>The Eiffel-Tower.</answer>", "eiffeltower")
        == 1.0
    )
    assert R.qa_em_reward("<answer>An apple</answer>", ["pear", "apple"]) == 1.0
    assert R.qa_em_reward("<answer>apple pie</answer>", {"target": ["apple"]}) == 0.0
    assert R.qa_em_reward("apple", "apple") == 0.0  # no <answer>


def test_qa_f1_by_hand():
    f1 = R.get_reward("qa_f1")
    # "paris france" vs "paris": precision 1/2, recall 1/1 -> F1 2/3; the best target counts.
    assert f1("<answer>Paris, France</answer>", ["Paris"]) == pytest.approx(2 / 3)
    assert f1("<answer>the river Seine</answer>", {"target": ["Loire", "Seine river"]}) == 1.0
    # "new york city" vs "york new": common {new, york} = 2, P 2/3, R 1 -> 0.8; words are a
    # multiset: "new new" vs "new" has one word in common, P 1/2.
    assert f1("<answer>New York City</answer>", "York New") == pytest.approx(0.8)
    assert f1("<answer>new new</answer>", "new") == pytest.approx(2 / 3)
    assert f1("<answer>Lima</answer>", "Oslo") == 0.0
    assert f1("Lima, no tags", "Lima") == -1.0  # DeepResearcher's format penalty
    assert f1("Lima", "Lima", format_penalty=0.0) == 0.0


def test_format_order():
    good = "<think>a</think> <tool_call>{}</tool_call> <answer>b</answer>"
    tags = ("think", "tool_call", "answer")
    assert R.format_reward(good, tags=tags) == 1.0
    assert (
        R.format_reward("<answer>b</answer><think>a</think><tool_call>x</tool_call>", tags=tags)
        == 0.0
    )
    assert (
        R.format_reward("<think>a <answer>b</answer>", tags=("think", "answer")) == 0.0
    )  # unclosed
    assert R.format_reward("<think>a</think><answer>b</answer>") == 1.0


def test_exec_penalty_and_tool_success():
    ok, bad = {"ok": True}, {"ok": False}
    assert R.exec_penalty_reward("", None, TrajectoryInfo(tool_calls=[ok, ok])) == 0.0
    assert R.exec_penalty_reward("", None, TrajectoryInfo(tool_calls=[ok, bad])) == -0.5
    assert R.tool_success_reward("", None, TrajectoryInfo(tool_calls=[ok, bad, ok, ok])) == 0.75
    assert R.tool_success_reward("", None, TrajectoryInfo()) == 0.0

    class Obs:  # attribute-style records work too
        def __init__(self, ok):
            self.ok = ok

    assert (
        R.tool_success_reward("", None, TrajectoryInfo(tool_calls=[Obs(True), Obs(False)])) == 0.5
    )


GT_CALL = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}]


def _resp(*calls, think=True):
    import json

    body = "\n".join(json.dumps(c) for c in calls)
    return ("<think>ok</think>\n" if think else "") + f"<tool_call>\n{body}\n</tool_call>"


def test_toolrl_correctness_hand_computed():
    # S_max = 1 + (1 + 2) = 4.
    same = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
    assert R.toolrl_correctness([same], GT_CALL) == pytest.approx(3.0)
    # one value wrong: S = 1 (names) + 1 (keys) + 1 (values) = 3 -> 6*3/4 - 3 = 1.5
    wrong_val = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "F"}}
    assert R.toolrl_correctness([wrong_val], GT_CALL) == pytest.approx(1.5)
    # missing key: keys Jaccard 1/2, one exact value: S = 1 + 0.5 + 1 = 2.5 -> 0.75
    missing = {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert R.toolrl_correctness([missing], GT_CALL) == pytest.approx(0.75)
    # an extra call: names 1/2, match 3 -> S = 3.5 -> 2.25
    extra = {"name": "search", "arguments": {"q": "x"}}
    assert R.toolrl_correctness([same, extra], GT_CALL) == pytest.approx(2.25)
    # wrong tool: S = 0 -> -3
    assert R.toolrl_correctness([extra], GT_CALL) == pytest.approx(-3.0)
    assert R.toolrl_correctness([], []) == 0.0  # no ground-truth calls: 0, as ToolRL's code
    assert R.toolrl_correctness([], GT_CALL) == pytest.approx(-3.0)
    # frequency-based name Jaccard: a duplicated call halves the name score, the second copy is
    # unmatched: S = 0.5 + 3 -> 6 * 3.5 / 4 - 3 = 2.25
    assert R.toolrl_correctness([same, same], GT_CALL) == pytest.approx(2.25)


def test_toolrl_reward_total():
    same = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
    assert R.toolrl_reward(_resp(same), GT_CALL) == pytest.approx(4.0)  # format 1 + correct 3
    assert R.toolrl_reward(_resp(same, think=False), GT_CALL) == pytest.approx(3.0)
    bad = "<think>x</think>\n<tool_call>\n{bad json\n</tool_call>"
    assert R.toolrl_reward(bad, GT_CALL) == pytest.approx(-2.0)  # format ok, call unparsable
    # format is exact: two blocks or text after the block fail it
    assert R.toolrl_reward(_resp(same) + _resp(same, think=False), GT_CALL) < 3.0
    assert R.toolrl_reward(_resp(same) + "\nok", GT_CALL) == pytest.approx(3.0)
    # ToolRL's string ground truth, one JSON call per line, with a <response>
    gt_str = (
        '<think>.</think>\n<tool_call>\n{"name": "get_weather", "parameters": '
        '{"city": "Paris", "unit": "C"}}\n</tool_call>\n<response>Sunny</response>'
    )
    with_resp = _resp(same) + "\n<response>Sunny</response>"
    assert R.toolrl_reward(with_resp, gt_str) == pytest.approx(4.0)
    assert R.toolrl_reward(_resp(same), gt_str) == pytest.approx(3.0)
    # no calls expected: R_correct = 0, format = think + response
    no_call = "<think>a</think>\n<response>hi</response>"
    assert R.toolrl_reward(no_call, "<response>hi</response>") == 1.0


def test_tool_n1_binary():
    a = {"name": "f", "arguments": {"x": 1, "y": [1, 2]}}
    b = {"name": "g", "arguments": {}}
    gt = [{"name": "g", "arguments": {}}, {"name": "f", "arguments": {"y": [1, 2], "x": 1}}]
    assert R.tool_n1_reward(_resp(a, b), gt) == 1.0  # order and key order do not matter
    assert R.tool_n1_reward(_resp(a, b, think=False), gt) == 0.0
    assert R.tool_n1_reward(_resp(a), gt) == 0.0
    assert R.tool_n1_reward(_resp(a, a, b), gt) == 0.0  # multiset, not set


def test_otc_tool_reward_values():
    c = 1.0
    assert R.otc_ppo_tool_reward(0, c) == 1.0
    assert R.otc_ppo_tool_reward(1, c) == pytest.approx(0.5)  # cos(pi/3)
    assert R.otc_ppo_tool_reward(2, c) == pytest.approx(math.cos(2 * math.pi / 5))
    # GRPO: peak at m = n; symmetric-ish decay around it.
    assert R.otc_map(0, 0) == 0 and R.otc_map(3, 0) == 3 and R.otc_map(1, 2) == pytest.approx(4 / 3)
    assert R.otc_grpo_tool_reward(2, 2, c) == pytest.approx(1.0)
    assert R.otc_grpo_tool_reward(1, 2, c) == pytest.approx(math.sin(math.pi / 3))
    assert R.otc_grpo_tool_reward(4, 2, c) == pytest.approx(math.sin(2 * math.pi / 3))
    assert R.otc_grpo_tool_reward(0, 2, c) == pytest.approx(0.0)
    assert R.otc_grpo_tool_reward(0, 0, c) == 1.0
    assert R.otc_grpo_tool_reward(1, 0, c) == pytest.approx(0.5)


def test_otc_rewards_gate_on_correctness():
    right, wrong = r"\boxed{6}", r"\boxed{5}"
    assert R.otc_ppo_reward(right, "6", TrajectoryInfo(num_calls=1)) == pytest.approx(0.5)
    assert R.otc_ppo_reward(wrong, "6", TrajectoryInfo(num_calls=0)) == 0.0
    assert R.otc_ppo_reward(right, "6", TrajectoryInfo(num_calls=1), alpha=2.0) == pytest.approx(
        1.0
    )
    info = TrajectoryInfo(num_calls=1, group_num_calls=[1, 2, 0], group_correct=[True, True, False])
    assert R.otc_grpo_reward(right, "6", info) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="group"):
        R.otc_grpo_reward(right, "6", TrajectoryInfo(num_calls=1))


def test_otc_grpo_batch_fills_group_context():
    comp = CompositeReward([("otc_grpo", 1.0, {})])
    responses = [r"\boxed{6}", r"\boxed{6}", r"\boxed{7}", r"\boxed{9}", r"\boxed{9}"]
    gts = ["6", "6", "6", "9", "9"]
    calls = [1, 3, 0, 0, 2]
    infos = [TrajectoryInfo(num_calls=k) for k in calls]
    totals, parts = comp.batch(responses, gts, infos, group_ids=[0, 0, 0, 1, 1])
    # group 0: n = 1 -> m=1: 1; m=3: f = 6/4 -> sin(1.5*pi/2); wrong: 0.
    # group 1: n = 0 -> m=0: 1; m=2: cos(2pi/5).
    expected = [1.0, math.sin(0.75 * math.pi), 0.0, 1.0, math.cos(2 * math.pi / 5)]
    np.testing.assert_allclose(totals, expected, rtol=1e-6)
    np.testing.assert_allclose(parts["otc_grpo"], expected, rtol=1e-6)
    with pytest.raises(ValueError, match="group_ids"):
        comp.batch(responses, gts, infos)


def test_retool_turn_bonus():
    assert R.retool_reward(r"\boxed{6}", "6", TrajectoryInfo(num_turns=9)) == 1.0
    assert R.retool_reward(r"\boxed{5}", "6", TrajectoryInfo(num_turns=2)) == pytest.approx(-1.0)
    assert R.retool_reward(r"\boxed{5}", "6", TrajectoryInfo(num_turns=6)) == pytest.approx(-0.8)
    assert R.retool_reward(r"\boxed{5}", "6", TrajectoryInfo(num_turns=20)) == pytest.approx(-0.6)


def test_dapo_overlong():
    f = lambda n: R.dapo_overlong_reward(
        "", None, TrajectoryInfo(response_length=n), max_len=100, buffer=20
    )
    assert f(50) == 0.0 and f(80) == 0.0
    assert f(90) == pytest.approx(-0.5)
    assert f(100) == pytest.approx(-1.0)
    assert f(101) == -1.0
    # DAPO's own setting: L_max = 20480, L_c = 4096.
    g = lambda n: R.dapo_overlong_reward("", None, TrajectoryInfo(response_length=n))
    assert g(16384) == 0.0 and g(18432) == pytest.approx(-0.5)


def test_composite_weights_and_batch_parallel():
    comp = CompositeReward(
        [("math", 1.0, {}), ("format", 0.5, {"tags": ["think"]}), {"name": "exec_penalty"}],
        max_workers=2,
    )
    resp = [r"<think>x</think>\boxed{4}", r"\boxed{5}", r"<think>\boxed{4}</think>"]
    infos = [TrajectoryInfo(tool_calls=[{"ok": False}]), None, TrajectoryInfo()]
    totals, parts = comp.batch(resp, ["4", "4", "4"], infos)
    np.testing.assert_allclose(parts["math"], [1, -1, 1])
    np.testing.assert_allclose(parts["format"], [1, 0, 1])
    np.testing.assert_allclose(parts["exec_penalty"], [-0.5, 0, 0])
    np.testing.assert_allclose(totals, [1.0, -1.0, 1.5])
    assert comp(resp[0], "4", infos[0]) == pytest.approx(1.0)
    # symbolic answers through the thread pool (math-verify without signal timeouts)
    t2, _ = CompositeReward([("math", 1.0, {})], max_workers=2).batch(
        [r"\boxed{\frac{1}{2}}", r"\boxed{\sqrt{4}}"], ["0.5", "2"]
    )
    np.testing.assert_allclose(t2, [1, 1])


def test_registry():
    assert {
        "math",
        "qa_em",
        "format",
        "exec_penalty",
        "tool_success",
        "toolrl",
        "tool_n1",
        "otc_ppo",
        "otc_grpo",
        "retool",
        "dapo_overlong",
    } <= set(R.registered_rewards())

    @R.register_reward("test_const")
    def const(response, ground_truth, info=None, value=2.0):
        return value

    assert CompositeReward([("test_const", 3.0, {"value": 1.0})])("", None) == 3.0
    with pytest.raises(KeyError, match="unknown reward .no_such_reward.; valid: .*boxed"):
        R.get_reward("no_such_reward")
    with pytest.raises(ValueError, match="already registered"):
        R.register_reward("test_const")(lambda *a: 0.0)
    assert R.get_reward("jaxrl_tools.rewards:math_reward") is R.math_reward


def test_ground_truth_call_forms():
    call = {"name": "f", "arguments": {"x": 1}}
    resp = '<think>t</think>\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    for gt in (
        [call],
        {"tool_calls": [call]},
        '[{"name": "f", "parameters": {"x": 1}}]',
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
    ):
        assert R.tool_n1_reward(resp, gt) == 1.0, gt
        assert R.toolrl_reward(resp, gt) == pytest.approx(4.0), gt


def test_a_reward_that_raises_names_the_record_sample_and_response():
    """A reward that raises on one trajectory (here qa_em on a ground truth it cannot read)
    stops scoring with one error naming the reward, the record's file:line, the sample, the
    ground truth and the start of the response; the thread pool path of slow rewards too."""
    records = [
        {"ground_truth": ["Paris"], "source": "qa.jsonl:1"},
        {"ground_truth": 5, "source": "qa.jsonl:2"},
    ]
    trajs = [
        Trajectory(i // 2, i % 2, [1], [2], [1], [0.0], [Span("model", 0, 1)], model_text=text)
        for i, text in enumerate(["<answer>Paris</answer>", "x", "no", "<answer>5</answer>"])
    ]
    for terms in ([("qa_em", 1.0, {})], [("otc_ppo", 1.0, {"correctness": "qa_em"})]):
        reward = CompositeReward(terms, max_workers=2)
        with pytest.raises(R.RewardError) as e:
            score_trajectories(reward, records, trajs, 2)
        msg = str(e.value)
        assert msg.startswith(f"qa.jsonl:2, sample 1: reward {terms[0][0]!r} raised TypeError")
        assert "ground truth 5;" in msg and "response begins '<answer>5</answer>'" in msg
        assert "\n" not in msg
