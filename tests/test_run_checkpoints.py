"""A run's checkpoints through `jaxrl-tools train` on the tiny run of tests/test_resume.py (two
steps, a checkpoint each): an unreadable newest checkpoint is skipped and the run goes on; a
diverged update (non-finite loss, gradient or update norm) stops the run before it is saved; a
resume with another model or algorithm is one line, exit 2.

The first run is shared; each test continues a copy of its folders.
"""

import dataclasses
import json
import logging
import math
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from fakes import fixed_trajectories
from test_resume import _config
from test_train_rl import Trainer, run_config

from jaxrl_tools import run
from jaxrl_tools.cli import main
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import config_from_dict
from jaxrl_tools.train.metrics import MetricsLogger


def _write(tmp, name: str, **trainer) -> str:
    cfg = _config(tmp, name)
    cfg["trainer"].update({"steps": 2, "checkpoint_every": 1, **trainer})
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkpoints")
    assert main(["train", "--config", _write(tmp, "first")]) == 0
    return tmp


def _copy(tmp, name: str) -> None:
    shutil.copytree(tmp / "first", tmp / name)


def _steps(folder) -> list[int]:
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def _records(log_dir) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _last_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_resume_skips_an_unreadable_newest_checkpoint_and_goes_on(first, caplog):
    _copy(first, "damaged")
    for f in (first / "damaged" / "ckpt" / "2").glob("state/ocdbt.process_*/d/*"):
        f.write_bytes(f.read_bytes()[:10])  # truncated
    cfg = config_from_dict(json.loads(Path(_write(first, "damaged", steps=3)).read_text()))
    with caplog.at_level(logging.WARNING):
        summary = run.train(cfg)
    assert summary["final_metrics"]
    skipped = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(skipped) == 1 and "step 2" in skipped[0], skipped
    # Step 2 redone once: no step twice in the log.
    assert [r["step"] for r in _records(first / "damaged" / "logs")] == [1, 2, 3]
    assert _steps(first / "damaged" / "ckpt") == [1, 2, 3]


def test_a_non_finite_update_stops_the_run_before_it_is_saved(first, capsys):
    _copy(first, "diverged")
    config = _write(first, "diverged", steps=3)
    # optim.lr=inf: the loss and gradient of step 3 are finite, its update is not.
    assert main(["train", "--config", config, "optim.lr=inf"]) == 2
    last = _last_line(capsys)
    assert last.startswith("jaxrl-tools: step 3: ") and "not finite" in last, last
    assert "actor/update_norm" in last and "optim.lr" in last, last
    assert _steps(first / "diverged" / "ckpt") == [1, 2]  # no checkpoint of the diverged step
    records = _records(first / "diverged" / "logs")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert not math.isfinite(records[-1]["actor/update_norm"])  # logged (inf), not left out
    # The last good checkpoint is intact: the run resumes from it.
    assert main(["train", "--config", config]) == 0
    assert _steps(first / "diverged" / "ckpt") == [1, 2, 3]


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model.tiny.intermediate_size=96", "down_proj.kernel has shape"),
        ("algorithm.kl_coef=0.1", "missing ['ref."),
    ],
)
def test_resuming_with_another_model_or_algorithm_is_one_line(first, capsys, override, named):
    config = _write(first, "first")
    assert main(["train", "--config", config, "trainer.steps=3", override]) == 2
    last = _last_line(capsys)
    assert (
        last.startswith(f"jaxrl-tools: checkpoint {first / 'first' / 'ckpt'}/2") and named in last
    )
    assert _steps(first / "first" / "ckpt") == [1, 2]


def test_skip_step_drops_a_non_finite_update_and_counts_it():
    cfg = run_config()
    cfg = dataclasses.replace(
        cfg,
        optim=dataclasses.replace(cfg.optim, lr=math.inf),
        trainer=dataclasses.replace(cfg.trainer, on_nonfinite="skip_step"),
    )
    trainer = Trainer(cfg, fixed_trajectories())
    before = [np.asarray(x).copy() for x in jax.tree.leaves(trainer.params)]
    metrics = trainer.step()
    assert metrics["actor/skipped_updates"] == 1 and trainer.diverged(metrics) is None
    assert int(trainer.state.step) == 0  # the old state, counters too
    for a, b in zip(before, jax.tree.leaves(trainer.params)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_on_nonfinite_is_validated():
    with pytest.raises(ConfigError, match="trainer.on_nonfinite='skip'"):
        config_from_dict({"tokenizer": {"path": "t"}, "trainer": {"on_nonfinite": "skip"}})


def test_metrics_log_keeps_non_finite_values(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    logger.log(1, {"actor/loss": float("nan"), "actor/grad_norm": float("inf"), "x": 1.0})
    logger.close()
    (record,) = _records(tmp_path)
    assert math.isnan(record["actor/loss"]) and record["actor/grad_norm"] == math.inf
