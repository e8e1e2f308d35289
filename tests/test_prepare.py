"""`jaxrl-tools prepare`: each converter on a few rows in its dataset's real format, read back the
way the recipes read them; the printed sha256; `check` naming the command for a missing file."""

import gzip
import hashlib
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl_tools import data
from jaxrl_tools.cli import main
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.datasets.prepare import BOXED_INSTRUCTION, DATASETS, prepare

ROOT = Path(__file__).resolve().parent.parent
DAPO_WRAP = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
    'problem.\n\n{}\n\nRemember to put your answer on its own line after "Answer:"'
)


def parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_back(path: Path, prompt_key="prompt", answer_key="ground_truth") -> list[dict]:
    """The records as a recipe's loader sees them (the converter's output is a valid input)."""
    source = data.RecordSource([path], prompt_key=prompt_key, answer_key=answer_key)
    return [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in source]


def boxed(problem: str) -> str:
    return f"{problem}\n\n{BOXED_INSTRUCTION}"


def test_math_converters_on_each_format(tmp_path):
    # DAPO-Math-17k (verl parquet; the published file repeats each problem)
    dapo_row = {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_WRAP.format("What is $2+3$?"), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "5", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "9a1"},
    }
    dapo = parquet(tmp_path / "dapo.parquet", [dapo_row] * 3)
    # ToRL's train.parquet (verl, a system message first)
    torl = parquet(
        tmp_path / "torl.parquet",
        [
            {
                "data_source": "aime24",
                "prompt": [
                    {"content": "Please reason step by step.", "role": "system"},
                    {"content": "Find $x$ if $x+1=3$.", "role": "user"},
                ],
                "ability": "other",
                "reward_model": {"ground_truth": "2", "stype": "rule"},
                "extra_info": {"id": "u1", "split": "train"},
            }
        ],
    )
    # AIME 2024 (HuggingFaceH4/aime_2024; Maxwell-Jia/AIME_2024 capitalises, integer answers)
    aime = parquet(
        tmp_path / "aime.parquet",
        [{"id": 60, "problem": "Aya walks.", "solution": "...", "answer": "204", "year": 2024}],
    )
    aime_caps = jsonl(
        tmp_path / "aime_caps.jsonl",
        [{"ID": "2024-I-1", "Problem": "Aya walks.", "Solution": "...", "Answer": 204}],
    )
    # MATH-500 (test.jsonl) and hendrycks MATH (no answer column: the last \boxed{})
    m500 = jsonl(
        tmp_path / "test.jsonl",
        [{"problem": "Compute $1/2+1/2$.", "solution": "...", "answer": "1",
          "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}],
    )  # fmt: skip
    hendrycks = jsonl(
        tmp_path / "math_train.jsonl",
        [{"problem": "Simplify $\\frac{2}{4}$.", "level": "Level 1", "type": "Prealgebra",
          "solution": "It is $\\boxed{\\frac{1}{2}}$."}],
    )  # fmt: skip
    cases = [
        ("dapo-math-17k", [dapo], "out.parquet", [(boxed("What is $2+3$?"), "5")]),
        ("torl", [torl], "t.jsonl", [(boxed("Find $x$ if $x+1=3$."), "2")]),
        ("aime24", [aime, aime_caps], "a.parquet", [(boxed("Aya walks."), "204")]),
        ("math500", [m500], "m.jsonl", [(boxed("Compute $1/2+1/2$."), "1")]),
        ("math", [hendrycks], "h.parquet", [(boxed("Simplify $\\frac{2}{4}$."), "\\frac{1}{2}")]),
    ]
    for name, inputs, out, expected in cases:
        out = tmp_path / out
        assert prepare(name, inputs, out) == len(expected), name
        got = read_back(out)
        assert [(r["prompt"], r["ground_truth"]) for r in got] == expected, name
    assert pq.read_table(tmp_path / "out.parquet").to_pylist()[0]["id"] == "9a1"
    prepare("math500", [m500], tmp_path / "bare.jsonl", instruction="")
    assert read_back(tmp_path / "bare.jsonl")[0]["prompt"] == "Compute $1/2+1/2$."


def test_prompts_that_ask_for_boxed_get_no_second_instruction(tmp_path):
    # ToRL's user turns end with their own \\boxed{} instruction: appending ours made two.
    own = "Find $x$ if $x+1=3$.\nPlease reason step by step, and put your final answer within \\boxed{}."
    row = {
        "prompt": [{"content": own, "role": "user"}],
        "reward_model": {"ground_truth": "2"},
        "data_source": "torl",
    }
    other = {"problem": "Find $y$ if $2y=6$.", "answer": "3"}  # no instruction: one appended
    out = tmp_path / "t.jsonl"
    prepare(
        "torl",
        [parquet(tmp_path / "torl.parquet", [row]), jsonl(tmp_path / "o.jsonl", [other])],
        out,
    )
    assert [r["prompt"] for r in read_back(out)] == [own, boxed("Find $y$ if $2y=6$.")]


def test_squad_answers_dicts_give_their_texts(tmp_path):
    squad = jsonl(
        tmp_path / "squad.jsonl",
        [{"id": "5733be", "question": "Who founded the school",
          "answers": {"text": ["Father Sorin", "Sorin"], "answer_start": [12, 19]}}],
    )  # fmt: skip
    out = tmp_path / "q.jsonl"
    prepare("nq-hotpotqa", [squad], out)
    got = read_back(out, prompt_key="question", answer_key="golden_answers")
    assert got == [{"prompt": "Who founded the school?", "ground_truth": ["Father Sorin", "Sorin"]}]
    bad = jsonl(tmp_path / "bad.jsonl", [{"question": "q?", "answers": {"answer_start": [1]}}])
    with pytest.raises(data.DataError, match=r"bad.jsonl:1: 'answers' is a dict without 'text'"):
        prepare("nq-hotpotqa", [bad], tmp_path / "b.jsonl")


def test_search_r1_questions_and_corpus(tmp_path):
    nq = jsonl(
        tmp_path / "nq_train.jsonl",
        [{"id": "train_0", "question": "total number of death row inmates in the us",
          "golden_answers": ["2,718"]}],
    )  # fmt: skip
    hotpot = jsonl(
        tmp_path / "hotpotqa_train.jsonl",
        [{"id": "5a8b", "question": "Which magazine was started first?",
          "golden_answers": ["Arthur's Magazine"], "metadata": {"type": "comparison"}}],
    )  # fmt: skip
    processed = parquet(  # Search-R1's own processed parquet
        tmp_path / "test.parquet",
        [{"id": "test_0", "question": "who got the first nobel prize in physics",
          "data_source": "nq", "prompt": [{"role": "user", "content": "..."}],
          "reward_model": {"style": "rule", "ground_truth": {"target": ["Wilhelm Röntgen"]}}}],
    )  # fmt: skip
    out = tmp_path / "nq_hotpotqa_train.parquet"
    assert prepare("nq-hotpotqa", [nq, hotpot, processed], out) == 3
    got = read_back(out, prompt_key="question", answer_key="golden_answers")
    assert got == [
        {"prompt": "total number of death row inmates in the us?", "ground_truth": ["2,718"]},
        {"prompt": "Which magazine was started first?", "ground_truth": ["Arthur's Magazine"]},
        {
            "prompt": "who got the first nobel prize in physics?",
            "ground_truth": ["Wilhelm Röntgen"],
        },
    ]
    sources = [r["data_source"] for r in pq.read_table(out).to_pylist()]
    assert sources == ["nq_train.jsonl", "hotpotqa_train.jsonl", "nq"]

    wiki = tmp_path / "wiki-18.jsonl.gz"
    lines = [
        {"id": "0", "contents": '"Aaron"\nAaron is a prophet.'},
        {"id": "1", "contents": '"Ab"\nAb is a month.'},
    ]
    with gzip.open(wiki, "wt", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(x) + "\n" for x in lines))
    corpus = tmp_path / "wiki18_corpus.jsonl"
    assert prepare("wiki18", [wiki], corpus) == 2
    assert [json.loads(x) for x in corpus.read_text().splitlines()] == lines


def test_bfcl_through_from_bfcl(tmp_path):
    fn = {
        "name": "calculate_triangle_area",
        "description": "Calculate the area of a triangle.",
        "parameters": {
            "type": "dict",
            "properties": {
                "base": {"type": "integer", "description": "The base."},
                "height": {"type": "integer", "description": "The height."},
                "unit": {"type": "string", "description": "The unit."},
            },
            "required": ["base", "height"],
        },
    }
    question = {"role": "user", "content": "Area of a triangle with base 10 and height 5?"}
    questions = jsonl(
        tmp_path / "BFCL_v3_simple.json",
        [
            {"id": "simple_0", "question": [[question]], "function": [fn]},
            {"id": "irrelevance_0", "question": [[question]], "function": [fn]},
        ],
    )
    answers = jsonl(
        tmp_path / "possible_answer.json",
        [
            {
                "id": "simple_0",
                "ground_truth": [
                    {"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["", "cm"]}}
                ],
            }
        ],
    )
    out = tmp_path / "bfcl.jsonl"
    assert prepare("bfcl", [questions], out, answers=[answers]) == 2
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert recs[0]["prompt"] == [question]
    assert recs[0]["tools"][0]["function"]["parameters"]["type"] == "object"
    assert recs[0]["ground_truth"] == [
        {"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}
    ]
    assert recs[1]["ground_truth"] == []  # no possible answer: the right move is no call


def test_cli_prints_a_reproducible_sha256_and_bad_input_is_one_line(tmp_path, capsys):
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": "4"}]
    src = jsonl(tmp_path / "test.jsonl", rows)
    sums = []
    for out in (tmp_path / "a" / "m.parquet", tmp_path / "b" / "m.parquet"):
        assert main(["prepare", "math500", "--input", str(src), "--output", str(out)]) == 0
        printed = capsys.readouterr().out
        assert f"wrote 2 math500 records to {out}" in printed
        digest = re.search(r"sha256 ([0-9a-f]{64})", printed).group(1)
        assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
        sums.append(digest)
    assert sums[0] == sums[1]
    bad = jsonl(tmp_path / "bad.jsonl", [{"question": "no answer here"}])
    assert main(["prepare", "aime24", "--input", str(bad), "--output", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"jaxrl-tools: {bad}:1: need a problem") and "\n" not in err
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "x.jsonl.partial").exists()


@pytest.mark.parametrize(
    "recipe, field, dataset",
    [
        ("dapo", "data.train_files", "dapo-math-17k"),
        ("torl", "data.train_files", "torl"),
        ("artist", "data.train_files", "math"),
    ],
)
def test_check_names_the_prepare_command(recipe, field, dataset, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    default = DATASETS[dataset].outputs[0]
    assert main(["check", "--smoke", "--config", recipe]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("jaxrl-tools:")]
    assert line.startswith(f"jaxrl-tools: {field}: {default} is missing: ")
    assert f"`jaxrl-tools prepare {dataset} --input <downloaded file> --output {default}`" in line
    assert DATASETS[dataset].source in line


def test_every_recipe_file_has_a_prepare_command():
    """Each data file a shipped recipe reads either ships or has a converter."""
    known = {Path(o).name for d in DATASETS.values() for o in d.outputs}
    for path in sorted(ROOT.glob("configs/*.yaml")):
        cfg = load_config(path)
        files = [*cfg.data.train_files, *cfg.data.eval_files]
        files += [t.config["corpus_path"] for t in cfg.tools if "corpus_path" in t.config]
        for f in files:
            assert (ROOT / f).is_file() or Path(f).name in known, (path.name, f)
