"""`jaxrl-tools prepare`: the benchmark files a user downloaded -> the files the recipes read.

    jaxrl-tools prepare dapo-math-17k --input dapo-math-17k.parquet \\
        --output data/dapo_math_17k.parquet

Each dataset below names its source, the input columns it reads and the recipes' default output
path; `jaxrl-tools check` prints the command when a recipe's file is missing (`missing_hint`).
Outputs (.jsonl or .parquet by suffix):

  math (dapo-math-17k, torl, aime24, math500, math)  {"prompt", "ground_truth", "data_source", "id"}
      the problem with an answer instruction appended (`--instruction`), duplicates dropped
  nq-hotpotqa   {"question", "golden_answers", "data_source", "id"}      (search_r1.yaml)
  wiki18        {"id", "contents"} per line, streamed (21M passages)      (the search tool)
  bfcl          {"prompt", "tools", "ground_truth"} via `function_calling.from_bfcl`

Every run ends by printing the record count and the output's sha256.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from jaxrl_tools.data import DataError
from jaxrl_tools.datasets import pretrained
from jaxrl_tools.datasets.files import read_rows, sha256, write_records
from jaxrl_tools.datasets.function_calling import from_bfcl
from jaxrl_tools.rewards.answers import last_boxed

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# DAPO-Math-17k wraps each problem in its own answer format ("Answer: $X"); our math rewards
# read \boxed{}, so the wrapper is replaced by --instruction.
_DAPO_HEAD = "Solve the following math problem step by step."
_DAPO_TAIL = "\n\nRemember to put your answer on its own line after"


@dataclasses.dataclass(frozen=True)
class Dataset:
    """One downloadable benchmark and how it becomes a recipe's input."""

    name: str
    what: str  # one line: what the file is
    source: str  # where to download it
    download: str  # the file(s) to pass as --input
    columns: str  # the input columns read
    outputs: tuple[str, ...]  # the recipes' default output paths
    convert: Callable[[Iterable[tuple[str, Mapping]], argparse.Namespace], Iterator[dict]]


def _get(row: Mapping, keys: tuple[str, ...]) -> Any:
    for k in keys:
        if row.get(k) is not None:
            return row[k]
    return None


# ---------------------------------------------------------------------------- converters


def _verl_problem(row: Mapping) -> tuple[str | None, Any]:
    """(problem, answer) of a verl-format row: `prompt` chat messages + `reward_model`."""
    msgs, rm = row.get("prompt"), row.get("reward_model")
    if not isinstance(msgs, list) or not isinstance(rm, Mapping):
        return None, None
    users = [m.get("content") for m in msgs if isinstance(m, Mapping) and m.get("role") == "user"]
    text = users[-1] if users else None
    if isinstance(text, str) and text.startswith(_DAPO_HEAD) and _DAPO_TAIL in text:
        text = text[text.index("\n\n") + 2 : text.rindex(_DAPO_TAIL)]
    return text, rm.get("ground_truth")


def math_records(rows: Iterable[tuple[str, Mapping]], opts: argparse.Namespace) -> Iterator[dict]:
    """Math problems from verl parquet (DAPO, ToRL: `prompt` messages + `reward_model.
    ground_truth`) or flat rows (`problem`/`question` + `answer`, or a `solution` whose last
    \\boxed{} is the answer: hendrycks MATH)."""
    seen = set()
    for where, row in rows:
        problem, answer = _verl_problem(row)
        if problem is None:
            problem = _get(row, ("problem", "Problem", "question", "Question"))
            answer = _get(row, ("answer", "Answer", "final_answer", "ground_truth"))
            if answer is None and _get(row, ("solution", "Solution")) is not None:
                answer = last_boxed(str(_get(row, ("solution", "Solution"))))
        if not isinstance(problem, str) or not problem.strip() or answer is None:
            raise DataError(
                f"{where}: need a problem (verl 'prompt' + 'reward_model', or 'problem' / "
                f"'question') and an answer ('answer', or a 'solution' with \\boxed{{}}); "
                f"fields: {sorted(row)}"
            )
        problem, answer = problem.strip(), str(answer).strip()
        if (problem, answer) in seen:  # DAPO-Math-17k's parquet repeats each problem 100 times
            continue
        seen.add((problem, answer))
        append = opts.instruction and not _has_instruction(problem)
        prompt = f"{problem}\n\n{opts.instruction}" if append else problem
        yield {
            "prompt": prompt,
            "ground_truth": answer,
            "data_source": str(row.get("data_source") or opts.name),
            "id": str(_record_id(row) or where.rsplit(":", 1)[-1]),
        }


def _has_instruction(problem: str) -> bool:
    """Whether the problem's last paragraph already asks for a \\boxed{} answer (ToRL's
    prompts carry their own instruction; a second one would contradict or repeat it)."""
    last = problem.rsplit("\n\n", 1)[-1].lower()
    return "\\boxed" in last


