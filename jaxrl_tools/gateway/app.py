"""The gateway's HTTP routes: an OpenAI-compatible API over a `Backend` and a `Chat`.

`make_app(backend, chat)` is an ASGI app (Starlette) with

  POST /v1/chat/completions  chat messages -> `chat.prompt_ids` -> `backend.generate`, one
                             `Generation` per choice (`n`), each reply read by `chat.reply`
                             (content, and `tool_calls` where the text holds calls).
  POST /v1/completions       a text prompt (tokenized without special tokens added) or token
                             ids, continued as they are; a batch of prompts is supported
                             (choice index = prompt index * n + j, as OpenAI numbers them).
  GET  /v1/models            the served model (`served_name`, default `backend.model`) with
                             `max_model_len` = `backend.max_context`.
  GET  /health               {} while the app is up.

Both generating routes stream (`stream: true`) as server-sent events (`gateway.streaming`) of
`chat.completion.chunk` / `text_completion` objects ending with `data: [DONE]`, with a usage
chunk (no choices) before it when `stream_options.include_usage` is set. Streamed text is held
back where it could still change (see `gateway.streaming`). The last chunk of a choice carries
the rest of its content, its `tool_calls` (each with its index, id, type, name and arguments,
whole) and its finish reason, so the streamed content equals the content of the same request
unstreamed.

Extension fields (the names vLLM and SGLang use): every choice carries `prompt_token_ids` (the
context it continued) and `token_ids` (every token sampled, the end token and the tokens of a
stop string included: what the policy produced, for training). Streamed, the first chunk of a
choice carries its `prompt_token_ids`, and each chunk the `token_ids` (and log-probs) of the
tokens released with it: concatenated over a choice's chunks they are its whole `token_ids`.
Log-probs (`logprobs: true` in chat, `logprobs: 0` or `1` in completions) cover the same tokens,
one entry per token id.

Requests are read and checked as `gateway.requests` describes: unknown fields are ignored, a
known field with a wrong type or value is a 400 naming it.

Not supported (a 400 saying so, rather than silently answering something else):
  - top log-probs (chat `top_logprobs` > 0, completions `logprobs` > 1): the engine computes
    only the log-prob of the token it sampled;
  - `tool_choice` "required" or a named function (constrained decoding would sample from
    another distribution than the policy's); "auto" and "none" are: with "none" the tools are
    still in the prompt, as OpenAI renders them, and generation stops before a "<tool_call>" tag;
  - `response_format` other than text, `logit_bias`, non-zero presence/frequency penalties
    (the engine samples from the policy's own distribution);
  - content parts other than text (images, audio, files), tools other than functions;
  - completions `echo` (no prompt log-probs: the prompt comes back as `prompt_token_ids`),
    `suffix`, and `best_of` other than `n`;
  - more than MAX_N choices, MAX_PROMPTS prompts, MAX_CHOICES sequences or MAX_STOPS stop
    strings in one request, a body over `max_body_bytes` (HTTP 413).

An unknown route is a 404 in the same error shape. An exception inside the backend or the chat
is logged and answered with a 500 (`server_error`; streamed: an error event, then [DONE]); a
`BadRequest` they raise is a 400. Nothing a client sends stops the server. With `api_key` the
/v1 routes ask for it (`Authorization: Bearer <key>`, else a 401); without, any key is
accepted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxrl_tools.gateway.backend import Backend, BadRequest, Chat, Completion
from jaxrl_tools.gateway.requests import (
    MAX_BODY_BYTES,
    MAX_CHOICES,
    MAX_N,
    MAX_PROMPTS,
    APIError,
    Fields,
    bad,
    generations,
    read_messages,
    read_response_format,
    read_tool_choice,
    read_tools,
    sampling,
    server_error,
)
from jaxrl_tools.gateway.streaming import (
    DONE,
    Run,
    TextStream,
    Tokens,
    chat_logprobs,
    generate_all,
    sse,
    stream_error,
    streaming,
    text_logprobs,
    usage,
)

log = logging.getLogger(__name__)

TOOL_CALL_TAG = "<tool_call>"  # Qwen/Hermes tool calls: the chat's parser reads these


def _assistant(message: dict) -> dict:
    out = {**message, "role": "assistant"}
    out.setdefault("content", None)
    if not out.get("tool_calls"):
        out.pop("tool_calls", None)
    return out


def _max_prompt_chars(tokenizer, max_context: int) -> int | None:
    """The most characters a prompt of `max_context` tokens can have (None: unknown)."""
    try:
        longest = max(map(len, tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return None
    return max_context * max(1, longest)


# ---------------------------------------------------------------------------- the app
class _Gateway:
    def __init__(self, backend: Backend, chat: Chat, name: str, max_body_bytes: int):
        self.backend, self.chat, self.name = backend, chat, name
        self.max_body_bytes = max_body_bytes
        self.tokens = Tokens(backend.tokenizer)
        self.created = int(time.time())
        # The chat (its caches) and the tokenizer run on a thread of their own: a long prompt
        # tokenizes without holding up the event loop (/health, other requests' streams).
        self._chat_thread = concurrent.futures.ThreadPoolExecutor(1, "gateway-chat")
        self.max_chars = _max_prompt_chars(backend.tokenizer, int(backend.max_context))

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._chat_thread, fn, *args)

    def _fits(self, chars: int, param: str) -> None:
        """A prompt of `chars` characters cannot fit the context (checked before tokenizing:
        no token covers more than the vocabulary's longest)."""
        if self.max_chars is not None and chars > self.max_chars:
            raise bad(
                f"the prompt is {chars} characters, more than this model's context of "
                f"{self.backend.max_context} tokens can hold: shorten it",
                param,
            )

    async def _body(self, request: Request) -> Fields:
        too_big = APIError(
            413,
            f"the request body is over {self.max_body_bytes} bytes",
            None,
            "invalid_request_error",
        )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_big
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise bad(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        return Fields(body)

    def _room(self, prompt: Sequence[int], param: str) -> int:
        room = int(self.backend.max_context) - len(prompt)
        if room <= 0:
            raise bad(
                f"the prompt is {len(prompt)} tokens, and this model's context holds "
                f"{self.backend.max_context} tokens of prompt and completion together: shorten it",
                param,
            )
        return room

    # ------------------------------------------------------------------ chat
    async def chat_completions(self, request: Request) -> Response:
        f = await self._body(request)
        messages = read_messages(f.get("messages"))
        tools = read_tools(f.get("tools"))
        choice = read_tool_choice(f.get("tool_choice"))
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
        self._fits(sum(len(m.get("content") or "") for m in messages), "messages")
        prompt = [int(t) for t in await self._off_loop(self.chat.prompt_ids, messages, tools)]
        stop = s["stop"]
        if tools and choice == "none" and TOOL_CALL_TAG not in stop:
            stop = (*stop, TOOL_CALL_TAG)
        gens = generations(prompt, s, self._room(prompt, "messages"), stop)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if stream:
            return streaming(
                self._chat_stream(
                    rid, created, messages, tools, gens, prompt, logprobs, include_usage
                )
            )
        completions = await generate_all(self.backend, gens)
        choices = []
        for i, c in enumerate(completions):
            message, finish = await self._off_loop(self.chat.reply, messages, tools, c)
            choices.append(
                {
                    "index": i,
                    "message": _assistant(message),
                    "logprobs": (
                        chat_logprobs(self.tokens, c.token_ids, c.logprobs) if logprobs else None
                    ),
                    "finish_reason": finish,
                    "prompt_token_ids": list(c.prompt_ids),
                    "token_ids": list(c.token_ids),
                }
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": self.name,
                "choices": choices,
                "usage": usage(len(prompt), sum(len(c.token_ids) for c in completions)),
            }
        )

    async def _chat_stream(
        self, rid, created, messages, tools, gens, prompt, logprobs, include_usage
    ) -> AsyncIterator[str]:
        n = len(gens)
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.name,
        }
        if include_usage:
            head["usage"] = None

        def chunk(i, delta, ids=None, lps=None, finish=None, **extra) -> str:
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            if logprobs and ids:
                choice["logprobs"] = chat_logprobs(self.tokens, ids, lps)
            if ids is not None:
                choice["token_ids"] = list(ids)
            return sse({**head, "choices": [{**choice, **extra}]})

        tags = (TOOL_CALL_TAG,) if tools else ()
        streams = [TextStream(self.tokens, g.stop, tags, strip=bool(tools)) for g in gens]
        got: list[list[tuple[int, float]]] = [[] for _ in range(n)]  # tokens received
        sent = [0] * n  # tokens sent (their ids and log-probs)
        used = 0
        run = None
        try:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""}, prompt_token_ids=prompt)
            run = Run(self.backend, gens)
            async for event in run.events():
                if event[0] == "tokens":
                    _, i, ids, lps = event
                    got[i] += zip(ids, lps)
                    delta = streams[i].add(ids)
                    if delta:
                        new = got[i][sent[i] :]
                        sent[i] = len(got[i])
                        yield chunk(
                            i, {"content": delta}, [t for t, _ in new], [lp for _, lp in new]
                        )
                    continue
                _, i, task = event
                c: Completion = task.result()
                message, finish = await self._off_loop(self.chat.reply, messages, tools, c)
                delta = {}
                rest = streams[i].finish(message.get("content") or "")
                if rest:
                    delta["content"] = rest
                if message.get("tool_calls"):
                    delta["tool_calls"] = [
                        {"index": k, **call} for k, call in enumerate(message["tool_calls"])
                    ]
                used += len(c.token_ids)
                yield chunk(i, delta, c.token_ids[sent[i] :], c.logprobs[sent[i] :], finish=finish)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(len(prompt), used)})
        except Exception as e:  # noqa: BLE001 -- the response has started: an error event
            yield stream_error(e, "a chat completion")
        finally:
            if run is not None:
                run.cancel()
        yield DONE

    # ------------------------------------------------------------------ completions
    def _prompts(self, value: Any) -> list[list[int]]:
        def ids_of(p: Any, where: str) -> list[int] | None:
            if isinstance(p, str):
                self._fits(len(p), "prompt")
                ids = self.tokens.encode(p)
            elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                ids = p
            else:
                return None
            if not ids:
                raise bad(f"{where} must not be empty", "prompt")
            for t in ids:
                if isinstance(t, bool) or t < 0 or (self.tokens.vocab and t >= self.tokens.vocab):
                    raise bad(f"{where} holds token id {t}, not in this vocabulary", "prompt")
            return ids

        single = ids_of(value, "prompt")
        if single is not None:
            return [single]
        if isinstance(value, list) and value:
            if len(value) > MAX_PROMPTS:
                raise bad(f"prompt holds at most {MAX_PROMPTS} prompts, got {len(value)}", "prompt")
            batch = [ids_of(p, f"prompt[{k}]") for k, p in enumerate(value)]
            if all(ids is not None for ids in batch):
                return batch
        if value == "" or value == []:
            raise bad("prompt must not be empty", "prompt")
        raise bad(
            "prompt must be a string, a list of token ids, or a list of strings or of token-id "
            "lists",
            "prompt",
        )

    async def completions(self, request: Request) -> Response:
        f = await self._body(request)
        prompts = await self._off_loop(self._prompts, f.get("prompt"))
        s = sampling(f, ("max_tokens",), 16)
        lp = f.integer("logprobs", None, 0, 5)
        if lp is not None and lp > 1:
            raise bad(
                "logprobs > 1 is not supported: the engine computes only the log-prob of the "
                "sampled token; send 0 or 1 (top_logprobs then holds the sampled token only)",
                "logprobs",
            )
        if f.boolean("echo"):
            raise bad(
                "echo is not supported (no prompt log-probs): the prompt's token ids come back "
                "in each choice's prompt_token_ids",
                "echo",
            )
        if f.string("suffix"):
            raise bad("suffix is not supported", "suffix")
        if f.integer("best_of", s["n"], 1, MAX_N) != s["n"]:
            raise bad("best_of is not supported: leave it out or send best_of = n", "best_of")
        if len(prompts) * s["n"] > MAX_CHOICES:
            raise bad(f"prompts x n is at most {MAX_CHOICES}, got {len(prompts)} x {s['n']}", "n")
        stream = f.boolean("stream")
        include_usage = f.include_usage()
        gens = []
        for k, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            gens += generations(prompt, s, self._room(prompt, where), s["stop"])
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n_prompt = sum(len(p) for p in prompts)
        if stream:
            return streaming(
                self._text_stream(rid, created, gens, lp is not None, include_usage, n_prompt)
            )
        completions = await generate_all(self.backend, gens)
        choices = [
            {
                "index": i,
                "text": c.text,
                "logprobs": (
                    text_logprobs(self.tokens, c.token_ids, c.logprobs, 0)[0]
                    if lp is not None
                    else None
                ),
                "finish_reason": c.finish_reason,
                "prompt_token_ids": list(c.prompt_ids),
                "token_ids": list(c.token_ids),
            }
            for i, c in enumerate(completions)
        ]
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.name,
                "choices": choices,
                "usage": usage(n_prompt, sum(len(c.token_ids) for c in completions)),
            }
        )

    async def _text_stream(
        self, rid, created, gens, logprobs, include_usage, n_prompt
    ) -> AsyncIterator[str]:
        n = len(gens)
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.name}
        if include_usage:
            head["usage"] = None
        offsets = [0] * n

        def chunk(i, text, ids, lps, finish=None, **extra) -> str:
            choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
            if logprobs:
                choice["logprobs"], offsets[i] = text_logprobs(self.tokens, ids, lps, offsets[i])
            return sse({**head, "choices": [{**choice, "token_ids": list(ids), **extra}]})

        streams = [TextStream(self.tokens, g.stop) for g in gens]
        got: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        sent = [0] * n
        first = [True] * n
        used = 0
        run = None
        try:
            run = Run(self.backend, gens)
            async for event in run.events():
                if event[0] == "tokens":
                    _, i, ids, lps = event
                    got[i] += zip(ids, lps)
                    delta = streams[i].add(ids)
                    if delta:
                        new = got[i][sent[i] :]
                        sent[i] = len(got[i])
                        extra = {"prompt_token_ids": list(gens[i].prompt_ids)} if first[i] else {}
                        first[i] = False
                        yield chunk(i, delta, [t for t, _ in new], [x for _, x in new], **extra)
                    continue
                _, i, task = event
                c: Completion = task.result()
                used += len(c.token_ids)
                extra = {"prompt_token_ids": list(c.prompt_ids)} if first[i] else {}
                yield chunk(
                    i,
                    streams[i].finish(c.text),
                    c.token_ids[sent[i] :],
                    c.logprobs[sent[i] :],
                    c.finish_reason,
                    **extra,
                )
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(n_prompt, used)})
        except Exception as e:  # noqa: BLE001 -- the response has started: an error event
            yield stream_error(e, "a completion")
        finally:
            if run is not None:
                run.cancel()
        yield DONE

    # ------------------------------------------------------------------ models
    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "jaxrl-tools",
                        "max_model_len": int(self.backend.max_context),
                    }
                ],
            }
        )

    async def health(self, request: Request) -> Response:
        return JSONResponse({})


