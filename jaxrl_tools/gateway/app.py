"""The gateway's HTTP routes: an OpenAI-compatible API over a `Backend` and a `Chat`.

`make_app(backend, chat)` is an ASGI app (Starlette) with

  POST /v1/chat/completions  chat messages -> `chat.prompt_ids` -> `backend.generate`, one
                             `Generation` per choice (`n`), each reply read by `chat.reply`
                             (content, and `tool_calls` where the text holds calls).
  POST /v1/responses         OpenAI's Responses API (the subset agents use), read into the
                             chat request it is equivalent to (`gateway.responses`).
  POST /v1/messages          Anthropic's Messages API, the same way (`gateway.messages`).
  POST /v1/completions       a text prompt or token ids, continued as they are
                             (`gateway.completions`).
  GET  /v1/models            the served model (`served_name`, default `backend.model`) with
                             `max_model_len` = `backend.max_context`.
  GET  /health               {} while the app is up.

Chat and text completions stream (`stream: true`) as server-sent events (`gateway.streaming`) of
`chat.completion.chunk` / `text_completion` objects ending with `data: [DONE]`, with a usage
chunk (no choices) before it when `stream_options.include_usage` is set. Streamed text is held
back where it could still change (see `gateway.streaming`). The last chunk of a choice carries
the rest of its content, its `tool_calls` (each with its index, id, type, name and arguments,
whole) and its finish reason, so the streamed content equals the content of the same request
unstreamed. (Responses and messages stream their APIs' own events: see their modules.)

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
  - nothing of `tool_choice` is: "auto"; "none" (the tools are still in the prompt, as OpenAI
    renders them, and generation stops before a "<tool_call>" tag); "required" and a named
    function force the start of a call: the reply's first tokens are given, "<tool_call>\n"
    (and `{"name": "<name>", "arguments": ` for a named function, as the chat template writes
    calls), the policy writes the rest. Given, not sampled, they end the prompt: the choice's
    `prompt_token_ids` hold them, its `token_ids` (what training takes as the policy's tokens)
    do not, and an agent's trajectory holds them as it holds a tool's output (loss mask 0);
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
import contextlib
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxrl_tools.gateway import chat_completions, completions, responses
from jaxrl_tools.gateway import messages as anthropic
from jaxrl_tools.gateway.backend import Backend, BadRequest, Chat, ChatCall, Completion
from jaxrl_tools.gateway.requests import (
    MAX_BODY_BYTES,
    APIError,
    Fields,
    bad,
    call_opener,
    generations,
    server_error,
)
from jaxrl_tools.gateway.streaming import TextStream, Tokens, generate_all, released

log = logging.getLogger(__name__)

TOOL_CALL_TAG = "<tool_call>"  # Qwen/Hermes tool calls: the chat's parser reads these


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
    async def prepare(self, messages, tools, choice, s: dict, param="messages") -> ChatCall:
        """A chat request (read by any route: chat completions, responses, messages) as the
        prompt and generations of its choices; `param` names the messages' field."""
        mode, name = choice
        opener = call_opener(mode, name)
        if opener and getattr(self.chat, "parser", "") is None:
            raise bad(
                "tool_choice cannot force a call: this model's protocol reads no tool calls "
                "(rollout.protocol); send 'auto' or 'none'",
                "tool_choice",
            )
        self._fits(sum(len(m.get("content") or "") for m in messages), param)
        prompt = [
            int(t) for t in await self._off_loop(self.chat.prompt_ids, messages, tools, opener)
        ]
        stop = s["stop"]
        if tools and mode == "none" and TOOL_CALL_TAG not in stop:
            stop = (*stop, TOOL_CALL_TAG)
        gens = generations(prompt, s, self._room(prompt, param), stop, opener)
        return ChatCall(messages, tools, gens, prompt, opener, self.tokens.encode(opener))

    async def _reply(self, call: ChatCall, c: Completion) -> tuple[dict, str]:
        return await self._off_loop(self.chat.reply, call.messages, call.tools, call.written(c))

    async def replies(self, call: ChatCall) -> list[tuple[Completion, dict, str]]:
        """Each choice's completion, assistant message and finish reason."""
        return [
            (c, *await self._reply(call, c)) for c in await generate_all(self.backend, call.gens)
        ]

    async def events(self, call: ChatCall) -> AsyncIterator[tuple]:
        """The choices streamed: ("text", i, delta, ids, logprobs) as text is released (with the
        tokens received since the last), then ("end", i, completion, message, finish, rest,
        ids, logprobs): the rest of the content and of the tokens."""
        tags = (TOOL_CALL_TAG,) if call.tools else ()
        streams = [TextStream(self.tokens, g.stop, tags, strip=bool(call.tools)) for g in call.gens]
        for st in streams:
            st.cut = bool(call.opener)  # a forced call: its text is the call's, none is content
        async with contextlib.aclosing(released(self.backend, call.gens, streams)) as events:
            async for event in events:
                if event[0] == "text":
                    yield event
                    continue
                _, i, c, ids, lps = event
                message, finish = await self._reply(call, c)
                rest = streams[i].finish(message.get("content") or "")
                yield "end", i, c, message, finish, rest, ids, lps

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

    def post(path, handler):
        return Route(path, _guarded(functools.partial(handler, gw), api_key), methods=["POST"])

    routes = [
        post("/v1/chat/completions", chat_completions.chat_completions),
        post("/v1/responses", responses.create),
        post("/v1/messages", anthropic.create),
        post("/v1/completions", completions.completions),
        Route("/v1/models", _guarded(gw.models, api_key), methods=["GET"]),
        Route("/health", _guarded(gw.health), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.gateway = gw
    return app
