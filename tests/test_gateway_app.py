"""The gateway's OpenAI-compatible routes (`gateway.app`) with the official `openai` client, over
a fake Backend (scripted replies of a byte-level tokenizer, streamed in pieces) and a fake Chat
(a plain rendering; `<tool_call>{json}</tool_call>` read back as OpenAI tool calls)."""

import asyncio
import contextlib
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from fakes import wait_until
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxrl_tools import serve_openai
from jaxrl_tools.gateway.app import make_app
from jaxrl_tools.gateway.backend import BadRequest, Completion
from jaxrl_tools.gateway.requests import read_tools
from jaxrl_tools.gateway.streaming import TextStream, Tokens
from jaxrl_tools.tools import ToolExecutor, function_tool

EOS = "<|im_end|>"
WEATHER = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def byte_tokenizer():
    """Every byte its own token (a character past ASCII is several), as Qwen's byte-level
    vocabulary writes rare characters; an end token and the two tool-call tags."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS, special=True)])
    tok.add_tokens([AddedToken("<tool_call>"), AddedToken("</tool_call>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


TOK = byte_tokenizer()


def enc(text):
    return TOK.encode(text, add_special_tokens=False)


def dec(ids):
    return TOK.decode(list(ids), skip_special_tokens=False)


def script(prompt: str, seed) -> str:
    """The fake policy's reply to a prompt (its last turn decides)."""
    body, _, forced = prompt.rpartition("\nassistant:\n")
    if forced.endswith('"arguments": '):  # tool_choice named a function: its arguments
        return '{"city": "Paris"}}\n</tool_call>'
    if forced:  # tool_choice "required": a call
        return '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    last = body.split("\n")[-1]  # the last message
    if last.startswith("tool:"):
        return "It is 18°C in Paris ☀️."
    if "weather" in last:
        return "Let me check.\n" + WEATHER
    if "unicode" in last:
        return "Héllo wörld — ☃ 👋 done."
    if "stops" in last:
        return "one two STOP three"
    if "long" in last:
        return "x" * 1000
    return f"Hello! seed={seed}"


class FakeBackend:
    """Scripted replies, decoded like the engine's: an end token closes a reply, stop strings
    end it (their tokens kept, their text cut), `max_tokens` and the context bound it."""

    def __init__(self, max_context=400):
        self.tokenizer, self.model, self.max_context = TOK, "fake-policy", max_context
        self.eos = TOK.convert_tokens_to_ids(EOS)
        self.gens = []

    async def generate(self, gen, on_tokens=None):
        self.gens.append(gen)
        prompt = dec(gen.prompt_ids)
        await asyncio.sleep(0)
        if "BOOM" in prompt:
            raise RuntimeError("the engine exploded")
        if "REWRITE" in prompt:
            raise BadRequest("this history was rewritten", "messages")
        planned = enc(script(prompt, gen.seed)) + [self.eos]
        limit = self.max_context - len(gen.prompt_ids)
        if gen.max_tokens is not None:
            limit = min(limit, gen.max_tokens)
        ids, text, finish, eos = [], None, "length", False
        for t in planned[:limit]:
            ids.append(t)
            if t == self.eos:
                finish, eos = "stop", True
                break
            written = dec(ids)
            hits = [written.find(s) for s in gen.stop if s in written]
            if hits:
                text, finish = written[: min(hits)], "stop"
                break
        if text is None:
            text = dec(ids[:-1] if eos else ids)
        lps = [-0.5 - 0.25 * (k % 4) for k in range(len(ids))]
        if on_tokens is not None:
            for k in range(0, len(ids), 3):
                on_tokens(ids[k : k + 3], lps[k : k + 3])
                await asyncio.sleep(0)
        return Completion(list(gen.prompt_ids), ids, lps, text, finish, eos)


