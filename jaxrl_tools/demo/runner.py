"""The `demo` command: SFT cold start, held-out evaluation, RL with the tools in the loop,
held-out evaluation, and the report; optionally a baseline RL run from the same SFT policy.

    summary = demo(cfg, baseline_reward="math")   # report.md and report.json in trainer.log_dir
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from jaxrl_tools import run, sharding
from jaxrl_tools.config import RewardSpec, RunConfig
from jaxrl_tools.demo import report
from jaxrl_tools.train.metrics import write_json


def demo(
    cfg: RunConfig,
    *,
    baseline_reward: str | None = None,
    baseline_estimator: str | None = None,
    baseline_agent: str | None = None,
) -> dict:
    """SFT cold start, held-out eval, GRPO with the sandbox in the loop, held-out eval, report.

    With `baseline_reward` (e.g. "math"), `baseline_estimator` (e.g. "grpo") or `baseline_agent`
    (a `rollout.agent`), a second RL run starts from the same SFT policy with only that reward,
    that advantage estimator or that agent, for the same steps on the same data, and the report
    compares the two (OTC vs plain GRPO, GiGPO vs GRPO, the built-in loop vs an agent).
    """
    t0 = time.perf_counter()
    out = Path(cfg.trainer.log_dir)
    base_cfg = None
    if (baseline_reward, baseline_estimator, baseline_agent) != (None, None, None):
        t = cfg.trainer
        change: dict[str, Any] = {}
        if baseline_reward is not None:
            change["reward"] = (RewardSpec(baseline_reward, 1.0, {}),)
        if baseline_estimator is not None:
            change["algorithm"] = dataclasses.replace(
                cfg.algorithm, adv_estimator=baseline_estimator
            )
        if baseline_agent is not None:
            change["rollout"] = dataclasses.replace(cfg.rollout, agent=baseline_agent)
        # Built (and so validated) before anything runs.
        base_cfg = dataclasses.replace(
            cfg,
            **change,
            trainer=dataclasses.replace(
                t,
                log_dir=str(out / "baseline"),
                run_name=f"{t.run_name}_baseline",
                checkpoint_dir=str(Path(t.checkpoint_dir) / "baseline"),
            ),
        )
    summary = run.train(
        cfg, evaluate_before=True, evaluate_after=True, keep_init_params=base_cfg is not None
    )
    summary.update(_method(cfg))
    summary["tools_desc"] = ", ".join(t.cls for t in cfg.tools) or "no tools"
    r = cfg.rollout
    summary["eval_desc"] = (
        "greedy decoding"
        if r.eval_temperature == 0
        else f"sampling at temperature {r.eval_temperature:g}, {r.eval_group_size} per problem"
    )
    baseline = None
    if base_cfg is not None:
        # A resumed run has no copy of its SFT policy; SFT is deterministic, so the baseline
        # then redoes it (or resumes its own checkpoint).
        baseline = run.train(
            base_cfg, evaluate_after=True, init_params=summary.pop("init_params", None)
        )
        baseline.update(_method(base_cfg))
    summary["wall_time_s"] = time.perf_counter() - t0
    text = report.demo_report(summary, baseline)
    if sharding.is_main_process():
        (out / "report.md").write_text(text)
    keep = lambda d: {k: v for k, v in d.items() if k not in _NOT_JSON}
    write_json(
        out / "report.json", {**keep(summary), "baseline": keep(baseline) if baseline else None}
    )
    print(text)
    print(f"(wall time {summary['wall_time_s']:.0f} s; report in {out / 'report.md'})")
    summary["baseline"] = baseline
    return summary


def _method(cfg: RunConfig) -> dict:
    """What names a run in the report: its reward, its estimator and its agent."""
    return {
        "reward_name": "+".join(r.name for r in cfg.reward),
        "estimator": cfg.algorithm.adv_estimator,
        "agent": cfg.rollout.agent,
    }


_NOT_JSON = ("params", "model_config", "tokenizer", "init_params")
