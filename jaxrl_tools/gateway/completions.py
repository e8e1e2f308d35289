"""POST /v1/completions (`gateway.app`): a text prompt (tokenized without special tokens added)
or token ids, continued as they are; a batch of prompts is supported (choice index = prompt
index * n + j, as OpenAI numbers them)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxrl_tools.gateway.requests import MAX_CHOICES, MAX_N, MAX_PROMPTS, bad, generations, sampling
from jaxrl_tools.gateway.streaming import (
    DONE,
    TextStream,
    generate_all,
    released,
    sse,
    stream_error,
    streaming,
    text_logprobs,
    usage,
)


def _prompts(gw, value: Any) -> list[list[int]]:
    def ids_of(p: Any, where: str) -> list[int] | None:
        if isinstance(p, str):
            gw._fits(len(p), "prompt")
            ids = gw.tokens.encode(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            ids = p
        else:
            return None
        if not ids:
            raise bad(f"{where} must not be empty", "prompt")
        for t in ids:
            if isinstance(t, bool) or t < 0 or (gw.tokens.vocab and t >= gw.tokens.vocab):
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
        "prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
        "prompt",
    )


async def completions(gw, request: Request) -> Response:
    f = await gw._body(request)
    prompts = await gw._off_loop(_prompts, gw, f.get("prompt"))
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
        gens += generations(prompt, s, gw._room(prompt, where), s["stop"])
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    n_prompt = sum(len(p) for p in prompts)
    if stream:
        return streaming(
            _text_stream(gw, rid, created, gens, lp is not None, include_usage, n_prompt)
        )
    completions = await generate_all(gw.backend, gens)
    choices = [
        {
            "index": i,
            "text": c.text,
            "logprobs": (
                text_logprobs(gw.tokens, c.token_ids, c.logprobs, 0)[0] if lp is not None else None
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
            "model": gw.name,
            "choices": choices,
            "usage": usage(n_prompt, sum(len(c.token_ids) for c in completions)),
        }
    )


async def _text_stream(
    gw, rid, created, gens, logprobs, include_usage, n_prompt
) -> AsyncIterator[str]:
    n = len(gens)
    head = {"id": rid, "object": "text_completion", "created": created, "model": gw.name}
    if include_usage:
        head["usage"] = None
    offsets = [0] * n

    def chunk(i, text, ids, lps, finish=None, **extra) -> str:
        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        if logprobs:
            choice["logprobs"], offsets[i] = text_logprobs(gw.tokens, ids, lps, offsets[i])
        return sse({**head, "choices": [{**choice, "token_ids": list(ids), **extra}]})

    streams = [TextStream(gw.tokens, g.stop) for g in gens]
    first = [True] * n
    used = 0
    try:
        async with contextlib.aclosing(released(gw.backend, gens, streams)) as events:
            async for event in events:
                if event[0] == "text":
                    _, i, delta, ids, lps = event
                    extra = {"prompt_token_ids": list(gens[i].prompt_ids)} if first[i] else {}
                    first[i] = False
                    yield chunk(i, delta, ids, lps, **extra)
                    continue
                _, i, c, ids, lps = event
                used += len(c.token_ids)
                extra = {"prompt_token_ids": list(c.prompt_ids)} if first[i] else {}
                yield chunk(i, streams[i].finish(c.text), ids, lps, c.finish_reason, **extra)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(n_prompt, used)})
    except Exception as e:  # noqa: BLE001 -- the response has started: an error event
        yield stream_error(e, "a completion")
    yield DONE
