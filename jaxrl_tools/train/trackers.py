"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow.

`open_trackers(cfg, resume=...)` starts the ones `trainer.loggers` names (on process 0 only) and
`MetricsLogger` hands them each logged step's metrics and the sample tables. wandb and mlflow
are imported only here, and only when a run asks for them (the `trackers` extra;
`check_installed` is the config-time check). A resumed run continues the same tracker runs:
their ids are kept in `log_dir/trackers.json`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.config_loader import config_to_yaml
from jaxrl_tools.sharding import is_main_process

log = logging.getLogger(__name__)

INSTALL = "pip install 'jaxrl-tools[trackers]'"
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # logger name -> the module it imports
SAMPLE_COLUMNS = ("step", "prompt", "response", "reward")
IDS_FILE = "trackers.json"

# MLflow's names (mlflow.utils.validation): alphanumerics, _ - . / and space (":" is refused on
# Windows), at most 250 characters. Its limit on a param's value is read from mlflow itself.
_MLFLOW_BAD_CHARS = re.compile(r"[^\w./\- ]")
_MLFLOW_MAX_KEY = 250


class Tracker(Protocol):
    name: str
    run_id: str

    def log(self, step: int, metrics: Mapping[str, float], time_s: float) -> None: ...

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules as None: its import is blocked
        return False


def check_installed(loggers: Sequence[str]) -> None:
    """Raises a one-line ConfigError if a tracker `loggers` names is not installed."""
    missing = [n for n in dict.fromkeys(loggers) if n in PACKAGES and not installed(PACKAGES[n])]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ConfigError(
            f"trainer.loggers: {' and '.join(missing)} {verb} not installed: {INSTALL} "
            f"(or leave {'it' if len(missing) == 1 else 'them'} out of trainer.loggers)"
        )


