"""Tool protocol, registry/YAML, executor validation, calculator, function_tool, BM25 search."""

import asyncio
import json
from typing import Literal

import pytest

from jaxrl_tools.tools import (
    TOOL_REGISTRY,
    BM25Index,
    CalculatorTool,
    Observation,
    PythonTool,
    SandboxConfig,
    SandboxPool,
    SearchTool,
    Tool,
    ToolCall,
    ToolExecutor,
    create_tool,
    function_tool,
    get_parser,
    load_tools_yaml,
    safe_eval,
    validate_arguments,
)
from jaxrl_tools.tools.base import describe_exception, format_int, json_value_error, safe_repr
from jaxrl_tools.tools.calculator import CalculatorError, format_number


def arun(coro):
    return asyncio.run(coro)


# --------------------------------------------------------------------------- calculator
@pytest.mark.parametrize(
    "expr,value",
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("2 ** 10", 1024),
        ("2 ^ 10", 1024),
        ("-3 // 2", -2),
        ("7 % 3", 1),
        ("sqrt(16) + abs(-2)", 6.0),
        ("factorial(5)", 120),
        ("round(pi, 3)", 3.142),
        ("max(1, 5, 3)", 5),
        ("log(e)", 1.0),
        ("10 / 4", 2.5),
    ],
)
def test_calculator_values(expr, value):
    assert safe_eval(expr) == pytest.approx(value)


@pytest.mark.parametrize(
    "expr,needle",
    [
        ("__import__('os')", "unknown function '__import__'"),
        ("__import__('os').system('id')", "unsupported syntax: Call"),
        ("(1).__class__", "unsupported syntax: Attribute"),
        ("x + 1", "unknown name 'x'"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 100000", "too large"),
        ("factorial(100000)", "factorial needs one integer <= 500"),
        ("1 / 0", "division by zero"),
        ("2.0 ** 100000", "exponent too large"),
        ("[1, 2]", "unsupported syntax: List"),
        ("lambda: 1", "unsupported syntax: Lambda"),
        ("1 +", "invalid expression"),
        ("1" * 2000, "longer than 1000"),
        ("sqrt(-1)", "sqrt: math domain error"),
    ],
)
def test_calculator_rejects(expr, needle):
    with pytest.raises(CalculatorError, match=None) as ei:
        safe_eval(expr)
    assert needle in str(ei.value)


def test_calculator_tool_errors_are_data():
    tool = CalculatorTool()
    ok = arun(tool.call({"expression": "3 * (4 + 5)"}))
    bad = arun(tool.call({"expression": "open('x')"}))
    assert ok.ok and ok.text == "27" and ok.latency_s >= 0
    assert not bad.ok and bad.text.startswith("Error: unknown function 'open'")
    assert arun(tool.call({"expression": "1/3"})).text == "0.333333333333"


# --------------------------------------------------------------------------- function_tool
def test_function_tool_schema_and_call():
    def get_weather(
        city: str,
        unit: Literal["c", "f"] = "c",
        days: int | None = None,
        tags: list[str] | None = None,
    ) -> dict:
        """Get the weather forecast.

        Looks it up in a table.

        Args:
          city: Name of the city,
            e.g. Paris.
          unit (str): Temperature unit.
          days: How many days.
        """
        return {"city": city, "unit": unit, "days": days}

    tool = function_tool(get_weather)
    fn = tool.schema()["function"]
    assert fn["name"] == "get_weather"
    assert fn["description"] == "Get the weather forecast.\n\nLooks it up in a table."
    props = fn["parameters"]["properties"]
    assert props["city"] == {"type": "string", "description": "Name of the city, e.g. Paris."}
    assert props["unit"] == {"enum": ["c", "f"], "description": "Temperature unit."}
    assert props["days"] == {"type": "integer", "description": "How many days."}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert fn["parameters"]["required"] == ["city"]
    obs = arun(tool.call({"city": "Zürich", "days": 2}))
    assert obs.ok and json.loads(obs.text) == {"city": "Zürich", "unit": "c", "days": 2}


def test_function_tool_async_decorator_and_errors():
    @function_tool(name="div")
    async def divide(a: float, b: float) -> float:
        """Divide a by b."""
        return a / b

    assert divide.name == "div" and divide.parameters["required"] == ["a", "b"]
    assert arun(divide.call({"a": 1, "b": 4})).text == "0.25"
    err = arun(divide.call({"a": 1, "b": 0}))
    assert not err.ok and err.text == "Error: ZeroDivisionError: division by zero"


# --------------------------------------------------------------------------- executor
class Echo(Tool):
    name = "echo"
    parameters = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "text": {"type": "string"},
            "n": {"type": "integer"},
            "mode": {"enum": ["a", "b"]},
            "xs": {"type": "array", "items": {"type": "number"}},
        },
        "required": ["text"],
    }

    async def _call(self, arguments, session_id):
        if arguments["text"] == "boom":
            raise RuntimeError("kaboom")
        return Observation(arguments["text"] * arguments.get("n", 1))


