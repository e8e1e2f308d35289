"""DeepResearcher's question filters (arXiv 2504.03160) as a data step: drop the questions that
are time-sensitive (the answer changes with the date), highly subjective, or potentially
harmful, as judged by a model behind an OpenAI-compatible endpoint.

    kept, dropped = filter_questions(records, ask, question_key="question")

where `ask(prompt) -> reply` is the judge (`endpoint_judge` for a /v1 endpoint), or

    python -m jaxrl_tools.datasets.question_filter --input data/train.jsonl \\
        --output data/train.filtered.jsonl --endpoint http://host:8000/v1 --model <name>

The output keeps the input's lines as they were (jsonl), minus the dropped ones; the command
prints how many each reason dropped. A reply that is not the JSON asked for drops the question
("unjudged"): a question nobody vouched for is not trained on. The paper names the kinds, not
its judge's prompt: `JUDGE_PROMPT` is ours.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxrl_tools.data import DataError

KINDS = ("time_sensitive", "subjective", "harmful")
JUDGE_PROMPT = """Classify this question for a question-answering training set.
- time_sensitive: its correct answer depends on when it is asked (e.g. "who is the current CEO").
- subjective: it asks for an opinion or taste, with no single verifiable answer.
- harmful: answering it could help someone cause harm.
Reply with only a JSON object: {{"time_sensitive": true|false, "subjective": true|false, \
"harmful": true|false}}

Question: {question}"""

Ask = Callable[[str], str]
_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


def judge(question: str, ask: Ask) -> list[str]:
    """The kinds `ask`'s judge flags for `question` (["unjudged"] when its reply is not the
    JSON object asked for)."""
    m = _OBJECT.search(ask(JUDGE_PROMPT.format(question=question)))
    try:
        flags = json.loads(m.group(0)) if m else None
    except ValueError:
        flags = None
    if not isinstance(flags, dict) or not all(isinstance(flags.get(k), bool) for k in KINDS):
        return ["unjudged"]
    return [k for k in KINDS if flags[k]]


def filter_questions(
    records: Sequence[dict], ask: Ask, *, question_key: str = "question"
) -> tuple[list[dict], Counter]:
    """(kept records, count of the dropped by reason; a question with several flags counts
    under its first)."""
    kept, dropped = [], Counter()
    for i, rec in enumerate(records):
        question = rec.get(question_key)
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"record {i + 1}: no {question_key!r} text (--question-key)")
        flags = judge(question, ask)
        if flags:
            dropped[flags[0]] += 1
        else:
            kept.append(rec)
    return kept, dropped


def endpoint_judge(endpoint: str, model: str, api_key: str | None = None) -> Ask:
    """The judge at an OpenAI-compatible /v1 endpoint, greedy."""
    from jaxrl_tools.datasets.retool_coldstart import rewrite_request  # noqa: PLC0415

    return lambda prompt: rewrite_request(endpoint, model, prompt, api_key=api_key, max_tokens=64)


def main(argv: Sequence[str] | None = None, ask: Ask | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="question records (jsonl)")
    p.add_argument("--output", required=True, help="where the kept records go (jsonl)")
    p.add_argument("--question-key", default="question", help="the question's field")
    p.add_argument("--endpoint", help="the judge's OpenAI-compatible base url (.../v1)")
    p.add_argument("--model", help="the judge's model name at that endpoint")
    p.add_argument("--api-key-env", help="an environment variable holding its API key")
    args = p.parse_args(argv)
    if ask is None:
        if not args.endpoint or not args.model:
            raise DataError("question_filter: give the judge as --endpoint and --model")
        key = os.environ.get(args.api_key_env) if args.api_key_env else None
        ask = endpoint_judge(args.endpoint, args.model, key)
    path = Path(args.input)
    if not path.is_file():
        raise DataError(f"--input {path}: file not found")
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line) if line.strip() else None)
        except ValueError:
            raise DataError(f"{path}:{n}: bad JSON") from None
    numbered = [(n, r) for n, r in enumerate(rows, 1) if r is not None]
    for n, r in numbered:  # name the line of a record without a question before judging any
        if not isinstance(r, dict) or not isinstance(r.get(args.question_key), str):
            raise DataError(f"{path}:{n}: no {args.question_key!r} text (--question-key)")
    kept, dropped = filter_questions([r for _, r in numbered], ask, question_key=args.question_key)
    kept_ids = {id(r) for r in kept}
    keep = {n for n, r in numbered if id(r) in kept_ids}
    Path(args.output).write_text("".join(x for n, x in enumerate(lines, 1) if n in keep))
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())) or "none"
    print(f"kept {len(kept)} of {len(numbered)} questions (dropped: {reasons}) -> {args.output}")


if __name__ == "__main__":
    main()
