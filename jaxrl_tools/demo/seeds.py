"""`jaxrl-tools demo --seeds 0,1,2`: the demo once per seed, then its headline figure as a
spread over the seeds, so a README's claim can be checked on any machine.

Seed s is `trainer.seed=s model.tiny.seed=s data.shuffle_seed=s` (another initialisation,
other SFT traces and sampling, another order of the data; the held-out set is the same). Each
seed writes its own report under `trainer.log_dir/seed<s>`; `seeds.md` and `seeds.json` in
`trainer.log_dir` hold the table: every seed's figures before RL, after RL (and after the
baseline's RL), the change (and the lead over the baseline) with its standard error, paired over
the held-out problems, and the mean and standard deviation over the seeds; `seeds.png` the
training curves of every seed (and its baseline's, dashed) side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from jaxrl_tools import sharding
from jaxrl_tools.config import RunConfig
from jaxrl_tools.demo import report, runner
from jaxrl_tools.train.metrics import plot_runs, read_metrics, write_json

# The figure each kind of demo is judged by, first match wins.
HEADLINES = (
    ("env/success_rate", "success rate"),
    ("calls/exact_call_accuracy", "exact-call accuracy"),
    ("reward/accuracy", "accuracy"),
)


def seed_config(cfg: RunConfig, seed: int) -> RunConfig:
    """`cfg` with seed `seed` everywhere a demo draws, its outputs in folders of their own."""
    t, m = cfg.trainer, cfg.model  # (model.tiny.seed changes nothing for a model.path)
    return dataclasses.replace(
        cfg,
        trainer=dataclasses.replace(
            t,
            seed=seed,
            log_dir=str(Path(t.log_dir) / f"seed{seed}"),
            checkpoint_dir=str(Path(t.checkpoint_dir) / f"seed{seed}"),
        ),
        model=dataclasses.replace(m, tiny=dataclasses.replace(m.tiny, seed=seed)),
        data=dataclasses.replace(cfg.data, shuffle_seed=seed),
    )


def parse_seeds(text: str) -> list[int]:
    """`--seeds 0,1,2` (argparse's type: a bad list is its usage error)."""
    try:
        out = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give seeds as 0,1,2") from None
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"{text!r}: a seed is repeated")
    return out


def demo_seeds(cfg: RunConfig, seeds: Sequence[int] | None, **baseline) -> dict:
    """Runs `runner.demo` for every seed (configs built, and so checked, before any runs) and
    writes the spread; no seeds: the demo once, as configured. `baseline` is `runner.demo`'s
    baseline_* arguments."""
    if seeds is None:
        return runner.demo(cfg, **baseline)
    configs = [seed_config(cfg, s) for s in seeds]
    runs = [runner.demo(c, **baseline) for c in configs]
    table = spread(list(seeds), runs, cfg)
    if sharding.is_main_process():
        out = Path(cfg.trainer.log_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "seeds.md").write_text(table["markdown"])
        write_json(out / "seeds.json", {k: v for k, v in table.items() if k != "markdown"})
        plot_runs(seed_curves(seeds, configs), out / "seeds.png")
    print(table["markdown"])
    return table


def seed_curves(seeds: Sequence[int], configs: Sequence[RunConfig]) -> dict[str, list[dict]]:
    """Each seed's logged training records, and its baseline's where one ran."""
    curves = {}
    for seed, c in zip(seeds, configs, strict=True):
        curves[f"seed {seed}"] = read_metrics(c.trainer.log_dir)
        if (Path(c.trainer.log_dir) / "baseline" / "metrics.jsonl").exists():
            curves[f"seed {seed} (baseline)"] = read_metrics(Path(c.trainer.log_dir) / "baseline")
    return curves


def _draws(cfg: RunConfig, metrics: dict) -> int:
    """Held-out answers behind a rate: problems x samples each (sampled evaluation)."""
    r = cfg.rollout
    return metrics["num_problems"] * (r.eval_group_size if r.eval_temperature > 0 else 1)


