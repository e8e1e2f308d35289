"""Every reward call has a wall-clock bound that holds in any thread (jaxrl_tools.rewards.deadline):
math checks that would run for ever stop at their deadline and score as wrong answers, a
reward that never returns is given up, each is counted, and a slow but right answer is checked,
not compared as text."""

import threading
import time

import numpy as np

from jaxrl_tools.rewards import TIMEOUTS, CompositeReward, deadline, math_equal

# sympy evaluates each of these for minutes or for ever
ENDLESS = [r"\boxed{10^{10^{100}}}", r"\boxed{9^{9^{9}}}", r"\boxed{(10^{100})!}"]


def never_returns(response: str, ground_truth=None, info=None) -> float:
    """Hangs on a response that says "hang" (an imported reward: not ours to trust)."""
    if "hang" in response:
        threading.Event().wait()
    return 1.0


def _in_a_thread(fn):
    """fn() on a thread of its own (training scores off the main thread, where signal-based
    timeouts do not work): (its result, seconds), or (None, None) if it is still running."""
    out = {}
    t0 = time.monotonic()
    thread = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    thread.start()
    thread.join(timeout=120)
    return (out["r"], time.monotonic() - t0) if "r" in out else (None, None)


def test_math_checks_that_never_end_score_wrong_at_their_deadline_in_any_thread():
    reward = CompositeReward([{"name": "math", "timeout_s": 2.0}], max_workers=4)
    responses = [*ENDLESS, r"\boxed{\frac{1}{2}}"]
    (totals, parts), seconds = _in_a_thread(lambda: reward.batch(responses, ["5", "5", "5", "0.5"]))
    assert seconds is not None and seconds < 15  # three checks killed in parallel at 2 s
    np.testing.assert_array_equal(parts["math"], [-1, -1, -1, 1])  # the reward's wrong answer
    np.testing.assert_array_equal(parts[TIMEOUTS], [1, 1, 1, 0])
    np.testing.assert_array_equal(totals, [-1, -1, -1, 1])
    # the killed workers' places are taken: the next symbolic checks are answered
    assert math_equal(r"\sqrt{4}", "2") and not math_equal(r"\sqrt{5}", "2")


def test_a_timeout_is_noted_to_whoever_counts_and_a_later_check_has_its_own_time():
    with deadline.counting_timeouts() as noted, deadline.deadline(1.0):
        assert not math_equal("9^{9^{9}}", "5")
    assert len(noted) == 1 and "9^{9^{9}}" in noted[0]
    with deadline.counting_timeouts() as noted:
        assert math_equal(r"\frac{6}{4}", "1.5")  # the default deadline: 10 s
    assert noted == []


def test_an_answer_slow_to_parse_is_checked_not_compared_as_text():
    """A 1,000-term sum recurses past Python's default limit in the LaTeX parser, where
    math-verify would fall back to comparing text (and score a right answer wrong)."""
    long_sum = "+".join(["1"] * 1000)
    assert math_equal(long_sum, "1000")
    assert not math_equal(long_sum, "999")


def test_a_reward_that_never_returns_is_given_up_and_scores_its_timeout_score():
    reward = CompositeReward(
        [
            {"name": "test_reward_deadlines:never_returns", "timeout_s": 0.5, "timeout_score": -2},
            {"name": "format", "kwargs": {"tags": ["think"]}},
        ],
        max_workers=2,
    )
    texts = ["<think>a</think>", "hang", "<think>b</think>", "hang too"]
    (totals, parts), seconds = _in_a_thread(lambda: reward.batch(texts, [None] * 4))
    assert seconds is not None and seconds < 10  # given up at 0.5 + 1 s, two at a time
    np.testing.assert_array_equal(parts["test_reward_deadlines:never_returns"], [1, -2, 1, -2])
    np.testing.assert_array_equal(parts[TIMEOUTS], [0, 1, 0, 1])
    np.testing.assert_array_equal(totals, [2, -2, 2, -2])
