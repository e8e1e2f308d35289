"""Tests for jaxrl_tools.data: sources, grain pipeline, resumable state, chat rendering."""

import copy
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl_tools import prompts
from jaxrl_tools.config import DataSection
from jaxrl_tools.data import (
    DataError,
    PromptLoader,
    RecordSource,
    load_sft_traces,
    loader_from_config,
)
from jaxrl_tools.prompts import render_prompt, select_tools
from jaxrl_tools.tools import PythonTool


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def _rows(n):
    return [{"prompt": f"What is {i} + 1?", "ground_truth": str(i + 1), "id": i} for i in range(n)]


def test_jsonl_and_parquet(tmp_path):
    j = _write_jsonl(tmp_path / "a.jsonl", _rows(3))
    pq.write_table(pa.Table.from_pylist(_rows(2)), tmp_path / "b.parquet")
    src = RecordSource([j, tmp_path / "b.parquet"])
    assert len(src) == 5
    assert src[0]["prompt"] == "What is 0 + 1?" and src[0]["ground_truth"] == "1"
    assert src[0]["meta"] == {"id": 0} and src[0]["tools"] is None
    assert src[4]["source"].endswith("b.parquet:2")
    assert src[1]["source"].endswith("a.jsonl:2")


def test_custom_keys_and_chat_prompts(tmp_path):
    rows = [
        {
            "question": [{"role": "user", "content": "hi"}],
            "answer": {"target": ["x"]},
            "tools": ["python"],
        }
    ]
    src = RecordSource(
        [_write_jsonl(tmp_path / "c.jsonl", rows)], prompt_key="question", answer_key="answer"
    )
    assert src[0]["prompt"][0]["content"] == "hi" and src[0]["ground_truth"] == {"target": ["x"]}
    assert src[0]["tools"] == ["python"]


