"""Model output never crashes the loop: seeded adversarial text through every parser, the
<tool_call> reader and the ToolExecutor (cheap tools only), checked to come back as data."""

import asyncio
import json
import random
import re

import pytest

from jaxrl_tools.tools import (
    CalculatorTool,
    Observation,
    ParseResult,
    ToolCall,
    ToolExecutor,
    function_tool,
    get_parser,
    read_tool_calls,
    safe_eval,
)
from jaxrl_tools.tools.base import clean_text, json_value_error
from jaxrl_tools.tools.calculator import CalculatorError
from jaxrl_tools.tools.parsers import PARSERS

SEED = 20240611
N_MUTANTS = 1000

VALID = [
    '<tool_call>{"name": "calculator", "arguments": {"expression": "(3 + 4) * 2"}}</tool_call>',
    '<tool_call>\n{"name": "lookup", "arguments": {"key": "Zürich 東京", "n": 2, '
    '"tags": ["a"], "opts": {"x": 1.5}}}\n</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2 ^ 10\\"}"}</tool_call>',
    '<tool_call>\n{"name": "lookup", "parameters": {"key": "a"}}\n'
    '{"name": "search", "parameters": {"query": "b"}}\n</tool_call>',  # ToolRL
    '<tool_call>[{"name": "echo", "arguments": {"v": [1, 2]}}, {"name": "flaky"}]</tool_call>',
    "Compute.\n```python\nprint(2 ** 10)\n```\n```output",
    "<code>\n```python\nx = 3\nprint(x)\n```\n</code>",
    "<think>facts</think><search> capital of France </search>",
]

ATOMS = [
    "[" * 50_000,
    "{" * 50_000,
    '{"a": ' * 20_000,
    "]" * 1000,
    "9" * 10_000,
    "-" + "9" * 10_000,
    "0." + "1" * 10_000,
    "1" + "0" * 400 + ".0",
    "1e999",
    "-1e999",
    "1e-99999",
    "NaN",
    "Infinity",
    "-Infinity",
    '"\\ud800"',
    "\\udc00",
    "\\ud83d\\ude80",
    "\ud800",
    "\udfff",
    "\x00",
    '"',
    "\\",
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    "null",
    "true",
    '"name"',
    '"arguments"',
    '"parameters"',
    '"calculator"',
    '"lookup"',
    "<tool_call>",
    "</tool_call>",
    "```python\n",
    "```",
    "```output",
    "<code>",
    "</code>",
    "<search>",
    "</search>",
    "\n",
    " ",
    "🚀",
    "東京",
    "\u202e",
    "\ufeff",
    "x" * 100_000,
    '"' + "x" * 100_000 + '"',
]


def _mutate(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 4)):
        i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
        op = rng.randrange(6)
        if op == 0:
            text = text[:i] + rng.choice(ATOMS) + text[i:]
        elif op == 1:
            text = text[:i] + text[j:]
        elif op == 2:
            text = text[:j] + text[i:j] * rng.randint(2, 50) + text[j:]
        elif op == 3:
            text = text[:i] + chr(rng.randrange(0x110000)) + text[i + 1 :]
        elif op == 4:
            text = text[:i]
        else:
            text = text + rng.choice(VALID)
    return text


def _bombs() -> list[str]:
    out = []
    for n in (97, 99, 1000, 100_000):
        nest = "[" * n + "]" * n
        out += [
            '<tool_call>{"name": "echo", "arguments": {"v": ' + nest + "}}</tool_call>",
            '<tool_call>{"name": "echo", "arguments": "{\\"v\\": ' + nest + '}"}</tool_call>',
            '<tool_call>\n{"name": "echo"}\n' + nest + "\n</tool_call>",
            "<tool_call>" + '{"a": ' * n + "1" + "}" * n + "</tool_call>",
        ]
    for num in (
        "9" * 10_000,
        "-" + "9" * 10_000,
        "1" * 10_000 + ".5",
        "1e" + "9" * 10_000,
        "1e-" + "9" * 10_000,
        "9" * 4300,
    ):
        out += [
            '<tool_call>{"name": "lookup", "arguments": {"key": "k", "n": '
            + num
            + "}}</tool_call>",
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"k\\", \\"n\\": '
            + num
            + '}"}</tool_call>',
            '<tool_call>{"name": ' + num + "}</tool_call>",
            "```python\nprint(" + num + ")\n```\n```output",
            "<search>" + num + "</search>",
        ]
    out += [
        "<tool_call>" * 100_000,
        "</tool_call>" * 100_000,
        "<code>" * 50_000 + "</code>",
        "```python\n" * 50_000 + "```output",
        ("<tool_call>{}</tool_call>" * 20_000),
        "<tool_call>" + "x" * 1_000_000 + "</tool_call>",
        "\ud800" * 10_000,
    ]
    return out