def _record_id(row: Mapping) -> Any:
    extra = row.get("extra_info")
    index = extra.get("index") if isinstance(extra, Mapping) else None
    return _get(row, ("id", "ID", "unique_id")) or index


def qa_records(rows: Iterable[tuple[str, Mapping]], opts: argparse.Namespace) -> Iterator[dict]:
    """QA pairs from FlashRAG / Search-R1 rows (`question` + `golden_answers`, or
    `reward_model.ground_truth.target`) or HotpotQA's own (`question` + `answer`)."""
    for where, row in rows:
        question = row.get("question")
        answers = row.get("golden_answers")
        rm = row.get("reward_model")
        if answers is None and isinstance(rm, Mapping) and isinstance(rm.get("ground_truth"), dict):
            answers = rm["ground_truth"].get("target")
        if answers is None:
            answers = _get(row, ("answers", "answer"))
        if isinstance(answers, Mapping):  # SQuAD: {"text": [...], "answer_start": [...]}
            if "text" not in answers:
                raise DataError(f"{where}: 'answers' is a dict without 'text': {sorted(answers)}")
            answers = answers["text"]
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(question, str) or not question.strip() or not answers:
            raise DataError(
                f"{where}: need 'question' and 'golden_answers' (or 'answer'); "
                f"fields: {sorted(row)}"
            )
        question = question.strip()
        if not question.endswith("?"):  # as Search-R1's data script does
            question += "?"
        yield {
            "question": question,
            "golden_answers": [str(a) for a in answers],
            "data_source": str(row.get("data_source") or where.split(":")[0].rsplit("/", 1)[-1]),
            "id": str(row.get("id") or where.rsplit(":", 1)[-1]),
        }


def corpus_records(rows: Iterable[tuple[str, Mapping]], opts) -> Iterator[dict]:
    """Search-R1's wiki-18 passages (`id` + `contents` = '"Title"\\ntext', or `title` +
    `text`), one by one."""
    for where, row in rows:
        contents = row.get("contents")
        if contents is None and row.get("text") is not None:
            contents = f'"{row.get("title", "")}"\n{row["text"]}'
        if not isinstance(contents, str) or row.get("id") is None:
            raise DataError(f"{where}: need 'id' and 'contents' (or 'title' + 'text')")
        yield {"id": str(row["id"]), "contents": contents}


