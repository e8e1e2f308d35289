"""POST /v1/messages: Anthropic's Messages API, read into the chat request it is equivalent to
and served on the chat route's path (`_Gateway.prepare`), as `gateway.responses` does: the
same prompt and training record as the chat completion of the same turns.

Read: `system` (a string or text blocks: a system message first), `messages` (role user or
assistant; content a string or blocks: text; an assistant's tool_use blocks, its tool calls;
a user's tool_result blocks, tool messages before the user's text), `tools` (name,
description, input_schema), `tool_choice` (auto, any = required, tool = a named function,
none), `max_tokens`, `temperature`, `top_p`, `stop_sequences`, `stream`, `metadata` (ignored).
Refused with a 400 naming the field: `top_k` (the engine samples top-p only), `thinking`
enabled, blocks other than those above (images, documents), tools with a `type` (Anthropic's
own server tools).

The reply: a message with a text block (where there is text) and a tool_use block per call
(`input`: the arguments), `stop_reason` end_turn, tool_use, max_tokens or stop_sequence (with
`stop_sequence`), usage, and `prompt_token_ids` / `token_ids` as in chat. Streamed: the
events of Anthropic's stream (message_start, content_block_start / _delta / _stop per block:
text_delta, input_json_delta, then message_delta with the stop reason and message_stop); an
error after the start is an `error` event.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxrl_tools.gateway.backend import ChatCall, Completion
from jaxrl_tools.gateway.requests import Fields, bad, declaration, read_tool_choice, sampling
from jaxrl_tools.gateway.streaming import error_of, sse, streaming


# ---------------------------------------------------------------------------- the request
def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad(f"{where} must be a string or a list of content blocks", where)
    return content


def _text(content: Any, where: str) -> str:
    texts = []
    for k, b in enumerate(_blocks(content, where)):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad(f"{where}[{k}] must be a text block, got {b.get('type')!r}", where)
        texts.append(b["text"])
    return "".join(texts)


def read_messages(system: Any, value: Any) -> list[dict]:
    """`system` and `messages` as chat messages (see the module docstring)."""
    out = [] if system is None else [{"role": "system", "content": _text(system, "system")}]
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list of messages", "messages")
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role must be 'user' or 'assistant', got {role!r}", where)
        texts, calls = [], []
        for k, b in enumerate(_blocks(m.get("content"), f"{where}.content")):
            kind, at = b.get("type"), f"{where}.content[{k}]"
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise bad(f"{at} must have a string name and an object input", at)
                arguments = json.dumps(b.get("input", {}))
                calls.append(
                    {
                        "id": str(b.get("id") or ""),
                        "type": "function",
                        "function": {"name": b["name"], "arguments": arguments},
                    }
                )
            elif kind == "tool_result" and role == "user":
                output = _text(b.get("content") or "", f"{at}.content")
                out.append(
                    {"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": output}
                )
            else:
                raise bad(
                    f"{at}: a {kind!r} block is not supported in a {role} message (text, an "
                    "assistant's tool_use, a user's tool_result)",
                    at,
                )
        if role == "assistant":
            out.append({"role": "assistant", "content": "".join(texts) or None})
            if calls:
                out[-1]["tool_calls"] = calls
        elif texts or not m.get("content"):
            out.append({"role": "user", "content": "".join(texts)})
    return out


def read_tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad("tools must be a list of {'name', 'description', 'input_schema'}", "tools")
    out = []
    for j, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(f"tools[{j}] must be a client tool (no type), got type {kind!r}", "tools")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"tools[{j}].name must be a non-empty string", "tools")
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise bad(f"tools[{j}].description must be a string", "tools")
        if not isinstance(t.get("input_schema", {}), dict):
            raise bad(f"tools[{j}].input_schema must be a JSON Schema object", "tools")
        out.append(declaration({**t, "parameters": t.get("input_schema")}))
    return out or None


def read_choice(value: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind in ("auto", "none"):
        return read_tool_choice(kind, tools)
    if kind == "any":
        return read_tool_choice("required", tools)
    if kind == "tool" and isinstance(value.get("name"), str):
        return read_tool_choice({"type": "function", "function": {"name": value["name"]}}, tools)
    raise bad(
        "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
        "tool_choice",
    )


# ---------------------------------------------------------------------------- the reply
def _stop(gw, stops, finish: str, c: Completion) -> tuple[str, str | None]:
    """Anthropic's stop reason, and which of the request's `stops` ended the reply (its tokens
    are the reply's last: the first one found in them)."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if not c.ended_with_eos and stops:
        written = gw.tokens.decode(c.token_ids)
        found = [(written.find(s), s) for s in stops if s in written]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


def _content(message: dict) -> list[dict]:
    out = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for tc in message.get("tool_calls") or ():
        try:
            args = json.loads(tc["function"]["arguments"])
        except ValueError:
            args = {}
        out.append(
            {"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"], "input": args}
        )
    return out