def spread(seeds: list[int], runs: list[dict], cfg: RunConfig) -> dict:
    """The headline figure per seed (before, after, baseline) and over the seeds."""
    key, name = next((k, n) for k, n in HEADLINES if k in runs[0]["after"])
    has_base = runs[0].get("baseline") is not None
    rows = []
    for seed, run in zip(seeds, runs):
        before, after = run["before"][key], run["after"][key]
        row = {"seed": seed, "before": before, "after": after, "change": after - before}
        row["change_se"] = change_se(cfg, run["before"], run["after"], key)
        row["wall_time_s"] = run["wall_time_s"]
        if has_base:
            base = run["baseline"]["after"]
            row |= {"baseline": base[key], "over_baseline": after - base[key]}
            row["over_baseline_se"] = change_se(cfg, base, run["after"], key)
        rows.append(row)
    cols = ["before", "after", "change"] + (["baseline", "over_baseline"] if has_base else [])
    stats = {c: _mean_sd([r[c] for r in rows]) for c in cols}
    by = "estimator" if key == "env/success_rate" else "reward_name"
    base_label = f" | after RL ({report.label(runs[0]['baseline'], by)})" if has_base else ""
    lines = [
        f"# jaxrl-tools demo over seeds {', '.join(map(str, seeds))}: {cfg.trainer.run_name}",
        "",
        f"Held-out {name} ({runs[0]['eval_desc']}); change = after - before, +- its standard "
        f"error ({_se_desc(runs[0], key)}).",
        "",
        f"| seed | before RL | after RL ({report.label(runs[0], by)}){base_label} | change | "
        + ("over the baseline | " if has_base else "")
        + "wall time |",
        "| --- | --- | --- |" + (" --- | --- |" if has_base else "") + " --- | --- |",
    ]
    signed = lambda v, se: f"{v * 100:+.1f} +- {se * 100:.1f}"  # noqa: E731
    for r in rows:
        base = f" | {r['baseline'] * 100:.1f}%" if has_base else ""
        over = f" | {signed(r['over_baseline'], r['over_baseline_se'])}" if has_base else ""
        lines.append(
            f"| {r['seed']} | {r['before'] * 100:.1f}% | {r['after'] * 100:.1f}%{base} | "
            f"{signed(r['change'], r['change_se'])}{over} | {r['wall_time_s']:.0f} s |"
        )
    pct = lambda c: f"{stats[c][0] * 100:.1f} (sd {stats[c][1] * 100:.1f})"  # noqa: E731
    mean = lambda c: f"{stats[c][0] * 100:+.1f} (sd {stats[c][1] * 100:.1f})"  # noqa: E731
    base = f" | {pct('baseline')}" if has_base else ""
    over = f" | {mean('over_baseline')}" if has_base else ""
    times = [r["wall_time_s"] for r in rows]
    lines.append(
        f"| mean | {pct('before')} | {pct('after')}{base} | {mean('change')}{over} | "
        f"{min(times):.0f}-{max(times):.0f} s |"
    )
    return {"metric": key, "rows": rows, "mean_sd": stats, "markdown": "\n".join(lines) + "\n"}


def _se_desc(run: dict, key: str) -> str:
    paired = all(key in m.get("_per_problem", {}) for m in (run["before"], run["after"]))
    return "paired over the held-out problems" if paired else "held-out answers as binomial draws"


def change_se(cfg: RunConfig, first: dict, second: dict, key: str) -> float:
    """The standard error of the change in `key` from evaluation `first` to `second`. Paired
    when both kept each problem's figure (the same problems: the sd of the per-problem changes
    over sqrt(problems), which also counts a problem's samples as the correlated draws they
    are); else the two rates as independent binomial draws."""
    pf, ps = (m.get("_per_problem", {}).get(key) for m in (first, second))
    if pf and ps and len(pf) == len(ps) > 1:
        d = [y - x for x, y in zip(pf, ps)]
        return _mean_sd(d)[1] / math.sqrt(len(d))
    n_f, n_s = _draws(cfg, first), _draws(cfg, second)
    return math.sqrt(first[key] * (1 - first[key]) / n_f + second[key] * (1 - second[key]) / n_s)


def _mean_sd(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, math.sqrt(var)
