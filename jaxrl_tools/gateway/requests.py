"""Reading and checking the bodies of the gateway's requests (`gateway.app`).

Requests: unknown fields are accepted and ignored (clients send extras: `user`, `metadata`,
`store`, `parallel_tool_calls`, ...); a known field with a wrong type or value is HTTP 400 with
OpenAI's error object ({"error": {"message", "type", "param", "code"}}) naming it in `param`.
`max_tokens` (and chat's `max_completion_tokens`) beyond the room the context leaves after the
prompt is clamped to it (the choice ends with finish_reason "length"), not refused: agents send
a fixed budget whatever the context; a prompt that leaves no room at all is a 400. `seed`: choice
j of a prompt samples with seed + j (mod 2**32). A message with role "developer" is a system
message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse

from jaxrl_tools.gateway.backend import Generation

MAX_N = 16  # choices of one prompt
MAX_PROMPTS = 16  # prompts of one completions request
MAX_CHOICES = 64  # sequences of one request (prompts x n)
MAX_STOPS = 4  # as OpenAI
MAX_BODY_BYTES = 8 * 2**20
ROLES = ("system", "user", "assistant", "tool")


class APIError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def server_error(e: BaseException) -> APIError:
    return APIError(500, f"the model backend failed: {type(e).__name__}: {e}", None, "server_error")


# ---------------------------------------------------------------------------- request fields
class Fields:
    """Typed reads of a request body's fields; null is the same as absent."""

    def __init__(self, body: dict):
        self.body = body

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def number(self, name: str, default: float, lo: float, hi: float, lo_open=False) -> float:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise bad(f"{name} must be a number", name)
        try:
            v = float(v)
        except OverflowError:
            raise bad(f"{name} is out of range", name) from None
        ok = (lo < v if lo_open else lo <= v) and v <= hi  # False for NaN
        if not ok:
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise bad(f"{name} must be in {interval}, got {v:g}", name)
        return v

    def integer(self, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad(f"{name} must be an integer", name)
        if v < lo or (hi is not None and v > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise bad(f"{name} must be {bound}, got {v}", name)
        return v

    def boolean(self, name: str, default: bool = False) -> bool:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad(f"{name} must be true or false", name)
        return v

    def string(self, name: str) -> str | None:
        v = self.body.get(name)
        if v is not None and not isinstance(v, str):
            raise bad(f"{name} must be a string", name)
        return v

    def stops(self) -> tuple[str, ...]:
        v = self.body.get("stop")
        if v is None:
            return ()
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise bad("stop must be a string or a list of strings", "stop")
        if len(v) > MAX_STOPS:
            raise bad(f"stop holds at most {MAX_STOPS} strings, got {len(v)}", "stop")
        if not all(v):
            raise bad("stop strings must not be empty", "stop")
        return tuple(dict.fromkeys(v))

    def include_usage(self) -> bool:
        v = self.body.get("stream_options")
        if v is None:
            return False
        if not isinstance(v, dict):
            raise bad("stream_options must be an object", "stream_options")
        usage = v.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise bad("stream_options.include_usage must be true or false", "stream_options")
        return bool(usage)

    def unsupported_sampling(self) -> None:
        """Refuses what would make the engine sample from another distribution."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = self.number(name, 0.0, -2.0, 2.0)
            if v != 0.0:
                raise bad(
                    f"{name} is not supported (the engine samples from the policy's own "
                    "distribution): send 0 or leave it out",
                    name,
                )
        bias = self.body.get("logit_bias")
        if bias is not None and not isinstance(bias, dict):
            raise bad("logit_bias must be an object", "logit_bias")
        if bias:
            raise bad(
                "logit_bias is not supported (the engine samples from the policy's own "
                "distribution)",
                "logit_bias",
            )


def sampling(f: Fields, max_names: Sequence[str], default_max: int | None) -> dict:
    """The sampling fields both generating routes share."""
    f.string("model")
    f.unsupported_sampling()
    max_tokens = default_max
    for name in max_names:  # the first one given wins (max_completion_tokens, then max_tokens)
        v = f.integer(name, None, 1)
        if v is not None:
            max_tokens = v
            break
    seed = f.integer("seed", None, -(2**63), 2**64 - 1)
    return {
        "temperature": f.number("temperature", 1.0, 0.0, 2.0),
        "top_p": f.number("top_p", 1.0, 0.0, 1.0, lo_open=True),
        "n": f.integer("n", 1, 1, MAX_N),
        "stop": f.stops(),
        "seed": seed,
        "max_tokens": max_tokens,
    }


def generations(
    prompt: list[int], s: dict, room: int, stop: tuple[str, ...], opener: str = ""
) -> list:
    max_tokens = None if s["max_tokens"] is None else min(s["max_tokens"], room)
    return [
        Generation(
            prompt_ids=tuple(prompt),
            max_tokens=max_tokens,
            temperature=s["temperature"],
            top_p=s["top_p"],
            stop=stop,
            seed=None if s["seed"] is None else (s["seed"] + j) % 2**32,
            opener=opener,
        )
        for j in range(s["n"])
    ]


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts (joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise bad(
                    f"{where}.content[{k}] is not a text part ({{'type': 'text', 'text': ...}}; "
                    f"got type {kind!r}): this model reads text only",
                    f"{where}.content",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where}.content must be a string, null or a list of text parts", f"{where}.content")


def read_messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with a role and content", where)
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise bad(
                f"{where}.role must be one of {list(ROLES)} or 'developer', got {m.get('role')!r}",
                f"{where}.role",
            )
        msg = {**m, "role": role, "content": _text_of(m.get("content"), where)}
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(f"{where}.tool_calls must be a list in an assistant message", where)
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad(
                        f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': "
                        "{'name': ..., 'arguments': ...}}",
                        f"{where}.tool_calls",
                    )
        out.append(msg)
    return out


def read_tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad("tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    for j, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(
                f"tools[{j}] must be a function tool (type 'function'), got {kind!r}", "tools"
            )
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{j}].function must be an object with a string name", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"tools[{j}].function.description must be a string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"tools[{j}].function.parameters must be a JSON Schema object", "tools")
    return [declaration(t["function"]) for t in value] or None


def declaration(fn: dict) -> dict:
    """A function declaration as the built-in loop renders one (`tools.Tool.schema`): SDK-only
    keys (`strict`, ...) dropped, so that an agent's prompts are the built-in loop's."""
    return {
        "type": "function",
        "function": {
            "name": fn["name"],
            "description": fn.get("description") or "",
            "parameters": fn.get("parameters")
            or {"type": "object", "properties": {}, "required": []},
        },
    }


def read_tool_choice(value: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    """(mode, name): "auto", "none", "required" (some call), or "function" with the name of the
    declared function to call (OpenAI's {"type": "function", "function": {"name": ...}})."""
    if value is None or value in ("auto", "none"):
        return value or "auto", None
    if value == "required":
        mode, name = "required", None
    elif isinstance(value, dict):
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise bad(
                "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
                "'function': {'name': ...}}",
                "tool_choice",
            )
        mode = "function"
    else:
        raise bad(
            f"tool_choice must be 'auto', 'none', 'required' or a named function, got {value!r}",
            "tool_choice",
        )
    declared = [t["function"]["name"] for t in tools or ()]
    if not declared:
        raise bad(
            f"tool_choice {value!r} asks for a tool call, but no tools are declared", "tool_choice"
        )
    if mode == "function" and name not in declared:
        raise bad(f"tool_choice names {name!r}, which is not in tools ({declared})", "tool_choice")
    return mode, name


def call_opener(mode: str, name: str | None) -> str:
    """The start of the reply a tool_choice forces (Qwen/Hermes calls, as the chat template
    writes them): the call tag, and for a named function its name up to its arguments."""
    if mode == "required":
        return "<tool_call>\n"
    if mode == "function":
        return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '
    return ""


def read_response_format(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad("response_format must be an object", "response_format")
    if value.get("type", "text") != "text":
        raise bad(
            f"response_format {value.get('type')!r} is not supported (no constrained decoding): "
            "ask for the format in the messages",
            "response_format",
        )
