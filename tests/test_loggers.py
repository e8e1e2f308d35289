"""Experiment trackers (`trainer.loggers`): Weights & Biases in offline mode and MLflow with a
local file store, read back from what they wrote: step metrics, the run config, sample tables;
config errors; and a tiny RL run logging to jsonl, wandb and mlflow.

No network: wandb runs offline (its run folder is read with wandb's own protobuf records) and
MLflow's store is a folder under the test's tmp_path.
"""

import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest
from fakes import tiny_run_config

from jaxrl_tools import check, run
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import config_from_dict, load_config
from jaxrl_tools.train import trackers
from jaxrl_tools.train.metrics import MetricsLogger, step_split

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

# Metrics as the trainer logs them: "/" groups, a pass@k ("@" is not a valid MLflow name), NaN.
STEPS = {
    1: {"reward/mean": 0.25, "reward/pass@4": 0.5, "actor/kl": float("nan"), "actor/loss": 1.5},
    2: {"reward/mean": 0.75, "reward/pass@4": 1.0, "actor/kl": 0.01, "actor/loss": 0.5},
}
ROWS = [
    {"prompt": "What is 6 * 7?", "response": "<answer>42</answer>", "reward": 1.0},
    {"prompt": "What is 6 * 7?", "response": "<answer>41</answer>", "reward": 0.0},
]


def text_reward(response: str, ground_truth=None, info=None) -> float:
    """Varies with the sampled text, so GRPO's advantages are not all zero."""
    return (len(set(response)) % 3) / 2.0


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb offline with its config, cache and data under tmp_path; MLflow's default store."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var, sub in (("DIR", "wandb"), ("CONFIG_DIR", "config"), ("CACHE_DIR", "cache")):
        monkeypatch.setenv(f"WANDB_{var}", str(tmp_path / "wandb_home" / sub))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_home" / "data"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return tmp_path


def _config(log_dir: Path, *overrides: str):
    return load_config(
        None,
        [
            f"tokenizer.path={log_dir.parent / 'tok'}",
            f"trainer.log_dir={log_dir}",
            "trainer.run_name=tiny-run",
            "trainer.loggers=[tensorboard,jsonl,wandb,mlflow]",
            *overrides,
        ],
    )


# ------------------------------------------------------------------------- reading back