@pytest.mark.parametrize(
    "call,needle",
    [
        (ToolCall("nope", {}), "unknown tool 'nope'; available tools: calculator, echo"),
        (ToolCall("echo", {}), "missing required argument 'text'"),
        (ToolCall("echo", {"text": 3}), "text must be of type string, got integer"),
        (ToolCall("echo", {"text": "a", "n": "2"}), "n must be of type integer, got string"),
        (ToolCall("echo", {"text": "a", "n": True}), "n must be of type integer, got boolean"),
        (ToolCall("echo", {"text": "a", "mode": "c"}), "mode must be one of ['a', 'b']"),
        (ToolCall("echo", {"text": "a", "xs": [1, "x"]}), "xs[1] must be of type number"),
        (ToolCall("echo", {"text": "a", "extra": 1}), "unknown argument 'extra'"),
        (ToolCall("echo", {"text": "boom"}), "Error in tool 'echo': RuntimeError: kaboom"),
    ],
)
def test_executor_errors_are_observations(call, needle):
    ex = ToolExecutor([Echo(), CalculatorTool()], max_concurrency=2)
    obs = arun(ex.execute(call, "s"))
    assert not obs.ok and needle in obs.text, obs.text


def test_executor_runs_calls_concurrently_in_order():
    class Slow(Tool):
        name = "slow"
        parameters = {"type": "object", "properties": {"t": {"type": "number"}}}

        async def _call(self, arguments, session_id):
            await asyncio.sleep(arguments["t"])
            return Observation(str(arguments["t"]))

    ex = ToolExecutor([Slow(), Echo()], max_concurrency=8, timeout_s=0.5)
    calls = [
        ToolCall("slow", {"t": 0.2}),
        ToolCall("slow", {"t": 0.1}),
        ToolCall("echo", {"text": "ab", "n": 2}),
        ToolCall("slow", {"t": 2.0}),
    ]

    async def go():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = await ex.execute_many(calls, "s")
        return out, loop.time() - t0

    out, dt = arun(go())
    assert [o.text for o in out[:3]] == ["0.2", "0.1", "abab"]
    assert not out[3].ok and "timed out" in out[3].text and out[3].metrics["timeout"] == 1.0
    assert dt < 1.0
    assert [s["function"]["name"] for s in ex.schemas()] == ["slow", "echo"]


def test_validate_arguments_accepts_integral_float_for_integer():
    assert (
        validate_arguments({"n": 2.0}, {"type": "object", "properties": {"n": {"type": "integer"}}})
        is None
    )


