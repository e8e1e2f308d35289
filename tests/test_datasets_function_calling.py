"""Function-calling data: the generator, the converters on small rows written in each public
format, Tool-N1's preprocessing, and the call metrics by hand."""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_tools.data import DataError, RecordSource
from jaxrl_tools.datasets import (
    call_metrics,
    convert,
    from_bfcl,
    from_hermes,
    from_toolace,
    from_xlam,
    generate,
    valid_record,
)
from jaxrl_tools.rewards import get_reward
from jaxrl_tools.tools import read_tool_calls

XLAM = {
    "id": 7,
    "query": "What's 12 EUR in JPY, and the weather in Oslo?",
    "tools": json.dumps(
        [
            {
                "name": "convert",
                "description": "Convert currency",
                "parameters": {
                    "amount": {"type": "number", "description": "amount"},
                    "to": {"type": "string", "description": "target", "default": "USD"},
                },
            },
            {
                "name": "weather",
                "description": "Weather",
                "parameters": {"city": {"type": "string", "description": "city"}},
            },
        ]
    ),
    "answers": json.dumps(
        [
            {"name": "convert", "arguments": {"amount": 12, "to": "JPY"}},
            {"name": "weather", "arguments": {"city": "Oslo"}},
        ]
    ),
}
TOOLACE = {
    "system": "You may call these functions:\n"
    + json.dumps(
        [
            {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                    "required": ["city"],
                },
            }
        ]
    ),
    "conversations": [
        {"from": "user", "value": "Weather in Paris, in celsius?"},
        {"from": "assistant", "value": '[get_weather(city="Paris", unit="celsius")]'},
        {"from": "tool", "value": '{"temp": 20}'},
        {"from": "assistant", "value": "It is 20 degrees in Paris."},
    ],
}
HERMES = {
    "conversations": [
        {
            "from": "system",
            "value": "You are a function calling AI. <tools> "
            + json.dumps(
                [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_stock_price",
                            "description": "Price of a stock",
                            "parameters": {
                                "type": "object",
                                "properties": {"symbol": {"type": "string"}},
                                "required": ["symbol"],
                            },
                        },
                    }
                ]
            )
            + " </tools>",
        },
        {"from": "human", "value": "How is Apple doing?"},
        {
            "from": "gpt",
            "value": "<tool_call>\n{'arguments': {'symbol': 'AAPL'}, 'name': 'get_stock_price'}"
            "\n</tool_call>",
        },
    ]
}
BFCL_Q = {
    "id": "simple_0",
    "question": [[{"role": "user", "content": "Area of a triangle with base 10 and height 5?"}]],
    "function": [
        {
            "name": "calc_area",
            "description": "Triangle area",
            "parameters": {
                "type": "dict",
                "properties": {
                    "base": {"type": "integer"},
                    "height": {"type": "integer"},
                    "unit": {"type": "string"},
                },
                "required": ["base", "height"],
            },
        }
    ],
}
BFCL_A = {
    "id": "simple_0",
    "ground_truth": [{"calc_area": {"base": [10], "height": [5], "unit": ["units", ""]}}],
}


def test_generated_records_are_valid_varied_and_deterministic():
    records = generate(200, seed=1)
    assert records == generate(200, seed=1) and records != generate(200, seed=2)
    assert all(valid_record(r) for r in records)
    calls = [len(r["ground_truth"]) for r in records]
    assert {0, 1, 2} <= set(calls)
    assert 0.05 < calls.count(0) / 200 < 0.3 and calls.count(2) > 20
    for r in records:
        names = [t["function"]["name"] for t in r["tools"]]
        assert len(names) >= 3 and len(set(names)) == len(names)
        assert len(names) > len(r["ground_truth"])  # distractors
        for c in r["ground_truth"]:  # the request names every argument value it asks for
            for v in c["arguments"].values():
                assert str(v) in r["prompt"][-1]["content"], (c, r["prompt"])


def test_generated_records_are_the_same_in_every_process():
    # Argument order too: it is the order of the call's JSON in SFT traces and tokenizer texts.
    code = "import json; from jaxrl_tools.datasets import generate; print(json.dumps(generate(300, 0)))"
    out = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True, text=True, check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }  # fmt: skip
    assert len(out) == 1
    for rec in json.loads(out.pop()):
        for call in rec["ground_truth"]:
            decl = next(t for t in rec["tools"] if t["function"]["name"] == call["name"])
            order = list(decl["function"]["parameters"]["properties"])
            assert list(call["arguments"]) == [a for a in order if a in call["arguments"]]


def test_generator_options_tools_shown_and_short_schemas():
    records = generate(100, seed=5, num_tools=(2, 2), param_descriptions=False)
    for r in records:  # two tools, three when two are called: a distractor always
        assert len(r["tools"]) == max(2, len(r["ground_truth"]) + 1)
        for t in r["tools"]:
            props = t["function"]["parameters"]["properties"].values()
            assert props and all("description" not in p and "type" in p for p in props)
    assert all(valid_record(r) for r in records)
    # the defaults are unchanged by the options: same records as before they existed
    assert generate(20, seed=1) == generate(20, seed=1, num_tools=(3, 5))
    with pytest.raises(ValueError, match="num_tools"):
        generate(1, num_tools=(1, 3))


def test_ground_truth_scores_full_marks_as_a_tool_call_answer():
    for r in generate(30, seed=4):
        blocks = "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in r["ground_truth"])
        answer = f"<think>ok</think>{blocks or 'Hello!'}"
        assert (read_tool_calls(answer) or []) == r["ground_truth"]
        assert get_reward("tool_n1")(answer, r["ground_truth"]) == 1.0