def wandb_records(log_dir: Path, run_id: str) -> list:
    """The records of wandb run `run_id`'s transaction log (`run-<id>.wandb`), as wandb's own
    protobuf `Record`s. The file is LevelDB's log format (32 KiB blocks of chunks with a 7-byte
    header: CRC, length, type) after wandb's 7-byte header; the package has no reader since it
    moved to wandb-core."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = (log_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb transaction log"
    block, pos, chunks, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(chunks)
            out.append(record)
            chunks = b""
        elif kind == 0:  # zero padding to the end of the block
            pos += -pos % block
    return out


def wandb_history(records) -> dict[int, dict]:
    """step -> {key: value} of the history records (a table: {"samples": {"path": ...}})."""
    out = {}
    for r in records:
        if r.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        for item in r.history.item:
            *parents, last = [item.key] if item.key else list(item.nested_key)
            node = row
            for name in parents:
                node = node.setdefault(name, {})
            node[last] = json.loads(item.value_json)
        out[row["_step"]] = row
    return out


def wandb_run(records):
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    return run_record


def mlflow_client(log_dir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(log_dir / "mlruns").resolve().as_uri())


def _nan_equal(a, b) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)


def _log_two_steps(cfg, log_dir, **kw) -> MetricsLogger:
    logger = MetricsLogger(
        log_dir, progress=False, trackers=trackers.open_trackers(cfg, **kw), desc="t"
    )
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.log_samples(2, ROWS)
    logger.close()
    return logger


# ------------------------------------------------------------------------------- trackers


def test_wandb_and_mlflow_hold_the_step_metrics_config_and_samples(offline):
    log_dir = offline / "logs"
    cfg = _config(log_dir, "trainer.wandb.tags=[smoke]", "optim.lr=3e-6")
    _log_two_steps(cfg, log_dir)
    ids = json.loads((log_dir / "trackers.json").read_text())

    # wandb: the run (name, tags, config) and one history row per step.
    records = wandb_records(log_dir, ids["wandb"])
    wb = wandb_run(records)
    assert (wb.display_name, wb.project, list(wb.tags)) == ("tiny-run", "jaxrl-tools", ["smoke"])
    config = {u.key: json.loads(u.value_json) for u in wb.config.update}
    assert config["optim"]["lr"] == pytest.approx(3e-6)
    assert config["trainer"]["loggers"] == ["tensorboard", "jsonl", "wandb", "mlflow"]
    history = wandb_history(records)
    assert sorted(history) == [1, 2]
    for step, metrics in STEPS.items():
        for key, value in metrics.items():
            assert _nan_equal(float(history[step][key]), value), (step, key)
    # The samples table: logged at step 2, its rows in the run's media folder.
    assert history[2]["samples"]["_type"] == "table-file" and history[2]["samples"]["nrows"] == 2
    (run_dir,) = (log_dir / "wandb").glob(f"offline-run-*-{ids['wandb']}")
    table = json.loads((run_dir / "files" / history[2]["samples"]["path"]).read_text())
    assert table["columns"] == ["step", "prompt", "response", "reward"]
    assert table["data"] == [[2, r["prompt"], r["response"], r["reward"]] for r in ROWS]

    # MLflow: experiment and run named from the run, params = the flattened config.
    client = mlflow_client(log_dir)
    mr = client.get_run(ids["mlflow"])
    assert mr.info.run_name == "tiny-run" and mr.info.status == "FINISHED"
    assert client.get_experiment(mr.info.experiment_id).name == "tiny-run"
    params = mr.data.params
    assert float(params["optim.lr"]) == pytest.approx(3e-6)
    assert params["trainer.run_name"] == "tiny-run"
    assert params["reward.0.name"] == "math"
    assert json.loads(params["trainer.loggers"]) == ["tensorboard", "jsonl", "wandb", "mlflow"]
    for key in ("reward/mean", "reward/pass@4", "actor/kl", "actor/loss"):
        hist = client.get_metric_history(ids["mlflow"], trackers.mlflow_key(key))
        assert [m.step for m in hist] == [1, 2], key
        for m in hist:
            assert _nan_equal(m.value, STEPS[m.step][key]), (m.step, key)
    assert trackers.mlflow_key("reward/pass@4") == "reward/pass_4"
    local = Path(client.download_artifacts(ids["mlflow"], "samples/step_0000002.json"))
    table = json.loads(local.read_text())
    assert table["columns"] == ["step", "prompt", "response", "reward"]
    assert table["data"] == [[2, r["prompt"], r["response"], r["reward"]] for r in ROWS]

    # jsonl: metrics.jsonl as before (NaN as NaN), and samples.jsonl.
    lines = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and math.isnan(lines[0]["actor/kl"])
    samples = [json.loads(x) for x in (log_dir / "samples.jsonl").read_text().splitlines()]
    assert samples == [{"step": 2, **r} for r in ROWS]
    assert any((log_dir / "tensorboard").iterdir())


def test_explicit_wandb_mode_and_mlflow_uri_and_experiment(tmp_path, offline, monkeypatch):
    """trainer.wandb.mode wins over WANDB_MODE; trainer.mlflow.tracking_uri over the default."""
    monkeypatch.setenv("WANDB_MODE", "online")  # would need a login: the config's mode wins
    log_dir, store = tmp_path / "logs", tmp_path / "elsewhere"
    cfg = _config(
        log_dir,
        "trainer.loggers=[jsonl,wandb,mlflow]",
        "trainer.wandb.mode=offline",
        f"trainer.mlflow.tracking_uri={store.as_uri()}",
        "trainer.mlflow.experiment=grpo-sweep",
    )
    _log_two_steps(cfg, log_dir)
    ids = json.loads((log_dir / "trackers.json").read_text())
    assert sorted(wandb_history(wandb_records(log_dir, ids["wandb"]))) == [1, 2]
    assert not (log_dir / "mlruns").exists()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.as_uri())
    run_info = client.get_run(ids["mlflow"]).info
    assert client.get_experiment(run_info.experiment_id).name == "grpo-sweep"
    hist = client.get_metric_history(ids["mlflow"], "reward/mean")
    assert [(m.step, m.value) for m in hist] == [(1, 0.25), (2, 0.75)]


def test_a_resumed_run_continues_its_tracker_runs(offline):
    log_dir = offline / "logs"
    cfg = _config(log_dir, "trainer.loggers=[jsonl,wandb,mlflow]")
    _log_two_steps(cfg, log_dir)
    first = json.loads((log_dir / "trackers.json").read_text())
    # Resumed from step 1: metrics.jsonl and samples.jsonl keep step 1 only, the runs go on.
    logger = MetricsLogger(
        log_dir,
        tensorboard=False,
        progress=False,
        start_step=1,
        trackers=trackers.open_trackers(cfg, resume=True),
    )
    logger.log(2, {"reward/mean": 0.5})
    logger.close()
    again = json.loads((log_dir / "trackers.json").read_text())
    assert again == first
    hist = mlflow_client(log_dir).get_metric_history(first["mlflow"], "reward/mean")
    assert [(m.step, m.value) for m in hist] == [(1, 0.25), (2, 0.75), (2, 0.5)]
    assert [json.loads(x)["step"] for x in (log_dir / "metrics.jsonl").open()] == [1, 2]
    assert (log_dir / "samples.jsonl").read_text() == ""  # its rows were of step 2
    # A new run (not resumed) starts new tracker runs.
    trackers.close_trackers(trackers.open_trackers(cfg))
    new = json.loads((log_dir / "trackers.json").read_text())
    assert new["wandb"] != first["wandb"] and new["mlflow"] != first["mlflow"]


def test_mlflow_samples_without_pandas_are_the_same_json(offline, monkeypatch):
    log_dir = offline / "logs"
    cfg = _config(log_dir, "trainer.loggers=[jsonl,mlflow]")
    real = trackers.installed
    monkeypatch.setattr(trackers, "installed", lambda m: m != "pandas" and real(m))
    (tracker,) = trackers.open_trackers(cfg)
    tracker.log_samples(3, [{"step": 3, **r} for r in ROWS])
    tracker.close()
    local = mlflow_client(log_dir).download_artifacts(tracker.run_id, "samples/step_0000003.json")
    table = json.loads(Path(local).read_text())
    assert table == {
        "columns": ["step", "prompt", "response", "reward"],
        "data": [[3, r["prompt"], r["response"], r["reward"]] for r in ROWS],
    }


class _Broken:
    name, run_id = "broken", "x"

    def __init__(self):
        self.closed = None

    def log(self, step, metrics, time_s):
        raise ConnectionError("tracking server unreachable")

    def log_samples(self, step, rows):
        raise ConnectionError("tracking server unreachable")

    def close(self, failed=False):
        self.closed = failed


def test_a_tracker_outage_is_a_warning_and_metrics_jsonl_keeps_the_step(tmp_path, caplog):
    broken = _Broken()
    logger = MetricsLogger(tmp_path, tensorboard=False, progress=False, trackers=[broken])
    logger.log(1, STEPS[1])
    logger.log_samples(1, ROWS)
    logger.close(failed=True)
    assert broken.closed is True
    assert "broken: step 1 not logged: tracking server unreachable" in caplog.text
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward/mean"] == 0.25
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 2


# -------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "trainer.loggers=[jsonl,wandbb]",
            "trainer.loggers='wandbb' is not one of ['tensorboard', 'jsonl', 'wandb', 'mlflow'] "
            "(did you mean 'wandb'?)",
        ),
        ("trainer.loggers=[tensorboard,wandb]", "trainer.loggers must include jsonl"),
        ("trainer.loggers=mlflow", "trainer.loggers must include jsonl"),
        ("trainer.wandb.mode=cloud", "trainer.wandb.mode='cloud' is not one of"),
        ("trainer.wandb.projekt=x", "unknown key 'trainer.wandb.projekt' (did you mean"),
        ("trainer.log_samples_every=-1", "trainer.log_samples_every must be >= 0"),
    ],
)
def test_bad_logger_settings_are_config_errors(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"tokenizer.path={tmp_path}", override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_missing_tracker_package_fails_the_preflight_check(tmp_path, monkeypatch):
    """Before any model is built: `check.preflight` (which `run.train` calls first)."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = config_from_dict(
        tiny_run_config(
            tmp_path,
            "r",
            "math",
            rollout={"protocol": "none", "max_response_len": 16},
            trainer={"loggers": ["jsonl", "wandb", "mlflow"]},
        )
    )
    with pytest.raises(ConfigError) as err:
        check.preflight(cfg)
    assert str(err.value) == (
        "trainer.loggers: wandb is not installed: pip install 'jaxrl-tools[trackers]' "
        "(or leave it out of trainer.loggers)"
    )
    assert not (tmp_path / "r" / "logs").exists()  # nothing started
    # The config itself loads without importing either tracker.
    assert cfg.trainer.loggers == ("jsonl", "wandb", "mlflow")


