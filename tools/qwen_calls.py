"""The Qwen/Hermes protocol: <tool_call>{"name": .., "arguments": {..}}</tool_call> blocks,
several per assistant turn, answered in one tool turn; and `read_tool_calls`, the lenient reader
that rewards score responses with."""

from __future__ import annotations

from jaxrl_tools.tools.parse_base import Parser, ParseResult, ToolCall, _decode_json, _scan_tags

_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"


class QwenParser(Parser):
    """Qwen/Hermes function calling: JSON inside <tool_call>...</tool_call>, several per turn.

    Args:
      stop_at_each_call: True: generation stops at the first "</tool_call>" (`stop_strings`),
        one call per segment. False: no tool stop; the turn runs to its end (an EOS token, or
        "<|im_end|>" as text: `turn_stops`, which end the response unless the turn holds
        calls) and all its <tool_call> blocks are parsed at once.
      chat_wrap: tool results are "tool" messages of the chat template (`chat_role`), which
        closes the assistant turn and wraps them (Qwen: a user turn of <tool_response> blocks);
        False: inline <tool_response> blocks (`format_observation`).

    A call inside <think>...</think> (or after an unclosed <think>, or before a lone </think>:
    a template that opens the think block itself) is an error: the model is reasoning about a
    call, not making it.
    """

    name = "qwen"

    def __init__(self, stop_at_each_call: bool = True, chat_wrap: bool = True):
        self.stop_strings = (_CALL_CLOSE,) if stop_at_each_call else ()
        self.turn_stops = () if stop_at_each_call else ("<|im_end|>",)
        self.chat_role = "tool" if chat_wrap else None

    def parse(self, text: str) -> ParseResult:
        spans, err = _scan_tags(text, _CALL_OPEN, _CALL_CLOSE)
        if err:
            return ParseResult(error=f"Error: {err}")
        thinking = _think_spans(text)
        calls = []
        for k, (a, b) in enumerate(spans, 1):
            where = f"{_CALL_OPEN} #{k}" if len(spans) > 1 else _CALL_OPEN
            if any(lo <= a < hi for lo, hi in thinking):
                return ParseResult(
                    error=f"Error: {where} is inside <think>: close </think> first, then call"
                )
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


def _think_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) of each <think> block: to its </think>, else to the end of the text; a
    </think> with no <think> before it closes a block opened at the start (by the prompt)."""
    spans, pos = [], 0
    while True:
        close = text.find("</think>", pos)
        open_ = text.find("<think>", pos)
        if close < 0:
            if open_ >= 0:
                spans.append((open_, len(text)))
            return spans
        start = open_ if 0 <= open_ < close else pos
        spans.append((start, close))
        pos = close + len("</think>")


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
