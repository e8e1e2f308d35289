"""Tool-call parsers, one per rollout protocol (see shared/METHODS.md).

Each parser has:
  stop_strings: the strings that end a tool-call segment; the engine stops generation there and
    must keep the stop string in the segment text it passes to `parse` (vLLM's
    include_stop_str_in_output=True), so an unterminated tag is reported as such.
  parse(text) -> ParseResult: the calls of one model segment, or a precise error for the model.
    No tool call at all is not an error (calls=[], error=None: the model answered).
  format_observation(obs_texts) -> str: what the host inserts after the segment.

  qwen:      <tool_call>{"name": .., "arguments": {..}}</tool_call> (several) -> a user turn
             of <tool_response>..</tool_response> blocks
  torl:      ```python ... ``` then ```output -> result, then ```
  retool:    <code>...</code> (a ```python fence inside is fine) -> <interpreter>...</interpreter>
  search_r1: <search>query</search> -> <information>top-k passages</information>
"""

from __future__ import annotations

import dataclasses
import json
import re


@dataclasses.dataclass
class ToolCall:
    """One parsed call: tool name, arguments object and the raw text it came from."""

    name: str
    arguments: dict
    raw: str = ""


@dataclasses.dataclass
class ParseResult:
    """Calls found in one segment, or `error` (a message meant for the model)."""

    calls: list[ToolCall] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _scan_tags(text: str, open_tag: str,
               close_tag: str) -> tuple[list[tuple[int, int]], str | None]:
    """Spans (start of body, end of body) of open..close pairs; an error on nesting/unterminated."""
    spans = []
    pos = 0
    while True:
        i = text.find(open_tag, pos)
        j = text.find(close_tag, pos)
        if i < 0:
            if j >= 0:
                return spans, f"found {close_tag} without a matching {open_tag}"
            return spans, None
        if 0 <= j < i:
            return spans, f"found {close_tag} without a matching {open_tag}"
        body = i + len(open_tag)
        end = text.find(close_tag, body)
        nxt = text.find(open_tag, body)
        if end < 0:
            return spans, f"unterminated {open_tag}: close it with {close_tag}"
        if 0 <= nxt < end:
            return spans, f"nested {open_tag} inside {open_tag}: write one call per tag"
        spans.append((body, end))
        pos = end + len(close_tag)


class Parser:
    """Base class; subclasses define `name`, `stop_strings`, `parse`, `format_observation`."""

    name = "base"
    stop_strings: tuple[str, ...] = ()

    def parse(self, text: str) -> ParseResult:
        raise NotImplementedError

    def format_observation(self, obs_texts: list[str]) -> str:
        raise NotImplementedError


class QwenParser(Parser):
    """Qwen/Hermes function calling: JSON inside <tool_call>...</tool_call>, several per turn.

    Args:
      stop_at_each_call: if True, stop_strings is ("</tool_call>",) (one call per segment);
        if False, generation runs to the end of the turn ("<|im_end|>") and may hold several.
      chat_wrap: format_observation closes the assistant turn and opens a user turn holding the
        <tool_response> blocks, then a new assistant turn (Qwen's chat template for tool
        messages); False returns only the <tool_response> blocks.
    """

    name = "qwen"

    def __init__(self, stop_at_each_call: bool = True, chat_wrap: bool = True):
        self.stop_strings = ("</tool_call>",) if stop_at_each_call else ("<|im_end|>",)
        self.chat_wrap = chat_wrap

    def parse(self, text: str) -> ParseResult:
        spans, err = _scan_tags(text, "<tool_call>", "</tool_call>")
        if err:
            return ParseResult(error=f"Error: {err}")
        calls = []
        for k, (a, b) in enumerate(spans, 1):
            raw = text[a:b].strip()
            where = f"<tool_call> #{k}" if len(spans) > 1 else "<tool_call>"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                return ParseResult(error=f"Error: invalid JSON in {where}: {e.msg} at line "
                                         f"{e.lineno} column {e.colno}")
            if not isinstance(obj, dict):
                return ParseResult(error=f"Error: {where} must hold a JSON object with 'name' "
                                         "and 'arguments'")
            name = obj.get("name")
            if not isinstance(name, str) or not name:
                return ParseResult(error=f"Error: {where} has no string field 'name'")
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):  # some models double-encode the arguments
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    return ParseResult(error=f"Error: 'arguments' of {where} is a string that is "
                                             f"not valid JSON: {e.msg}")
            if not isinstance(args, dict):
                return ParseResult(error=f"Error: 'arguments' of {where} must be a JSON object, "
                                         f"got {type(args).__name__}")
            calls.append(ToolCall(name=name, arguments=args, raw=text[a:b]))
        return ParseResult(calls=calls)

    def format_observation(self, obs_texts: list[str]) -> str:
        body = "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in obs_texts)
        if not self.chat_wrap:
            return body
        return f"<|im_end|>\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


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
            return ParseResult(error="Error: several ```python blocks before ```output; "
                                     "write one block per execution")
        body_start = opens[-1].end()
        close = seg.find("```", body_start)
        if close < 0:
            return ParseResult(error="Error: unterminated ```python block: close it with ``` "
                                     "before ```output")
        if seg[close + 3:].strip():
            return ParseResult(error="Error: text between the code block and ```output")
        code = seg[body_start:close]
        if not code.strip():
            return ParseResult(error="Error: empty ```python block")
        return ParseResult(calls=[ToolCall(self.tool_name, {"code": code},
                                           raw=text[opens[-1].start():])])

    def format_observation(self, obs_texts: list[str]) -> str:
        return "\n" + "\n".join(obs_texts) + "\n```\n"


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
            return ParseResult(error=f"Error: {len(spans)} {o} blocks in one turn; write one "
                                     f"{o}...{c} and wait for the result")
        a, b = spans[0]
        body = self._body(text[a:b])
        if not body.strip():
            return ParseResult(error=f"Error: empty {o} block")
        return ParseResult(calls=[ToolCall(self.tool_name, {self.arg: body},
                                           raw=text[a - len(o):b + len(c)])])


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

    def __init__(self, tool_name: str = "search"):
        super().__init__(tool_name)

    def format_observation(self, obs_texts: list[str]) -> str:
        return "\n\n<information>" + "\n".join(t.strip() for t in obs_texts) + \
            "</information>\n\n"


PARSERS = {"qwen": QwenParser, "hermes": QwenParser, "torl": ToRLParser,
           "retool": ReToolParser, "search_r1": SearchR1Parser}


def get_parser(protocol: str, **kwargs) -> Parser:
    """The parser of a protocol: "qwen" (alias "hermes"), "torl", "retool" or "search_r1"."""
    try:
        cls = PARSERS[protocol]
    except KeyError:
        raise ValueError(f"unknown tool-call protocol {protocol!r}; valid: "
                         f"{sorted(PARSERS)}") from None
    return cls(**kwargs)
