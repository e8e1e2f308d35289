"""The invented tool world of the recipes whose calls execute (datasets/tool_world.py): functions
declared by import path, ARTIST's function calls run through the executor, and shipped answers
that follow from the tools' results only."""

import asyncio
import json
import re
from pathlib import Path

import pytest

from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.datasets import tool_world
from jaxrl_tools.rewards import get_reward
from jaxrl_tools.tools import SearchTool, ToolExecutor, create_tool, get_parser

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "tool_world"


def functions_executor() -> ToolExecutor:
    spec = "jaxrl_tools.datasets.tool_world:{}"
    return ToolExecutor(
        [
            create_tool("function", {"function": spec.format(f.__name__)})
            for f in tool_world.FUNCTIONS
        ]
    )


def call(executor, name: str, **arguments) -> dict:
    """A call as artist_functions has the model write it: the function's own tag."""
    names = tuple(f.__name__ for f in tool_world.FUNCTIONS)
    parsed = get_parser("artist", tool_tags="named", tools=names).parse(
        f"<think>look it up</think><{name}>{json.dumps(arguments)}</{name}>"
    )
    (c,) = parsed.calls
    obs = asyncio.run(executor.execute(c))
    assert obs.ok, obs.text
    return json.loads(obs.text)


def test_a_function_named_by_import_path_is_a_tool_with_its_own_schema():
    tool = create_tool("function", {"function": "jaxrl_tools.datasets.tool_world:get_weather"})
    fn = tool.schema()["function"]
    assert fn["name"] == "get_weather" and fn["description"] == "The current temperature in a city."
    assert fn["parameters"]["required"] == ["city"]
    assert fn["parameters"]["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"]
    with pytest.raises(ConfigError, match=r"config\.function='tool_world:nope' cannot be loaded"):
        create_tool("function", {"function": "tool_world:nope"})
    with pytest.raises(ConfigError, match=r"give 'package\.module:function'"):
        create_tool("function", {"function": "get_weather"})
    obs = asyncio.run(tool.call({"city": "Atlantis"}))
    assert not obs.ok and "unknown city 'Atlantis'; known: Dressik, Ormund" in obs.text


def test_artist_calls_execute_and_the_shipped_answers_follow_from_their_results():
    """An oracle that answers every held-out question from the tools' results alone (through
    ARTIST's call syntax, the parser and the executor) gets every shipped answer, and the
    recipe's reward scores that answer right."""
    ex = functions_executor()
    answer = get_reward("artist_answer")
    records = [
        json.loads(line) for line in (DATA / "functions_test.jsonl").read_text().splitlines()
    ]
    kinds = set()
    for rec in records:
        q = rec["prompt"]
        if m := re.fullmatch(r"What is the temperature in (\w+) in fahrenheit\?", q):
            got = call(ex, "get_weather", city=m[1], unit="fahrenheit")["temperature"]
        elif m := re.fullmatch(r"How much is (\d+) (\w+) in (\w+)\?", q):
            got = call(
                ex, "convert_currency", amount=int(m[1]), from_currency=m[2], to_currency=m[3]
            )
            got = got["amount"]
        elif m := re.fullmatch(r"Which is warmer right now, (\w+) or (\w+)\?", q):
            a, b = (call(ex, "get_weather", city=c)["temperature"] for c in (m[1], m[2]))
            got = m[1] if a > b else m[2]
        else:
            m = re.fullmatch(r"How much do (\d+) shares of (\w+) cost in (\w+)\?", q)
            price = call(ex, "get_stock_price", symbol=m[2])["price"]
            got = call(ex, "convert_currency", amount=price * int(m[1]), from_currency="USD",
                       to_currency=m[3])["amount"]  # fmt: skip
        kinds.add(" ".join(q.split()[:3]))
        response = f"<think>from the tools</think><answer>{got}</answer>"
        assert answer(response, rec["ground_truth"]) == 1.0, (q, got, rec["ground_truth"])
        assert answer("<think>guess</think><answer>42.5</answer>", rec["ground_truth"]) == 0.0
    assert len(kinds) == 4  # every kind of question is held out


def test_the_mixed_questions_need_both_searches_and_a_computation():
    search = SearchTool(corpus_path=str(DATA / "corpus.jsonl"), top_k=3)
    passages = {
        json.loads(line)["id"]: json.loads(line)["text"]
        for line in (DATA / "corpus.jsonl").read_text().splitlines()
    }
    train = (DATA / "mixed_train.jsonl").read_text().splitlines()
    seen = {i for line in train for i in json.loads(line)["landmarks"]}
    for line in (DATA / "mixed_test.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert not seen & set(rec["landmarks"])  # held-out landmarks
        facts = []
        for lid in rec["landmarks"]:
            name = re.match(r"(.+?) stands in", passages[lid])[1]
            obs = asyncio.run(search.call({"query": name}))
            assert passages[lid] in obs.text, (name, obs.text)  # the search finds it
            year, height = map(
                int, re.search(r"built in (\d+) and is (\d+) metres", obs.text).groups()
            )
            facts.append((year, height))
        if "years after" in rec["prompt"]:
            want = abs(facts[0][0] - facts[1][0])
        else:
            want = round((facts[0][1] + facts[1][1]) * tool_world.FEET_PER_METRE, 1)
        assert float(rec["ground_truth"]) == pytest.approx(want), rec


def test_the_shipped_files_are_the_generators_output(tmp_path):
    for name, path in tool_world.write_dataset(tmp_path).items():
        assert path.read_bytes() == (DATA / f"{name}.jsonl").read_bytes(), name


def test_the_artist_recipe_declares_the_functions_it_runs():
    cfg = load_config(ROOT / "configs" / "artist_functions.yaml")
    assert [t.name for t in cfg.tools] == [f.__name__ for f in tool_world.FUNCTIONS]
    for line in tool_world.function_signatures().splitlines():
        assert line in cfg.data.system_prompt  # what the prompt shows is what runs
