"""Parsers of the tool-call protocols: calls, precise errors, observation formats."""

import pytest

from jaxrl_tools.tools import ParseResult, get_parser, last_traceback_line, truncate_middle


# --------------------------------------------------------------------------- qwen
def test_qwen_several_calls_and_unicode():
    p = get_parser("qwen")
    text = ('I will look. <tool_call>\n{"name": "search", "arguments": {"query": "Zürich 東京 🚀"}}'
            '\n</tool_call>\n<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": '
            '\\"1+1\\"}"}</tool_call>')
    r = p.parse(text)
    assert r.ok and [c.name for c in r.calls] == ["search", "calculator"]
    assert r.calls[0].arguments == {"query": "Zürich 東京 🚀"}
    assert r.calls[1].arguments == {"expression": "1+1"}  # double-encoded arguments accepted
    assert p.stop_strings == ("</tool_call>",)
    assert get_parser("qwen", stop_at_each_call=False).stop_strings == ("<|im_end|>",)


def test_qwen_no_call_is_not_an_error():
    r = get_parser("qwen").parse("The answer is \\boxed{4}.")
    assert r == ParseResult(calls=[], error=None)


@pytest.mark.parametrize("text,needle", [
    ('<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>', "invalid JSON in <tool_call>"),
    ('<tool_call>{“name”: “f”}</tool_call>', "invalid JSON"),  # unicode quotes
    ('<tool_call>["f", {}]</tool_call>', "must hold a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no string field 'name'"),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object, got list"),
    ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "f", "arguments": {}}', "unterminated <tool_call>"),
    ('<tool_call><tool_call>{"name": "f"}</tool_call></tool_call>', "nested <tool_call>"),
    ('{"name": "f"}</tool_call>', "without a matching <tool_call>"),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{bad</tool_call>',
     "invalid JSON in <tool_call> #2"),
])
def test_qwen_errors(text, needle):
    r = get_parser("qwen").parse(text)
    assert not r.ok and not r.calls
    assert needle in r.error and r.error.startswith("Error:")


def test_qwen_observation_format():
    p = get_parser("qwen")
    out = p.format_observation(["a", "b"])
    assert out == ("<|im_end|>\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n"
                   "<tool_response>\nb\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert get_parser("qwen", chat_wrap=False).format_observation(["x"]) == \
        "<tool_response>\nx\n</tool_response>"


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


@pytest.mark.parametrize("text,needle", [
    ("```python\nprint(1)\n```output", "unterminated ```python"),
    ("```python\nprint(1)\n```\n```python\nprint(2)\n```\n```output", "several ```python"),
    ("```python\n```\n```output", "empty ```python"),
    ("result:\n```output", "without a preceding ```python"),
    ("```python\nprint(1)\n```\nand then\n```output", "text between"),
    ("```python\nprint(1)\n```\n", "not followed by ```output"),
])
def test_torl_errors(text, needle):
    r = get_parser("torl").parse(text)
    assert not r.ok and needle in r.error


# --------------------------------------------------------------------------- retool
def test_retool_parse_and_format():
    p = get_parser("retool")
    r = p.parse("Think.\n<code>\n```python\nx = 3\nprint(x * 'é')\n```\n</code>")
    assert r.ok and r.calls[0].arguments == {"code": "x = 3\nprint(x * 'é')"}
    assert p.parse("<code>print(1)</code>").calls[0].arguments == {"code": "print(1)"}
    assert p.stop_strings == ("</code>",)
    assert p.format_observation(["1"]) == "\n<interpreter>\n1\n</interpreter>\n"


@pytest.mark.parametrize("text,needle", [
    ("<code>print(1)", "unterminated <code>"),
    ("<code>a<code>b</code></code>", "nested <code>"),
    ("<code>print(1)</code><code>print(2)</code>", "2 <code> blocks"),
    ("<code>  </code>", "empty <code>"),
    ("print(1)</code>", "without a matching <code>"),
])
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
    assert p.format_observation(["Doc 1(Title: Paris) ...\n"]) == \
        "\n\n<information>Doc 1(Title: Paris) ...</information>\n\n"
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
    tb = ('Traceback (most recent call last):\n  File "<snippet>", line 2, in <module>\n'
          '    1/0\n    ~^~\nZeroDivisionError: division by zero\n')
    assert last_traceback_line(tb) == "ZeroDivisionError: division by zero"
    assert last_traceback_line("") == ""
