"""Run metrics: a jsonl file, TensorBoard, experiment trackers (`train.trackers`), a console
progress bar, and a PNG plot at the end; rollout samples as rows; summaries written as JSON."""

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from tensorboardX import SummaryWriter
from tqdm.auto import tqdm

from jaxrl_tools.sharding import is_main_process
from jaxrl_tools.train.trackers import Tracker, close_trackers

log = logging.getLogger(__name__)

# The curves of the end-of-run plot, when present.
PLOT_KEYS = (
    "reward/mean",
    "reward/accuracy",
    "env/success_rate",
    "tools/calls_per_response",
    "tools/error_rate",
    "response/length_mean",
    "actor/entropy",
    "actor/kl",
    "actor/grad_norm",
)


def public(metrics: Mapping) -> dict:
    """The metrics without the private ones (keys starting with "_")."""
    return {k: v for k, v in metrics.items() if not k.startswith("_")}


def write_json(path: Path, obj) -> None:
    """Writes `obj` as JSON (process 0 only: in a multi-process job every process has it)."""
    if not is_main_process():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    default = lambda x: x.tolist() if isinstance(x, np.generic | np.ndarray) else str(x)
    path.write_text(json.dumps(obj, indent=2, default=default))


def _scalar(value) -> float | None:
    try:
        return float(np.asarray(value))  # NaN and inf too: a diverged update shows in the log
    except (TypeError, ValueError):
        return None


def _keep_until(path: Path, start_step: int) -> list[dict]:
    """Rewrites a jsonl log with only its records of steps 1..start_step (none for 0: a new
    log); returns them."""
    kept = []
    if start_step and path.is_file():
        with path.open(encoding="utf-8") as f:
            for line in f:
                record = json.loads(line) if line.strip() else {}
                if 0 < record.get("step", 0) <= start_step:
                    kept.append(record)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:  # no step twice after a resume
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)
    return kept


def step_split(history: list[dict]) -> dict[str, float]:
    """The mean logged RL step in seconds: "generate" (sampling, tool calls included), "score"
    (the rewards), "update" and "step" (all of it)."""
    rows = [r for r in history if "time/step_s" in r]
    if not rows:
        return {}
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / len(rows)  # noqa: E731
    score = mean("time/score_s")
    return {
        "generate": mean("time/rollout_s") - score,
        "score": score,
        "update": mean("time/update_s"),
        "step": mean("time/step_s"),
    }


class MetricsLogger:
    """Writes one record per step to `log_dir/metrics.jsonl` (always: a resumed run reads it
    back), TensorBoard and the experiment trackers given; rollout samples to
    `log_dir/samples.jsonl` and the trackers' tables.

    Only process 0 writes; other processes accept calls and do nothing, so callers need no
    branches.

    Args:
      log_dir: the run's folder.
      total_steps: for the progress bar.
      tensorboard: also write TensorBoard event files.
      progress: show a tqdm progress bar on the console.
      start_step: the step a resumed run continues from: records of later steps (logged after
        its last checkpoint) are dropped from the files, earlier ones kept for the plot, and the
        progress bar starts there. 0 starts a new log.
      trackers: started experiment trackers (`trackers.open_trackers`), ended by `close`. A
        tracker's error while logging is a warning: metrics.jsonl keeps the record.
    """

    def __init__(
        self,
        log_dir: str | Path,
        *,
        total_steps: int | None = None,
        tensorboard: bool = True,
        progress: bool = True,
        start_step: int = 0,
        desc: str = "train",
        trackers: Sequence[Tracker] = (),
    ):
        self.log_dir = Path(log_dir)
        self.active = is_main_process()
        self.history: list[dict[str, float]] = []
        self.trackers = list(trackers)
        self._tb = self._bar = self._file = self._samples = None
        if not self.active:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / "metrics.jsonl"
        self.history = _keep_until(path, start_step)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115
        samples = self.log_dir / "samples.jsonl"
        if samples.is_file():
            _keep_until(samples, start_step)
        if tensorboard:
            self._tb = SummaryWriter(str(self.log_dir / "tensorboard"))
        if progress:
            self._bar = tqdm(total=total_steps, initial=start_step, desc=desc, dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, object], *, prefix: str = "") -> dict:
        """Records scalar metrics for `step` (non-scalars are dropped; NaN is written as NaN)."""
        record = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            v = _scalar(value)
            if v is not None:
                record[prefix + key] = v
        self.history.append(record)
        if not self.active:
            return record
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, v in record.items():
                if key not in ("step", "time"):
                    self._tb.add_scalar(key, v, step)
        if self._bar is not None:
            shown = {k.split("/")[-1]: f"{record[k]:.3g}" for k in PLOT_KEYS[:4] if k in record}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
        values = {k: v for k, v in record.items() if k not in ("step", "time")}
        for tracker in self.trackers:
            try:
                tracker.log(int(step), values, record["time"])
            except Exception as e:  # a tracker's outage does not stop training
                log.warning("%s: step %d not logged: %s", tracker.name, step, e)
        return record

    def log_samples(self, step: int, rows: Sequence[Mapping]) -> list[dict]:
        """Records rollout samples of `step`: rows with "prompt", "response" and "reward",
        written to `log_dir/samples.jsonl` (with their step) and as a table to the trackers."""
        rows = [  # the columns of trackers.SAMPLE_COLUMNS
            {
                "step": int(step),
                "prompt": str(r.get("prompt", "")),
                "response": str(r.get("response", "")),
                "reward": _scalar(r.get("reward")),
            }
            for r in rows
        ]
        if not self.active or not rows:
            return rows
        if self._samples is None:
            self._samples = open(self.log_dir / "samples.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self._samples.writelines(json.dumps(r) + "\n" for r in rows)
        self._samples.flush()
        for tracker in self.trackers:
            try:
                tracker.log_samples(int(step), rows)
            except Exception as e:
                log.warning("%s: samples of step %d not logged: %s", tracker.name, step, e)
        return rows

    def plot(self, path: str | Path | None = None, keys: Sequence[str] = PLOT_KEYS) -> Path | None:
        """Writes a PNG with one panel per main curve (and one per `level/*/` statistic, a line
        per level); returns its path."""
        if not self.active or not self.history:
            return None
        seen = {k for r in self.history for k in r}
        panels = [(k, [k]) for k in keys if k in seen]
        for stat in ("tool", "reward"):
            by_level = sorted(k for k in seen if k.startswith("level/") and k.endswith(f"/{stat}"))
            if by_level:
                panels.append((f"{stat} by level", by_level))
        path = Path(path) if path else self.log_dir / "curves.png"
        return _draw(panels, {None: self.history}, path)

    def flush(self) -> None:
        """Puts everything logged so far on disk (TensorBoard buffers events)."""
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self, *, failed: bool = False) -> None:
        """Closes the files and ends the trackers' runs (`failed`: marked as failed)."""
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
        if self._samples is not None:
            self._samples.close()
        close_trackers(self.trackers, failed=failed)
        self.trackers = []


