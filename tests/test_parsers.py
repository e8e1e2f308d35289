"""Parsers of the tool-call protocols: calls, precise errors, observation formats."""

import time

import pytest

from jaxrl_tools.prompts import chat_continuation
from jaxrl_tools.rollout.stops import first_stop
from jaxrl_tools.tasks.tokenizer import build_tokenizer
from jaxrl_tools.tools import (
    ParseResult,
    get_parser,
    last_traceback_line,
    read_tool_calls,
    truncate_middle,
)


# --------------------------------------------------------------------------- qwen
def test_qwen_several_calls_and_unicode():
    p = get_parser("qwen")
    text = (
        'I will look. <tool_call>\n{"name": "search", "arguments": {"query": "Zürich 東京 🚀"}}'
        '\n</tool_call>\n<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": '
        '\\"1+1\\"}"}</tool_call>'
    )
    r = p.parse(text)
    assert r.ok and [c.name for c in r.calls] == ["search", "calculator"]
    assert r.calls[0].arguments == {"query": "Zürich 東京 🚀"}
    assert r.calls[1].arguments == {"expression": "1+1"}  # double-encoded arguments accepted
    assert p.stop_strings == ("</tool_call>",)
    p = get_parser("qwen", stop_at_each_call=False)
    assert p.stop_strings == () and p.turn_stops == ("<|im_end|>",)


def test_qwen_no_call_is_not_an_error():
    r = get_parser("qwen").parse("The answer is \\boxed{4}.")
    assert r == ParseResult(calls=[], error=None)


@pytest.mark.parametrize(
    "text,needle",
    [
        (
            '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',
            "invalid JSON in <tool_call>",
        ),
        ("<tool_call>{“name”: “f”}</tool_call>", "invalid JSON"),  # unicode quotes
        ('<tool_call>["f", {}]</tool_call>', "must hold a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no string field 'name'"),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            "must be a JSON object, got list",
        ),
        ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "f", "arguments": {}}', "unterminated <tool_call>"),
        ('<tool_call><tool_call>{"name": "f"}</tool_call></tool_call>', "nested <tool_call>"),
        ('{"name": "f"}</tool_call>', "without a matching <tool_call>"),
        (
            '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{bad</tool_call>',
            "invalid JSON in <tool_call> #2",
        ),
    ],
)
def test_qwen_errors(text, needle):
    r = get_parser("qwen").parse(text)
    assert not r.ok and not r.calls
    assert needle in r.error and r.error.startswith("Error:")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "t", vocab_size=300)


def test_qwen_observation_format(tok):
    """Tool results become "tool" messages of the chat template (which owns the turn markup);
    without chat wrapping, bare <tool_response> blocks."""
    p = get_parser("qwen")
    assert p.chat_role == "tool"
    assert chat_continuation(tok, p.chat_role, ["a", "b"]) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n"
        "<tool_response>\nb\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    bare = get_parser("qwen", chat_wrap=False)
    assert bare.chat_role is None
    assert bare.format_observation(["x"]) == "<tool_response>\nx\n</tool_response>"


# --------------------------------------------------------------------------- torl
def test_torl_parse_and_format():
    p = get_parser("torl")
    text = "Let me compute.\n```python\nprint(2 ** 10)\n```\n```output"
    r = p.parse(text)
    assert r.ok and r.calls[0].name == "python"
    assert r.calls[0].arguments == {"code": "print(2 ** 10)\n"}
    assert p.stop_strings == ("```output",)
    assert p.format_observation(["1024"]) == "\n1024\n```\n"
    assert p.parse("no code here, \\boxed{3}") == ParseResult()


@pytest.mark.parametrize(
    "text,needle",
    [
        ("```python\nprint(1)\n```output", "unterminated ```python"),
        ("```python\nprint(1)\n```\n```python\nprint(2)\n```\n```output", "several ```python"),
        ("```python\n```\n```output", "empty ```python"),
        ("result:\n```output", "without a preceding ```python"),
        ("```python\nprint(1)\n```\nand then\n```output", "text between"),
        ("```python\nprint(1)\n```\n", "not followed by ```output"),
    ],
)
def test_torl_errors(text, needle):
    r = get_parser("torl").parse(text)
    assert not r.ok and needle in r.error