def _guarded(handler, api_key: str | None = None):
    """Every failure of a route as an OpenAI error response: nothing reaches the server. With
    `api_key`, a request without `Authorization: Bearer <api_key>` is a 401."""

    async def endpoint(request: Request) -> Response:
        try:
            if api_key is not None and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), f"Bearer {api_key}".encode()
            ):
                raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)")
            return await handler(request)
        except APIError as e:
            return e.response()
        except BadRequest as e:
            return bad(str(e), e.param).response()
        except Exception as e:  # noqa: BLE001 -- a 500 the client reads, logged here
            log.exception("%s %s failed", request.method, request.url.path)
            return server_error(e).response()

    return endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    if status == 404:
        message = f"no route {request.method} {request.url.path}"
    elif status == 405:
        message = f"{request.url.path} does not take {request.method}"
    else:
        message = str(getattr(exc, "detail", exc))
    kind = "invalid_request_error" if status < 500 else "server_error"
    return APIError(status, message, None, kind).response()


def make_app(
    backend: Backend,
    chat: Chat,
    *,
    served_name: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
) -> Starlette:
    """The OpenAI-compatible ASGI app over `backend` and `chat` (see the module docstring).

    Args:
      backend: decodes the requests' generations.
      chat: chat messages to prompt ids, completions to assistant messages.
      served_name: the model name the responses and `GET /v1/models` carry (default
        `backend.model`); requests may name any model.
      max_body_bytes: the largest request body (larger: HTTP 413).
      api_key: the key the /v1 routes ask for (`Authorization: Bearer <key>`); None: any.
    """
    gw = _Gateway(backend, chat, served_name or str(backend.model), max_body_bytes)
    routes = [
        Route("/v1/chat/completions", _guarded(gw.chat_completions, api_key), methods=["POST"]),
        Route("/v1/completions", _guarded(gw.completions, api_key), methods=["POST"]),
        Route("/v1/models", _guarded(gw.models, api_key), methods=["GET"]),
        Route("/health", _guarded(gw.health), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.gateway = gw
    return app