def bfcl_records(rows: Iterable[tuple[str, Mapping]], opts: argparse.Namespace) -> Iterator[dict]:
    """BFCL question rows with their possible-answer rows (`--answers`, matched by id); a
    question without one (the irrelevance categories) expects no call."""
    answers = {}
    for path in opts.answers or ():
        answers.update((row.get("id"), row) for _, row in read_rows(Path(path)))
    for where, row in rows:
        answer = answers.get(row.get("id"), {"id": row.get("id"), "ground_truth": []})
        try:
            yield from from_bfcl(row, answer)
        except (DataError, KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: {e}") from None


_MATH = "{'problem' or 'question', 'answer'} rows, or verl 'prompt' + 'reward_model.ground_truth'"
DATASETS = {
    d.name: d
    for d in (
        Dataset(
            "dapo-math-17k",
            "DAPO-Math-17K training problems",
            "https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k",
            "data/dapo-math-17k.parquet",
            "verl: prompt (chat messages), reward_model.ground_truth, data_source",
            ("data/dapo_math_17k.parquet",),
            math_records,
        ),
        Dataset(
            "torl",
            "ToRL's 28k training problems",
            "https://github.com/GAIR-NLP/ToRL/tree/main/data/torl_data",
            "train.parquet",
            "verl: prompt (chat messages), reward_model.ground_truth, data_source",
            ("data/torl_train.parquet",),
            math_records,
        ),
        Dataset(
            "aime24",
            "AIME 2024 (30 problems, evaluation)",
            "https://huggingface.co/datasets/HuggingFaceH4/aime_2024",
            "data/train-*.parquet",
            _MATH,
            ("data/aime_2024.parquet",),
            math_records,
        ),
        Dataset(
            "math500",
            "MATH-500 (evaluation)",
            "https://huggingface.co/datasets/HuggingFaceH4/MATH-500",
            "test.jsonl",
            "problem, answer, unique_id",
            ("data/math500.parquet",),
            math_records,
        ),
        Dataset(
            "math",
            "MATH (hendrycks) training problems",
            "https://huggingface.co/datasets/EleutherAI/hendrycks_math",
            "every <subject>/train-*.parquet",
            "problem, solution (the answer is its last \\boxed{})",
            ("data/math_train.parquet",),
            math_records,
        ),
        Dataset(
            "nq-hotpotqa",
            "Search-R1's NQ + HotpotQA questions",
            "https://huggingface.co/datasets/RUC-NLPIR/FlashRAG_datasets",
            "nq/train.jsonl and hotpotqa/train.jsonl (test: nq/test.jsonl, hotpotqa/dev.jsonl)",
            "question, golden_answers (or Search-R1's parquet: reward_model.ground_truth.target)",
            ("data/nq_hotpotqa_train.parquet", "data/nq_hotpotqa_test.parquet"),
            qa_records,
        ),
        Dataset(
            "wiki18",
            "Search-R1's wiki-18 corpus (21M passages)",
            "https://huggingface.co/datasets/PeterJinGo/wiki-18-corpus",
            "wiki-18.jsonl.gz",
            "id, contents ('\"Title\"\\ntext')",
            ("data/wiki18_corpus.jsonl",),
            corpus_records,
        ),
        Dataset(
            "bfcl",
            "BFCL function-calling questions",
            "https://github.com/ShishirPatil/gorilla/tree/main/berkeley-function-call-leaderboard/data",
            "BFCL_v3_simple.json (and --answers possible_answer/BFCL_v3_simple.json)",
            "id, question (turns), function (declarations); answers: id, ground_truth",
            ("data/bfcl.jsonl",),
            bfcl_records,
        ),
    )
}


def prepare(name: str, inputs, output, *, instruction=BOXED_INSTRUCTION, answers=()) -> int:
    """Converts `inputs` (paths) of dataset `name` into `output`; returns the record count."""
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; known: {sorted(DATASETS)}")
    output = Path(output)
    if output.suffix not in (".jsonl", ".parquet"):
        raise DataError(f"--output {output}: give a .jsonl or .parquet path")
    if name == "wiki18" and output.suffix != ".jsonl":
        raise DataError("--output: the wiki18 corpus is written as .jsonl (streamed)")
    opts = argparse.Namespace(name=name, instruction=instruction, answers=list(answers or ()))
    rows = (item for p in inputs for item in read_rows(Path(p)))
    return write_records(DATASETS[name].convert(rows, opts), output)


def missing_hint(path: str) -> str | None:
    """One line for a recipe's missing file: what it is and the command that makes it."""
    if Path(path).name == "retool_coldstart.jsonl":
        return (
            f"{path} is missing: ReTool's code-integrated cold-start traces; run `jaxrl-tools "
            f"prepare retool-coldstart --input <text reasoning traces> --output {path} "
            "--endpoint <an OpenAI-compatible /v1> --model <its model>`"
        )
    for d in DATASETS.values():
        for default in d.outputs:
            if Path(default).name == Path(path).name:
                extra = " --answers <possible_answer file>" if d.name == "bfcl" else ""
                return (
                    f"{path} is missing: {d.what}; download {d.download} from {d.source}, then "
                    f"run `jaxrl-tools prepare {d.name} --input <downloaded file>{extra} "
                    f"--output {path}`"
                )
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `prepare` subcommand's arguments."""
    table = "\n".join(f"  {d.name:14s}{d.what}: {d.source}" for d in DATASETS.values())
    p.description = (
        f"datasets:\n{table}\nmodels (-> a Hugging Face folder):\n{pretrained.describe()}"
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("dataset", choices=sorted([*DATASETS, "retool-coldstart", *pretrained.COMMANDS]))
    p.add_argument("--input", action="append", help="a downloaded file (repeat)")
    p.add_argument("--output", required=True, help="the .jsonl or .parquet (a model: folder)")
    p.add_argument("--answers", action="append", help="bfcl: possible-answer file(s)")
    p.add_argument(
        "--instruction",
        default=BOXED_INSTRUCTION,
        help="math: appended to each problem ('' for none)",
    )
    coldstart = p.add_argument_group("retool-coldstart (text traces -> code-integrated traces)")
    coldstart.add_argument("--endpoint", help="the rewriter's OpenAI-compatible base url (.../v1)")
    coldstart.add_argument("--model", help="the rewriter's model name at that endpoint")
    coldstart.add_argument("--api-key-env", help="an environment variable holding its API key")
    coldstart.add_argument("--concurrency", type=int, default=8, help="traces in flight")
    pretrained.add_arguments(p)
    p.set_defaults(overrides=[])  # the CLI's dotted overrides: prepare takes none


def run(args: argparse.Namespace) -> int:
    """`jaxrl-tools prepare`: converts, then prints the count and the output's sha256."""
    if args.dataset in pretrained.COMMANDS:  # models, not records
        return pretrained.run(args)
    if not args.input:
        raise DataError(f"prepare {args.dataset}: give the downloaded file(s) as --input")
    if args.dataset == "retool-coldstart":  # a model and the sandbox, not a conversion
        from jaxrl_tools.datasets import retool_coldstart  # noqa: PLC0415

        return retool_coldstart.run(args)
    n = prepare(
        args.dataset, args.input, args.output, instruction=args.instruction, answers=args.answers
    )
    print(f"jaxrl-tools prepare: wrote {n} {args.dataset} records to {args.output}")
    print(f"sha256 {sha256(Path(args.output))}  {args.output}")
    return 0
