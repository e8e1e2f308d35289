"""POST /v1/responses: the subset of OpenAI's Responses API that agents use (the OpenAI Agents
SDK's default model, `OpenAIResponsesModel`; Codex-style clients), served on the chat route's
own path (`_Gateway.prepare`): a request becomes the chat messages and tools of the equivalent
chat completion, so its prompt, its reply and its training record are that request's.

Read: `instructions` (a system message first), `input` (a string: a user message; or items:
messages of role user / system / developer / assistant with string content or input_text /
output_text parts; `function_call` items, joined to the assistant message before them as its
tool calls; `function_call_output` items, tool messages), `tools` of type function (flat:
name, description, parameters; `strict` dropped as in chat), `tool_choice` (auto, none,
required, {"type": "function", "name": ...}), `max_output_tokens`, `temperature`, `top_p`,
`seed`, `stream`, `include` ("message.output_text.logprobs": each output_text's log-probs),
`metadata` (echoed). Ignored: `store` (nothing is stored: the response says store false),
`parallel_tool_calls`, `truncation`, `reasoning`, `user`. Refused with a 400 naming the field:
`previous_response_id` and `conversation` (no state is kept: send the whole history as input),
`prompt` (stored prompts), `background`, `text.format` other than text, `top_logprobs`, content
other than text, items other than those above, tools other than functions.

The response: output items (a message with one output_text, where the reply has text or no
calls, then a function_call per call: call_id, name, arguments), status "completed", or
"incomplete" (reason max_output_tokens) where the reply hit its token limit, usage, and the
extension fields of chat choices: `prompt_token_ids`, `token_ids`. Streamed: response.created,
response.in_progress, then per item output_item.added, (content_part.added, output_text.delta
..., output_text.done, content_part.done | function_call_arguments.delta, .done),
output_item.done, and response.completed (or response.incomplete), each with its
sequence_number; an error after the start is an `error` event.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxrl_tools.gateway.backend import ChatCall, Completion
from jaxrl_tools.gateway.requests import (
    Fields,
    bad,
    declaration,
    read_tool_choice,
    sampling,
)
from jaxrl_tools.gateway.streaming import chat_logprobs, error_of, sse, streaming

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
STATELESS = ("previous_response_id", "conversation", "prompt")


# ---------------------------------------------------------------------------- the request
def _text(content: Any, where: str) -> str:
    """Content as text: a string or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise bad(
                    f"{where}[{k}] is not a text part (input_text or output_text, got "
                    f"{kind!r}): this model reads text only",
                    where,
                )
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where} must be a string or a list of text parts", where)


def _string(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad(f"{where}.{key} must be a string", f"{where}.{key}")
    return v


def read_input(instructions: Any, value: Any) -> list[dict]:
    """`instructions` and `input` as chat messages (see the module docstring)."""
    messages = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input must be a string or a non-empty list of items", "input")
    for k, item in enumerate(value):
        where = f"input[{k}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object (a message or a function call item)", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"{where}.role must be one of {list(ROLES)}, got {role!r}", where)
            role = "system" if role == "developer" else role
            messages.append(
                {"role": role, "content": _text(item.get("content"), where + ".content")}
            )
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn's text and calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = _text(item.get("output"), where + ".output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise bad(
                f"{where}.type {kind!r} is not supported: send message, function_call and "
                "function_call_output items",
                f"{where}.type",
            )
    return messages


