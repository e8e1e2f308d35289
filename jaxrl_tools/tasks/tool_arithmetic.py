"""The demo task: generated tool-arithmetic problems and SFT traces that use a Python tool.

    problems = make_problems(1000, seed=0, difficulty=(0, 1, 2, 3))
    write_jsonl([p.to_record() for p in problems], "train.jsonl")          # RL prompts
    traces = sft_traces(problems, tokenizer, mix=0.8, protocol="qwen")      # SFT warm-up
    write_jsonl(traces, "sft.jsonl")

Answers are exact integers, given as `\\boxed{N}` in traces: the same format the `math` reward
(`jaxrl_tools.rewards`) checks.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from jaxrl_tools.config import DataSection, SFTSection
from jaxrl_tools.rollout import declares_tools
from jaxrl_tools.tasks import function_calling
from jaxrl_tools.tools import PythonTool, get_parser

TRACE_PROTOCOLS = ("qwen", "torl", "retool")  # protocols traces can be written in
MAX_DIFFICULTY = 3

# Difficulty -> (digits of the first operand, digits of the second, operators).
_LEVELS = {
    0: ((1, 1), (1, 1), "+"),  # single-digit sums: answered directly
    1: ((2, 2), (1, 2), "+-*"),
    2: ((3, 4), (2, 3), "+*"),
    3: ((4, 5), (3, 4), "*"),
}

_TEMPLATES = ("What is {e}?", "Compute {e}.", "Calculate {e}.", "What is the value of {e}?")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem with its exact integer answer."""

    id: str
    question: str
    expression: str  # Python-evaluable, e.g. "4821 * 397"
    answer: str  # exact integer, as a string
    difficulty: int

    @property
    def is_easy(self) -> bool:
        """Easy problems are answered directly (no tool) in SFT traces."""
        return self.difficulty == 0

    def to_record(self, tools: Sequence[str] = ("python",)) -> dict:
        """The record `jaxrl_tools.data` reads: prompt, ground_truth, tools, plus metadata."""
        return {
            "id": self.id,
            "prompt": self.question,
            "ground_truth": self.answer,
            "tools": list(tools),
            "difficulty": self.difficulty,
        }


def _operand(rng: random.Random, digits: tuple[int, int]) -> int:
    d = rng.randint(*digits)
    lo = 0 if d == 1 else 10 ** (d - 1)
    return rng.randint(lo, 10**d - 1)


def make_problems(n: int, seed: int = 0, difficulty: int | Sequence[int] = 2) -> list[Problem]:
    """Generate `n` arithmetic problems, deterministically from `seed`.

    Args:
      n: number of problems.
      seed: random seed (same seed and arguments -> same problems).
      difficulty: 0 (single digits) .. 3 (4-5 digit × 3-4 digit products), or a sequence of
        levels to draw from uniformly.

    Returns:
      A list of `Problem`s with exact integer answers.
    """
    levels = [difficulty] if isinstance(difficulty, int) else list(difficulty)
    if not levels or any(lv not in _LEVELS for lv in levels):
        raise ValueError(
            f"difficulty must be in 0..{MAX_DIFFICULTY} (or a list of them), got {difficulty!r}"
        )
    rng = random.Random(seed)
    out = []
    for i in range(n):
        level = rng.choice(levels)
        d1, d2, ops = _LEVELS[level]
        a, b, op = _operand(rng, d1), _operand(rng, d2), rng.choice(ops)
        expr = f"{a} {op} {b}"
        answer = _OPS[op](a, b)
        question = rng.choice(_TEMPLATES).format(e=expr)
        out.append(Problem(f"arith-{seed}-{i}", question, expr, str(answer), level))
    return out


def _observation(protocol: str, result: str) -> str:
    """What rollouts insert after an inline tool call (the protocol's parser owns the format)."""
    return get_parser(protocol).format_observation([result])


def printed(answer: str) -> str:
    """What the sandboxed tool returns for `print(answer)`: stdout, with its newline (SFT traces
    must show the policy the observation that rollouts will insert)."""
    return f"{answer}\n"


def _final(answer: str) -> str:
    return f"The answer is \\boxed{{{answer}}}."