def test_zerotir_stops_at_the_closing_fence_of_an_open_python_block():
    p = get_parser("zerotir")
    (stop,) = p.stop_strings
    assert first_stop("```python\nx = 1", p.stop_strings) is None  # the opening fence: no stop
    text = "Compute.\n```python\nprint(2 ** 10)\n```\nmore"
    end, which = first_stop(text, p.stop_strings)
    assert text[:end].endswith("print(2 ** 10)\n```") and which is stop
    assert first_stop("```bash\nls\n```", p.stop_strings) is None  # only python blocks run
    r = p.parse(text[:end])
    assert r.ok and r.calls[0].arguments == {"code": "print(2 ** 10)\n"}
    assert p.format_observation(["1024"]) == "\n```output\n1024\n```\n"
    assert p.parse("no code here, \\boxed{3}") == ParseResult()
    assert "unterminated" in p.parse("```python\nprint(1)").error
    assert "empty" in p.parse("```python\n```").error


# --------------------------------------------------------------------------- retool
def test_retool_parse_and_format():
    p = get_parser("retool")
    r = p.parse("Think.\n<code>\n```python\nx = 3\nprint(x * 'é')\n```\n</code>")
    assert r.ok and r.calls[0].arguments == {"code": "x = 3\nprint(x * 'é')"}
    assert p.parse("<code>print(1)</code>").calls[0].arguments == {"code": "print(1)"}
    assert p.stop_strings == ("</code>",)
    assert p.format_observation(["1"]) == "\n<interpreter>\n1\n</interpreter>\n"


@pytest.mark.parametrize(
    "text,needle",
    [
        ("<code>print(1)", "unterminated <code>"),
        ("<code>a<code>b</code></code>", "nested <code>"),
        ("<code>print(1)</code><code>print(2)</code>", "2 <code> blocks"),
        ("<code>  </code>", "empty <code>"),
        ("print(1)</code>", "without a matching <code>"),
    ],
)
def test_retool_errors(text, needle):
    r = get_parser("retool").parse(text)
    assert not r.ok and needle in r.error


# --------------------------------------------------------------------------- search-r1
def test_search_r1_parse_and_format():
    p = get_parser("search_r1")
    r = p.parse("<think>need facts</think><search> capital of France </search>")
    assert r.ok and r.calls[0].name == "search"
    assert r.calls[0].arguments == {"query": "capital of France"}
    assert p.stop_strings == ("</search>",)
    assert (
        p.format_observation(["Doc 1(Title: Paris) ...\n"])
        == "\n\n<information>Doc 1(Title: Paris) ...</information>\n\n"
    )
    bad = p.parse("<search>a</search> <search>b</search>")
    assert not bad.ok and "2 <search> blocks" in bad.error
    assert "unterminated <search>" in p.parse("<search>q").error


def test_unknown_protocol():
    with pytest.raises(ValueError, match="unknown tool-call protocol 'xml'"):
        get_parser("xml")


# --------------------------------------------------------------------------- helpers
def test_truncate_middle():
    assert truncate_middle("short", 10) == "short"
    t = truncate_middle("a" * 50 + "b" * 50, 21)
    assert len(t) == 21 and t.startswith("a" * 9) and t.endswith("b" * 9) and "..." in t
    assert truncate_middle("abcdef", 3) == "abc"
    assert truncate_middle("abc", 0) == ""


def test_last_traceback_line():
    tb = (
        'Traceback (most recent call last):\n  File "<snippet>", line 2, in <module>\n'
        "    1/0\n    ~^~\nZeroDivisionError: division by zero\n"
    )
    assert last_traceback_line(tb) == "ZeroDivisionError: division by zero"
    assert last_traceback_line("") == ""


# --------------------------------------------------------------------------- robustness
def _call(args_json: str) -> str:
    return f'<tool_call>{{"name": "f", "arguments": {args_json}}}</tool_call>'