def read_tools(value: Any) -> list[dict] | None:
    """Function tools (flat: name, description, parameters) as chat tool declarations."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad("tools must be a list of {'type': 'function', 'name': ...}", "tools")
    out = []
    for j, t in enumerate(value):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad(
                f"tools[{j}] must be a function tool (type 'function'), got {kind!r}: this "
                "model runs no built-in tools",
                "tools",
            )
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"tools[{j}].name must be a non-empty string", "tools")
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise bad(f"tools[{j}].description must be a string", "tools")
        if t.get("parameters") is not None and not isinstance(t["parameters"], dict):
            raise bad(f"tools[{j}].parameters must be a JSON Schema object", "tools")
        out.append(declaration(t))
    return out or None


def read_choice(value: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    if isinstance(value, dict):
        if value.get("type") != "function" or not isinstance(value.get("name"), str):
            raise bad(
                "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
                "'name': ...}",
                "tool_choice",
            )
        value = {"type": "function", "function": {"name": value["name"]}}
    return read_tool_choice(value, tools)


def _refuse_unsupported(f: Fields) -> None:
    for name in STATELESS:
        if f.get(name) is not None:
            raise bad(
                f"{name} is not supported: this gateway keeps no responses or conversations "
                "(store: false); send the whole history as input",
                name,
            )
    if f.boolean("background"):
        raise bad("background is not supported: send the request and wait", "background")
    text = f.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
            raise bad("text must be an object ({'format': {'type': 'text'}})", "text")
        if (fmt or {}).get("type", "text") != "text":
            raise bad(
                f"text.format {fmt.get('type')!r} is not supported (no constrained decoding): "
                "ask for the format in the input",
                "text.format",
            )
    if f.integer("top_logprobs", 0, 0, 20):
        raise bad(
            "top_logprobs > 0 is not supported: the engine computes only the log-prob of the "
            "sampled token (include 'message.output_text.logprobs' for those)",
            "top_logprobs",
        )


# ---------------------------------------------------------------------------- the response
class _Reply:
    """One response being built: its head fields, output items and the event counter."""

    def __init__(self, gw, f: Fields, call: ChatCall, logprobs: bool):
        self.gw, self.call, self.logprobs = gw, call, logprobs
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.f = f
        self.seq = 0

    def response(self, status: str, output=(), c: Completion | None = None) -> dict:
        f = self.f
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": f.get("instructions"),
            "max_output_tokens": f.get("max_output_tokens"),
            "metadata": f.get("metadata") or {},
            "model": self.gw.name,
            "output": list(output),
            "parallel_tool_calls": f.get("parallel_tool_calls") is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": f.get("temperature"),
            "text": {"format": {"type": "text"}},
            "tool_choice": f.get("tool_choice") or "auto",
            "tools": f.get("tools") or [],
            "top_p": f.get("top_p"),
            "truncation": "disabled",
            "usage": None,
        }
        if c is not None:
            n_in, n_out = len(c.prompt_ids), len(c.token_ids)
            out["usage"] = {
                "input_tokens": n_in,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": n_in + n_out,
            }
            out["prompt_token_ids"] = list(c.prompt_ids)
            out["token_ids"] = list(c.token_ids)
        return out

    def text_part(self, text: str, c: Completion | None = None) -> dict:
        lps = chat_logprobs(self.gw.tokens, c.token_ids, c.logprobs)["content"] if c else []
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": lps}

    def message(self, mid: str, status: str, content: list) -> dict:
        return {
            "type": "message",
            "id": mid,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def items(self, message: dict, status: str, c: Completion) -> list[dict]:
        out = []
        if message.get("content") or not message.get("tool_calls"):
            part = self.text_part(message.get("content") or "", c if self.logprobs else None)
            out.append(self.message(f"msg_{uuid.uuid4().hex}", status, [part]))
        out += [_function_call(call) for call in message.get("tool_calls") or ()]
        return out

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        body = {"type": kind, "sequence_number": self.seq - 1, **fields}
        return f"event: {kind}\n" + sse(body)


def _function_call(call: dict, status: str = "completed", arguments: str | None = None) -> dict:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": f"fc_{call['id'].removeprefix('call_')}",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if arguments is None else arguments,
        "status": status,
    }


def _status(finish: str) -> str:
    return "incomplete" if finish == "length" else "completed"


async def create(gw, request: Request) -> Response:
    f = await gw._body(request)
    _refuse_unsupported(f)
    messages = read_input(f.get("instructions"), f.get("input"))
    tools = read_tools(f.get("tools"))
    choice = read_choice(f.get("tool_choice"), tools)
    s = {**sampling(f, ("max_output_tokens",), None), "n": 1}
    include = f.get("include") or []
    if not isinstance(include, list):
        raise bad("include must be a list of strings", "include")
    stream = f.boolean("stream")
    if f.get("metadata") is not None and not isinstance(f.get("metadata"), dict):
        raise bad("metadata must be an object", "metadata")
    call = await gw.prepare(messages, tools, choice, s, param="input")
    reply = _Reply(gw, f, call, "message.output_text.logprobs" in include)
    if stream:
        return streaming(_stream(reply))
    ((c, message, finish),) = await gw.replies(call)
    status = _status(finish)
    return JSONResponse(reply.response(status, reply.items(message, status, c), c))


async def _stream(r: _Reply) -> AsyncIterator[str]:
    yield r.event("response.created", response=r.response("in_progress"))
    yield r.event("response.in_progress", response=r.response("in_progress"))
    mid, text, output = f"msg_{uuid.uuid4().hex}", "", []
    ref = {"item_id": mid, "output_index": 0, "content_index": 0}
    try:
        async with contextlib.aclosing(r.gw.events(r.call)) as events:
            async for event in events:
                if event[0] == "text":
                    if not text:  # the message item opens with its first text
                        yield r.event(
                            "response.output_item.added",
                            output_index=0,
                            item=r.message(mid, "in_progress", []),
                        )
                        yield r.event(
                            "response.content_part.added", **{**ref, "part": r.text_part("")}
                        )
                    text += event[2]
                    yield r.event("response.output_text.delta", **ref, delta=event[2], logprobs=[])
                    continue
                _, _, c, message, finish, rest, _, _ = event
        status = _status(finish)
        items = r.items(message, status, c)
        if items[0]["type"] == "message":
            if not text:
                yield r.event(
                    "response.output_item.added",
                    output_index=0,
                    item=r.message(mid, "in_progress", []),
                )
                yield r.event("response.content_part.added", **{**ref, "part": r.text_part("")})
            if rest:
                yield r.event("response.output_text.delta", **ref, delta=rest, logprobs=[])
            items[0]["id"] = mid
            part = items[0]["content"][0]
            yield r.event(
                "response.output_text.done", **ref, text=part["text"], logprobs=part["logprobs"]
            )
            yield r.event("response.content_part.done", **ref, part=part)
            yield r.event("response.output_item.done", output_index=0, item=items[0])
            output.append(items[0])
        for item in items[len(output) :]:
            k = len(output)
            opened = {**item, "arguments": "", "status": "in_progress"}
            yield r.event("response.output_item.added", output_index=k, item=opened)
            ref_call = {"item_id": item["id"], "output_index": k}
            yield r.event(
                "response.function_call_arguments.delta", **ref_call, delta=item["arguments"]
            )
            yield r.event(
                "response.function_call_arguments.done",
                **ref_call,
                name=item["name"],
                arguments=item["arguments"],
            )
            yield r.event("response.output_item.done", output_index=k, item=item)
            output.append(item)
        end = "response.completed" if status == "completed" else "response.incomplete"
        yield r.event(end, response=r.response(status, output, c))
    except Exception as e:  # noqa: BLE001 -- the response has started: an error event
        err = error_of(e, "a response").body()["error"]
        yield r.event("error", error=err, **{k: err[k] for k in ("message", "param", "code")})
