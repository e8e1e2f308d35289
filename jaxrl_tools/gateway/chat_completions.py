"""POST /v1/chat/completions (`gateway.app`): chat messages -> `chat.prompt_ids` ->
`backend.generate`, one `Generation` per choice (`n`), each reply read by `chat.reply`
(content, and `tool_calls` where the text holds calls); streamed as `chat.completion.chunk`
events (see `gateway.app` for the fields)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxrl_tools.gateway.requests import (
    bad,
    read_messages,
    read_response_format,
    read_tool_choice,
    read_tools,
    sampling,
)
from jaxrl_tools.gateway.streaming import DONE, chat_logprobs, sse, stream_error, streaming, usage


def _assistant(message: dict) -> dict:
    out = {**message, "role": "assistant"}
    out.setdefault("content", None)
    if not out.get("tool_calls"):
        out.pop("tool_calls", None)
    return out


async def chat_completions(gw, request: Request) -> Response:
    f = await gw._body(request)
    messages = read_messages(f.get("messages"))
    tools = read_tools(f.get("tools"))
    choice = read_tool_choice(f.get("tool_choice"), tools)
    read_response_format(f.get("response_format"))
    s = sampling(f, ("max_completion_tokens", "max_tokens"), None)
    logprobs = f.boolean("logprobs")
    if f.integer("top_logprobs", 0, 0, 20):
        raise bad(
            "top_logprobs > 0 is not supported: the engine computes only the log-prob of "
            "the sampled token; send logprobs: true without top_logprobs",
            "top_logprobs",
        )
    stream = f.boolean("stream")
    include_usage = f.include_usage()
    call = await gw.prepare(messages, tools, choice, s)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if stream:
        return streaming(_chat_stream(gw, rid, created, call, logprobs, include_usage))
    replies = await gw.replies(call)
    choices = [
        {
            "index": i,
            "message": _assistant(message),
            "logprobs": (chat_logprobs(gw.tokens, c.token_ids, c.logprobs) if logprobs else None),
            "finish_reason": finish,
            "prompt_token_ids": list(c.prompt_ids),
            "token_ids": list(c.token_ids),
        }
        for i, (c, message, finish) in enumerate(replies)
    ]
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": gw.name,
            "choices": choices,
            "usage": usage(len(call.prompt), sum(len(c.token_ids) for c, _, _ in replies)),
        }
    )


async def _chat_stream(gw, rid, created, call, logprobs, include_usage) -> AsyncIterator[str]:
    head = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": gw.name,
    }
    if include_usage:
        head["usage"] = None

    def chunk(i, delta, ids=None, lps=None, finish=None, **extra) -> str:
        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        if logprobs and ids:
            choice["logprobs"] = chat_logprobs(gw.tokens, ids, lps)
        if ids is not None:
            choice["token_ids"] = list(ids)
        return sse({**head, "choices": [{**choice, **extra}]})

    used = 0
    try:
        for i in range(len(call.gens)):
            yield chunk(i, {"role": "assistant", "content": ""}, prompt_token_ids=call.prompt)
        async with contextlib.aclosing(gw.events(call)) as events:
            async for event in events:
                if event[0] == "text":
                    _, i, text, ids, lps = event
                    yield chunk(i, {"content": text}, ids, lps)
                    continue
                _, i, c, message, finish, rest, ids, lps = event
                delta = {"content": rest} if rest else {}
                if message.get("tool_calls"):
                    delta["tool_calls"] = [
                        {"index": k, **tc} for k, tc in enumerate(message["tool_calls"])
                    ]
                used += len(c.token_ids)
                yield chunk(i, delta, ids, lps, finish=finish)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(len(call.prompt), used)})
    except Exception as e:  # noqa: BLE001 -- the response has started: an error event
        yield stream_error(e, "a chat completion")
    yield DONE