class FakeChat:
    """Messages rendered as "role: text" lines; replies read like `TemplateChat`'s."""

    def __init__(self):
        self.replies = 0

    def prompt_ids(self, messages, tools, opener=""):
        lines = ["TOOLS: " + json.dumps([t["function"]["name"] for t in tools])] if tools else []
        for m in messages:
            if m["content"] == "UNRENDERABLE":
                raise BadRequest("the chat template cannot render this", "messages")
            calls = [c["function"]["name"] for c in m.get("tool_calls") or ()]
            lines.append(f"{m['role']}: {m['content']}" + (f" calls={calls}" if calls else ""))
        return enc("\n".join(lines) + "\nassistant:\n") + enc(opener)

    def reply(self, messages, tools, completion):
        self.replies += 1
        ids = completion.token_ids[:-1] if completion.ended_with_eos else completion.token_ids
        written = dec(ids)
        blocks = re.findall(r"<tool_call>(.*?)</tool_call>", written, re.S) if tools else []
        if not blocks:
            return {"role": "assistant", "content": completion.text}, completion.finish_reason
        calls = []
        for k, body in enumerate(blocks):
            obj = json.loads(body)
            calls.append(
                {
                    "id": f"call_{self.replies}_{k}",
                    "type": "function",
                    "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"])},
                }
            )
        content = re.sub(r"<tool_call>.*?</tool_call>", "", written, flags=re.S).strip()
        return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls"


def make(max_context=400, **kw):
    backend, chat = FakeBackend(max_context), FakeChat()
    return make_app(backend, chat, **kw), backend, chat


def async_client(app):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key="x", http_client=http, max_retries=0)


def user(text):
    return [{"role": "user", "content": text}]


async def collect_chat(stream):
    """A streamed chat completion's choices: content, tool calls, finish, token ids, logprobs."""
    out, chunks = {}, []
    async for chunk in stream:
        chunks.append(chunk)
        for ch in chunk.choices:
            c = out.setdefault(
                ch.index, {"content": "", "calls": {}, "finish": None, "ids": [], "lps": []}
            )
            d = ch.delta
            if d.content:
                assert "\ufffd" not in d.content
                c["content"] += d.content
            for tc in d.tool_calls or ():
                call = c["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            c["ids"] += (ch.model_extra or {}).get("token_ids") or []
            if ch.logprobs and ch.logprobs.content:
                c["lps"] += [e.logprob for e in ch.logprobs.content]
            if ch.finish_reason:
                c["finish"] = ch.finish_reason
    return out, chunks


# ---------------------------------------------------------------------------- async client
def test_chat_with_the_async_client():
    app, backend, _ = make(served_name="policy-A")

    async def main():
        client = async_client(app)
        r = await client.chat.completions.create(model="anything", messages=user("hi"))
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
        assert r.model == "policy-A"
        ch = r.choices[0]
        assert ch.message.role == "assistant" and ch.message.content == "Hello! seed=None"
        assert ch.finish_reason == "stop" and ch.logprobs is None
        extra = ch.model_extra
        assert extra["prompt_token_ids"] == list(backend.gens[-1].prompt_ids)
        assert dec(extra["token_ids"]) == "Hello! seed=None" + EOS
        assert r.usage.prompt_tokens == len(extra["prompt_token_ids"])
        assert r.usage.completion_tokens == len(extra["token_ids"])
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.to_dict()["choices"][0]["token_ids"] == extra["token_ids"]

        # n choices: one generation each, seed + i; text parts flattened, developer = system
        msgs = [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}],
            },
        ]
        r = await client.chat.completions.create(
            model="m", messages=msgs, n=2, seed=7, temperature=0.5, top_p=0.9, max_tokens=50
        )
        assert [c.message.content for c in r.choices] == ["Hello! seed=7", "Hello! seed=8"]
        assert [c.index for c in r.choices] == [0, 1]
        g = backend.gens[-2:]
        assert [x.seed for x in g] == [7, 8]
        assert g[0].temperature == 0.5 and g[0].top_p == 0.9 and g[0].max_tokens == 50
        assert dec(g[0].prompt_ids).startswith("system: be brief\nuser: hi\n")
        assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)

        # logprobs: one entry per sampled token, the end token included
        r = await client.chat.completions.create(
            model="m", messages=user("unicode please"), logprobs=True, top_logprobs=0
        )
        ch = r.choices[0]
        ids, entries = ch.model_extra["token_ids"], ch.logprobs.content
        assert len(entries) == len(ids)
        assert [e.logprob for e in entries] == [-0.5 - 0.25 * (k % 4) for k in range(len(ids))]
        assert bytes(b for e in entries for b in e.bytes).decode() == ch.message.content + EOS
        assert entries[1].token.startswith("bytes:\\x")  # the first byte of "é"
        assert all(e.top_logprobs == [] for e in entries)

        # stop strings end the reply; their tokens stay in token_ids
        r = await client.chat.completions.create(model="m", messages=user("stops"), stop="STOP")
        ch = r.choices[0]
        assert ch.message.content == "one two " and ch.finish_reason == "stop"
        assert dec(ch.model_extra["token_ids"]) == "one two STOP"
        assert backend.gens[-1].stop == ("STOP",)

    asyncio.run(main())


