"""Streaming the gateway's completions (`gateway.app`): tokens as text and log-prob entries,
the incremental text of a choice, generations running together, server-sent events.

Streamed text is the text of the tokens decoded so far, held back where it could still change:
the last token received (it may be the end token, or half of a character), a half-decoded
character, anything from a stop string on and any end of the text that could begin one, and,
when the request has tools, anything from a "<tool_call>" tag on, the end of the text that could
begin one, trailing whitespace, and all of it while it starts with whitespace (the reply's
content is the text around the calls, stripped).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.responses import StreamingResponse

from jaxrl_tools.gateway.backend import Backend, BadRequest, Completion, Generation
from jaxrl_tools.gateway.requests import APIError, bad, server_error

log = logging.getLogger(__name__)

_LOGPROB_FLOOR = -9999.0  # a non-finite log-prob (JSON has no -inf), as vLLM reports it


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


class Tokens:
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


def chat_logprobs(tokens: Tokens, ids: Sequence[int], lps: Sequence[float]) -> dict:
    content = []
    for tid, lp in zip(ids, lps):
        name, _, raw = tokens.piece(int(tid))
        content.append({"token": name, "logprob": _logprob(lp), "bytes": raw, "top_logprobs": []})
    return {"content": content}


def text_logprobs(tokens: Tokens, ids: Sequence[int], lps: Sequence[float], offset: int):
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


class TextStream:
    """The streamable text of a choice: what the tokens received so far decode to, up to the
    first stop string or tag, without what could still change (see the module docstring).

    `add` returns the new text to send; `finish(final)` the rest of the final text (a warning
    is logged where the text sent is not its start: a chat whose reply rewrites the text)."""

    def __init__(self, tokens: Tokens, stops: Sequence[str], tags: Sequence[str] = (), strip=False):
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
class Run:
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


async def released(
    backend: Backend, gens: Sequence[Generation], streams: Sequence[TextStream]
) -> AsyncIterator[tuple]:
    """The generations run together, each through its `TextStream`: ("text", i, delta, ids,
    logprobs) as text is released (with the tokens received since the last release), then
    ("end", i, completion, ids, logprobs) with the tokens never released; the caller finishes
    `streams[i]` with the final text. Closing it cancels the generations still running. Every
    streaming route (chat, Responses, Messages, text completions) reads this one loop."""
    got: list[list[tuple[int, float]]] = [[] for _ in gens]  # tokens received
    sent = [0] * len(gens)  # tokens released (their ids and log-probs)
    run = Run(backend, gens)
    try:
        async for event in run.events():
            if event[0] == "tokens":
                _, i, ids, lps = event
                got[i] += zip(ids, lps)
                delta = streams[i].add(ids)
                if delta:
                    new, sent[i] = got[i][sent[i] :], len(got[i])
                    yield "text", i, delta, [t for t, _ in new], [lp for _, lp in new]
                continue
            _, i, task = event
            c: Completion = task.result()
            yield "end", i, c, c.token_ids[sent[i] :], c.logprobs[sent[i] :]
    finally:
        run.cancel()


async def generate_all(backend: Backend, gens: Sequence[Generation]) -> list[Completion]:
    tasks = [asyncio.ensure_future(backend.generate(g)) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def error_of(e: BaseException, what: str) -> APIError:
    """The error a stream that has started reports (an unexpected one logged)."""
    if isinstance(e, BadRequest):
        return bad(str(e), e.param)
    if isinstance(e, APIError):
        return e
    log.error("%s failed while streaming", what, exc_info=e)
    return server_error(e)


def stream_error(e: BaseException, what: str) -> str:
    return sse(error_of(e, what).body())


def streaming(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        gen,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
