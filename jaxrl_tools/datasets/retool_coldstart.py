"""ReTool's cold-start data (arXiv 2504.11536): text reasoning traces rewritten so that their
computation happens in code, with the code's real outputs spliced in.

    jaxrl-tools prepare retool-coldstart --input traces.jsonl \\
        --output data/retool_coldstart.jsonl --endpoint http://localhost:8000/v1 \\
        --model Qwen2.5-32B-Instruct

For each input row ({"prompt" or "problem", "response" or "solution", "ground_truth" or
"answer"}), a model behind any OpenAI-compatible endpoint rewrites the solution with
`REWRITE_PROMPT`: its computations become `<code>` blocks. Every block then runs in the
sandbox, in one session per trace (as the retool recipe's Python tool runs them), and its output
is spliced in after the block in the rollout's own markup (`<interpreter>...</interpreter>`);
anything the rewriter wrote there itself is dropped. A trace is kept only if it has a block,
its tags are well formed, every block ran, and its last `\\boxed{}` (outside the outputs)
equals the reference. The counts of each rejection are printed.

Output rows: {"prompt", "response", "ground_truth"}; `sft.train_files` reads them, rendering the
prompt with the run's chat template and training on the response except its outputs.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

from jaxrl_tools.data import DataError
from jaxrl_tools.datasets.files import read_rows, sha256, write_records
from jaxrl_tools.rewards.answers import last_boxed, math_equal
from jaxrl_tools.tools import PythonTool, get_parser

REWRITE_PROMPT = """\
Rewrite the solution below so that its computations are done by Python code.

Keep the reasoning in words. Wherever the solution computes something (arithmetic, algebra, \
counting cases, checking a value), write the code instead, inside <code> and </code> as one \
```python block that prints what it finds. Do not write the printed result yourself: it will \
be inserted after each block, inside <interpreter> and </interpreter>, and your next words \
may use it. End with the final answer, the same as the solution's, as \\boxed{{...}}.

Problem:
{problem}

Solution:
{solution}
"""

REJECTIONS = ("request_failed", "no_code", "unparsable", "code_failed", "wrong_answer")
_CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)
_INTERPRETER = re.compile(r"\s*<interpreter>.*?</interpreter>", re.DOTALL)


def _field(row: Mapping, names: tuple[str, ...], where: str) -> str:
    for name in names:
        if isinstance(row.get(name), str) and row[name].strip():
            return row[name]
    raise DataError(f"{where}: needs one of the text fields {list(names)}")


def rewrite_request(endpoint: str, model: str, prompt: str, *, api_key: str | None = None,
                    max_tokens: int = 4096, timeout_s: float = 300.0) -> str:  # fmt: skip
    """The rewriter's answer to `prompt` (POST {endpoint}/chat/completions, greedy)."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0,
            "max_tokens": max_tokens,
        }
    ).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        endpoint.rstrip("/") + "/chat/completions", data=body, headers=headers
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


async def splice(text: str, run_code, format_observation) -> tuple[str | None, str]:
    """The trace with each `<code>` block's real output after it, or (None, the rejection).

    Args:
      text: the rewriter's trace.
      run_code: async code -> (ok, output text), the blocks of one trace in order.
      format_observation: the protocol's markup of an output (the retool parser's).
    """
    text = _INTERPRETER.sub("", text)  # the rewriter's own guesses at outputs
    if "<code>" not in text:
        return None, "no_code"
    if text.count("<code>") != text.count("</code>") or len(_CODE.findall(text)) != text.count(
        "<code>"
    ):
        return None, "unparsable"
    out, pos = [], 0
    for m in _CODE.finditer(text):
        ok, output = await run_code(m.group(1))
        if not ok:
            return None, "code_failed"
        out += [text[pos : m.end()], format_observation([output])]
        pos = m.end()
        while text.startswith("\n", pos):  # the markup ends the line; the model writes on
            pos += 1
    out.append(text[pos:])
    return "".join(out), ""


def model_text(spliced: str) -> str:
    """The trace without its outputs (what the model wrote)."""
    return re.sub(r"<interpreter>.*?</interpreter>", "", spliced, flags=re.DOTALL)


async def build(
    rows: Iterable[tuple[str, Mapping]],
    rewrite,
    tool,
    *,
    concurrency: int = 8,
) -> tuple[list[dict], Counter]:
    """The kept cold-start records and the count of each rejection.

    Args:
      rows: (where, row) pairs of text traces.
      rewrite: sync (problem, solution) -> the rewriter's trace; raises on a failed request.
      tool: a session-mode `PythonTool` (its sandbox runs every block).
    """
    parser = get_parser("retool")
    gate = asyncio.Semaphore(concurrency)
    counts: Counter = Counter()

    async def one(i: int, where: str, row: Mapping) -> dict | None:
        problem = _field(row, ("prompt", "problem", "question"), where)
        solution = _field(row, ("response", "solution"), where)
        answer = row.get("ground_truth", row.get("answer"))
        if answer is None:
            raise DataError(f"{where}: needs the reference answer (ground_truth or answer)")
        async with gate:
            try:
                text = await asyncio.to_thread(rewrite, problem, solution)
            except (OSError, urllib.error.URLError, KeyError, ValueError, TypeError):
                counts["request_failed"] += 1
                return None

            async def run_code(code: str) -> tuple[bool, str]:
                obs = await tool.call({"code": parser._body(code)}, f"coldstart-{i}")
                return obs.ok, obs.text

            try:
                spliced, rejection = await splice(text, run_code, parser.format_observation)
            finally:
                await tool.close_session(f"coldstart-{i}")
        if spliced is None:
            counts[rejection] += 1
            return None
        boxed = last_boxed(model_text(spliced))
        if boxed is None or not math_equal(boxed, str(answer)):
            counts["wrong_answer"] += 1
            return None
        counts["kept"] += 1
        return {"prompt": problem, "response": spliced, "ground_truth": answer}

    rows = list(rows)
    done = await asyncio.gather(*(one(i, w, r) for i, (w, r) in enumerate(rows)))
    return [r for r in done if r is not None], counts


def run(args) -> int:
    """`jaxrl-tools prepare retool-coldstart`: builds, writes, prints the counts."""
    if not args.endpoint or not args.model:
        raise DataError("retool-coldstart needs --endpoint (an OpenAI-compatible /v1) and --model")
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None

    def rewrite(problem: str, solution: str) -> str:
        prompt = REWRITE_PROMPT.format(problem=problem, solution=solution)
        return rewrite_request(args.endpoint, args.model, prompt, api_key=api_key)

    rows = [item for p in args.input for item in read_rows(Path(p))]

    async def main():
        tool = PythonTool(mode="session")
        try:
            return await build(rows, rewrite, tool, concurrency=args.concurrency)
        finally:
            await tool.close()

    kept, counts = asyncio.run(main())
    if not kept:
        raise DataError(f"retool-coldstart kept no trace of {len(rows)} ({dict(counts)})")
    n = write_records(kept, Path(args.output))
    rejected = ", ".join(f"{k} {counts.get(k, 0)}" for k in REJECTIONS)
    print(f"jaxrl-tools prepare: kept {n} of {len(rows)} traces ({rejected}) -> {args.output}")
    print(f"sha256 {sha256(Path(args.output))}  {args.output}")
    return 0
