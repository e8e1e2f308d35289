"""Tool-call parsers, one per rollout protocol (see docs/METHODS.md).

Each parser has:
  stop_strings: the strings (or compiled regexes: where their first match ends) that end a
    tool-call segment; the engine stops generation there and
    must keep the stop string in the segment text it passes to `parse` (vLLM's
    include_stop_str_in_output=True), so an unterminated tag is reported as such.
  parse(text) -> ParseResult: the calls of one model segment, or a precise error for the model.
    No tool call at all is not an error (calls=[], error=None: the model answered).
  format_observation(obs_texts) -> str: what the host inserts after the segment.

  qwen:      <tool_call>{"name": .., "arguments": {..}}</tool_call> (several per turn) -> a
             user turn of <tool_response>..</tool_response> blocks (tools.qwen_calls)
  torl:      ```python ... ``` then ```output -> result, then ```
  zerotir:   ```python ... ``` (stops at the closing fence) -> ```output result ```
  retool:    <code>...</code> (a ```python fence inside is fine) -> <interpreter>...</interpreter>
  search_r1: <search>query</search> -> <information>top-k passages</information>
  artist:    <tool>code or {"name", "arguments"}</tool> -> <output>...</output>; with
             tool_tags "named" the paper's <tool_name>: <python>code</python>,
             <get_weather>{"city": ..}</get_weather>

`parse` never raises, whatever the model wrote: JSON that Python cannot hold safely (deep
nesting, integers past the int-string digit limit, NaN/Infinity, unpaired surrogates) is a parse
error for the model too. `read_tool_calls(text)` is the lenient <tool_call> reader of rewards.
"""

from __future__ import annotations

import re

from jaxrl_tools.tools.base import json_value_error
from jaxrl_tools.tools.parse_base import (  # noqa: F401 -- re-exported
    Parser,
    ParseResult,
    ToolCall,
    _decode_json,
    _scan_tags,
)
from jaxrl_tools.tools.qwen_calls import QwenParser, read_tool_calls  # noqa: F401


class ToRLParser(Parser):
    """ToRL: a ```python fenced block, then ```output (the stop string); result + ``` inserted."""

    name = "torl"
    stop_strings = ("```output",)
    _open = re.compile(r"```python[ \t]*\n?")

    def __init__(self, tool_name: str = "python"):
        self.tool_name = tool_name

    def parse(self, text: str) -> ParseResult:
        out = text.rfind("```output")
        if out < 0:
            if self._open.search(text):
                return ParseResult(error="Error: code block not followed by ```output")
            return ParseResult()
        seg = text[:out]
        opens = list(self._open.finditer(seg))
        if not opens:
            return ParseResult(error="Error: ```output without a preceding ```python block")
        if len(opens) > 1:
            # a second ```python after the last closed block, or two blocks: ambiguous
            return ParseResult(
                error="Error: several ```python blocks before ```output; "
                "write one block per execution"
            )
        body_start = opens[-1].end()
        close = seg.find("```", body_start)
        if close < 0:
            return ParseResult(
                error="Error: unterminated ```python block: close it with ``` before ```output"
            )
        if seg[close + 3 :].strip():
            return ParseResult(error="Error: text between the code block and ```output")
        return self._code_call(seg[body_start:close], text[opens[-1].start() :])

    def _code_call(self, code: str, raw: str) -> ParseResult:
        """The call running a ```python block's `code`, or the error for an empty or
        unencodable one."""
        if not code.strip():
            return ParseResult(error="Error: empty ```python block")
        err = json_value_error(code, "the ```python block")
        if err:
            return ParseResult(error=f"Error: {err}")
        return ParseResult(calls=[ToolCall(self.tool_name, {"code": code}, raw=raw)])

    def format_observation(self, obs_texts: list[str]) -> str:
        return "\n" + "\n".join(obs_texts) + "\n```\n"