def test_a_tracker_that_cannot_start_is_a_one_line_config_error(offline):
    log_dir = offline / "logs"
    cfg = _config(
        log_dir, "trainer.loggers=[jsonl,mlflow]", "trainer.mlflow.tracking_uri=nosuch://x"
    )
    with pytest.raises(ConfigError) as err:
        trackers.open_trackers(cfg)
    assert str(err.value).startswith("trainer.loggers: mlflow could not start a run at nosuch://x")
    assert "check trainer.mlflow.tracking_uri" in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------ a tiny real run


def test_a_tiny_run_logs_its_steps_to_jsonl_wandb_and_mlflow(offline):
    cfg = config_from_dict(
        tiny_run_config(
            offline,
            "tracked",
            "test_loggers:text_reward",
            rollout={"protocol": "none", "max_response_len": 16},
            trainer={
                "steps": 2,
                "checkpoint_every": 0,
                "loggers": ["jsonl", "wandb", "mlflow"],
                "log_samples_every": 2,
            },
        )
    )
    t0 = time.perf_counter()
    run.train(cfg)
    elapsed = time.perf_counter() - t0
    log_dir = Path(cfg.trainer.log_dir)
    jsonl = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == [1, 2]
    assert not (log_dir / "tensorboard").exists()  # not in trainer.loggers
    ids = json.loads((log_dir / "trackers.json").read_text())
    history = wandb_history(wandb_records(log_dir, ids["wandb"]))
    client = mlflow_client(log_dir)
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"
    for key in ("reward/mean", "actor/loss", "actor/grad_norm", "response/length_mean"):
        expected = [r[key] for r in jsonl]
        assert [float(history[s][key]) for s in (1, 2)] == pytest.approx(expected), key
        hist = client.get_metric_history(ids["mlflow"], key)
        assert [(m.step, m.value) for m in hist] == list(zip([1, 2], expected)), key
    # Samples of step 2 only: the 2 prompts x 4 samples, the rewards as text_reward scores them.
    samples = [json.loads(x) for x in (log_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and {s["step"] for s in samples} == {2}
    for s in samples:
        assert s["prompt"] and s["reward"] == text_reward(s["response"])
    assert history[2]["samples"]["nrows"] == 8 and "samples" not in history[1]
    assert [a.path for a in client.list_artifacts(ids["mlflow"], "samples")] == [
        "samples/step_0000002.json"
    ]
    assert jsonl[-1]["reward/mean"] == pytest.approx(sum(s["reward"] for s in samples) / 8)
    print(f"tiny tracked run: {elapsed:.1f}s")


def test_step_split_is_the_mean_logged_step_with_scoring_out_of_generation():
    history = [
        {"step": 1, "time/step_s": 10.0, "time/rollout_s": 6.0, "time/score_s": 1.0,
         "time/update_s": 4.0},
        {"step": 2, "time/step_s": 20.0, "time/rollout_s": 8.0, "time/score_s": 3.0,
         "time/update_s": 12.0},
        {"step": 2, "eval/reward/mean": 0.5},  # an evaluation's record: not a step
    ]  # fmt: skip
    assert step_split(history) == {"generate": 5.0, "score": 2.0, "update": 8.0, "step": 15.0}
    assert step_split([]) == {}
