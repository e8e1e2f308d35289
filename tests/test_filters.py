"""Host-side batch filters vs loop transcriptions; layouts and errors."""

import numpy as np
import pytest

from jaxrl_tools.algorithms import accuracy_band_filter, dynamic_sampling_filter, starpo_s_filter
from jaxrl_tools.train.scoring import group_reward_metrics


def rand_rewards(seed, num_groups=12, G=4):
    rng = np.random.default_rng(seed)
    r = rng.choice([0.0, 1.0], (num_groups, G))
    r[0] = 1.0  # all right
    r[1] = 0.0  # all wrong
    return r


@pytest.mark.parametrize("seed", range(3))
def test_dynamic_sampling(seed):
    r = rand_rewards(seed)
    want = [g for g in range(len(r)) if any(x != r[g][0] for x in r[g])]
    np.testing.assert_array_equal(dynamic_sampling_filter(r.reshape(-1), 4), want)
    np.testing.assert_array_equal(dynamic_sampling_filter(r), want)
    assert 0 not in want and 1 not in want


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("frac", [0.25, 0.5, 1.0])
def test_starpo_s(seed, frac):
    rng = np.random.default_rng(seed)
    r = rng.normal(size=(12, 4))
    stds = [np.sqrt(sum((x - np.mean(g)) ** 2 for x in g) / 3) for g in r]
    k = max(1, int(frac * 12))
    want = sorted(sorted(range(12), key=lambda i: -stds[i])[:k])
    np.testing.assert_array_equal(starpo_s_filter(r.reshape(-1), 4, keep_fraction=frac), want)


def test_starpo_s_default_quarter():
    r = np.zeros((8, 4))
    r[5] = [0, 1, 0, 1]
    r[2] = [0, 0, 0, 1]
    np.testing.assert_array_equal(starpo_s_filter(r), [2, 5])


@pytest.mark.parametrize("seed", range(3))
def test_accuracy_band(seed):
    rng = np.random.default_rng(seed)
    r = rng.choice([-1.0, 1.0], (20, 5))
    want = [g for g in range(20) if 0.2 <= sum(x >= 0.5 for x in r[g]) / 5 <= 0.8]
    np.testing.assert_array_equal(accuracy_band_filter(r.reshape(-1), 5), want)
    # band edges are inclusive: 1/5 and 4/5 correct are kept, 0/5 and 5/5 are not
    edge = np.array([[1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [0] * 5, [1] * 5], float)
    np.testing.assert_array_equal(accuracy_band_filter(edge), [0, 1])


def test_errors():
    with pytest.raises(ValueError, match="not a multiple of group_size 4"):
        dynamic_sampling_filter(np.zeros(10), 4)
    with pytest.raises(ValueError, match="group_size"):
        starpo_s_filter(np.zeros(8))
    with pytest.raises(ValueError, match="keep_fraction"):
        starpo_s_filter(np.zeros((2, 2)), keep_fraction=0.0)
    with pytest.raises(ValueError, match="low <= high"):
        accuracy_band_filter(np.zeros((2, 2)), low=0.9, high=0.1)


@pytest.mark.parametrize("seed", range(2))
def test_within_group_reward_spread_metrics(seed):
    """RAGEN's echo-trap signal against a loop over the groups (sample std, as StarPO-S)."""
    r = rand_rewards(seed)
    r[2] = [0.5, 0.5, 0.25, 1.0]
    m = group_reward_metrics(r.reshape(-1), 4)
    stds, uniform = [], 0
    for group in r:
        mean = sum(group) / 4
        stds.append((sum((x - mean) ** 2 for x in group) / 3) ** 0.5)
        uniform += all(x == group[0] for x in group)
    assert m["reward/group_std"] == pytest.approx(sum(stds) / len(stds))
    assert m["reward/uniform_groups_frac"] == pytest.approx(uniform / len(r))
    assert m["reward/uniform_groups_frac"] >= 2 / 12  # groups 0 and 1
    assert group_reward_metrics(r.reshape(-1), 1) == {}  # one sample a prompt: no groups


def test_dapo_dynamic_sampling_filters_on_accuracy_not_the_shaped_reward():
    """DAPO: an all-correct group with one response in the overlong buffer has unequal
    rewards, yet no accuracy signal: dropped. A mixed group is kept."""
    from jaxrl_tools import configs
    from jaxrl_tools.config_loader import load_config
    from jaxrl_tools.train.scoring import filter_groups

    filters = load_config(configs.path("dapo"), []).algorithm.filters
    math = np.array([1, 1, 1, 1, 1, -1, 1, 1], np.float32)
    overlong = np.array([0, 0, 0, -0.5, 0, 0, 0, 0], np.float32)
    parts = {"math": math, "dapo_overlong": overlong}
    scores = math + overlong
    np.testing.assert_array_equal(filter_groups(scores, 4, filters, parts), [1])
    # without an answer-check term, the reward itself
    np.testing.assert_array_equal(filter_groups(scores, 4, filters), [0, 1])