def _samples() -> list[str]:
    rng = random.Random(SEED)
    garbage_alphabet = '{}[]":,\\ \n0123456789abenulrst<>/_`' + "\ud800\u00e9🚀"
    out = list(VALID) + _bombs()
    out += [_mutate(rng, rng.choice(VALID)) for _ in range(N_MUTANTS)]
    out += [
        "".join(rng.choice(garbage_alphabet) for _ in range(rng.randint(0, 400)))
        for _ in range(100)
    ]
    return out


# --------------------------------------------------------------------------- the tools
def lookup(key: str, n: int = 1, tags: list[str] | None = None, opts: dict | None = None) -> dict:
    """Echoes its (typed) arguments back as JSON."""
    return {"key": key * min(n, 3), "n": n, "tags": tags, "opts": opts}


def python(code: str) -> str:
    """A cheap stand-in for the sandbox: evaluates the code as a calculator expression."""
    return str(safe_eval(code))


def search(query: str, k: int = 3) -> list[str]:
    return [query[:k]] * k


def echo(**kwargs) -> dict:
    return kwargs


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no")


def flaky(kind: int = 0) -> int:
    """Fails in a different way for each kind; returns a number too big to print otherwise."""
    errors = [
        ValueError(10**5000),
        RecursionError("deep"),
        SystemExit(1),
        MemoryError(),
        KeyError("\ud800"),
        _Unprintable(),
    ]
    if 0 <= kind < len(errors):
        raise errors[kind]
    return 7**kind


def _executor() -> ToolExecutor:
    fns = [function_tool(f) for f in (lookup, python, search, echo, flaky)]
    return ToolExecutor([CalculatorTool(), *fns], max_concurrency=8, timeout_s=10.0)


# --------------------------------------------------------------------------- the checks
def _check_parse(r) -> None:
    assert isinstance(r, ParseResult)
    if r.error is not None:
        assert isinstance(r.error, str) and r.error.startswith("Error:") and not r.calls
        assert len(r.error) < 300 and clean_text(r.error) == r.error, r.error[:300]
    for c in r.calls:
        assert isinstance(c, ToolCall) and isinstance(c.name, str) and c.name
        assert isinstance(c.arguments, dict) and json_value_error(c.arguments) is None


def _check_observation(obs) -> None:
    assert isinstance(obs, Observation) and isinstance(obs.text, str) and isinstance(obs.ok, bool)
    obs.text.encode("utf-8")  # tokenizable: no unpaired surrogates
    assert len(obs.text) <= 5000, obs.text[:200]
    assert obs.ok or obs.text.startswith("Error"), obs.text[:200]
    assert "internal_error" not in obs.metrics, obs.text


def _as_tool_calls(protocol: str, calls: list[ToolCall]) -> list[ToolCall]:
    """The parsed calls, plus the same arguments sent to the calculator (to reach a tool)."""
    out = list(calls)
    for c in calls:
        if protocol in ("torl", "retool"):
            out.append(ToolCall("calculator", {"expression": c.arguments["code"]}))
        out.append(ToolCall("flaky", c.arguments))
    return out


def test_parsers_reader_and_executor_never_raise():
    samples = _samples()
    calls: list[ToolCall] = []
    n_ok = n_err = 0
    for text in samples:
        for protocol in PARSERS:
            r = get_parser(protocol).parse(text)
            _check_parse(r)
            n_ok += bool(r.calls)
            n_err += r.error is not None
            calls += _as_tool_calls(protocol, r.calls)
        got = read_tool_calls(text)
        assert got is None or all(
            isinstance(c, dict) and set(c) == {"name", "arguments"} for c in got
        )
        for c in got or []:
            if isinstance(c["name"], str) and isinstance(c["arguments"], dict):
                calls.append(ToolCall(c["name"], c["arguments"]))
    assert n_ok > 100 and n_err > 100  # both paths exercised
    calls += [ToolCall("flaky", {"kind": k}) for k in range(7)]

    async def run_all():
        ex = _executor()
        return await ex.execute_many(calls, "s")

    obs = asyncio.run(run_all())
    assert len(obs) == len(calls)
    for o in obs:
        _check_observation(o)
    assert sum(o.ok for o in obs) > 50 and sum(not o.ok for o in obs) > 50