@pytest.mark.parametrize(
    "text,needle",
    [
        (_call('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"), "nested deeper than 100 levels"),
        (_call('{"a": ' + "[" * 99 + "]" * 99 + "}"), "arguments.a[0][0]"),
        (
            _call('{"a": ' + "9" * 10_000 + "}"),
            "integer has more than 4300 digits; write it as a string",
        ),
        (
            _call('"{\\"a\\": ' + "9" * 10_000 + '}"'),
            "'arguments' of <tool_call> is a string that is not valid JSON: an integer",
        ),
        (_call('"' + "[" * 5000 + '"'), "not valid JSON: nested deeper"),
        (_call('{"a": NaN}'), "NaN is not valid JSON"),
        (_call('{"a": [1, -Infinity]}'), "-Infinity is not valid JSON"),
        (_call('{"a": 1e999}'), "number 1e999 is out of range"),
        (_call('{"a": "x\\ud800"}'), "arguments.a holds an unpaired UTF-16 surrogate"),
        (_call('{"\\udc00": 1}'), "arguments has a key with an unpaired UTF-16 surrogate"),
        (_call('"{\\"a\\": \\"\\\\ud800\\"}"'), "not valid JSON: arguments.a holds an unpaired"),
    ],
)
def test_qwen_refuses_json_python_cannot_hold(text, needle):
    r = get_parser("qwen").parse(text)
    assert not r.ok and not r.calls and r.error.startswith("Error:")
    assert needle in r.error, r.error
    assert len(r.error) < 250


def test_qwen_still_accepts_the_limits():
    deep = "[" * 97 + "]" * 97  # 100 levels with the call object and its arguments
    r = get_parser("qwen").parse(
        _call('{"a": ' + deep + ', "n": ' + "9" * 4300 + ', "s": "\\ud83d\\ude80"}')
    )
    assert r.ok, r.error
    assert r.calls[0].arguments["n"] == int("9" * 4300) and r.calls[0].arguments["s"] == "🚀"


@pytest.mark.parametrize(
    "protocol,text",
    [
        ("torl", "```python\nprint('\udc80')\n```\n```output"),
        ("retool", "<code>print('\ud800')</code>"),
        ("search_r1", "<search>\udfff</search>"),
    ],
)
def test_code_parsers_refuse_unpaired_surrogates(protocol, text):
    r = get_parser(protocol).parse(text)
    assert not r.ok and "unpaired UTF-16 surrogate" in r.error


# --------------------------------------------------------------------------- read_tool_calls
@pytest.mark.parametrize(
    "text,calls",
    [
        ("The answer is 4.", []),
        (
            '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
            [{"name": "f", "arguments": {"x": 1}}],
        ),
        # ToolRL: one object per line, "parameters" for the arguments
        (
            '<think>t</think>\n<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n'
            '{"name": "get_time", "parameters": {}}\n</tool_call>\n<response>ok</response>',
            [
                {"name": "get_weather", "arguments": {"city": "Paris"}},
                {"name": "get_time", "arguments": {}},
            ],
        ),
        (
            '<tool_call>[{"name": "a"}, {"name": "b", "arguments": "{\\"k\\": 2}"}]</tool_call>',
            [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": 2}}],
        ),
        (
            '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>'
            '<tool_call>{"name": 3, "arguments": null}</tool_call>',
            [{"name": "a", "arguments": "not json"}, {"name": 3, "arguments": {}}],
        ),
        # like the regex <tool_call>(.*?)</tool_call>: a stray close and an unterminated tail are skipped
        (
            'x</tool_call> <tool_call>{"name": "a"}</tool_call> <tool_call>{"name": "b"',
            [{"name": "a", "arguments": {}}],
        ),
        (
            '<tool_call>{"name": "a", "arguments": "' + "9" * 5000 + '"}</tool_call>',
            [{"name": "a", "arguments": "9" * 5000}],
        ),
    ],
)
def test_read_tool_calls(text, calls):
    assert read_tool_calls(text) == calls


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>  </tool_call>",
        "<tool_call>{bad json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>[{"name": "a"}, 3]</tool_call>',
        "<tool_call>42</tool_call>",
        '<tool_call>\n{"name": "a"}\n{oops\n</tool_call>',
        '<tool_call><tool_call>{"name": "a"}</tool_call></tool_call>',
        '<tool_call>{"name": "a"}</tool_call><tool_call>{"nam": "b"}</tool_call>',
        # what the rewards copy raised on (RecursionError, ValueError) or let through (NaN)
        _call('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        _call('{"a": ' + "9" * 10_000 + "}"),
        _call('{"a": NaN}'),
        _call('{"a": "\\ud800"}'),
    ],
)
def test_read_tool_calls_malformed_is_none(text):
    assert read_tool_calls(text) is None


def test_read_tool_calls_is_linear_on_unterminated_tags():
    text = "<tool_call>" * 200_000  # the regex version scans to the end from every tag
    t0 = time.perf_counter()
    assert read_tool_calls(text) == []
    assert time.perf_counter() - t0 < 1.0
