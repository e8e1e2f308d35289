"""One-step asynchronous rollouts (`trainer.async_rollouts`) with truncated importance sampling.

The tiny RL run of tests/test_resume.py, three steps: step 1's batch is sampled with the current
weights (staleness 0), so its importance weights pi_old / pi_behaviour (the trainer's forward
against the engine's log-probs of the same tokens) are 1 to float tolerance; steps 2 and 3 were
sampled during the previous update with the weights before it (staleness 1), so theirs are not.
"""

import json
import time

import pytest
from fakes import tiny_run_config

from jaxrl_tools import run
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import config_from_dict


def text_reward(response: str, ground_truth=None, info=None) -> float:
    """Varies with the sampled text, so GRPO's advantages are not all zero."""
    time.sleep(0.01)
    return (len(set(response)) % 3) / 2.0


def _config(tmp, name, tis_cap=2.0):
    return config_from_dict(
        tiny_run_config(
            tmp,
            name,
            "test_async_rollouts:text_reward",
            rollout={"protocol": "none", "max_response_len": 16},
            algorithm={"tis_cap": tis_cap},
            trainer={"steps": 3, "checkpoint_every": 0, "async_rollouts": True},
        )
    )


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    run.train(_config(tmp, "async"))
    lines = (tmp / "async" / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_the_first_batch_is_on_policy_and_its_weights_are_one(records):
    first = records[0]
    assert first["async/staleness"] == 0
    assert first["actor/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["actor/is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert first["actor/is_truncated_frac"] == 0


def test_later_batches_are_one_update_stale_and_reweighted(records):
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records[1:]:
        assert r["async/staleness"] == 1
        # The update moved the policy: its log-probs of the sampled tokens differ.
        assert abs(r["actor/is_weight_max"] - 1.0) > 1e-3
        assert r["time/step_s"] > 0 and r["async/rollout_wait_s"] >= 0


def test_async_rollouts_need_the_importance_weight_cap(tmp_path):
    with pytest.raises(ConfigError, match="set algorithm.tis_cap"):
        run.train(_config(tmp_path, "nocap", tis_cap=None))