def _message(gw, mid: str, content: list, stop=(None, None), c: Completion | None = None) -> dict:
    out = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": gw.name,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }
    if c is not None:
        out["usage"] = {"input_tokens": len(c.prompt_ids), "output_tokens": len(c.token_ids)}
        out["prompt_token_ids"], out["token_ids"] = list(c.prompt_ids), list(c.token_ids)
    return out


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\n" + sse({"type": kind, **fields})


async def create(gw, request: Request) -> Response:
    f = await gw._body(request)
    if f.get("top_k") is not None:
        raise bad("top_k is not supported: the engine samples with temperature and top_p", "top_k")
    thinking = f.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        raise bad("thinking is not supported: the policy's reply is its own", "thinking")
    messages = read_messages(f.get("system"), f.get("messages"))
    tools = read_tools(f.get("tools"))
    choice = read_choice(f.get("tool_choice"), tools)
    body = {**f.body, "stop": f.get("stop_sequences")}
    s = {**sampling(Fields(body), ("max_tokens",), None), "n": 1}
    stream = f.boolean("stream")
    call = await gw.prepare(messages, tools, choice, s)
    mid = f"msg_{uuid.uuid4().hex}"
    if stream:
        return streaming(_stream(gw, call, mid, s["stop"]))
    ((c, message, finish),) = await gw.replies(call)
    stop = _stop(gw, s["stop"], finish, c)
    return JSONResponse(_message(gw, mid, _content(message), stop, c))


async def _stream(gw, call: ChatCall, mid: str, stops) -> AsyncIterator[str]:
    start = _message(gw, mid, [])
    start["usage"]["input_tokens"] = len(call.prompt)
    yield _event("message_start", message=start)
    index, text = 0, False
    try:
        async with contextlib.aclosing(gw.events(call)) as events:
            async for event in events:
                if event[0] == "end":
                    _, _, c, message, finish, rest, _, _ = event
                    break
                if not text:  # the text block opens with the first text
                    text = True
                    block = {"type": "text", "text": ""}
                    yield _event("content_block_start", index=0, content_block=block)
                delta = {"type": "text_delta", "text": event[2]}
                yield _event("content_block_delta", index=0, delta=delta)
        blocks = _content(message)
        if blocks and blocks[0]["type"] == "text":
            if not text:
                text = True
                yield _event(
                    "content_block_start", index=0, content_block={"type": "text", "text": ""}
                )
            if rest:
                yield _event(
                    "content_block_delta", index=0, delta={"type": "text_delta", "text": rest}
                )
            blocks = blocks[1:]
        if text:
            yield _event("content_block_stop", index=0)
            index = 1
        for k, b in enumerate(blocks, index):
            yield _event("content_block_start", index=k, content_block={**b, "input": {}})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(b["input"])}
            yield _event("content_block_delta", index=k, delta=delta)
            yield _event("content_block_stop", index=k)
        reason, seq = _stop(gw, stops, finish, c)
        delta = {"stop_reason": reason, "stop_sequence": seq}
        yield _event("message_delta", delta=delta, usage={"output_tokens": len(c.token_ids)})
        yield _event("message_stop")
    except Exception as e:  # noqa: BLE001 -- the response has started: an error event
        err = error_of(e, "a message").body()["error"]
        yield _event("error", error={"type": err["type"], "message": err["message"]})