class ZeroTIRParser(ToRLParser):
    """ZeroTIR: generation stops at the closing fence of a ```python block (a stop pattern: in
    a segment holding an open ```python block, its next ``` closes it), and the host inserts
    the ```output block. The model need not write ```output itself, as ToRL's trigger asks."""

    name = "zerotir"
    stop_strings = (re.compile(r"```python.*?```", re.S),)

    def parse(self, text: str) -> ParseResult:
        opens = list(self._open.finditer(text))
        if not opens:
            return ParseResult()
        body_start = opens[-1].end()
        close = text.find("```", body_start)
        if close < 0:
            return ParseResult(error="Error: unterminated ```python block: close it with ```")
        return self._code_call(text[body_start:close], text[opens[-1].start() :])

    def format_observation(self, obs_texts: list[str]) -> str:
        return "\n```output\n" + "\n".join(obs_texts) + "\n```\n"


class _TagParser(Parser):
    """One <tag>body</tag> per segment, ending at the closing tag."""

    tag = "code"
    arg = "code"
    result_tag = "interpreter"

    def __init__(self, tool_name: str):
        self.tool_name = tool_name
        self.stop_strings = (f"</{self.tag}>",)

    def _body(self, body: str) -> str:
        return body.strip()

    def parse(self, text: str) -> ParseResult:
        o, c = f"<{self.tag}>", f"</{self.tag}>"
        spans, err = _scan_tags(text, o, c)
        if err:
            return ParseResult(error=f"Error: {err}")
        if not spans:
            return ParseResult()
        if len(spans) > 1:
            return ParseResult(
                error=f"Error: {len(spans)} {o} blocks in one turn; write one "
                f"{o}...{c} and wait for the result"
            )
        a, b = spans[0]
        return self._code_call(self._body(text[a:b]), o, text[a - len(o) : b + len(c)])

    def _code_call(self, body: str, opener: str, raw: str) -> ParseResult:
        """The code tool's call with `body`, or the error of an empty or unsafe block."""
        if not body.strip():
            return ParseResult(error=f"Error: empty {opener} block")
        err = json_value_error(body, f"the {opener} block")
        if err:
            return ParseResult(error=f"Error: {err}")
        return ParseResult(calls=[ToolCall(self.tool_name, {self.arg: body}, raw=raw)])


class ReToolParser(_TagParser):
    """ReTool: <code>...</code> (a ```python fence inside is stripped) -> <interpreter>."""

    name = "retool"
    tag, arg = "code", "code"

    def __init__(self, tool_name: str = "python"):
        super().__init__(tool_name)

    def _body(self, body: str) -> str:
        m = re.fullmatch(r"\s*```(?:python|py)?[ \t]*\n(.*?)\n?```\s*", body, re.DOTALL)
        return m.group(1) if m else body.strip("\n")

    def format_observation(self, obs_texts: list[str]) -> str:
        return "\n<interpreter>\n" + "\n".join(obs_texts) + "\n</interpreter>\n"


class SearchR1Parser(_TagParser):
    """Search-R1: <search>query</search> -> <information>top-k passages</information>."""

    name = "search_r1"
    tag, arg = "search", "query"
    answer_pattern = re.compile(r"<answer>.*?</answer>", re.S)

    def __init__(self, tool_name: str = "search"):
        super().__init__(tool_name)

    def format_observation(self, obs_texts: list[str]) -> str:
        return "\n\n<information>" + "\n".join(t.strip() for t in obs_texts) + "</information>\n\n"


ARTIST_TAG_FORMS = ("tool", "named")