def test_tool_calls_round_trip():
    app, backend, _ = make()

    async def main():
        client = async_client(app)
        history = user("what is the weather in Paris?")
        r = await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check."
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert dec(ch.model_extra["token_ids"]) == "Let me check.\n" + WEATHER + EOS
        history += [
            ch.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
        ]
        r = await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
        assert r.choices[0].message.content == "It is 18°C in Paris ☀️."
        assert r.choices[0].message.tool_calls is None
        assert "assistant: Let me check. calls=['get_weather']" in dec(backend.gens[-1].prompt_ids)

        # tool_choice "none": the tools are in the prompt, generation stops before a call
        r = await client.chat.completions.create(
            model="m", messages=user("weather?"), tools=TOOLS, tool_choice="none"
        )
        ch = r.choices[0]
        assert ch.message.tool_calls is None and ch.message.content == "Let me check.\n"
        assert backend.gens[-1].stop == ("<tool_call>",)
        assert dec(backend.gens[-1].prompt_ids).startswith("TOOLS:")

    asyncio.run(main())


def test_tool_choice_forces_the_call_opener_as_prompt_tokens():
    """ "required" and a named function: the reply starts with the call tag (and the named
    function's name), given as the prompt's last tokens, not sampled: the choice's token_ids
    (what training takes as the policy's) are what the policy wrote after them."""
    app, backend, _ = make()
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def main():
        client = async_client(app)
        for choice, opener in [
            ("required", "<tool_call>\n"),
            (named, '<tool_call>\n{"name": "get_weather", "arguments": '),
        ]:
            r = await client.chat.completions.create(
                model="m", messages=user("hello"), tools=TOOLS, tool_choice=choice
            )
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls" and ch.message.content is None
            (call,) = ch.message.tool_calls
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris"}
            assert backend.gens[-1].opener == opener
            prompt, ids = ch.model_extra["prompt_token_ids"], ch.model_extra["token_ids"]
            assert dec(prompt).endswith("assistant:\n" + opener)
            assert not dec(ids).startswith("<tool_call>")  # the opener is not the policy's
            assert r.usage.completion_tokens == len(ids)
            stream = await client.chat.completions.create(
                model="m", messages=user("hello"), tools=TOOLS, tool_choice=choice, stream=True
            )
            out, _ = await collect_chat(stream)
            assert out[0]["content"] == "" and out[0]["finish"] == "tool_calls"
            assert out[0]["calls"][0]["name"] == "get_weather" and out[0]["ids"] == ids
        for choice, tools, says in [
            ("required", None, "no tools are declared"),
            ({"type": "function", "function": {"name": "nope"}}, TOOLS, "not in tools"),
            ({"type": "function"}, TOOLS, "tool_choice must be"),
            ("sometimes", TOOLS, "tool_choice must be"),
        ]:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(
                    model="m", messages=user("hello"), tools=tools, tool_choice=choice
                )
            assert e.value.body["param"] == "tool_choice" and says in e.value.message

    asyncio.run(main())