def test_xlam_row():
    (r,) = from_xlam(XLAM)
    assert r["prompt"] == [{"role": "user", "content": XLAM["query"]}]
    convert_decl = r["tools"][0]["function"]
    assert convert_decl["parameters"]["required"] == ["amount"]  # "to" has a default
    assert "default" not in convert_decl["parameters"]["properties"]["to"]
    assert r["ground_truth"][1] == {"name": "weather", "arguments": {"city": "Oslo"}}


def test_toolace_row_splits_into_one_record_per_assistant_turn():
    call, answer = from_toolace(TOOLACE)
    assert call["ground_truth"] == [
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    ]
    assert [m["role"] for m in call["prompt"]] == ["system", "user"]
    assert answer["ground_truth"] == [] and [m["role"] for m in answer["prompt"]][-2:] == [
        "assistant",
        "tool",
    ]


def test_unparsable_calls_give_no_record_not_a_no_call_one():
    # As ground truth [] an unreadable call attempt would reward calling nothing.
    broken = [dict(t) for t in TOOLACE["conversations"]]
    broken[1] = {"from": "assistant", "value": '[get_weather(city="Paris", unit=celsius)]'}
    (answer,) = from_toolace(dict(TOOLACE, conversations=broken))
    assert answer["ground_truth"] == [] and answer["prompt"][-1]["role"] == "tool"
    turns = [dict(t) for t in HERMES["conversations"]]
    call = next(t for t in turns if "<tool_call>" in t["value"])
    call["value"] = "<tool_call>\n{'name': 'get_stock_price', 'arguments': {\n</tool_call>"
    assert from_hermes(dict(HERMES, conversations=turns)) == []
    # a plain answer in brackets is no call attempt: a no-call record
    plain = [*TOOLACE["conversations"][:3], {"from": "assistant", "value": "[20, 21]"}]
    assert from_toolace(dict(TOOLACE, conversations=plain))[-1]["ground_truth"] == []


def test_hermes_row_with_python_dict_calls():
    (r,) = from_hermes(HERMES)
    assert r["ground_truth"] == [{"name": "get_stock_price", "arguments": {"symbol": "AAPL"}}]
    assert r["tools"][0]["function"]["name"] == "get_stock_price"
    assert [m["role"] for m in r["prompt"]] == ["system", "user"]


def test_bfcl_rows_take_the_first_accepted_value_and_drop_optional_blanks():
    (r,) = from_bfcl(BFCL_Q, BFCL_A)
    assert r["ground_truth"] == [
        {"name": "calc_area", "arguments": {"base": 10, "height": 5, "unit": "units"}}
    ]
    assert r["tools"][0]["function"]["parameters"]["type"] == "object"
    assert r["prompt"] == [{"role": "user", "content": BFCL_Q["question"][0][0]["content"]}]
    with pytest.raises(DataError, match="simple_0"):
        from_bfcl(BFCL_Q, {"id": "other"})


def test_converted_records_load_as_project_records(tmp_path):
    records = (
        convert([XLAM], "xlam")
        + convert([TOOLACE], "toolace")
        + convert([HERMES], "hermes")
        + convert([BFCL_Q], "bfcl", answers=[BFCL_A])
    )
    assert len(records) == 5
    path = tmp_path / "fc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    source = RecordSource([str(path)])  # validated as the trainer reads them
    loaded = [{k: source[i][k] for k in ("prompt", "tools", "ground_truth")} for i in range(5)]
    assert loaded == records  # lossless through JSONL


def test_tool_n1_filter_drops_undeclared_tools_and_bad_arguments():
    (good,) = from_xlam(XLAM)
    unknown = dict(good, ground_truth=[{"name": "nope", "arguments": {}}])
    missing = dict(good, ground_truth=[{"name": "weather", "arguments": {}}])
    wrong_type = dict(good, ground_truth=[{"name": "convert", "arguments": {"amount": "12"}}])
    assert valid_record(good)
    assert not any(valid_record(r) for r in (unknown, missing, wrong_type))
    assert convert([XLAM, dict(XLAM, answers='[{"name": "nope"}]')], "xlam") == [good]


def test_bad_rows_name_the_field():
    with pytest.raises(DataError, match="'answers'"):
        from_xlam({"query": "q", "tools": "[]"})
    with pytest.raises(DataError, match="'tools' is not valid JSON"):
        from_xlam({"query": "q", "tools": "[", "answers": "[]"})
    with pytest.raises(DataError, match="no JSON tool list"):
        from_toolace({"system": "no tools here", "conversations": []})
    with pytest.raises(DataError, match="unknown function-calling format"):
        convert([], "sharegpt")


def test_call_metrics_by_hand():
    w = {"name": "weather", "arguments": {"city": "Oslo"}}
    w2 = {"name": "weather", "arguments": {"city": "Lima"}}
    t = {"name": "timer", "arguments": {"minutes": 5}}
    predicted = [[w], [w2, t], [], [], [t]]
    truth = [[w], [w, t], [], [w], []]
    m = call_metrics(predicted, truth)
    assert m["exact_call_accuracy"] == pytest.approx(2 / 5)
    # name F1 per response: 1, 1, 1 (both empty), 0, 0
    assert m["name_f1"] == pytest.approx(3 / 5)
    # argument F1: 1, (1 match of 2 and 2: 2*1/4), 1, 0, 0
    assert m["argument_f1"] == pytest.approx((1 + 0.5 + 1) / 5)
    assert m["no_call_precision"] == pytest.approx(1 / 2)  # silent twice, right once