def _adversarial_values():
    deep = []
    for _ in range(100_000):
        deep = [deep]
    cyclic: list = []
    cyclic.append(cyclic)
    return [
        10**5000,
        -(10**5000),
        float("nan"),
        float("inf"),
        "\ud800",
        "x" * 1_000_000,
        deep,
        cyclic,
        {1: 2},
        {(1, 2): 3},
        {1, 2},
        b"bytes",
        object(),
        None,
        True,
        1.5,
        "ok",
        [1, "a", None],
        {"nested": {"\udc00": 1}},
        {"k": [float("-inf")]},
    ]


def test_executor_never_raises_on_arbitrary_arguments():
    rng = random.Random(SEED)
    values = _adversarial_values()
    names = [
        "calculator",
        "lookup",
        "python",
        "search",
        "echo",
        "flaky",
        "nope",
        "",
        None,
        3,
        ["lookup"],
        "x" * 100_000,
        "\ud800",
    ]
    keys = [
        "expression",
        "key",
        "n",
        "tags",
        "opts",
        "code",
        "query",
        "k",
        "kind",
        "v",
        "",
        "\ud800",
        7,
        None,
    ]
    calls = []
    for _ in range(2000):
        if rng.random() < 0.1:
            args = rng.choice(values)
        else:
            args = {rng.choice(keys): rng.choice(values) for _ in range(rng.randint(0, 4))}
        calls.append(ToolCall(rng.choice(names), args))

    async def run_all():
        return await _executor().execute_many(calls, "s")

    for o in asyncio.run(run_all()):
        _check_observation(o)


# --------------------------------------------------------------------------- read_tool_calls
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _regex_reference(text):
    """The copy that lived in jaxrl_tools/rewards.py (it raised on deep JSON and huge ints)."""
    calls = []
    for block in _TOOL_CALL_RE.findall(text):
        block = block.strip()
        if not block:
            return None
        try:
            objs = [json.loads(block)]
        except json.JSONDecodeError:
            try:
                objs = [json.loads(line) for line in block.splitlines() if line.strip()]
            except json.JSONDecodeError:
                return None
        for obj in objs:
            for o in obj if isinstance(obj, list) else [obj]:
                if not isinstance(o, dict) or "name" not in o:
                    return None
                args = o.get("arguments", o.get("parameters", {}))
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        pass
                calls.append({"name": o.get("name"), "arguments": args if args is not None else {}})
    return calls


# What read_tool_calls refuses on purpose: NaN/Infinity, float overflow, surrogate escapes,
# long digit runs, deep nesting. Texts that could hold any of these are not compared.
_REFUSED = re.compile(r"NaN|Infinity|[eE][+-]?\d{3}|\\u[dD][89a-fA-F]|[\ud800-\udfff]|\d{4000}")


@pytest.mark.parametrize("seed", range(4))
def test_read_tool_calls_matches_the_regex_reader(seed):
    rng = random.Random(seed)
    blocks = [v for v in VALID if "<tool_call>" in v]
    alphabet = '{}[]":,\\ \n0123456789abenulrst'
    atoms = [
        "<tool_call>",
        "</tool_call>",
        '"name"',
        '"arguments"',
        '"parameters"',
        '"x"',
        "null",
        "[",
        "{",
        "}",
        "]",
        '\\"',
        "\n",
        '{"name": "f"}',
        "[]",
        '"{}"',
    ]
    compared = 0
    for _ in range(500):
        text = rng.choice(blocks) + rng.choice(["", " ", "\n"]) + rng.choice(blocks)
        for _ in range(rng.randint(0, 5)):
            i = rng.randrange(len(text) + 1)
            if rng.random() < 0.5:
                text = text[:i] + rng.choice(atoms + list(alphabet)) + text[i:]
            else:
                text = text[:i] + text[i + rng.randint(1, 5) :]
        if _REFUSED.search(text) or text.count("[") + text.count("{") > 90:
            continue
        assert read_tool_calls(text) == _regex_reference(text), text
        compared += 1
    assert compared > 400


def test_calculator_on_random_expressions_raises_only_calculator_error():
    rng = random.Random(SEED)
    alphabet = list("0123456789+-*/%^().,e ") + [
        "**",
        "//",
        "sqrt(",
        "factorial(",
        "round(",
        "log(",
        "gcd(",
        "pi",
        "9" * 300,
        "\ud800",
    ]
    for _ in range(2000):
        expr = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        try:
            value = safe_eval(expr)
        except CalculatorError as e:
            assert len(str(e)) < 200
        else:
            assert isinstance(value, int | float) and not isinstance(value, bool)