def test_streaming_equals_unstreamed():
    app, _, _ = make()

    async def main():
        client = async_client(app)
        cases = [
            dict(messages=user("hi")),
            dict(messages=user("unicode")),
            dict(messages=user("stops"), stop=["STOP", "thr"]),
            dict(messages=user("weather"), tools=TOOLS),
            dict(messages=user("unicode, weather"), tools=TOOLS),  # "unicode" is not the last word
            dict(messages=user("hi"), tools=TOOLS, n=2, seed=3),
            dict(messages=user("long"), max_tokens=20),
        ]
        for case in cases:
            whole = await client.chat.completions.create(model="m", logprobs=True, **case)
            stream = await client.chat.completions.create(
                model="m",
                logprobs=True,
                stream=True,
                stream_options={"include_usage": True},
                **case,
            )
            got, chunks = await collect_chat(stream)
            assert len(got) == len(whole.choices)
            for ch in whole.choices:
                c = got[ch.index]
                assert c["content"] == (ch.message.content or ""), case
                assert c["finish"] == ch.finish_reason
                assert c["ids"] == ch.model_extra["token_ids"]
                assert c["lps"] == [e.logprob for e in ch.logprobs.content]
                calls = [
                    {"name": t.function.name, "arguments": t.function.arguments}
                    for t in ch.message.tool_calls or ()
                ]
                assert [
                    {k: v[k] for k in ("name", "arguments")} for v in c["calls"].values()
                ] == calls
                assert all(v["id"] for v in c["calls"].values())
            first = chunks[0].choices[0]
            assert first.delta.role == "assistant"
            assert (
                first.model_extra["prompt_token_ids"]
                == whole.choices[0].model_extra["prompt_token_ids"]
            )
            assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
            assert all(
                c.object == "chat.completion.chunk" and c.model == "fake-policy" for c in chunks
            )
            texts = [d.delta.content or "" for c in chunks for d in c.choices]
            assert not any("STOP" in t or "<tool_call" in t for t in texts)
            if case["messages"][0]["content"] == "unicode":  # it did stream, in pieces
                assert sum(1 for t in texts if t) > 3

    asyncio.run(main())


def test_text_stream_holds_back_what_may_change():
    tokens = Tokens(TOK)
    s = TextStream(tokens, ["STOP"])
    ids = enc("aé b STthe STOP end")
    out = [s.add(ids[k : k + 1]) for k in range(len(ids))]
    assert out[:4] == ["", "a", "", "é"]  # a token waits for the next; "é" is two tokens
    assert "".join(out) == "aé b STthe "
    assert s.finish("aé b STthe ") == ""
    s = TextStream(tokens, [], ["<tool_call>"], strip=True)
    ids = enc(" lead <tool_call>{}</tool_call>")
    assert "".join(s.add(ids[k : k + 2]) for k in range(0, len(ids), 2)) == ""
    assert s.finish("lead") == "lead"