def trace_messages(problem: Problem, use_tool: bool, protocol: str = "qwen") -> list[dict]:
    """The chat messages of one trace (system prompt not included).

    - direct: "In my head: 4 * 7 = 28. The answer is \\boxed{28}." (one fixed first word, so a
      policy's choice between answering directly and calling the tool is one token: "In" or
      "Let", not spread over ten digit tokens)
    - qwen: an assistant turn with a `python` tool_call, a tool turn with the output, and an
      assistant turn with the answer.
    - torl: one assistant message: ```python block, ```output, the result, the answer.
    - retool: one assistant message: <code>print(...)</code>, <interpreter>result</interpreter>,
      the answer.
    """
    if protocol not in TRACE_PROTOCOLS:
        raise ValueError(f"protocol must be one of {TRACE_PROTOCOLS}, got {protocol!r}")
    user = {"role": "user", "content": problem.question}
    if not use_tool:
        return [
            user,
            {
                "role": "assistant",
                "content": f"In my head: {problem.expression} = {problem.answer}. "
                + _final(problem.answer),
            },
        ]
    code = f"print({problem.expression.replace(' ', '')})"
    if protocol == "qwen":
        call = {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}
        return [
            user,
            {
                "role": "assistant",
                "content": "Let me compute it with Python.",
                "tool_calls": [call],
            },
            {"role": "tool", "name": "python", "content": printed(problem.answer)},
            {"role": "assistant", "content": _final(problem.answer)},
        ]
    model_a, obs, model_b = _inline_parts(problem, protocol, code)
    return [user, {"role": "assistant", "content": model_a + obs + model_b}]


def _inline_parts(problem: Problem, protocol: str, code: str) -> tuple[str, str, str]:
    """(model text up to and including the stop string, observation, model continuation)."""
    if protocol == "torl":
        model_a = f"Let me compute it with Python.\n```python\n{code}\n```\n```output"
    else:
        model_a = f"Let me compute it with Python.\n<code>{code}</code>"
    return model_a, _observation(protocol, printed(problem.answer)), _final(problem.answer)


def _segments(tokenizer, messages, tools, problem, use_tool, protocol, system_prompt):
    """Split the rendered conversation into (text, trainable) pieces.

    Trainable: the assistant's own tokens (incl. <|im_end|>); not: the prompt, tool responses
    and inline observations.
    """
    full_msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages
    render = lambda msgs, gen: tokenizer.apply_chat_template(
        msgs, tools=tools, tokenize=False, add_generation_prompt=gen
    )
    segments: list[list[Any]] = []
    prev = ""
    for k, msg in enumerate(full_msgs):
        if msg["role"] == "assistant":
            prompt_part = render(full_msgs[:k], True)
            segments.append([prompt_part[len(prev) :], False])
            upto = render(full_msgs[: k + 1], False)
            body = upto[len(prompt_part) :]
            if use_tool and protocol != "qwen":
                code = f"print({problem.expression.replace(' ', '')})"
                model_a, obs, _ = _inline_parts(problem, protocol, code)
                i, j = body.index(obs), body.index(obs) + len(obs)
                assert body.startswith(model_a)
                segments += [[body[:i], True], [body[i:j], False], [body[j:], True]]
            else:
                segments.append([body, True])
            prev = upto
    full = render(full_msgs, False)
    if full[len(prev) :]:
        segments.append([full[len(prev) :], False])
    assert "".join(s for s, _ in segments) == full
    return full, [s for s in segments if s[0]]