def read_metrics(log_dir: str | Path) -> list[dict]:
    """The records a run logged (`log_dir/metrics.jsonl`), one per step."""
    lines = (Path(log_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line]


def plot_runs(
    runs: Mapping[str, Sequence[Mapping]],
    path: str | Path,
    keys: Sequence[str] = PLOT_KEYS,
    smooth: int = 5,
) -> Path | None:
    """Writes a PNG with one panel per curve in `keys` and a line per run (`runs`: label -> its
    logged records, e.g. `read_metrics`), each a moving mean over `smooth` steps: several
    seeds, or methods, side by side. Labels containing "baseline" are dashed."""
    seen = {k for records in runs.values() for r in records for k in r}
    panels = [(k, [k]) for k in keys if k in seen]
    title = f"moving mean of {smooth} steps" if smooth > 1 else None
    return _draw(panels, runs, Path(path), smooth=smooth, title=title)


def _draw(panels, runs: Mapping, path: Path, smooth: int = 1, title=None) -> Path | None:
    """One panel per (title, keys); a line per key and per run (label None: the only run)."""
    if not panels:
        return None
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4 * cols, 3 * rows))  # no pyplot: no global backend state
    axes = fig.subplots(rows, cols, squeeze=False)
    colors = {}  # a run and its baseline share one
    for label in runs:
        if label is not None:
            colors.setdefault(_without_baseline(label), f"C{len(colors)}")
    for i, (ax, (name, keys)) in enumerate(zip(axes.flat, panels)):
        for label, records in runs.items():
            for key in keys:
                pts = [(r["step"], r[key]) for r in records if key in r]
                if not pts:
                    continue
                steps, values = map(np.asarray, zip(*pts))
                if smooth > 1 and len(values) >= smooth:
                    values = np.convolve(values, np.ones(smooth) / smooth, mode="valid")
                    steps = steps[smooth - 1 :]
                line = key.split("/")[1] if len(keys) > 1 else label
                style = "--" if label and "baseline" in label else "-"
                color = colors[_without_baseline(label)] if label else None
                ax.plot(steps, values, style, color=color, marker="." if smooth == 1 else None,
                        label=line)  # fmt: skip
        if len(keys) > 1:
            ax.legend(title="level", fontsize="small")
        elif 1 < len(runs) <= 4 and i == 0:  # the runs' legend once
            ax.legend(fontsize="small")
        ax.set_title(name)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    right = 1.0
    if len(runs) > 4 and all(len(keys) == 1 for _, keys in panels):  # many: beside the panels
        fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="center right", fontsize="small")
        right = 0.8
    fig.tight_layout(rect=(0, 0, right, 1))
    fig.savefig(path, dpi=100)
    return path


def _without_baseline(label: str) -> str:
    return label.replace("baseline", "").strip(" ()")
