"""`jaxrl-tools demo --seeds`: one demo per seed, each in its own folders, and the headline
figure as a spread (per-seed change with its binomial standard error, mean and sd)."""

import json
import math

import numpy as np
import pytest

from jaxrl_tools import cli, configs
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.demo.seeds import seed_config, seed_curves, spread


def _run(before, after, n=100, baseline=None):
    run = {"before": {"reward/accuracy": before, "num_problems": n}, "wall_time_s": 60.0}
    run |= {"after": {"reward/accuracy": after, "num_problems": n}, "eval_desc": "greedy"}
    run |= {"reward_name": "math", "estimator": "grpo", "agent": None}
    if baseline is not None:
        run["baseline"] = {"after": {"reward/accuracy": baseline, "num_problems": n}}
        run["baseline"]["reward_name"] = "math"
        run["baseline"] |= {"agent": "m:tool_math_agent"}
    return run


def test_the_spread_is_each_seeds_change_with_its_error_and_the_mean_over_seeds():
    cfg = load_config(configs.path("grpo_tool_math"), [])
    table = spread([0, 1, 2], [_run(0.02, 0.58, baseline=0.57), _run(0.02, 0.06, baseline=0.09),
                               _run(0.10, 0.70, baseline=0.71)], cfg)  # fmt: skip
    first = table["rows"][0]
    assert first["change"] == pytest.approx(0.56)
    assert first["change_se"] == pytest.approx(math.sqrt(0.02 * 0.98 / 100 + 0.58 * 0.42 / 100))
    mean, sd = table["mean_sd"]["change"]
    changes = [0.56, 0.04, 0.60]
    assert mean == pytest.approx(sum(changes) / 3)
    assert sd == pytest.approx(math.sqrt(sum((c - mean) ** 2 for c in changes) / 2))
    md = table["markdown"]
    assert "| seed | before RL | after RL (math) | after RL (math, agent tool_math_agent) |" in md
    assert "| 0 | 2.0% | 58.0% | 57.0% | +56.0 +- 5.1 | +1.0 +- 7.0 | 60 s |" in md
    assert (
        "| mean | 4.7 (sd 4.6) | 44.7 (sd 34.0) | 45.7 (sd 32.5) | +40.0 (sd 31.2) | "
        "-1.0 (sd 2.0) |" in md
    )
    assert "binomial draws" in md


def test_with_each_problems_figure_the_error_is_paired_over_the_problems():
    """The same problems before and after: the sd of the per-problem changes / sqrt(n). Rooms
    that move together make it smaller than the binomial error; the table says which it is."""
    rng = np.random.default_rng(0)
    hard = rng.random(128)  # each problem's difficulty, shared by both evaluations
    before = np.clip(hard + rng.normal(0, 0.05, 128), 0, 1)
    after = np.clip(before + 0.05 + rng.normal(0, 0.05, 128), 0, 1)
    run = _run(before.mean(), after.mean(), n=128)
    run["before"]["_per_problem"] = {"reward/accuracy": before.tolist()}
    run["after"]["_per_problem"] = {"reward/accuracy": after.tolist()}
    cfg = load_config(configs.path("grpo_tool_math"), [])
    row = spread([0], [run], cfg)["rows"][0]
    d = after - before
    assert row["change_se"] == pytest.approx(d.std(ddof=1) / np.sqrt(128))
    binomial = spread([0], [_run(before.mean(), after.mean(), n=128)], cfg)["rows"][0]
    assert row["change_se"] < binomial["change_se"] / 3
    assert "paired over the held-out problems" in spread([0], [run], cfg)["markdown"]


def test_a_seed_is_every_seed_a_demo_draws_and_its_own_folders():
    cfg = load_config(configs.path("grpo_tool_math"), [])
    two = seed_config(cfg, 2)
    assert (two.trainer.seed, two.model.tiny.seed, two.data.shuffle_seed) == (2, 2, 2)
    assert two.trainer.log_dir.endswith("logs/seed2")
    assert two.trainer.checkpoint_dir.endswith("checkpoints/seed2")
    assert two.tokenizer == cfg.tokenizer  # one tokenizer for all seeds


def test_seed_curves_are_each_seeds_records_and_its_baselines(tmp_path):
    cfg = load_config(configs.path("grpo_tool_math"), [f"trainer.log_dir={tmp_path}"])
    runs = [seed_config(cfg, s) for s in (0, 1)]
    for c, folders in zip(runs, (["", "baseline"], [""]), strict=True):
        for folder in folders:
            (tmp_path / c.trainer.log_dir / folder).mkdir(parents=True, exist_ok=True)
            lines = [{"step": k, "reward/mean": k / 10 + len(folder)} for k in (1, 2)]
            text = "\n".join(json.dumps(r) for r in lines)
            (tmp_path / c.trainer.log_dir / folder / "metrics.jsonl").write_text(text)
    curves = seed_curves([0, 1], runs)
    assert list(curves) == ["seed 0", "seed 0 (baseline)", "seed 1"]
    assert [r["reward/mean"] for r in curves["seed 0 (baseline)"]] == [8.1, 8.2]


def test_demo_over_two_seeds_in_a_smoke_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--smoke", "--seeds", "0,1"]) == 0
    logs = tmp_path / "runs/smoke/grpo_tool_math/logs"
    reports = [json.loads((logs / f"seed{s}/report.json").read_text()) for s in (0, 1)]
    assert [r["after"]["num_problems"] for r in reports] == [4, 4]
    entropy = [r["final_metrics"]["actor/entropy"] for r in reports]
    assert entropy[0] != entropy[1]  # another initialisation, other samples
    table = json.loads((logs / "seeds.json").read_text())
    assert [r["seed"] for r in table["rows"]] == [0, 1] and table["metric"] == "reward/accuracy"
    assert "| mean |" in (logs / "seeds.md").read_text() and "| mean |" in capsys.readouterr().out
    assert (logs / "seeds.png").read_bytes()[:4] == b"\x89PNG"  # the seeds' curves side by side
    with pytest.raises(SystemExit):
        cli.main(["demo", "--smoke", "--seeds", "0,0"])
