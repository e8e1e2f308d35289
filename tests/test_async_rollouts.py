"""Rollouts ahead of the update (`trainer.max_staleness`), with off-policy corrections.

The tiny RL run of tests/test_resume.py. Batch b is sampled with the weights after update
max(0, b - 1 - k) (the fixed schedule of `rollout.ahead`), so with k = 2 the batches of steps
1-4 are 0, 1, 2 and 2 versions old: every token's recorded version says so. Step 1's batch is
sampled with the current weights, so its importance weights pi_old / pi_behaviour (the trainer's
forward against the engine's log-probs of the same tokens) are 1 to float tolerance; later ones
are stale and reweighted. With partial rollouts (k = 1) a rollout takes newer weights between
decode chunks and no token is older than the bound.
"""

import json
import threading
import time

import jax
import numpy as np
import pytest
from fakes import tiny_run_config

from jaxrl_tools import run
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import config_from_dict
from jaxrl_tools.rollout import ahead


def text_reward(response: str, ground_truth=None, info=None) -> float:
    """Varies with the sampled text, so GRPO's advantages are not all zero."""
    time.sleep(0.01)
    return (len(set(response)) % 3) / 2.0


def _config(tmp, name, steps=4, tis_cap=2.0, **trainer):
    return config_from_dict(
        tiny_run_config(
            tmp,
            name,
            "test_async_rollouts:text_reward",
            # 8 samples on 4 slots: an evaluation's 4 greedy prompts take every slot a rollout
            # uses (the engine's per-slot sampling modes were once shared with it)
            rollout={"protocol": "none", "max_response_len": 16, "slots": 4},
            algorithm={"tis_cap": tis_cap},
            trainer={"steps": steps, "checkpoint_every": 0, **trainer},
        )
    )


def _records(tmp, name):
    lines = (tmp / name / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def ahead_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    summary = run.train(_config(tmp, "ahead", max_staleness=2))
    return _records(tmp, "ahead"), summary["params"]


@pytest.fixture(scope="module")
def records(ahead_run):
    return ahead_run[0]


def test_every_batch_is_as_stale_as_the_schedule_says(records):
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:  # every token of batch b has version max(0, b - 3)
        assert r["async/staleness_max"] == min(r["step"] - 1, 2)
        assert r["async/staleness_mean"] == r["async/staleness_max"]
        assert r["async/trainer_wait_s"] >= 0 and r["async/rollout_gate_s"] >= 0
        assert r["async/partial_swaps"] == 0


def test_the_first_batch_is_on_policy_and_its_weights_are_one(records):
    first = records[0]
    assert first["actor/off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["actor/off_policy/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert first["actor/off_policy/truncated_frac"] == 0


def test_later_batches_are_stale_and_reweighted(records):
    for r in records[1:]:
        # The updates moved the policy: its log-probs of the sampled tokens differ.
        assert abs(r["actor/off_policy/ratio_max"] - 1.0) > 1e-3


def test_evaluations_between_decode_passes_leave_the_training_alone(ahead_run, tmp_path):
    """Greedy evaluations every step, run in the update's turns while later batches decode (on
    a view of the engine: slot modes and a serving copy of its own), change nothing of the run:
    same batches, same updates."""
    summary = run.train(_config(tmp_path, "evals", max_staleness=2, eval_every=1))
    records, params = _records(tmp_path, "evals"), summary["params"]
    assert all("eval/reward/mean" in r for r in records[:-1])
    for a, b in zip(ahead_run[0], records):
        assert b["reward/mean"] == a["reward/mean"] and b["actor/loss"] == a["actor/loss"]
    for a, b in zip(jax.tree.leaves(ahead_run[1]), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_partial_rollouts_take_newer_weights_within_the_bound(tmp_path):
    run.train(_config(tmp_path, "partial", steps=3, max_staleness=1, partial_rollouts=True))
    records = _records(tmp_path, "partial")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 1
    # Update 1 is dispatched while batch 2 decodes; that rollout goes on with its weights.
    assert sum(r["async/partial_swaps"] for r in records) >= 1


def test_the_schedule_bounds_versions_and_orders_device_work():
    """The pipeline alone, with a fake rollout of 30 decode passes: the main thread's work runs
    only between passes (never during one), the weights a batch starts from are the
    schedule's, and partial rollouts move to newer weights mid-rollout."""
    k, last = 2, 6
    log, in_pass = [], threading.Event()

    def rollout(b, params):
        cur = ahead.CURRENT.get()
        versions = []
        assert params == cur.version_for(b)  # the weights of that version
        for _ in range(30):
            cur.at_pass()
            in_pass.set()
            versions.append(cur.version)
            time.sleep(0.002)
            in_pass.clear()
        return versions

    pipe = ahead.RolloutsAhead(rollout, 0, start=0, last=last, max_staleness=k, partial=True)
    try:
        for step in range(1, last + 1):
            versions, _ = pipe.take(step)
            log.append(versions)

            def update(step=step):
                assert not in_pass.is_set()
                if pipe.wanted(step):
                    pipe.publish(step, step)  # "weights" of version step: the number itself

            pipe.turn(update)
            time.sleep(0.01)
    finally:
        pipe.close()
    for b, versions in enumerate(log, start=1):
        assert versions == sorted(versions)
        assert min(versions) >= max(0, b - 1 - k)  # never older than the bound
        assert max(versions) <= b - 1  # nor newer than the update's own start
    assert any(len(set(v)) > 1 for v in log)  # some rollout switched weights midway


def test_a_failed_worker_is_logged_and_stops_the_main_threads_turns(monkeypatch, caplog):
    """As in a multi-process run (the hand-overs fence; nothing else of it is needed here): the
    worker's error is logged when it happens (the main thread, which raises it, may be waiting
    on its peers), and the main thread's next turn raises it instead of running alone (its
    device calls would match no other process's)."""
    monkeypatch.setattr(ahead, "is_multiprocess", lambda: True)

    def rollout(b, params):
        raise ValueError("reward server gone")

    ran = []
    pipe = ahead.RolloutsAhead(rollout, 0, start=0, last=2, max_staleness=1)
    try:
        with pytest.raises(ValueError, match="reward server gone"):
            pipe.take(1)
        with pytest.raises(ValueError, match="reward server gone"):
            pipe.turn(lambda: ran.append(1))
    finally:
        pipe.close()
    assert not ran
    [record] = [r for r in caplog.records if r.name == ahead.__name__]
    assert record.levelname == "ERROR" and "reward server gone" in str(record.exc_info[1])


def test_stale_rollouts_need_a_correction(tmp_path):
    with pytest.raises(ConfigError, match="algorithm.off_policy"):
        run.train(_config(tmp_path, "nocap", tis_cap=None, max_staleness=1))


def test_the_old_key_says_what_replaced_it(tmp_path):
    with pytest.raises(ConfigError, match="trainer.max_staleness: 1"):
        _config(tmp_path, "old", async_rollouts=True)


def test_staleness_is_bounded(tmp_path):
    """A huge k would sample the whole run with the first policy, its batches queued in memory."""
    with pytest.raises(ConfigError, match=r"trainer.max_staleness must be in \[0, 8\].*got 9"):
        _config(tmp_path, "far", max_staleness=9)
    pipe = ahead.RolloutsAhead(lambda b, p: b, 0, start=0, last=3, max_staleness=2)
    assert pipe._ready.maxsize == 4  # k + 1 batches ahead and the worker's error
    assert [pipe.take(b)[0] for b in (1, 2, 3)] == [1, 2, 3]
    pipe.close()