def sft_traces(
    problems: Sequence[Problem],
    tokenizer=None,
    mix: float = 0.8,
    *,
    protocol: str = "qwen",
    seed: int = 0,
    system_prompt: str | None = None,
    easy_mix: float = 0.0,
) -> list[dict]:
    """SFT conversations: tool use for non-easy problems (with probability `mix`), direct
    answers for easy ones (and the rest).

    Args:
      problems: from `make_problems`.
      tokenizer: a tokenizer with the chat template; when given, each trace also gets the
        rendered `text` and `segments` ([[text, trainable], ...], concatenating to `text`).
      mix: probability that a non-easy problem is solved with the tool (0 = never, 1 = always).
      protocol: "qwen" (tool_calls + tool turns), "torl" (```python / ```output) or "retool"
        (<code> / <interpreter>): must match the rollout protocol (the tools parser name).
      seed: seed of the tool/direct draw.
      system_prompt: optional system message.
      easy_mix: probability that an easy problem is solved with the tool (a policy that
        over-uses the tool, for OTC's tool-efficiency runs).

    Returns:
      A list of dicts: id, messages, tools (the qwen protocol's JSON schemas, else []),
      protocol, uses_tool, ground_truth (+ text, segments with a tokenizer).
    """
    if protocol not in TRACE_PROTOCOLS:
        raise ValueError(f"protocol must be one of {TRACE_PROTOCOLS}, got {protocol!r}")
    for name, value in (("mix", mix), ("easy_mix", easy_mix)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    rng = random.Random(seed)
    tools = [PythonTool.default_schema()] if protocol == "qwen" else []
    out = []
    for p in problems:
        use_tool = rng.random() < (easy_mix if p.is_easy else mix)
        messages = trace_messages(p, use_tool, protocol)
        rec = {
            "id": p.id,
            "messages": messages,
            "tools": tools,
            "protocol": protocol,
            "uses_tool": use_tool,
            "ground_truth": p.answer,
        }
        if tokenizer is not None:
            rec["text"], rec["segments"] = _segments(
                tokenizer, messages, tools or None, p, use_tool, protocol, system_prompt
            )
        out.append(rec)
    return out


def write_jsonl(records: Iterable[Any], path: str | os.PathLike) -> Path:
    """Write records (dicts or `Problem`s) as one JSON object per line; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            if isinstance(r, Problem):
                r = r.to_record()
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def problem_from_dict(d: dict) -> Problem:
    """Inverse of `dataclasses.asdict(problem)` (extra keys are ignored)."""
    return Problem(**{f.name: d[f.name] for f in fields(Problem)})


__all__ = [
    "Problem",
    "make_problems",
    "sft_traces",
    "trace_messages",
    "printed",
    "write_jsonl",
    "problem_from_dict",
    "TRACE_PROTOCOLS",
    "task_records",
    "task_sft_traces",
    "tokenizer_texts",
]


def task_records(data: DataSection, protocol: str, split: str) -> list[dict]:
    """The task's prompt records: "train", or the held-out "eval" set (another seed)."""
    if data.task == "function_calling":
        return function_calling.task_records(data, split)
    n, seed = (
        (data.task_train_size, data.shuffle_seed)
        if split == "train"
        else (data.task_eval_size, data.shuffle_seed + 10_000)
    )
    all_levels = tuple(range(data.task_difficulty + 1))
    levels = (
        all_levels if split == "train" or data.task_eval_all_levels else (data.task_difficulty,)
    )
    # Function calling declares the tool in the system turn; inline protocols need no schema.
    tools = ("python",) if declares_tools(protocol) else ()
    return [p.to_record(tools=tools) for p in make_problems(n, seed=seed, difficulty=levels)]


def tokenizer_texts(protocol: str, repeats: int = 100) -> list[str]:
    """The arithmetic task's tokenizer corpus: where the protocol declares the Python tool in
    every prompt's system turn, its declaration as the chat template writes it (repeated, so
    that its words get merges of their own: prompts 29% shorter with 1,024 tokens); none else."""
    if not declares_tools(protocol):
        return []
    return [json.dumps(PythonTool.default_schema(), ensure_ascii=False)] * repeats


def task_sft_traces(
    data: DataSection, sft: SFTSection, protocol: str, tokenizer
) -> list[list[list[Any]]]:
    """The task's generated SFT traces as segment lists ([[text, trainable], ...])."""
    if data.task == "function_calling":
        return function_calling.task_sft_traces(data, sft, tokenizer)
    problems = make_problems(
        sft.num_traces,
        seed=data.shuffle_seed + 20_000,
        difficulty=tuple(range(data.task_difficulty + 1)),
    )
    traces = sft_traces(
        problems,
        tokenizer,
        mix=sft.tool_mix,
        easy_mix=sft.easy_tool_mix,
        protocol=protocol,
        seed=data.shuffle_seed,
        system_prompt=data.system_prompt,
    )
    return [t["segments"] for t in traces]