def config_dict(cfg: RunConfig) -> dict:
    """The run config as plain data, as its YAML file reads."""
    return yaml.safe_load(config_to_yaml(cfg))


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """Dotted keys -> string values: mappings (and lists of mappings, by index) are walked, other
    values written as JSON (strings as they are)."""
    out: dict[str, str] = {}
    if isinstance(tree, Mapping) and tree:
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
    elif isinstance(tree, list) and tree and all(isinstance(x, Mapping) for x in tree):
        for i, value in enumerate(tree):
            out.update(flatten(value, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = tree if isinstance(tree, str) else json.dumps(tree)
    return out


def mlflow_key(key: str) -> str:
    """`key` as MLflow accepts a metric or param name ("reward/pass@4" -> "reward/pass_4")."""
    return _MLFLOW_BAD_CHARS.sub("_", key)[:_MLFLOW_MAX_KEY]


class WandbTracker:
    """A Weights & Biases run named `trainer.run_name`, its files under `log_dir/wandb`."""

    name = "wandb"

    def __init__(self, cfg: RunConfig, config: dict, run_id: str | None = None):
        import wandb  # noqa: PLC0415  (the [trackers] extra)

        t, w = cfg.trainer, cfg.trainer.wandb
        kwargs: dict[str, Any] = dict(
            project=w.project,
            entity=w.entity,
            name=t.run_name,
            dir=t.log_dir,
            config=config,
            tags=list(w.tags) or None,
        )
        if w.mode is not None:  # else wandb decides: WANDB_MODE, or online
            kwargs["mode"] = w.mode
        if run_id is not None:  # a resumed run continues its wandb run
            kwargs.update(id=run_id, resume="allow")
        try:
            self.run = wandb.init(**kwargs)
        except wandb.errors.Error as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"trainer.loggers: wandb could not start a run ({first}); log in (`wandb "
                "login` or WANDB_API_KEY) or set trainer.wandb.mode=offline"
            ) from None
        self.run_id = self.run.id
        self._wandb = wandb

    def log(self, step: int, metrics: Mapping[str, float], time_s: float) -> None:
        self.run.log(dict(metrics), step=step)  # NaN and inf as they are, as in metrics.jsonl

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        table = self._wandb.Table(
            columns=list(SAMPLE_COLUMNS), data=[[r[c] for c in SAMPLE_COLUMNS] for r in rows]
        )
        self.run.log({"samples": table}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run named `trainer.run_name` in experiment `trainer.mlflow.experiment` (or the
    run name): the flattened config as params, the step metrics, sample tables as artifacts."""

    name = "mlflow"

    def __init__(self, cfg: RunConfig, config: dict, run_id: str | None = None):
        # The [trackers] extra.
        from mlflow.entities import Metric, Param  # noqa: PLC0415
        from mlflow.exceptions import MlflowException  # noqa: PLC0415
        from mlflow.tracking import MlflowClient  # noqa: PLC0415
        from mlflow.utils import validation  # noqa: PLC0415

        t, m = cfg.trainer, cfg.trainer.mlflow
        uri = m.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        if uri is None:
            uri = (Path(t.log_dir) / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # mlflow 3 keeps its file store behind this opt-in (mlflow-skinny has no SQL store).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri, self._metric = uri, Metric
        max_value = getattr(validation, "MAX_PARAM_VAL_LENGTH", 500)
        params = {mlflow_key(k): v[:max_value] for k, v in flatten(config).items()}
        try:
            self.client = client = MlflowClient(tracking_uri=uri)
            run, logged = self._start(m.experiment or t.run_name, t.run_name, run_id)
            self.run_id = run.info.run_id
            changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
            if changed:  # mlflow refuses to change a param
                log.warning("mlflow keeps the first values of the changed params %s", changed)
            new = [Param(k, v) for k, v in params.items() if k not in logged]
            client.log_batch(self.run_id, params=new)
        except MlflowException as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"trainer.loggers: mlflow could not start a run at {uri} ({first}); check "
                "trainer.mlflow.tracking_uri (null: a file store in trainer.log_dir/mlruns)"
            ) from None

    def _start(self, experiment: str, run_name: str, run_id: str | None):
        """(the run, its params already logged): run `run_id` continued if the store has it,
        else a new run in `experiment` (created, or restored if deleted)."""
        from mlflow.exceptions import MlflowException  # noqa: PLC0415  (the [trackers] extra)

        client = self.client
        if run_id is not None:  # a resumed run
            try:
                run = client.get_run(run_id)
                client.update_run(run_id, status="RUNNING")
                return run, run.data.params
            except MlflowException:
                log.warning(
                    "mlflow run %s not found at %s: starting a new one", run_id, self.tracking_uri
                )
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            exp_id = client.create_experiment(experiment)
        else:
            exp_id = exp.experiment_id
            if exp.lifecycle_stage == "deleted":
                client.restore_experiment(exp_id)
        return client.create_run(exp_id, run_name=run_name), {}

    def log(self, step: int, metrics: Mapping[str, float], time_s: float) -> None:
        ms = int(time_s * 1000)
        batch = [self._metric(mlflow_key(k), float(v), ms, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)  # NaN and inf are stored as such

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        path = f"samples/step_{step:07d}.json"
        if installed("pandas"):  # log_table needs it; it marks the file as a table for the UI
            data = {c: [r[c] for r in rows] for c in SAMPLE_COLUMNS}
            self.client.log_table(self.run_id, data, path)
        else:  # the same JSON as log_table writes (pandas' "split" layout)
            data = {
                "columns": list(SAMPLE_COLUMNS),
                "data": [[r[c] for c in SAMPLE_COLUMNS] for r in rows],
            }
            self.client.log_dict(self.run_id, data, path)

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


OPENERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def open_trackers(cfg: RunConfig, *, resume: bool = False) -> list[Tracker]:
    """Starts the trackers `cfg.trainer.loggers` names (none on processes other than 0).

    Args:
      cfg: the run config (its whole config is logged: wandb's config, mlflow's params).
      resume: continue the tracker runs whose ids `log_dir/trackers.json` holds (a resumed
        run); else start new ones.

    Raises:
      ConfigError: a tracker is not installed, or wandb cannot start a run (not logged in).
    """
    t = cfg.trainer
    names = [n for n in dict.fromkeys(t.loggers) if n in OPENERS]
    if not names or not is_main_process():
        return []
    check_installed(names)
    log_dir = Path(t.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    ids_path = log_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if resume and ids_path.is_file() else {}
    config = config_dict(cfg)
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(OPENERS[name](cfg, config, ids.get(name)))
    except BaseException:
        close_trackers(opened, failed=True)
        raise
    ids_path.write_text(json.dumps({tr.name: tr.run_id for tr in opened}))
    return opened


def close_trackers(trackers: Sequence[Tracker], *, failed: bool = False) -> None:
    """Ends every tracker's run; one that fails to end does not stop the others."""
    for tr in trackers:
        try:
            tr.close(failed=failed)
        except Exception as e:  # the run's own outcome matters more than a tracker's
            log.warning("%s: could not end run %s: %s", tr.name, tr.run_id, e)