class ArtistParser(_TagParser):
    """ARTIST (arXiv 2505.01441): a tool call, then <output>...</output>, between <think>
    blocks, ending with <answer>.

    tool_tags "tool": every call in a literal <tool>...</tool>. The body is a function call when
    it is a JSON object with a string "name" ({"name": .., "arguments": {..}}), else Python code
    for `tool_name` (a ```python fence inside is stripped).
    tool_tags "named" (the paper's <tool_name>...</tool_name>): the tag is the tool's name, one
    of `tools`: <python>code</python> for the code tool `tool_name`, <get_weather>{"city":
    "Lima"}</get_weather> (the body its JSON arguments) for any other tool. Generation stops at
    each tool's closing tag."""

    name = "artist"
    tag, arg = "tool", "code"

    def __init__(
        self, tool_name: str = "python", tool_tags: str = "tool", tools: tuple[str, ...] = ()
    ):
        super().__init__(tool_name)
        if tool_tags not in ARTIST_TAG_FORMS:
            raise ValueError(f"tool_tags must be one of {ARTIST_TAG_FORMS}, got {tool_tags!r}")
        self.tool_tags = tool_tags
        self.tools = tuple(dict.fromkeys(tools or (tool_name,)))
        if tool_tags == "named":
            bad = [t for t in self.tools if not re.fullmatch(r"[A-Za-z_][\w.-]*", t)]
            if bad or {"think", "output", "answer"} & set(self.tools):
                raise ValueError(f"tool names {self.tools} cannot all be ARTIST tags")
            self.stop_strings = tuple(f"</{t}>" for t in self.tools)

    _body = ReToolParser._body

    def _parse_named(self, text: str) -> ParseResult:
        found = []  # (start of the opening tag, tool, body start, body end)
        for t in self.tools:
            spans, err = _scan_tags(text, f"<{t}>", f"</{t}>")
            if err:
                return ParseResult(error=f"Error: {err}")
            found += [(a - len(t) - 2, t, a, b) for a, b in spans]
        if not found:
            return ParseResult()
        if len(found) > 1:
            return ParseResult(
                error=f"Error: {len(found)} tool calls in one turn; write one and wait for "
                "its <output>"
            )
        start, t, a, b = found[0]
        raw = text[start : b + len(t) + 3]
        if t == self.tool_name:
            return self._code_call(self._body(text[a:b]), f"<{t}>", raw)
        args, err = _decode_json(text[a:b].strip() or "{}", f"<{t}>")
        if err:
            return ParseResult(error=f"Error: the body of <{t}> must be its JSON arguments: {err}")
        if not isinstance(args, dict):
            return ParseResult(
                error=f"Error: the body of <{t}> must be a JSON object of its arguments, "
                f"got {type(args).__name__}"
            )
        return ParseResult(calls=[ToolCall(t, args, raw=raw)])

    def parse(self, text: str) -> ParseResult:
        if self.tool_tags == "named":
            return self._parse_named(text)
        result = super().parse(text)
        if not result.calls:
            return result
        code = result.calls[0].arguments["code"]
        if not code.lstrip().startswith("{"):
            return result
        obj, err = _decode_json(code.strip())
        if err or not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return result  # not a function call: run it as code (the tool reports errors)
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, dict):
            return ParseResult(
                error=f"Error: 'arguments' of <tool> must be a JSON object, "
                f"got {type(args).__name__}"
            )
        return ParseResult(calls=[ToolCall(obj["name"], args, raw=result.calls[0].raw)])

    def format_observation(self, obs_texts: list[str]) -> str:
        return "\n<output>\n" + "\n".join(obs_texts) + "\n</output>\n"


PARSERS = {
    "artist": ArtistParser,
    "qwen": QwenParser,
    "hermes": QwenParser,
    "torl": ToRLParser,
    "zerotir": ZeroTIRParser,
    "retool": ReToolParser,
    "search_r1": SearchR1Parser,
}


def get_parser(protocol: str, **kwargs) -> Parser:
    """The parser of a protocol: "qwen" (alias "hermes"), "torl", "zerotir", "retool",
    "search_r1" or "artist"."""
    try:
        cls = PARSERS[protocol]
    except KeyError:
        raise ValueError(
            f"unknown tool-call protocol {protocol!r}; valid: {sorted(PARSERS)}"
        ) from None
    return cls(**kwargs)


def declares_tools(protocol: str) -> bool:
    """Whether `protocol` declares its tools in the chat template's system turn (function
    calling); inline protocols (ToRL, ReTool, Search-R1) describe them in the prompt."""
    return protocol != "none" and bool(getattr(get_parser(protocol), "chat_role", None))
