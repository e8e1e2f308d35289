"""Tool-call parsers, one per rollout protocol (see docs/METHODS.md).

Each parser has:
  stop_strings: the strings (or compiled regexes: where their first match ends) that end a
    tool-call segment; the engine stops generation there and
    must keep the stop string in the segment text it passes to `parse` (vLLM's
    include_stop_str_in_output=True), so an unterminated tag is reported as such.
  parse(text) -> ParseResult: the calls of one model segment, or a precise error for the model.
    No tool call at all is not an error (calls=[], error=None: the model answered).
  format_observation(obs_texts) -> str: what the host inserts after the segment.

  qwen:      <tool_call>{"name": .., "arguments": {..}}</tool_call> (several) -> a user turn
             of <tool_response>..</tool_response> blocks
  torl:      ```python ... ``` then ```output -> result, then ```
  zerotir:   ```python ... ``` (stops at the closing fence) -> ```output result ```
  retool:    <code>...</code> (a ```python fence inside is fine) -> <interpreter>...</interpreter>
  search_r1: <search>query</search> -> <information>top-k passages</information>
  artist:    <tool>code or {"name", "arguments"}</tool> -> <output>...</output>

`parse` never raises, whatever the model wrote: JSON that Python cannot hold safely (deep
nesting, integers past the int-string digit limit, NaN/Infinity, unpaired surrogates) is a parse
error for the model too. `read_tool_calls(text)` is the lenient <tool_call> reader of rewards.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from typing import Any

from jaxrl_tools.tools.base import MAX_JSON_DEPTH, json_value_error


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


def _scan_tags(
    text: str, open_tag: str, close_tag: str, strict: bool = True
) -> tuple[list[tuple[int, int]], str | None]:
    """Spans (start of body, end of body) of open..close pairs, in order.

    strict: an error (and the spans before it) on a closing tag without an opening one, a nested
    opening tag or an unterminated one. Otherwise reads like the regex `open(.*?)close`: stray
    closing tags and an unterminated last opening tag are skipped, a nested opening tag stays in
    the body, and never an error. Linear time either way (the regex is quadratic on many
    unterminated opening tags).
    """
    spans = []
    pos = 0
    while True:
        i = text.find(open_tag, pos)
        if strict:
            j = text.find(close_tag, pos)
            if i < 0:
                if j >= 0:
                    return spans, f"found {close_tag} without a matching {open_tag}"
                return spans, None
            if 0 <= j < i:
                return spans, f"found {close_tag} without a matching {open_tag}"
        elif i < 0:
            return spans, None
        body = i + len(open_tag)
        end = text.find(close_tag, body)
        if end < 0:
            return spans, (
                f"unterminated {open_tag}: close it with {close_tag}" if strict else None
            )
        if strict and 0 <= text.find(open_tag, body, end):
            return spans, f"nested {open_tag} inside {open_tag}: write one call per tag"
        spans.append((body, end))
        pos = end + len(close_tag)


class _JSONValueError(ValueError):
    """Valid JSON syntax that tools do not take (non-finite numbers); message for the model."""


def _no_constant(name: str):
    raise _JSONValueError(f"{name} is not valid JSON; write a finite number or a string")


def _finite_float(s: str) -> float:
    x = float(s)
    if not math.isfinite(x):
        raise _JSONValueError(
            f"number {s[:20]}{'...' if len(s) > 20 else ''} is out of range "
            "for a 64-bit float; write it as a string"
        )
    return x


def _decode_json(s: str, root: str = "") -> tuple[Any, str | None]:
    """json.loads that never raises: (value, None), or (None, a short message for the model).

    Refused besides syntax errors: NaN/Infinity and floats that overflow, integers past
    Python's int-string digit limit, nesting deeper than MAX_JSON_DEPTH and strings with
    unpaired UTF-16 surrogates (see `json_value_error`); `root` names the value in messages.
    """
    try:
        value = json.loads(s, parse_float=_finite_float, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        return None, f"{e.msg} at line {e.lineno} column {e.colno}"
    except _JSONValueError as e:
        return None, str(e)
    except RecursionError:
        return None, f"nested deeper than {MAX_JSON_DEPTH} levels"
    except ValueError:  # int(): more digits than the interpreter converts (Python >= 3.11)
        return None, (
            f"an integer has more than {sys.get_int_max_str_digits()} digits; write it as a string"
        )
    err = json_value_error(value, root)
    return (None, err) if err else (value, None)


class Parser:
    """Base class; subclasses define `name`, `stop_strings`, `parse`, `format_observation`."""

    name = "base"
    stop_strings: tuple[str, ...] = ()
    # Chat protocols set the message role of tool results: the agent loop then renders them as
    # such messages through the tokenizer's chat template (the only owner of turn markup)
    # instead of appending `format_observation`'s inline text.
    chat_role: str | None = None

    def parse(self, text: str) -> ParseResult:
        raise NotImplementedError

    def format_observation(self, obs_texts: list[str]) -> str:
        raise NotImplementedError


_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"


class QwenParser(Parser):
    """Qwen/Hermes function calling: JSON inside <tool_call>...</tool_call>, several per turn.

    Args:
      stop_at_each_call: if True, stop_strings is ("</tool_call>",) (one call per segment);
        if False, generation runs to the end of the turn ("<|im_end|>") and may hold several.
      chat_wrap: tool results are "tool" messages of the chat template (`chat_role`), which
        closes the assistant turn and wraps them (Qwen: a user turn of <tool_response> blocks);
        False: inline <tool_response> blocks (`format_observation`).
    """

    name = "qwen"

    def __init__(self, stop_at_each_call: bool = True, chat_wrap: bool = True):
        self.stop_strings = ("</tool_call>",) if stop_at_each_call else ("<|im_end|>",)
        self.chat_role = "tool" if chat_wrap else None

    def parse(self, text: str) -> ParseResult:
        spans, err = _scan_tags(text, _CALL_OPEN, _CALL_CLOSE)
        if err:
            return ParseResult(error=f"Error: {err}")
        calls = []
        for k, (a, b) in enumerate(spans, 1):
            where = f"{_CALL_OPEN} #{k}" if len(spans) > 1 else _CALL_OPEN
            obj, err = _decode_json(text[a:b].strip())
            if err:
                return ParseResult(error=f"Error: invalid JSON in {where}: {err}")
            if not isinstance(obj, dict):
                return ParseResult(
                    error=f"Error: {where} must hold a JSON object with 'name' and 'arguments'"
                )
            name = obj.get("name")
            if not isinstance(name, str) or not name:
                return ParseResult(error=f"Error: {where} has no string field 'name'")
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):  # some models double-encode the arguments
                args, err = _decode_json(args, "arguments") if args.strip() else ({}, None)
                if err:
                    return ParseResult(
                        error=f"Error: 'arguments' of {where} is a string that is "
                        f"not valid JSON: {err}"
                    )
            if not isinstance(args, dict):
                return ParseResult(
                    error=f"Error: 'arguments' of {where} must be a JSON object, "
                    f"got {type(args).__name__}"
                )
            calls.append(ToolCall(name=name, arguments=args, raw=text[a:b]))
        return ParseResult(calls=calls)

    def format_observation(self, obs_texts: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in obs_texts)


def read_tool_calls(text: str) -> list[dict] | None:
    """Every call in the <tool_call>...</tool_call> blocks of `text`, as {"name", "arguments"}.

    The lenient reader that rewards score responses and ground truths with (ToolRL, Tool-N1);
    the rollout's strict one is `QwenParser.parse`. Both share the tag scanner and the JSON
    decoder, so it never raises either.

    A block holds one JSON object (Qwen), one JSON object per line (ToolRL) or a JSON list of
    objects (whole block or per line). Blocks are read like the regex <tool_call>(.*?)</tool_call>:
    a closing tag without an opening one and an unterminated last block are skipped. Arguments
    come from "arguments" (else "parameters"); a JSON string there is decoded when it decodes,
    missing or null arguments become {}; names and arguments are not otherwise checked.

    Args:
      text: a model response or a ground-truth answer string.

    Returns:
      The calls in order; [] when there is no block; None when a block is empty, is not JSON
      (neither whole nor line by line; NaN/Infinity, integers past the int-string digit limit,
      nesting deeper than MAX_JSON_DEPTH and unpaired surrogates count as not JSON) or holds
      anything but objects with a "name".
    """
    spans, _ = _scan_tags(text, _CALL_OPEN, _CALL_CLOSE, strict=False)
    calls = []
    for a, b in spans:
        block = text[a:b].strip()
        if not block:
            return None
        obj, err = _decode_json(block)
        objs = [obj]
        if err:  # ToolRL: one object per line
            objs = []
            for line in block.splitlines():
                if line.strip():
                    obj, err = _decode_json(line)
                    if err:
                        return None
                    objs.append(obj)
        for obj in objs:
            for o in obj if isinstance(obj, list) else [obj]:
                if not isinstance(o, dict) or "name" not in o:
                    return None
                args = o.get("arguments", o.get("parameters", {}))
                if isinstance(args, str):
                    decoded, err = _decode_json(args)
                    args = args if err else decoded
                calls.append({"name": o.get("name"), "arguments": {} if args is None else args})
    return calls


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
        body = self._body(text[a:b])
        if not body.strip():
            return ParseResult(error=f"Error: empty {o} block")
        err = json_value_error(body, f"the {o} block")
        if err:
            return ParseResult(error=f"Error: {err}")
        return ParseResult(
            calls=[ToolCall(self.tool_name, {self.arg: body}, raw=text[a - len(o) : b + len(c)])]
        )


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
        return "\n\n<information>" + "\n".join(t.strip() for t in obs_texts) + "</information>\n\n"


class ArtistParser(_TagParser):
    """ARTIST (arXiv 2505.01441): <tool>...</tool> -> <output>...</output>, between <think>
    blocks, ending with <answer>. The body is a function call when it is a JSON object with a
    string "name" ({"name": .., "arguments": {..}}, the paper's function-calling setting), else
    Python code for `tool_name` (its math setting; a ```python fence inside is stripped)."""

    name = "artist"
    tag, arg = "tool", "code"

    def __init__(self, tool_name: str = "python"):
        super().__init__(tool_name)

    _body = ReToolParser._body

    def parse(self, text: str) -> ParseResult:
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