# --------------------------------------------------------------------------- registry / YAML
def test_registry_and_yaml(tmp_path):
    assert {"python", "search", "calculator"} <= set(TOOL_REGISTRY)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": 0, "title": "Paris", "text": "capital of France"}) + "\n")
    yaml_text = f"""
tools:
  - class_name: calculator
    config: {{type: native}}
    tool_schema:
      type: function
      function:
        name: calc
        description: arithmetic
        parameters: {{type: object, properties: {{expression: {{type: string}}}},
                     required: [expression]}}
  - class_name: jaxrl_tools.tools.search.SearchTool
    config: {{corpus_path: {corpus}, top_k: 1, cache_dir: {tmp_path / "cache"}}}
"""
    path = tmp_path / "tools.yaml"
    path.write_text(yaml_text)
    tools = load_tools_yaml(path)
    assert [t.name for t in tools] == ["calc", "search"]
    assert tools[0].schema()["function"]["description"] == "arithmetic"
    ex = ToolExecutor(tools)
    assert arun(ex.execute(ToolCall("calc", {"expression": "2+2"}))).text == "4"
    with pytest.raises(ValueError, match="unknown tool class 'nope'"):
        create_tool("nope")
    with pytest.raises(ValueError, match="bad config for tool 'calculator'"):
        create_tool("calculator", {"bogus": 1})
    with pytest.raises(ValueError, match="keys must be class_name"):
        load_tools_yaml("tools:\n  - {klass: calculator}\n")


# --------------------------------------------------------------------------- search
PASSAGES = [
    ("Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris, France."),
    ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level."),
    ("Python (language)", "Python is a programming language created by Guido van Rossum."),
    ("Great Wall", "The Great Wall of China is a series of fortifications in northern China."),
    ("Amazon River", "The Amazon is the largest river by discharge volume of water."),
]


def _write_corpus(path, wiki_format=False):
    with open(path, "w") as fh:
        for i, (t, x) in enumerate(PASSAGES):
            row = (
                {"id": str(i), "contents": f'"{t}"\n{x}'}
                if wiki_format
                else {"id": str(i), "title": t, "text": x}
            )
            fh.write(json.dumps(row) + "\n")


def test_bm25_returns_right_passage_and_caches(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus, wiki_format=True)
    cache = tmp_path / "cache"
    tool = SearchTool(str(corpus), top_k=2, cache_dir=str(cache))
    assert not tool.index.loaded_from_cache
    obs = arun(tool.call({"query": "who created the python programming language?"}))
    assert obs.ok
    first = obs.text.splitlines()[0]
    assert first == (
        "Doc 1(Title: Python (language)) Python is a programming language created "
        "by Guido van Rossum."
    )
    again = BM25Index(corpus, cache)
    assert again.loaded_from_cache and again.search("highest mountain", 1)[0][0] == 1
    assert arun(tool.call({"query": "zzzz qqqq"})).text == "No results found."
    assert not arun(tool.call({"query": "  "})).ok
    _write_corpus(corpus)  # changed corpus -> new hash -> new index
    assert not BM25Index(corpus, cache).loaded_from_cache


def test_bm25_bad_corpus_names_line(tmp_path):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"title": "a", "text": "b"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: invalid JSON"):
        BM25Index(corpus, tmp_path / "cache")


# --------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def pool():
    p = SandboxPool(1, SandboxConfig(timeout_s=2.0))
    yield p
    p.close()


@pytest.mark.parametrize(
    "protocol,segment",
    [
        ("torl", "Compute.\n```python\nimport sympy\nprint(sympy.factorint(360))\n```\n```output"),
        ("retool", "<code>\n```python\nimport sympy\nprint(sympy.factorint(360))\n```\n</code>"),
        (
            "qwen",
            '<tool_call>{"name": "python", "arguments": {"code": '
            '"import sympy\\nprint(sympy.factorint(360))"}}</tool_call>',
        ),
    ],
)
def test_parse_execute_format_python(pool, protocol, segment):
    tool = PythonTool(pool=pool, tool_schema=None)
    parser = get_parser(protocol)
    ex = ToolExecutor([tool])
    r = parser.parse(segment)
    assert r.ok, r.error
    obs = arun(ex.execute_many(r.calls, "traj"))
    assert obs[0].ok and obs[0].text.strip() == "{2: 3, 3: 2, 5: 1}"
    assert "{2: 3, 3: 2, 5: 1}" in parser.format_observation([o.text for o in obs])


