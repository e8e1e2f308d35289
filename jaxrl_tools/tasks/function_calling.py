"""The function-calling task (`data.task: function_calling`): generated prompts with JSON-schema
tools (`datasets.function_calling.generate`), SFT traces in ToolRL's answer format, and the
demo's report.

A trace answers in ToolRL's format (what the `toolrl` reward's format check wants):

    <think>I need get_weather and set_timer.</think>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    {"name": "set_timer", "arguments": {"minutes": 5}}
    </tool_call>

or, when no tool fits, `<think>No tool is needed.</think>\\n<response>...</response>`. The SFT
traces are imperfect on purpose, so that RL has something to learn: with probability
1 - `sft.tool_mix` each, a request is answered by describing its calls in a <response> instead
of making them (`described_answer`: a model that talks about a tool instead of calling it), a
two-call request is answered with its first call only, and an optional argument the user asked
for (the weather's unit) is left out.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_tools.config import DataSection, SFTSection
from jaxrl_tools.datasets.function_calling import SYSTEM, generate

EVAL_SEED_OFFSET = 10_000  # held-out prompts: another seed of the generator
SFT_SEED_OFFSET = 20_000
_REPLIES = ("Happy to help!", "You're welcome.", "Sure, ask me anything.")


def num_tools(data: DataSection) -> tuple[int, int]:
    """Tools shown per prompt: `data.task_difficulty` is the most (the fewest is 2 below it,
    and never under 2); two-call requests always get at least one distractor."""
    most = max(2, min(7, data.task_difficulty))
    return max(2, most - 2), most


def task_records(data: DataSection, split: str) -> list[dict]:
    """Prompt records ("train", or the held-out "eval" set from another seed); each record's
    `difficulty` is its number of ground-truth calls (0, 1 or 2), for the per-level report."""
    n, seed = (
        (data.task_train_size, data.shuffle_seed)
        if split == "train"
        else (data.task_eval_size, data.shuffle_seed + EVAL_SEED_OFFSET)
    )
    records = generate(n, seed, num_tools=num_tools(data), system=data.system_prompt or SYSTEM)
    for i, rec in enumerate(records):
        rec["id"] = f"fc-{seed}-{i}"
        rec["difficulty"] = len(rec["ground_truth"])
    return records


def tokenizer_texts(n: int = 400) -> list[str]:
    """The tokenizer corpus of the task (fixed: a change changes the tokenizer): generated
    declarations as the chat template writes them (one JSON line each), requests, answers."""
    texts = []
    for rec in generate(n, seed=1, num_tools=(2, 5)):
        texts.append("\n".join(json.dumps(t, ensure_ascii=False) for t in rec["tools"]))
        texts.append(rec["prompt"][-1]["content"])
        texts.append(toolrl_answer(rec["ground_truth"]))
    return texts


def toolrl_answer(calls: Sequence[Mapping], reply: str = "Happy to help!") -> str:
    """A response in ToolRL's format: a thought, then one <tool_call> block with one JSON call
    per line, or a <response> when there is no call."""
    if not calls:
        return f"<think>No tool is needed.</think>\n<response>{reply}</response>"
    lines = "\n".join(json.dumps({"name": c["name"], "arguments": c["arguments"]}) for c in calls)
    return f"{_thought(calls)}\n<tool_call>\n{lines}\n</tool_call>"


def _thought(calls: Sequence[Mapping]) -> str:
    """The thought before calls, the same whether they are made or described (so the choice
    between the two comes at the tag after it)."""
    return f"<think>I need {' and '.join(c['name'] for c in calls)}.</think>"


def described_answer(calls: Sequence[Mapping]) -> str:
    """The under-calling answer: the calls written out in prose inside a <response>, so that
    nothing is called (the arguments are still copied, as in a call)."""
    said = " and ".join(f"{c['name']} with {json.dumps(c['arguments'])}" for c in calls)
    return f"{_thought(calls)}\n<response>I would call {said}.</response>"


def imperfect_calls(calls: Sequence[Mapping], rng: random.Random, mix: float) -> list[dict]:
    """The calls an imperfect trace makes: with probability 1 - mix each, the second call is
    dropped and the optional "unit" argument is left out."""
    out = [dict(c, arguments=dict(c["arguments"])) for c in calls]
    if len(out) > 1 and rng.random() >= mix:
        out = out[:1]
    for c in out:
        if "unit" in c["arguments"] and rng.random() >= mix:
            del c["arguments"]["unit"]
    return out


def trace_segments(tokenizer, record: Mapping[str, Any], answer: str) -> list[list[Any]]:
    """[[prompt, False], [answer + end of turn, True]]: the prompt rendered with its tools by
    the chat template, and the assistant turn the template closes."""
    render = lambda msgs, gen: tokenizer.apply_chat_template(
        msgs, tools=record["tools"], tokenize=False, add_generation_prompt=gen
    )
    prompt = render(record["prompt"], True)
    full = render([*record["prompt"], {"role": "assistant", "content": answer}], False)
    assert full.startswith(prompt), "the chat template does not extend the prompt"
    return [[prompt, False], [full[len(prompt) :], True]]


def task_sft_traces(data: DataSection, sft: SFTSection, tokenizer) -> list[list[list[Any]]]:
    """`sft.num_traces` traces on generated prompts (a seed of their own), imperfect with
    probability 1 - `sft.tool_mix` (`described_answer`, `imperfect_calls`)."""
    records = generate(
        sft.num_traces,
        data.shuffle_seed + SFT_SEED_OFFSET,
        num_tools=num_tools(data),
        system=data.system_prompt or SYSTEM,
    )
    rng = random.Random(data.shuffle_seed)
    traces = []
    for rec in records:
        calls = imperfect_calls(rec["ground_truth"], rng, sft.tool_mix)
        if calls and rng.random() >= sft.tool_mix:
            answer = described_answer(calls)
        else:
            answer = toolrl_answer(calls, rng.choice(_REPLIES))
        traces.append(trace_segments(tokenizer, rec, answer))
    return traces


# ------------------------------------------------------------------------------------ report


def _row(name: str, m: dict) -> str:
    by_calls = ", ".join(
        f"{lv} calls: {m[f'level/{lv}/accuracy'] * 100:.0f}%"
        for lv in sorted(k.split("/")[1] for k in m if k.startswith("level/") and "accuracy" in k)
    )
    return (
        f"| {name} | {m['calls/exact_call_accuracy'] * 100:.1f}% | {m['calls/name_f1']:.3f} | "
        f"{m['calls/argument_f1']:.3f} | {m['calls/no_call_precision']:.3f} | "
        f"{m['calls/call_rate'] * 100:.0f}% | {by_calls} |"
    )


def demo_report(summary: dict) -> str:
    """The function-calling demo's report: the SFT policy against the RL policy on held-out
    prompts (exact calls, name and argument F1, no-call precision, by number of calls)."""
    b, a = summary["before"], summary["after"]
    acc_b, acc_a = b["calls/exact_call_accuracy"] * 100, a["calls/exact_call_accuracy"] * 100
    lines = [
        f"# jaxrl-tools demo: {summary['run_name']}",
        "",
        f"Held-out prompts: {a['num_problems']} ({summary['eval_desc']}; generated function "
        "calling, JSON-schema tools declared in the system turn).",
        "",
        "| policy | exact-call accuracy | name F1 | argument F1 | no-call precision | "
        "responses calling | exact calls by number of calls needed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        _row("SFT (before RL)", b),
        _row(f"SFT + RL ({summary['reward_name']})", a),
        "",
        f"RL changed held-out exact-call accuracy by {acc_a - acc_b:+.1f} points "
        f"({acc_b:.1f}% -> {acc_a:.1f}%).",
        "",
        "Examples after RL:",
    ]
    for ex in a.get("_examples", []):
        lines.append(
            f"- {ex['prompt'][-1]['content']!r} -> {ex['response']!r} (score {ex['score']:g})"
        )
    if summary.get("plot"):
        lines += ["", f"Training curves: {summary['plot']}"]
    return "\n".join(lines) + "\n"
