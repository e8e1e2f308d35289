"""DeepResearcher's question filters (jaxrl_tools/datasets/question_filter.py) with a scripted
judge: what is dropped and why, the kept lines as they were, and the errors."""

import json

import pytest

from jaxrl_tools.data import DataError
from jaxrl_tools.datasets import question_filter as qf

VERDICTS = {
    "Who is the current mayor of Lisbon?": '{"time_sensitive": true, "subjective": false, "harmful": false}',
    "Which city has the nicest beaches?": 'Sure: {"time_sensitive": false, "subjective": true, "harmful": false}',
    "How do I pick my neighbour's lock?": '{"time_sensitive": false, "subjective": false, "harmful": true}',
    "Where was Moran Bite born?": '{"time_sensitive": false, "subjective": false, "harmful": false}',
    "Who founded Quito Labs?": "I cannot tell.",
}  # fmt: skip


def ask(prompt):
    assert prompt.startswith("Classify this question")  # the judge sees JUDGE_PROMPT
    return VERDICTS[prompt.rsplit("Question: ", 1)[1]]


def test_flagged_and_unjudged_questions_are_dropped():
    records = [{"question": q, "golden_answers": ["x"]} for q in VERDICTS]
    kept, dropped = qf.filter_questions(records, ask)
    assert [r["question"] for r in kept] == ["Where was Moran Bite born?"]
    assert dropped == {"time_sensitive": 1, "subjective": 1, "harmful": 1, "unjudged": 1}
    with pytest.raises(DataError, match=r"record 1: no 'prompt' text \(--question-key\)"):
        qf.filter_questions(records, ask, question_key="prompt")


def test_command_keeps_the_input_lines_as_they_were(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"question": q, "id": i}) + "\n" for i, q in enumerate(VERDICTS)]
    src.write_text("".join(lines))
    out = tmp_path / "out.jsonl"
    qf.main(["--input", str(src), "--output", str(out)], ask=ask)
    assert out.read_text() == lines[3]
    assert "kept 1 of 5 questions (dropped: harmful 1, subjective 1, time_sensitive 1, " in (
        capsys.readouterr().out
    )
    src.write_text(lines[0] + '{"q": "no question"}\n')
    with pytest.raises(DataError, match=r"in\.jsonl:2: no 'question' text"):
        qf.main(["--input", str(src), "--output", str(out)], ask=ask)
    with pytest.raises(DataError, match="give the judge as --endpoint and --model"):
        qf.main(["--input", str(src), "--output", str(out)])