def test_python_tool_error_timeout_and_truncation(pool):
    tool = PythonTool(pool=pool, max_output_chars=50, timeout_s=1.0)
    err = arun(tool.call({"code": "print('partial')\nraise ValueError('bad value')"}))
    assert not err.ok and err.text == "partial\nValueError: bad value"
    slow = arun(tool.call({"code": "while True: pass"}))
    assert not slow.ok and "time limit" in slow.text and slow.metrics["timeout"] == 1.0
    long = arun(tool.call({"code": "print('a' * 100 + 'b' * 100)"}))
    assert long.ok and len(long.text) == 50 and "..." in long.text
    assert not arun(tool.call({"code": 5})).ok
    with pytest.raises(ValueError, match="mode='repl'"):
        PythonTool(mode="repl", pool=pool)


def test_python_tool_keeps_output_printed_before_timeout(pool):
    tool = PythonTool(pool=pool, timeout_s=1.0)
    obs = arun(tool.call({"code": "import time\nprint('step 1')\ntime.sleep(5)"}))
    assert not obs.ok and obs.text.startswith("step 1\n") and "time limit" in obs.text


# --------------------------------------------------------------------------- robustness
@pytest.mark.parametrize(
    "expr,needle",
    [
        ("-" * 999 + "1", "nested too deeply"),
        ("1 + \ud800", "unpaired UTF-16 surrogate"),
        ("1\x00", "null character"),
        ("round(5, -10**12)", "round: ndigits must be within +-10000"),
        ("log(2, 1)", "log: division by zero"),
        ("'" + "x" * 500 + "'", "unsupported value 'xxxx"),
    ],
)
def test_calculator_rejects_adversarial(expr, needle):
    with pytest.raises(CalculatorError) as ei:
        safe_eval(expr)
    assert needle in str(ei.value) and len(str(ei.value)) < 100


def test_calculator_tool_arguments_of_wrong_type():
    tool = CalculatorTool()
    for args in ({"expression": 10**5000}, {"expression": None}, {}):
        obs = arun(tool.call(args))
        assert (
            not obs.ok and obs.text == "Error: 'expression' must be a string, e.g. \"2 * (3 + 4)\""
        )
    assert format_number(10**5000).startswith("1000") and len(format_number(10**5000)) == 5001


@pytest.mark.parametrize(
    "call,needle",
    [
        (ToolCall("echo", {"text": "a", 1: 2}), "arguments has a key that is not a string: 1"),
        (
            ToolCall("echo", {"text": "a", "n": 10**5000}),
            "Error in tool 'echo': OverflowError: cannot fit 'int'",
        ),
        (
            ToolCall("echo", {"text": "a", "xs": [1, float("nan")]}),
            "arguments.xs[1] must be a finite number, got nan",
        ),
        (ToolCall("echo", {"text": "\ud800"}), "arguments.text holds an unpaired UTF-16 surrogate"),
        (
            ToolCall("echo", {"text": "a", "xs": {1, 2}}),
            "arguments.xs has type set, which is not JSON",
        ),
        (ToolCall("echo", {"text": "a", "x" * 10**6: 1}), "unknown argument 'xxxxxxxxxx"),
        (ToolCall(["echo"], {"text": "a"}), "unknown tool ['echo']"),
        (
            ToolCall("e" * 10**6, {}),
            "eeeeeeeeeeeeeeeeeeeeeeeeeee'; available tools: calculator, echo",
        ),
        (ToolCall("echo", "text"), "arguments must be a JSON object, got string"),
    ],
)
def test_executor_refuses_arguments_a_tool_cannot_take(call, needle):
    ex = ToolExecutor([Echo(), CalculatorTool()])
    obs = arun(ex.execute(call))
    assert not obs.ok and needle in obs.text and len(obs.text) < 300, obs.text[:300]