# ---------------------------------------------------------------------------- sync client
@contextlib.contextmanager
def serving(app):
    """`app` on uvicorn at 127.0.0.1 and a free port, in a background thread: its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def served():
    app, backend, _ = make(max_context=300)
    with serving(app) as url:
        yield url, backend


def test_sync_client_over_http(served):
    url, backend = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    (model,) = client.models.list().data
    assert model.id == "fake-policy" and model.owned_by == "jaxrl-tools"
    assert model.model_extra["max_model_len"] == 300

    r = client.chat.completions.create(model="fake-policy", messages=user("unicode"), n=2)
    assert [c.message.content for c in r.choices] == ["Héllo wörld — ☃ 👋 done."] * 2
    stream = client.chat.completions.create(
        model="fake-policy", messages=user("weather"), tools=TOOLS, stream=True
    )
    content, calls, finish = "", [], None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"] and calls[0].index == 0

    # completions: a text prompt (no special tokens added), token ids, a batch
    r = client.completions.create(model="m", prompt="user: stops\nassistant:\n", max_tokens=7)
    (ch,) = r.choices
    assert r.object == "text_completion" and ch.text == "one two" and ch.finish_reason == "length"
    assert ch.model_extra["prompt_token_ids"] == enc("user: stops\nassistant:\n")
    assert backend.gens[-1].max_tokens == 7 and r.usage.completion_tokens == 7
    r = client.completions.create(
        model="m", prompt=enc("user: hi\nassistant:\n"), seed=12345, logprobs=1
    )
    (ch,) = r.choices
    assert ch.text == "Hello! seed=1234" and ch.finish_reason == "length"  # 16 tokens by default
    assert backend.gens[-1].max_tokens == 16
    assert ch.logprobs.tokens[:2] == ["H", "e"] and len(ch.logprobs.token_logprobs) == 16
    assert ch.logprobs.top_logprobs[0] == {"H": -0.5} and ch.logprobs.text_offset[:3] == [0, 1, 2]
    r = client.completions.create(
        model="m",
        prompt=["user: hi\nassistant:\n", "user: stops\nassistant:\n"],
        n=2,
        stop=["STOP"],
        seed=5,
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["Hello! seed=5", "Hello! seed=6", "one two ", "one two "]
    assert r.usage.prompt_tokens == len(enc("user: hi\nassistant:\n")) + len(
        enc("user: stops\nassistant:\n")
    )

    # streamed completions: the same text and tokens
    for prompt in ("user: unicode\nassistant:\n", "user: stops\nassistant:\n"):
        kw = dict(model="m", prompt=prompt, max_tokens=40, stop=["STOP"], logprobs=0)
        whole = client.completions.create(**kw).choices[0]
        text, ids, toks, finish = "", [], [], None
        chunks = list(
            client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
        )
        for chunk in chunks[:-1]:
            (ch,) = chunk.choices
            text += ch.text
            ids += ch.model_extra["token_ids"]
            toks += ch.logprobs.tokens
            finish = ch.finish_reason or finish
        assert (text, ids, toks, finish) == (
            whole.text,
            whole.model_extra["token_ids"],
            whole.logprobs.tokens,
            whole.finish_reason,
        )
        assert chunks[-1].usage.completion_tokens == len(ids)

    # a failure in the backend: a 500 the client reads, and the server serves on
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="m", messages=user("BOOM"))
    assert e.value.body["type"] == "server_error" and "exploded" in e.value.message
    with pytest.raises(openai.APIError, match="exploded"):
        for _ in client.chat.completions.create(model="m", messages=user("BOOM"), stream=True):
            pass
    assert client.chat.completions.create(model="m", messages=user("hi")).choices[0].message.content


# ---------------------------------------------------------------------------- raw HTTP errors
BAD_CHAT = [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
    ),
    ({"messages": [{"role": "user", "content": "UNRENDERABLE"}]}, "messages"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "lots"}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": True}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"seed": "x"}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ({"stream": 1}, "stream"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"model": 5}, "model"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
]
BAD_COMPLETIONS = [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [[1, 2], [-1]]}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": ["a"] * 17}, "prompt"),
    ({"prompt": "hi", "logprobs": 3}, "logprobs"),
    ({"prompt": "hi", "logprobs": 6}, "logprobs"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "suffix": "end"}, "suffix"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": ["a"] * 8, "n": 9}, "n"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x" * 400}, "prompt"),
]


def test_errors_are_openai_shaped_and_the_server_serves_on():
    app, backend, _ = make(max_body_bytes=1 << 20)

    async def main():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw"
        ) as http:

            async def expect(status, method, path, param=None, **kw):
                r = await http.request(method, path, **kw)
                assert r.status_code == status, (path, kw, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
                assert err["code"] is None and err["param"] == param, (kw, err)
                assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
                return err

            ok_chat = {"model": "m", "messages": user("hi")}
            for fields, param in BAD_CHAT:
                await expect(400, "POST", "/v1/chat/completions", param, json={**ok_chat, **fields})
            for fields, param in BAD_COMPLETIONS:
                await expect(400, "POST", "/v1/completions", param, json={"model": "m", **fields})
            await expect(400, "POST", "/v1/chat/completions", content=b"{not json")
            await expect(400, "POST", "/v1/chat/completions", content=b"[" * 100_000)
            await expect(400, "POST", "/v1/chat/completions", json=["a list"])
            await expect(
                400,
                "POST",
                "/v1/chat/completions",
                "messages",
                json=ok_chat | {"messages": user("x" * 500)},
            )
            await expect(404, "POST", "/v1/embeddings", json={})
            await expect(404, "GET", "/nowhere")
            await expect(405, "GET", "/v1/chat/completions")
            await expect(413, "POST", "/v1/chat/completions", content=b" " * (2 << 20))
            err = await expect(
                500, "POST", "/v1/chat/completions", json=ok_chat | {"messages": user("BOOM")}
            )
            assert "exploded" in err["message"]
            await expect(
                400,
                "POST",
                "/v1/chat/completions",
                "messages",
                json=ok_chat | {"messages": user("REWRITE")},
            )

            # streamed: the failure is an error event, then [DONE]
            r = await http.post("/v1/completions", json={"prompt": "BOOM", "stream": True})
            events = [e for e in r.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][len("data: ") :])["error"]["type"] == "server_error"

            # unknown fields are ignored; max_tokens past the context is clamped to the room
            r = await http.post(
                "/v1/chat/completions",
                json=ok_chat
                | {"user": "u", "metadata": {"a": 1}, "whatever": [1], "max_tokens": 10**6},
            )
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
            gen = backend.gens[-1]
            assert gen.max_tokens == backend.max_context - len(gen.prompt_ids)
            r = await http.post(
                "/v1/chat/completions",
                json=ok_chat | {"messages": user("long"), "max_tokens": 10**6},
            )
            ch = r.json()["choices"][0]
            assert ch["finish_reason"] == "length"
            assert len(ch["prompt_token_ids"]) + len(ch["token_ids"]) == backend.max_context
            r = await http.get("/v1/models")
            assert r.json()["data"][0]["id"] == "fake-policy"
            assert (await http.get("/health")).status_code == 200

    asyncio.run(main())


def test_a_client_that_hangs_up_cancels_its_generations():
    class Slow(FakeBackend):
        cancelled = 0

        async def generate(self, gen, on_tokens=None):
            try:
                for k in range(200):
                    on_tokens([40 + k % 10], [-1.0])
                    await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                Slow.cancelled += 1
                raise
            raise AssertionError("not cancelled")

    app = make_app(Slow(), FakeChat())
    with serving(app) as url, httpx.Client(base_url=url) as http:
        body = {"messages": user("hi"), "stream": True, "n": 2}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert all(next(lines) is not None for _ in range(6))  # the stream is under way
        assert wait_until(lambda: Slow.cancelled == 2)
        assert http.get("/v1/models").status_code == 200


def test_an_api_key_is_asked_for_when_set_and_an_open_bind_without_one_is_flagged():
    app, _, _ = make(api_key="sesame")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = await http.get("/v1/models", headers=headers)
                assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
            ok = await http.get("/v1/models", headers={"Authorization": "Bearer sesame"})
            assert ok.status_code == 200
            assert (await http.get("/health")).status_code == 200  # probes need no key
        http = httpx.AsyncClient(transport=transport, base_url="http://gw")
        client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="sesame", http_client=http)
        r = await client.chat.completions.create(model="m", messages=user("hi"))
        assert r.choices[0].message.content

    asyncio.run(main())
    for host, key, flagged in [("127.0.0.1", None, False), ("0.0.0.0", None, True)] + [
        ("0.0.0.0", "sesame", False)
    ]:
        with socket.create_server((host, 0)) as sock:
            assert serve_openai.unguarded(sock, key) == flagged, (host, key)


def test_sdk_tool_declarations_are_rendered_as_the_built_in_loops():
    """SDK-only keys (the OpenAI Agents SDK's `strict`) are dropped: an agent's prompt is the
    built-in loop's for the same tools."""

    @function_tool
    def add(a: int, b: int) -> str:
        """Adds two integers."""
        return str(a + b)

    built_in = ToolExecutor([add]).schemas()
    sdk = [{"type": "function", "function": {**built_in[0]["function"], "strict": False}}]
    assert read_tools(sdk) == built_in


def test_prompts_tokenize_off_the_event_loop_and_one_past_the_context_is_refused_unread():
    """A slow prompt (a long message's tokenizing) does not hold up /health; a message longer
    than the context could hold at the vocabulary's longest token is a 400 before tokenizing."""
    app, backend, chat = make(max_context=400)
    rendered = []

    def slow_prompt_ids(messages, tools, opener=""):
        rendered.append(messages)
        time.sleep(1.5)  # a tokenizer at work, holding the GIL or not
        return FakeChat.prompt_ids(chat, messages, tools, opener)

    chat.prompt_ids = slow_prompt_ids

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            slow = asyncio.ensure_future(
                http.post("/v1/chat/completions", json={"model": "m", "messages": user("hi")})
            )
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            assert (await http.get("/health")).status_code == 200
            health_s = time.monotonic() - t0
            assert (await slow).status_code == 200
            huge = user("x" * (400 * max(map(len, TOK.get_vocab())) + 1))
            r = await http.post("/v1/chat/completions", json={"model": "m", "messages": huge})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            assert "characters" in r.json()["error"]["message"]
            r = await http.post(
                "/v1/completions", json={"model": "m", "prompt": huge[0]["content"]}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        return health_s

    assert asyncio.run(main()) < 1.0  # answered while the prompt was still tokenizing
    assert len(rendered) == 1  # the huge message was never rendered