@pytest.mark.parametrize(
    "bad,needle",
    [
        ('{"prompt": "q", "ground_truth": "1"', "bad JSON"),
        ('{"ground_truth": "1"}', "missing field 'prompt'"),
        ('{"prompt": "q"}', "missing field 'ground_truth'"),
        ('{"prompt": [{"content": "x"}], "ground_truth": "1"}', "'role'"),
        ('{"prompt": "q", "ground_truth": "1", "tools": "python"}', "must be a list"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_line_error_names_file_and_line(tmp_path, bad, needle):
    path = _write_jsonl(tmp_path / "bad.jsonl", [_rows(1)[0], "", bad])
    with pytest.raises(DataError) as e:
        RecordSource([path])
    assert f"{path}:3" in str(e.value) and needle in str(e.value)


def test_bad_unicode_is_a_bad_line_naming_file_and_line(tmp_path):
    """A byte that is not UTF-8, or an unpaired surrogate escape (which JSON parses and every
    tokenizer refuses), is the line's error, like bad JSON."""
    good = json.dumps(_rows(1)[0]).encode() + b"\n"
    cases = {
        "latin1.jsonl": (b'{"prompt": "caf\xe9", "ground_truth": "1"}\n', "not UTF-8 (byte 0xe9"),
        "surrogate.jsonl": (
            b'{"prompt": [{"role": "user", "content": "x\\ud800"}], "ground_truth": "1"}\n',
            "field 'prompt'[0]['content'] holds an unpaired surrogate",
        ),
    }
    for name, (bad, needle) in cases.items():
        path = tmp_path / name
        path.write_bytes(good + bad + good)
        with pytest.raises(DataError) as e:
            RecordSource([path])
        assert str(e.value).startswith(f"{path}:2: ") and needle in str(e.value), e.value
        assert len(RecordSource([path], skip_bad_lines=True)) == 2
        traces = tmp_path / f"traces_{name}"
        traces.write_bytes(bad.replace(b'"prompt"', b'"segments"'))
        with pytest.raises(DataError, match=f"{traces}:1: .*(not UTF-8|surrogate)"):
            load_sft_traces([traces])


def test_skip_bad_lines_counts_and_logs(tmp_path, caplog):
    rows = _rows(4)
    lines = [rows[0], "not json", rows[1], '{"prompt": "x"}', rows[2], rows[3]]
    path = _write_jsonl(tmp_path / "d.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="jaxrl_tools.data"):
        src = RecordSource([path], skip_bad_lines=True)
    assert len(src) == 4 and src.num_skipped == 2
    assert [s.line for s in src.skipped] == [2, 4]
    assert f"{path}:2" in caplog.text and "skipped 2 bad line(s)" in caplog.text
    assert [r["ground_truth"] for r in src] == ["1", "2", "3", "4"]


def test_missing_file_and_empty(tmp_path):
    with pytest.raises(DataError, match="not found"):
        RecordSource([tmp_path / "nope.jsonl"])
    with pytest.raises(DataError, match="no valid records"):
        RecordSource([_write_jsonl(tmp_path / "e.jsonl", ["oops"])], skip_bad_lines=True)
    with pytest.raises(DataError, match="unsupported"):
        RecordSource([_write_jsonl(tmp_path / "e.csv", ["a"])])


def _ids(batches):
    return [[r["meta"]["id"] for r in b] for b in batches]


def test_shuffle_deterministic_and_epochs(tmp_path):
    src = RecordSource([_write_jsonl(tmp_path / "f.jsonl", _rows(10))])
    a = PromptLoader(src, batch_size=5, seed=1)
    b = PromptLoader(src, batch_size=5, seed=1)
    c = PromptLoader(src, batch_size=5, seed=2)
    first_a = _ids([next(a) for _ in range(6)])
    assert first_a == _ids([next(b) for _ in range(6)])
    assert first_a != _ids([next(c) for _ in range(6)])
    # each epoch is a permutation, reshuffled between epochs
    epochs = [sorted(first_a[2 * e] + first_a[2 * e + 1]) for e in range(3)]
    assert all(e == list(range(10)) for e in epochs)
    assert first_a[0] + first_a[1] != first_a[2] + first_a[3]
    # finite epochs stop; eval order is file order
    fin = PromptLoader(src, batch_size=4, shuffle=False, num_epochs=1, drop_remainder=False)
    assert _ids(list(fin)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_state_restore_sees_same_data(tmp_path):
    src = RecordSource([_write_jsonl(tmp_path / "g.jsonl", _rows(7))])
    run = PromptLoader(src, batch_size=3, seed=4)
    for _ in range(3):
        next(run)
    state = json.loads(json.dumps(run.get_state()))  # survives a checkpoint round trip
    expected = _ids([next(run) for _ in range(5)])
    resumed = PromptLoader(src, batch_size=3, seed=4)
    resumed.set_state(state)
    assert _ids([next(resumed) for _ in range(5)]) == expected


def test_a_shard_reads_its_slice_of_each_batch(tmp_path):
    """Process 1 of 3 reads records [2:4] of each batch of 6 (and only those), and `gather`
    gives it the whole batch; the iterator state is the unsharded loader's."""
    src = RecordSource([_write_jsonl(tmp_path / "s.jsonl", _rows(9))])
    whole = PromptLoader(src, batch_size=6, seed=2)
    sent = []

    def gather(mine):  # stands in for the all-gather of the other two processes' slices
        sent.append(mine)
        return [["p0"], mine, ["p2"]]

    shard = PromptLoader(src, batch_size=6, seed=2, shard=(1, 3), gather=gather)
    for _ in range(3):
        batch, got = next(whole), next(shard)
        assert sent[-1] == batch[2:4]
        assert got == ["p0", *batch[2:4], "p2"]
    assert shard.get_state() == whole.get_state()
    with pytest.raises(ValueError, match="needs `gather`"):
        PromptLoader(src, batch_size=6, shard=(0, 2))


def test_loader_from_config(tmp_path):
    train = _write_jsonl(tmp_path / "t.jsonl", _rows(6) + ["bad"])
    cfg = DataSection(
        train_files=(str(train),),
        eval_files=(str(train),),
        batch_size=2,
        eval_batch_size=4,
        skip_bad_lines=True,
        shuffle_seed=3,
    )
    tr = loader_from_config(cfg, "train")
    assert len(next(tr)) == 2 and tr.source.num_skipped == 1
    ev = loader_from_config(cfg, "eval")
    assert [len(b) for b in ev] == [4, 2]


def test_render_prompt_with_tools(tok):
    schema = PythonTool.default_schema()
    rec = {"prompt": "What is 2 * 3?", "tools": ["python"]}
    text = render_prompt(tok, rec, [schema], "Use tools.")
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools")
    assert json.dumps(schema) in text
    assert text.endswith("<|im_start|>user\nWhat is 2 * 3?<|im_end|>\n<|im_start|>assistant\n")
    # no tools for this record / no schema
    plain = render_prompt(tok, {"prompt": "hi", "tools": []}, [schema], None)
    assert "<tools>" not in plain and plain.endswith("<|im_start|>assistant\n")
    # chat prompts keep their own system message
    chat = {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]}
    assert render_prompt(tok, chat, None, "ignored").startswith("<|im_start|>system\nS<|im_end|>")
    # a record carrying full schemas
    assert "<tools>" in render_prompt(tok, {"prompt": "q", "tools": [schema]})


def test_plain_template_renders_base_model_prompts(tok):
    plain = prompts.use_template(copy.deepcopy(tok), "plain")
    rec = {"prompt": "What is 2 * 3?", "tools": ["python"]}
    schema = PythonTool.default_schema()
    assert render_prompt(plain, rec, [schema], "Solve it.") == (
        "Solve it.\nUser: What is 2 * 3?\nAssistant:"  # no tool declarations
    )
    assert render_prompt(plain, {"prompt": "q"}) == "User: q\nAssistant:"
    # ToRL's words (its tir_base_0309), a backslash and braces included
    torl_format = (
        "{system}User: Please integrate natural language reasoning with programs to solve the "
        "problem above, and put your final answer within \\boxed{}.\n{prompt}\nAssistant:\n"
    )
    torl = prompts.use_template(copy.deepcopy(tok), "plain", torl_format)
    system = "A conversation between User and Assistant. The user asks a question, and the "
    system += "Assistant solves it."
    assert render_prompt(torl, {"prompt": "1+1?"}, None, system) == (
        f"{system}\nUser: Please integrate natural language reasoning with programs to solve "
        "the problem above, and put your final answer within \\boxed{}.\n1+1?\nAssistant:\n"
    )
    # A trace: the prompt as rendered for the rollout, then the response and the end of text.
    trace = [{"role": "user", "content": "q"}, {"role": "assistant", "content": " 6"}]
    assert plain.apply_chat_template(trace, tokenize=False) == (
        "User: q\nAssistant: 6" + plain.eos_token
    )
    for turns in ([*trace, {"role": "user", "content": "again"}], [trace[0], trace[0]]):
        with pytest.raises(Exception, match="the plain template renders a system prompt, one"):
            render_prompt(plain, {"prompt": turns})
    assert render_prompt(tok, {"prompt": "q"}).startswith("<|im_start|>")  # the chat one intact


def test_select_tools():
    s = PythonTool.default_schema()
    assert select_tools(None, [s]) == [s]
    assert select_tools(["python"], {"python": s}) == [s]
    assert select_tools([], [s]) is None
    with pytest.raises(DataError, match="unknown tool 'search'"):
        select_tools(["search"], [s])