def test_executor_deep_arguments_are_refused_without_recursion():
    deep = []
    for _ in range(100_000):
        deep = [deep]
    obs = arun(ToolExecutor([Echo()]).execute(ToolCall("echo", {"text": "a", "xs": deep})))
    assert not obs.ok and "is nested deeper than 100 levels" in obs.text
    big = {"text": "a", "n": 10**5000}
    assert validate_arguments(big, {"properties": {"n": {"maximum": 5}}}).startswith(
        "n must be <= 5, got 1000"
    )


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no")


class Misbehaving(Tool):
    """A tool that fails in every way a tool can, chosen by the 'how' argument."""

    name = "bad"
    parameters = {"type": "object", "properties": {"how": {"type": "string"}}, "required": ["how"]}

    async def _call(self, arguments, session_id):
        how = arguments["how"]
        if how == "bigint_message":
            raise ValueError(10**5000)
        if how == "unprintable":
            raise _Unprintable()
        if how == "exit":
            raise SystemExit(3)
        if how == "long_message":
            raise RuntimeError("x" * 10**6)
        if how == "recursion":
            return await self._call(arguments, session_id)
        if how == "not_an_observation":
            return "plain text"
        if how == "surrogate":
            return Observation("bad \udc80 text")
        return Observation(12345)


@pytest.mark.parametrize(
    "how,ok,text",
    [
        ("bigint_message", False, "Error in tool 'bad': ValueError: <unprintable message>"),
        ("unprintable", False, "Error in tool 'bad': _Unprintable: <unprintable message>"),
        ("exit", False, "Error in tool 'bad': SystemExit: 3"),
        (
            "recursion",
            False,
            "Error in tool 'bad': RecursionError: maximum recursion depth exceeded",
        ),
        ("not_an_observation", False, "Error in tool 'bad': it returned str, not an Observation"),
        ("surrogate", True, "bad \ufffd text"),
        ("text_not_str", True, "12345"),
    ],
)
def test_tool_failures_are_observations(how, ok, text):
    for run in (
        lambda: Misbehaving().call({"how": how}),
        lambda: ToolExecutor([Misbehaving()]).execute(ToolCall("bad", {"how": how})),
    ):
        obs = arun(run())
        assert obs.ok == ok and obs.text.startswith(text), obs.text[:200]


def test_tool_error_messages_are_cut():
    obs = arun(Misbehaving().call({"how": "long_message"}))
    assert not obs.ok and len(obs.text) < 1100 and "..." in obs.text


def test_function_tool_results_python_cannot_print():
    def big(n: int) -> int:
        """A huge number."""
        return 7**n

    def nested_big(n: int) -> list:
        return [7**n]

    def cyclic() -> list:
        xs = []
        xs.append(xs)
        return xs

    obs = arun(function_tool(big).call({"n": 10_000}))
    assert obs.ok and obs.text.startswith("95587") and "..." in obs.text  # 8451 digits, cut to 4000
    obs = arun(function_tool(nested_big).call({"n": 10_000}))
    assert not obs.ok and obs.text.startswith(
        "Error: the result of 'nested_big' cannot be written as JSON"
    )
    obs = arun(function_tool(cyclic).call({}))
    assert not obs.ok and "Circular reference" in obs.text
    obs = arun(function_tool(big).call({"n": "x"}))  # wrong type reaching the function
    assert not obs.ok and obs.text.startswith("Error: TypeError:")


def test_safe_text_helpers():
    assert format_int(-(10**5000)).startswith("-1000") and len(format_int(10**5000)) == 5001
    assert format_int(2**200_000) == "<integer of about 60206 digits>"
    assert safe_repr(10**5000, 20) == "100000000...00000000" and safe_repr("ab") == "'ab'"
    assert describe_exception(ValueError(10**5000)) == "ValueError: <unprintable message>"
    assert json_value_error({"a": [1, {"b": "ok"}], "c": (True, None, 1.5)}) is None
    assert (
        json_value_error({"a": [1, {"b": float("inf")}]})
        == "arguments.a[1].b must be a finite number, got inf"
    )
    assert json_value_error([{"x": {1}}], root="") == "[0].x has type set, which is not JSON"
