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

Both generating routes stream (`stream: true`) as server-sent events of `chat.completion.chunk`
/ `text_completion` objects ending with `data: [DONE]`, with a usage chunk (no choices) before
it when `stream_options.include_usage` is set. Streamed text is the text of the tokens decoded
so far, held back where it could still change: the last token received (it may be the end
token, or half of a character), a half-decoded character, anything from a stop string on and
any end of the text that could begin one, and, when the request has tools, anything from a
"<tool_call>" tag on, the end of the text that could begin one, trailing whitespace, and all of
it while it starts with whitespace (the reply's content is the text around the calls, stripped).
The last chunk of a choice carries the rest of its content, its `tool_calls` (each with its
index, id, type, name and arguments, whole) and its finish reason, so the streamed content
equals the content of the same request unstreamed.

Extension fields (the names vLLM and SGLang use): every choice carries `prompt_token_ids` (the
context it continued) and `token_ids` (every token sampled, the end token and the tokens of a
stop string included: what the policy produced, for training). Streamed, the first chunk of a
choice carries its `prompt_token_ids`, and each chunk the `token_ids` (and log-probs) of the
tokens released with it: concatenated over a choice's chunks they are its whole `token_ids`.
Log-probs (`logprobs: true` in chat, `logprobs: 0` or `1` in completions) cover the same tokens,
one entry per token id.

Requests: unknown fields are accepted and ignored (clients send extras: `user`, `metadata`,
`store`, `parallel_tool_calls`, ...); a known field with a wrong type or value is HTTP 400 with
OpenAI's error object ({"error": {"message", "type", "param", "code"}}) naming it in `param`.
`max_tokens` (and chat's `max_completion_tokens`) beyond the room the context leaves after the
prompt is clamped to it (the choice ends with finish_reason "length"), not refused: agents send
a fixed budget whatever the context; a prompt that leaves no room at all is a 400. `seed`: choice
j of a prompt samples with seed + j (mod 2**32). A message with role "developer" is a system
message.

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
`BadRequest` they raise is a 400. Nothing a client sends stops the server. There is no
authentication: any API key is accepted.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxrl_tools.gateway.backend import Backend, BadRequest, Chat, Completion, Generation

log = logging.getLogger(__name__)

MAX_N = 16  # choices of one prompt
MAX_PROMPTS = 16  # prompts of one completions request
MAX_CHOICES = 64  # sequences of one request (prompts x n)
MAX_STOPS = 4  # as OpenAI
MAX_BODY_BYTES = 8 * 2**20
TOOL_CALL_TAG = "<tool_call>"  # Qwen/Hermes tool calls: the chat's parser reads these
ROLES = ("system", "user", "assistant", "tool")
_LOGPROB_FLOOR = -9999.0  # a non-finite log-prob (JSON has no -inf), as vLLM reports it


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


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def _server_error(e: BaseException) -> APIError:
    return APIError(500, f"the model backend failed: {type(e).__name__}: {e}", None, "server_error")


# ---------------------------------------------------------------------------- request fields
class _Fields:
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
            raise _bad(f"{name} must be a number", name)
        try:
            v = float(v)
        except OverflowError:
            raise _bad(f"{name} is out of range", name) from None
        ok = (lo < v if lo_open else lo <= v) and v <= hi  # False for NaN
        if not ok:
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise _bad(f"{name} must be in {interval}, got {v:g}", name)
        return v

    def integer(self, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise _bad(f"{name} must be an integer", name)
        if v < lo or (hi is not None and v > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise _bad(f"{name} must be {bound}, got {v}", name)
        return v

    def boolean(self, name: str, default: bool = False) -> bool:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise _bad(f"{name} must be true or false", name)
        return v

    def string(self, name: str) -> str | None:
        v = self.body.get(name)
        if v is not None and not isinstance(v, str):
            raise _bad(f"{name} must be a string", name)
        return v

    def stops(self) -> tuple[str, ...]:
        v = self.body.get("stop")
        if v is None:
            return ()
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise _bad("stop must be a string or a list of strings", "stop")
        if len(v) > MAX_STOPS:
            raise _bad(f"stop holds at most {MAX_STOPS} strings, got {len(v)}", "stop")
        if not all(v):
            raise _bad("stop strings must not be empty", "stop")
        return tuple(dict.fromkeys(v))

    def include_usage(self) -> bool:
        v = self.body.get("stream_options")
        if v is None:
            return False
        if not isinstance(v, dict):
            raise _bad("stream_options must be an object", "stream_options")
        usage = v.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise _bad("stream_options.include_usage must be true or false", "stream_options")
        return bool(usage)

    def unsupported_sampling(self) -> None:
        """Refuses what would make the engine sample from another distribution."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = self.number(name, 0.0, -2.0, 2.0)
            if v != 0.0:
                raise _bad(
                    f"{name} is not supported (the engine samples from the policy's own "
                    "distribution): send 0 or leave it out",
                    name,
                )
        bias = self.body.get("logit_bias")
        if bias is not None and not isinstance(bias, dict):
            raise _bad("logit_bias must be an object", "logit_bias")
        if bias:
            raise _bad(
                "logit_bias is not supported (the engine samples from the policy's own "
                "distribution)",
                "logit_bias",
            )


def _sampling(f: _Fields, max_names: Sequence[str], default_max: int | None) -> dict:
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


def _generations(prompt: list[int], s: dict, room: int, stop: tuple[str, ...]) -> list:
    max_tokens = None if s["max_tokens"] is None else min(s["max_tokens"], room)
    return [
        Generation(
            prompt_ids=tuple(prompt),
            max_tokens=max_tokens,
            temperature=s["temperature"],
            top_p=s["top_p"],
            stop=stop,
            seed=None if s["seed"] is None else (s["seed"] + j) % 2**32,
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
                raise _bad(
                    f"{where}.content[{k}] is not a text part ({{'type': 'text', 'text': ...}}; "
                    f"got type {kind!r}): this model reads text only",
                    f"{where}.content",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(
        f"{where}.content must be a string, null or a list of text parts", f"{where}.content"
    )


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object with a role and content", where)
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise _bad(
                f"{where}.role must be one of {list(ROLES)} or 'developer', got {m.get('role')!r}",
                f"{where}.role",
            )
        msg = {**m, "role": role, "content": _text_of(m.get("content"), where)}
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise _bad(f"{where}.tool_calls must be a list in an assistant message", where)
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _bad(
                        f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': "
                        "{'name': ..., 'arguments': ...}}",
                        f"{where}.tool_calls",
                    )
        out.append(msg)
    return out


def _tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    for j, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(
                f"tools[{j}] must be a function tool (type 'function'), got {kind!r}", "tools"
            )
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{j}].function must be an object with a string name", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"tools[{j}].function.description must be a string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"tools[{j}].function.parameters must be a JSON Schema object", "tools")
    return value or None


def _tool_choice(value: Any) -> str:
    if value is None or value == "auto":
        return "auto"
    if value == "none":
        return "none"
    if value == "required" or isinstance(value, dict):
        raise _bad(
            "tool_choice 'required' or a named tool is not supported: the policy chooses "
            "whether to call a tool (forcing a call would sample from another distribution "
            "than the one trained); send 'auto' or 'none'",
            "tool_choice",
        )
    raise _bad(f"tool_choice must be 'auto' or 'none', got {value!r}", "tool_choice")


def _response_format(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise _bad("response_format must be an object", "response_format")
    if value.get("type", "text") != "text":
        raise _bad(
            f"response_format {value.get('type')!r} is not supported (no constrained decoding): "
            "ask for the format in the messages",
            "response_format",
        )


# ---------------------------------------------------------------------------- tokens as text
@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the pieces of byte-level BPE vocabs)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class _Tokens:
    """Per-token text and bytes (log-prob entries), and the tokenizer's text of token runs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._pieces: dict[int, tuple[str, str, list[int]]] = {}
        try:
            self.vocab = int(len(tokenizer))
        except TypeError:
            self.vocab = None

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def piece(self, tid: int) -> tuple[str, str, list[int]]:
        """(name, text, bytes) of one token: its text, or "bytes:\\xe4..." for a token that is
        part of a character (its bytes, where the vocabulary is byte-level)."""
        hit = self._pieces.get(tid)
        if hit is None:
            text = self.decode([tid])
            raw = text.encode("utf-8", "surrogatepass")
            name = text
            if "\ufffd" in text and self.byte_level:
                try:
                    piece = self.tokenizer.convert_ids_to_tokens(tid)
                    raw = bytes(_byte_decoder()[ch] for ch in piece)
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    name = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
                except (KeyError, TypeError, ValueError, AttributeError):
                    raw = text.encode("utf-8", "surrogatepass")
            hit = self._pieces[tid] = (name, text, list(raw))
        return hit


def _logprob(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) else _LOGPROB_FLOOR


def _chat_logprobs(tokens: _Tokens, ids: Sequence[int], lps: Sequence[float]) -> dict:
    content = []
    for tid, lp in zip(ids, lps):
        name, _, raw = tokens.piece(int(tid))
        content.append({"token": name, "logprob": _logprob(lp), "bytes": raw, "top_logprobs": []})
    return {"content": content}


def _text_logprobs(tokens: _Tokens, ids: Sequence[int], lps: Sequence[float], offset: int):
    """Legacy completions log-probs; `top_logprobs` holds the sampled token only. Returns them
    and the text offset after them."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for tid, lp in zip(ids, lps):
        name, text, _ = tokens.piece(int(tid))
        lp = _logprob(lp)
        out["tokens"].append(name)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({name: lp})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


class _TextStream:
    """The streamable text of a choice: what the tokens received so far decode to, up to the
    first stop string or tag, without what could still change (see the module docstring).

    `add` returns the new text to send; `finish(final)` the rest of the final text (a warning
    is logged where the text sent is not its start: a chat whose reply rewrites the text)."""

    def __init__(
        self, tokens: _Tokens, stops: Sequence[str], tags: Sequence[str] = (), strip=False
    ):
        self.tokens, self.stops, self.tags, self.strip = tokens, tuple(stops), tuple(tags), strip
        # A tokenizer that cleans up spaces (" ." -> ".") may take back a trailing space.
        cleans = getattr(tokens.tokenizer, "clean_up_tokenization_spaces", False) is True
        self.hold_space = strip or cleans
        self.ids: list[int] = []
        self.sent = ""
        self.cut = False  # a stop string or tag was reached: nothing more until the end

    def add(self, ids: Sequence[int]) -> str:
        self.ids += ids
        if self.cut or len(self.ids) < 2:
            return ""
        text = self.tokens.decode(self.ids[:-1])
        ends = self.stops + self.tags
        end = len(text)
        for s in ends:
            i = text.find(s)
            if 0 <= i < end:
                end, self.cut = i, True
        text = text[:end]
        if not self.cut:
            hold = 0
            for s in ends:
                for k in range(min(len(s) - 1, len(text)), hold, -1):
                    if text.endswith(s[:k]):
                        hold = k
                        break
            text = text[: len(text) - hold]
        text = text.rstrip("\ufffd")
        if self.strip and text[:1].isspace():
            return ""  # may be stripped from the reply's content: all of it at the end
        if self.hold_space:
            text = text.rstrip()
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def finish(self, final: str) -> str:
        if final.startswith(self.sent):
            return final[len(self.sent) :]
        log.warning("streamed text %r is not the start of the reply %r", self.sent, final)
        return ""


# ---------------------------------------------------------------------------- generation runs
class _Run:
    """Generations running together, their streamed tokens and endings on one queue:
    ("tokens", i, ids, logprobs) and ("done", i, task)."""

    def __init__(self, backend: Backend, gens: Sequence[Generation]):
        loop = asyncio.get_running_loop()
        thread = threading.get_ident()
        self.queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            if threading.get_ident() == thread:
                self.queue.put_nowait(item)
            else:  # a backend calling back from its own thread
                loop.call_soon_threadsafe(self.queue.put_nowait, item)

        def on_tokens_of(i: int):
            def on_tokens(ids, logprobs) -> None:
                put(("tokens", i, [int(t) for t in ids], [float(x) for x in logprobs]))

            return on_tokens

        def ended(i: int, task: asyncio.Future) -> None:
            if not task.cancelled():
                task.exception()  # retrieved here: a failure is reported by the reader
            self.queue.put_nowait(("done", i, task))

        self.tasks = []
        for i, gen in enumerate(gens):
            task = asyncio.ensure_future(backend.generate(gen, on_tokens_of(i)))
            task.add_done_callback(functools.partial(ended, i))
            self.tasks.append(task)

    async def events(self) -> AsyncIterator[tuple]:
        ended: set[int] = set()
        while len(ended) < len(self.tasks):
            item = await self.queue.get()
            if item[1] in ended:  # tokens a backend's thread called back after its end
                continue
            if item[0] == "done":
                ended.add(item[1])
            yield item

    def cancel(self) -> None:
        for task in self.tasks:
            if not task.done():
                task.cancel()


async def _generate_all(backend: Backend, gens: Sequence[Generation]) -> list[Completion]:
    tasks = [asyncio.ensure_future(backend.generate(g)) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


_DONE = "data: [DONE]\n\n"


def _stream_error(e: BaseException, what: str) -> str:
    if isinstance(e, BadRequest):
        err = _bad(str(e), e.param)
    elif isinstance(e, APIError):
        err = e
    else:
        log.error("%s failed while streaming", what, exc_info=e)
        err = _server_error(e)
    return _sse(err.body())


def _streaming(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        gen,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _assistant(message: dict) -> dict:
    out = {**message, "role": "assistant"}
    out.setdefault("content", None)
    if not out.get("tool_calls"):
        out.pop("tool_calls", None)
    return out


# ---------------------------------------------------------------------------- the app
class _Gateway:
    def __init__(self, backend: Backend, chat: Chat, name: str, max_body_bytes: int):
        self.backend, self.chat, self.name = backend, chat, name
        self.max_body_bytes = max_body_bytes
        self.tokens = _Tokens(backend.tokenizer)
        self.created = int(time.time())

    async def _body(self, request: Request) -> _Fields:
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
            raise _bad(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        return _Fields(body)

    def _room(self, prompt: Sequence[int], param: str) -> int:
        room = int(self.backend.max_context) - len(prompt)
        if room <= 0:
            raise _bad(
                f"the prompt is {len(prompt)} tokens, and this model's context holds "
                f"{self.backend.max_context} tokens of prompt and completion together: shorten it",
                param,
            )
        return room

    # ------------------------------------------------------------------ chat
    async def chat_completions(self, request: Request) -> Response:
        f = await self._body(request)
        messages = _messages(f.get("messages"))
        tools = _tools(f.get("tools"))
        choice = _tool_choice(f.get("tool_choice"))
        _response_format(f.get("response_format"))
        s = _sampling(f, ("max_completion_tokens", "max_tokens"), None)
        logprobs = f.boolean("logprobs")
        if f.integer("top_logprobs", 0, 0, 20):
            raise _bad(
                "top_logprobs > 0 is not supported: the engine computes only the log-prob of "
                "the sampled token; send logprobs: true without top_logprobs",
                "top_logprobs",
            )
        stream = f.boolean("stream")
        include_usage = f.include_usage()
        prompt = [int(t) for t in self.chat.prompt_ids(messages, tools)]
        stop = s["stop"]
        if tools and choice == "none" and TOOL_CALL_TAG not in stop:
            stop = (*stop, TOOL_CALL_TAG)
        gens = _generations(prompt, s, self._room(prompt, "messages"), stop)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if stream:
            return _streaming(
                self._chat_stream(
                    rid, created, messages, tools, gens, prompt, logprobs, include_usage
                )
            )
        completions = await _generate_all(self.backend, gens)
        choices = []
        for i, c in enumerate(completions):
            message, finish = self.chat.reply(messages, tools, c)
            choices.append(
                {
                    "index": i,
                    "message": _assistant(message),
                    "logprobs": (
                        _chat_logprobs(self.tokens, c.token_ids, c.logprobs) if logprobs else None
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
                "usage": _usage(len(prompt), sum(len(c.token_ids) for c in completions)),
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
                choice["logprobs"] = _chat_logprobs(self.tokens, ids, lps)
            if ids is not None:
                choice["token_ids"] = list(ids)
            return _sse({**head, "choices": [{**choice, **extra}]})

        tags = (TOOL_CALL_TAG,) if tools else ()
        streams = [_TextStream(self.tokens, g.stop, tags, strip=bool(tools)) for g in gens]
        got: list[list[tuple[int, float]]] = [[] for _ in range(n)]  # tokens received
        sent = [0] * n  # tokens sent (their ids and log-probs)
        used = 0
        run = None
        try:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""}, prompt_token_ids=prompt)
            run = _Run(self.backend, gens)
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
                message, finish = self.chat.reply(messages, tools, c)
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
                yield _sse({**head, "choices": [], "usage": _usage(len(prompt), used)})
        except Exception as e:  # noqa: BLE001 -- the response has started: an error event
            yield _stream_error(e, "a chat completion")
        finally:
            if run is not None:
                run.cancel()
        yield _DONE

    # ------------------------------------------------------------------ completions
    def _prompts(self, value: Any) -> list[list[int]]:
        def ids_of(p: Any, where: str) -> list[int] | None:
            if isinstance(p, str):
                ids = self.tokens.encode(p)
            elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                ids = p
            else:
                return None
            if not ids:
                raise _bad(f"{where} must not be empty", "prompt")
            for t in ids:
                if isinstance(t, bool) or t < 0 or (self.tokens.vocab and t >= self.tokens.vocab):
                    raise _bad(f"{where} holds token id {t}, not in this vocabulary", "prompt")
            return ids

        single = ids_of(value, "prompt")
        if single is not None:
            return [single]
        if isinstance(value, list) and value:
            if len(value) > MAX_PROMPTS:
                raise _bad(
                    f"prompt holds at most {MAX_PROMPTS} prompts, got {len(value)}", "prompt"
                )
            batch = [ids_of(p, f"prompt[{k}]") for k, p in enumerate(value)]
            if all(ids is not None for ids in batch):
                return batch
        if value == "" or value == []:
            raise _bad("prompt must not be empty", "prompt")
        raise _bad(
            "prompt must be a string, a list of token ids, or a list of strings or of token-id "
            "lists",
            "prompt",
        )

    async def completions(self, request: Request) -> Response:
        f = await self._body(request)
        prompts = self._prompts(f.get("prompt"))
        s = _sampling(f, ("max_tokens",), 16)
        lp = f.integer("logprobs", None, 0, 5)
        if lp is not None and lp > 1:
            raise _bad(
                "logprobs > 1 is not supported: the engine computes only the log-prob of the "
                "sampled token; send 0 or 1 (top_logprobs then holds the sampled token only)",
                "logprobs",
            )
        if f.boolean("echo"):
            raise _bad(
                "echo is not supported (no prompt log-probs): the prompt's token ids come back "
                "in each choice's prompt_token_ids",
                "echo",
            )
        if f.string("suffix"):
            raise _bad("suffix is not supported", "suffix")
        if f.integer("best_of", s["n"], 1, MAX_N) != s["n"]:
            raise _bad("best_of is not supported: leave it out or send best_of = n", "best_of")
        if len(prompts) * s["n"] > MAX_CHOICES:
            raise _bad(f"prompts x n is at most {MAX_CHOICES}, got {len(prompts)} x {s['n']}", "n")
        stream = f.boolean("stream")
        include_usage = f.include_usage()
        gens = []
        for k, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            gens += _generations(prompt, s, self._room(prompt, where), s["stop"])
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n_prompt = sum(len(p) for p in prompts)
        if stream:
            return _streaming(
                self._text_stream(rid, created, gens, lp is not None, include_usage, n_prompt)
            )
        completions = await _generate_all(self.backend, gens)
        choices = [
            {
                "index": i,
                "text": c.text,
                "logprobs": (
                    _text_logprobs(self.tokens, c.token_ids, c.logprobs, 0)[0]
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
                "usage": _usage(n_prompt, sum(len(c.token_ids) for c in completions)),
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
                choice["logprobs"], offsets[i] = _text_logprobs(self.tokens, ids, lps, offsets[i])
            return _sse({**head, "choices": [{**choice, "token_ids": list(ids), **extra}]})

        streams = [_TextStream(self.tokens, g.stop) for g in gens]
        got: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        sent = [0] * n
        first = [True] * n
        used = 0
        run = None
        try:
            run = _Run(self.backend, gens)
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
                yield _sse({**head, "choices": [], "usage": _usage(n_prompt, used)})
        except Exception as e:  # noqa: BLE001 -- the response has started: an error event
            yield _stream_error(e, "a completion")
        finally:
            if run is not None:
                run.cancel()
        yield _DONE

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


def _guarded(handler):
    """Every failure of a route as an OpenAI error response: nothing reaches the server."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except BadRequest as e:
            return _bad(str(e), e.param).response()
        except Exception as e:  # noqa: BLE001 -- a 500 the client reads, logged here
            log.exception("%s %s failed", request.method, request.url.path)
            return _server_error(e).response()

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
) -> Starlette:
    """The OpenAI-compatible ASGI app over `backend` and `chat` (see the module docstring).

    Args:
      backend: decodes the requests' generations.
      chat: chat messages to prompt ids, completions to assistant messages.
      served_name: the model name the responses and `GET /v1/models` carry (default
        `backend.model`); requests may name any model.
      max_body_bytes: the largest request body (larger: HTTP 413).
    """
    gw = _Gateway(backend, chat, served_name or str(backend.model), max_body_bytes)
    routes = [
        Route("/v1/chat/completions", _guarded(gw.chat_completions), methods=["POST"]),
        Route("/v1/completions", _guarded(gw.completions), methods=["POST"]),
        Route("/v1/models", _guarded(gw.models), methods=["GET"]),
        Route("/health", _guarded(gw.health), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.gateway = gw
    return app
