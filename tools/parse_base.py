"""What every tool-call parser shares: the parse result, the strict tag scanner and a JSON
decoder that never raises (`tools.parsers` has the protocols)."""

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
    # What marks a segment as the final answer, for protocols that answer a turn with neither
    # a call nor an answer (`rollout.invalid_action` "notice"); None: no such rule.
    answer_pattern: re.Pattern | None = None

    def parse(self, text: str) -> ParseResult:
        raise NotImplementedError

    def format_observation(self, obs_texts: list[str]) -> str:
        raise NotImplementedError
