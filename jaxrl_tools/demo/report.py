"""The demo's report: the SFT policy against the RL policy (and a baseline RL run) on held-out
problems, as a markdown table with accuracy and tool use by difficulty."""

from __future__ import annotations

from jaxrl_tools.tasks import function_calling


def _report_row(name: str, m: dict) -> str:
    levels = sorted(k.split("/")[1] for k in m if k.startswith("level/") and k.endswith("/tool"))
    by_level = ", ".join(
        f"L{lv}: {m[f'level/{lv}/accuracy'] * 100:.0f}% / {m[f'level/{lv}/tool'] * 100:.0f}%"
        for lv in levels
    )
    return (
        f"| {name} | {m['reward/accuracy'] * 100:.1f}% | {m['tools/used_frac'] * 100:.1f}% | "
        f"{m['tools/calls_per_response']:.2f} | {m['tools/error_rate']:.2f} | {by_level} |"
    )


def _kinds_table(before: dict, after: dict) -> list[str]:
    """Accuracy and tool use per kind of question, before and after RL (where records name
    their kind)."""
    kinds = sorted(k.split("/")[1] for k in after if k.startswith("kind/") and k.endswith("/tool"))
    if not kinds:
        return []

    def pct(m: dict, k: str, what: str) -> str:
        return f"{m[f'kind/{k}/{what}'] * 100:.0f}%"

    return [
        "",
        "| kind | accuracy before -> after | tool use before -> after |",
        "| --- | --- | --- |",
        *(
            f"| {k} | {pct(before, k, 'accuracy')} -> {pct(after, k, 'accuracy')} | "
            f"{pct(before, k, 'tool')} -> {pct(after, k, 'tool')} |"
            for k in kinds
        ),
    ]


def _productivity(m: dict) -> str:
    """OTC's tool productivity: correct answers per tool call."""
    calls = m["tools/calls_per_response"]
    return f"{m['reward/accuracy'] / calls:.2f}" if calls else "n/a (no calls)"


def _times(summary: dict) -> str:
    """Where the time went: SFT, one held-out evaluation, and the mean RL step's parts."""
    split = summary.get("step_time_s")
    if not split:
        return ""
    named = (("SFT", "sft_time_s"), ("one evaluation", "eval_time_s"))
    parts = [f"{name} {summary[key]:.0f} s" for name, key in named if key in summary]
    return (
        "Time: "
        + ", ".join(parts + [f"mean RL step {split['step']:.1f} s"])
        + f" (generate {split['generate']:.1f} s, score {split['score']:.1f} s, "
        f"update {split['update']:.1f} s)."
    )


def _episode_row(name: str, m: dict) -> str:
    return (
        f"| {name} | {m['env/success_rate'] * 100:.1f}% | {m['reward/mean']:.3f} | "
        f"{m['env/turns_mean']:.2f} |"
    )


def label(run: dict, key: str) -> str:
    """A run's name in the report: its reward or estimator (`key`), and its agent if any."""
    agent = run.get("agent")
    return run[key] + (f", agent {agent.rsplit(':', 1)[1]}" if agent else "")


def episodes_report(summary: dict, baseline: dict | None = None) -> str:
    """A grid-game demo's report: success on held-out episodes (unseen seeds) before vs after
    RL, and against a baseline estimator's run from the same SFT policy."""
    b, a = summary["before"], summary["after"]
    name = f"SFT + RL ({label(summary, 'estimator')})"
    lines = [
        f"# jaxrl-tools demo: {summary['run_name']}",
        "",
        f"Held-out episodes: {a['num_problems']} unseen seeds ({summary['eval_desc']}).",
        "",
        "| policy | success rate | episode score | turns per episode |",
        "| --- | --- | --- | --- |",
        _episode_row("SFT (before RL)", b),
    ]
    if baseline is not None:
        lines.append(_episode_row(f"SFT + RL ({label(baseline, 'estimator')})", baseline["after"]))
    lines += [
        _episode_row(name, a),
        "",
        f"RL ({label(summary, 'estimator')}) changed the held-out success rate by "
        f"{(a['env/success_rate'] - b['env/success_rate']) * 100:+.1f} points "
        f"({b['env/success_rate'] * 100:.1f}% -> {a['env/success_rate'] * 100:.1f}%).",
    ]
    if baseline is not None:
        base = baseline["after"]["env/success_rate"]
        lines.append(
            f"Against {label(baseline, 'estimator')} at the same budget from the same SFT policy: "
            f"{(a['env/success_rate'] - base) * 100:+.1f} points ({base * 100:.1f}% -> "
            f"{a['env/success_rate'] * 100:.1f}%)."
        )
    if summary.get("plot"):
        lines += ["", f"Training curves: {summary['plot']}"]
    return "\n".join(lines) + "\n"


def demo_report(summary: dict, baseline: dict | None = None) -> str:
    """The demo's report: the SFT policy vs the RL policy (and a baseline RL run) on held-out
    problems."""
    if "env/success_rate" in summary["after"]:
        return episodes_report(summary, baseline)
    if "calls/exact_call_accuracy" in summary["after"] and baseline is None:
        return function_calling.demo_report(summary)
    b, a = summary["before"], summary["after"]
    acc_b, acc_a = b["reward/accuracy"] * 100, a["reward/accuracy"] * 100
    tool_b, tool_a = b["tools/used_frac"] * 100, a["tools/used_frac"] * 100
    name = f"SFT + RL ({label(summary, 'reward_name')})"
    lines = [
        f"# jaxrl-tools demo: {summary['run_name']}",
        "",
        f"Held-out problems: {a['num_problems']} ({summary['eval_desc']}; tools: "
        f"{summary['tools_desc']}).",
        "",
        "| policy | accuracy | responses calling the tool | tool calls / response | "
        "tool error rate | by difficulty (accuracy / tool use) |",
        "| --- | --- | --- | --- | --- | --- |",
        _report_row("SFT (before RL)", b),
    ]
    if baseline is not None:
        lines.append(_report_row(f"SFT + RL ({label(baseline, 'reward_name')})", baseline["after"]))
    lines += [
        _report_row(name, a),
        "",
        f"RL ({label(summary, 'reward_name')}) changed held-out accuracy by "
        f"{acc_a - acc_b:+.1f} points ({acc_b:.1f}% -> {acc_a:.1f}%) and the tool-call rate by "
        f"{tool_a - tool_b:+.1f} points.",
    ]
    if baseline is not None:
        base = baseline["after"]
        calls, base_calls = a["tools/calls_per_response"], base["tools/calls_per_response"]
        change = f" ({(calls / base_calls - 1) * 100:+.0f}%)" if base_calls else ""
        lines.append(
            f"Against RL with {label(baseline, 'reward_name')} from the same SFT policy: accuracy "
            f"{(a['reward/accuracy'] - base['reward/accuracy']) * 100:+.1f} points, tool calls "
            f"per response {calls:.2f} vs {base_calls:.2f}{change}, tool productivity (correct "
            f"answers per tool call) {_productivity(a)} vs {_productivity(base)}."
        )
    lines += _kinds_table(b, a)
    if times := _times(summary):
        lines += ["", times]
    for when, m in (("before", b), ("after", a)):
        lines += ["", f"Examples {when} RL:"]
        lines += [
            f"- {ex['prompt']!r} -> {ex['response']!r} (answer {ex['ground_truth']}, "
            f"score {ex['score']:g})"
            for ex in m.get("_examples", [])
        ]
    if summary.get("plot"):
        lines += ["", f"Training curves: {summary['plot']}"]
    return "\n".join(lines) + "\n"
