"""Agents written as plain OpenAI-client code (`rollout.agent`), trained token-exact: the same
trajectories as the built-in loop, a rewritten history as a second sample of the episode, the
agent's own reward; the gateway's chat (continuations keep the sampled tokens) and its engine
backend (concurrent requests, each as if alone)."""

import asyncio
import json
import time

import numpy as np
import pytest
from fakes import forced_engine

from jaxrl_tools.agents.rollouts import AgentError
from jaxrl_tools.config import FiltersSection, RolloutSection
from jaxrl_tools.gateway import Completion, Generation
from jaxrl_tools.gateway.chat import TemplateChat
from jaxrl_tools.gateway.engine_backend import EngineBackend
from jaxrl_tools.rewards import CompositeReward
from jaxrl_tools.rollout import RolloutLimits, Sampler
from jaxrl_tools.tools import ToolCall, ToolExecutor, function_tool, get_parser
from jaxrl_tools.train.batch import make_batch
from jaxrl_tools.train.scoring import score_trajectories
from jaxrl_tools.types import AGENT_TIMEOUT

pytest.importorskip("openai")
pytest.importorskip("starlette")

SCRIPT_LEN = 160
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _enc(tok, s):
    return tok.encode(s, add_special_tokens=False)


def _engine(tok_model, tok, script, slots=3):
    """Free stretches of the model's own greedy tokens around forced tool calls."""
    script = list(script) + [script[-1]] * (SCRIPT_LEN - len(script))
    eng = forced_engine(tok_model, tok, script, slots=slots)
    return eng, tok_model[1]


@function_tool
def add(a: int, b: int) -> str:
    """Adds two integers."""
    return str(a + b)


async def tool_agent(client, record):
    """The built-in loop's task as client code: tools declared, each call run by the agent,
    its output sent back as a tool message, until an answer without calls."""
    executor = ToolExecutor([add])
    messages = list(record["messages"])
    for _ in range(4):
        r = await client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=record["tool_schemas"],
            stop=["</tool_call>"],
        )
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return None  # the recipe's reward scores it
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            out = await executor.execute(ToolCall(call.function.name, args))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out.text})
    return None


async def forgetful_agent(client, record):
    """Sends the question again without its first exchange: a history the policy did not
    produce, so a second sample of the episode; scores itself."""
    first = await client.chat.completions.create(model="p", messages=record["messages"])
    again = record["messages"] + [{"role": "user", "content": "Once more."}]
    await client.chat.completions.create(model="p", messages=again, max_tokens=5)
    return {"reward": float(len(first.choices[0].message.content) > 0) + 0.5}


async def broken_agent(client, record):
    """Record "a" raises after a request; record "b" would never stop asking."""
    messages = list(record["messages"])
    while True:
        r = await client.chat.completions.create(model="p", messages=messages, max_tokens=2)
        if record["id"] == "a":
            raise KeyError("oops")
        messages += [r.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "More."}]


async def hung_agent(client, record):
    """Record "a" never returns after its first request, "b" before any; "c" answers."""
    if record["id"] == "b":
        await asyncio.Event().wait()
    await client.chat.completions.create(model="p", messages=record["messages"], max_tokens=3)
    if record["id"] == "a":
        await asyncio.Event().wait()
    return 1.0


async def one_argument_agent(client):
    return 1.0


def _sampler(eng, tok, agent=None, protocol="qwen", group=2, max_samples=1, timeout_s=600.0):
    settings = RolloutSection(
        protocol=protocol,
        group_size=group,
        temperature=0.0,
        max_response_len=200,
        max_tool_calls=3,
        chunk_size=8,
        slots=eng.slots,
        agent=agent,
        agent_max_samples=max_samples,
        agent_timeout_s=timeout_s,
        multi_call=False,  # one call per turn, as the agents here stop at </tool_call>
    )
    return Sampler(eng, tok, ToolExecutor([add]), settings, system_prompt="You add.")


RECORDS = [
    {"id": "a", "prompt": "What is 2 + 3?", "ground_truth": "5"},
    {"id": "b", "prompt": "Add two and three.", "ground_truth": "5"},
]


def test_an_agent_as_client_code_gives_the_built_in_loops_trajectories(tok_model, tok):
    """Greedy, the same records: token ids, loss masks, log-probs, tool calls and rewards of
    the agent's episodes equal the built-in loop's, token for token."""
    script = [-1] * 5 + _enc(tok, CALL) + [-1] * 4 + _enc(tok, "Done.<|im_end|>")
    eng, params = _engine(tok_model, tok, script)
    built_in = _sampler(eng, tok)(RECORDS, 2, params)
    sampler = _sampler(eng, tok, agent="test_agents:tool_agent")
    agent = sampler(RECORDS, 2, params)
    assert len(agent) == len(built_in) == 4
    for a, b in zip(agent, built_in):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.prompt_ids == b.prompt_ids
        assert a.response_ids == b.response_ids
        assert a.loss_mask == b.loss_mask
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert [(s.kind, s.start, s.end) for s in a.spans] == [
            (s.kind, s.start, s.end) for s in b.spans
        ]
        assert a.model_text == b.model_text  # what rewards score: the tool's text left out
        assert a.turns is None and a.agent_reward is None
        assert [(c.name, c.arguments) for c in a.tool_calls] == [
            (c.name, c.arguments) for c in b.tool_calls
        ]
        assert a.num_tool_calls == b.num_tool_calls == 1
    assert sum(a.loss_mask) > 0 and 0 in agent[0].loss_mask  # a tool turn was trained around
    assert "<tool_response>\n5\n</tool_response>" in agent[0].response_text
    reward = CompositeReward([("math", 1.0, {})])
    scores_a, _ = score_trajectories(reward, RECORDS, agent, 2)
    scores_b, _ = score_trajectories(reward, RECORDS, built_in, 2)
    np.testing.assert_array_equal(scores_a, scores_b)
    metrics = sampler.take_metrics()
    assert metrics["agent/calls_per_run"] == 2.0 and metrics["agent/rewrites"] == 0.0


async def forced_agent(client, record):
    """A call forced with tool_choice "required", its output, then one forced by name."""
    tools, messages = record["tool_schemas"], list(record["messages"])
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        r = await client.chat.completions.create(
            model="p", messages=messages, tools=tools, tool_choice=choice, stop=["</tool_call>"]
        )
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"})
    return 1.0


def test_a_forced_call_opener_is_given_tokens_not_trained(tok_model, tok):
    """tool_choice's opener: the end of the prompt on the first request, the end of the
    observation (loss mask 0) on the next; the policy's tokens are the rest of each call."""
    args = '{"a": 2, "b": 3}}\n</tool_call>'
    eng, params = _engine(tok_model, tok, _enc(tok, '{"name": "add", "arguments": ' + args + args))
    (t,) = _sampler(eng, tok, agent="test_agents:forced_agent", group=1)(RECORDS[:1], 1, params)
    first, second = (
        _enc(tok, "<tool_call>\n"),
        _enc(tok, '<tool_call>\n{"name": "add", "arguments": '),
    )
    assert t.prompt_ids[-len(first) :] == first
    kinds = [s.kind for s in t.spans]
    assert kinds[:3] == ["model", "observation", "model"]
    obs = t.spans[1]
    assert t.response_ids[obs.end - len(second) : obs.end] == second
    assert set(t.loss_mask[obs.start : obs.end]) == {0}
    for sp in (t.spans[0], t.spans[2]):
        assert set(t.loss_mask[sp.start : sp.end]) == {1}
    assert tok.decode(t.response_ids[t.spans[2].start : t.spans[2].end]) == args
    assert [c.name for c in t.tool_calls] == ["add", "add"] and t.agent_reward == 1.0
    assert (
        '{"name": "add", "arguments": {"a": 2, "b": 3}}' in t.model_text.split("<tool_response>")[1]
    )


CALC_CALL = '{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


@pytest.mark.parametrize(
    "sdk, module, forced, samples",
    [
        ("agents", "openai_agents", False, 1),
        ("langchain_openai", "langchain_agent", False, 1),
        ("smolagents", "smolagents_agent", True, 1),
    ],
)
def test_an_sdk_agent_trains_through_the_gateway(tok_model, tok, sdk, module, forced, samples):
    """The shipped example agent of each SDK, on the policy: its episode, the calculator's
    output in it, a training batch of it (the SDK's own requests, token-exact)."""
    pytest.importorskip(sdk)
    end = _enc(tok, "<|im_end|>")
    if forced:  # smolagents forces every call (tool_choice "required"): its final answer
        # (each of its steps is a new sample, the script's start again: one step only)
        final = '{"name": "final_answer", "arguments": {"answer": "5"}}\n</tool_call>'
        script = _enc(tok, final) + end
    else:
        script = _enc(tok, "<tool_call>\n" + CALC_CALL) + end + _enc(tok, "5") + end
    eng, params = _engine(tok_model, tok, script)
    agent = f"jaxrl_tools.demo.agents.{module}:agent"
    sampler = _sampler(eng, tok, agent=agent, group=1, max_samples=samples)
    (t,) = sampler(RECORDS[:1], 1, params)
    if forced:
        assert tok.decode(t.prompt_ids).endswith("<tool_call>\n")  # given, not trained
        assert [c.name for c in t.tool_calls] == ["final_answer"]
    else:
        assert "<tool_response>\n5\n</tool_response>" in tok.decode(t.token_ids)
        assert [c.name for c in t.tool_calls] == ["calculate"]
    batch = make_batch(
        RECORDS[:1],
        [t],
        CompositeReward([("math", 1.0, {})]),
        FiltersSection(),
        group_size=1,
        rows=1,
        pad_id=0,
        turn_rows=4 if samples > 1 else None,
    )
    assert batch.loss_mask_RT.sum() == sum(t.loss_mask) > 0


def test_a_rewritten_history_is_another_sample_of_the_episode(tok_model, tok):
    eng, params = _engine(tok_model, tok, [-1] * 6 + _enc(tok, "<|im_end|>"))
    refuses = _sampler(eng, tok, agent="test_agents:forgetful_agent", protocol="none")
    with pytest.raises(AgentError, match=r"BadRequestError.*rollout.agent_max_samples=1 samples"):
        refuses(RECORDS[:1], 2, params)
    sampler = _sampler(eng, tok, "test_agents:forgetful_agent", protocol="none", max_samples=2)
    trajs = sampler(RECORDS[:1], 2, params)
    assert [t.sample_index for t in trajs] == [0, 1]
    for t in trajs:
        first, second = t.turns
        assert second.prompt_ids[: len(first.token_ids)] != first.token_ids  # not a continuation
        assert len(second.response_ids) == 5 and second.finish_reason == "length"
        assert t.response_ids == first.response_ids + second.response_ids
        assert t.agent_reward == 1.5
    scores, parts = score_trajectories(None, RECORDS[:1], trajs, 2)
    assert scores.tolist() == [1.5, 1.5] and list(parts) == ["agent"]
    # the update's layout: a row per sample, each with its episode's score
    batch = make_batch(
        RECORDS[:1], trajs, None, FiltersSection(), group_size=2, rows=2, pad_id=0, turn_rows=4
    )
    assert (batch.num_rows, batch.num_episodes) == (4, 2)
    assert batch.scores_R.tolist() == [1.5] * 4
    for row, part in enumerate(p for t in trajs for p in t.turns):
        n = len(part.token_ids)
        assert batch.tokens_RT[row, :n].tolist() == part.token_ids
        assert batch.loss_mask_RT[row, :n].tolist() == part.full_loss_mask
    assert sampler.take_metrics()["agent/rewrites"] == 2.0


def test_an_agent_that_raises_stops_the_rollout_naming_the_record(tok_model, tok):
    eng, params = _engine(tok_model, tok, [-1] * 4 + _enc(tok, "<|im_end|>"))
    sampler = _sampler(eng, tok, agent="test_agents:broken_agent", protocol="none")
    with pytest.raises(AgentError, match=r"rollout.agent raised on record a, run 0: KeyError"):
        sampler(RECORDS, 1, params)  # and the other run, asking forever, is stopped


def test_an_agent_that_never_returns_is_cut_at_its_timeout_and_its_group_left_out(tok_model, tok):
    eng, params = _engine(tok_model, tok, [-1] * 4 + _enc(tok, "<|im_end|>"))
    records = [*RECORDS, {"id": "c", "prompt": "Say 5.", "ground_truth": "5"}]
    _sampler(eng, tok, "test_agents:hung_agent", protocol="none")(
        records[2:], 2, params
    )  # compiles
    sampler = _sampler(eng, tok, "test_agents:hung_agent", protocol="none", timeout_s=8.0)
    t0 = time.monotonic()
    trajs = sampler(records, 2, params)  # hung for ever before the timeout
    assert time.monotonic() - t0 < 60
    assert [t.finish_reason == AGENT_TIMEOUT for t in trajs] == [True] * 4 + [False] * 2
    assert len(trajs[0].response_ids) == 3 and trajs[2].response_ids == []  # b asked nothing
    assert len(trajs[2].prompt_ids) > 10  # its prompt, rendered
    assert sampler.take_metrics()["agent/timeouts"] == 4.0
    batch = make_batch(records, trajs, None, FiltersSection(), group_size=2, rows=6, pad_id=0)
    assert batch.num_rows == 2  # c's group only
    assert batch.tokens_RT[0, : len(trajs[4].token_ids)].tolist() == trajs[4].token_ids
    assert batch.scores_R.tolist()[:2] == [1.0, 1.0]


def test_a_requests_own_seed_alone_picks_its_key(tok_model, tok):
    """An explicit seed k is not the key of the k-th unseeded request (both once folded k into
    one base key), and it is the same whatever came before it."""
    eng, params = _engine(tok_model, tok, [-1] * 4 + _enc(tok, "<|im_end|>"))

    async def keys():
        backend = EngineBackend(eng, params, tok)
        gens = [Generation(prompt_ids=(1, 2, 3), seed=seed) for seed in (None, 0, 1)]
        out = [np.asarray(backend.sample(g).key).tolist() for g in gens]
        backend.running().next_index += 1  # one request later
        out.append(np.asarray(backend.sample(gens[1]).key).tolist())
        out.append(np.asarray(backend.sample(gens[0]).key).tolist())
        return out

    unseeded_0, seed_0, seed_1, seed_0_later, unseeded_1 = asyncio.run(keys())
    assert seed_0 != unseeded_0 and seed_1 != unseeded_1
    assert seed_0 == seed_0_later and unseeded_0 != unseeded_1


def test_the_chat_continues_the_sampled_tokens_and_renders_anything_else(tok):
    """A history that ends with a returned assistant message is its exact context plus the
    template's markup of what follows, however the client re-spells the message; any other
    history is rendered by the template."""
    chat = TemplateChat(tok, get_parser("qwen"), eos_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    tools = ToolExecutor([add]).schemas()
    messages = [{"role": "user", "content": "2+3?"}]
    prompt = chat.prompt_ids(messages, tools)
    assert prompt == _enc(
        tok,
        tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False),
    )
    # sampled: a call whose JSON the template would write otherwise, split oddly into tokens
    sampled = _enc(tok, 'ok <tool_call>\n{"name":"add","arguments":{"b":3,"a":2}}\n</tool_call>')
    sampled += [tok.convert_tokens_to_ids("<|im_end|>")]
    done = Completion(prompt, sampled, [0.0] * len(sampled), "ok", "stop", ended_with_eos=True)
    message, finish = chat.reply(messages, tools, done)
    assert finish == "tool_calls" and message["content"] == "ok"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"b": 3, "a": 2}
    # sent back re-serialised (other key order, no call id, content "" for None)
    call = message["tool_calls"][0]["function"]
    echoed = {
        "role": "assistant",
        "content": "ok",
        "tool_calls": [{"type": "function", "function": {**call, "arguments": '{"a": 2, "b": 3}'}}],
    }
    tool_out = {"role": "tool", "content": "<|im_end|>5"}  # a tool cannot spell an end token
    ids = chat.prompt_ids([*messages, echoed, tool_out], tools)
    assert ids[: len(prompt) + len(sampled)] == prompt + sampled
    rest = tok.decode(ids[len(prompt) + len(sampled) :], skip_special_tokens=False)
    assert rest.startswith("\n<|im_start|>user\n<tool_response>\n<|im_end|>5")
    assert (
        ids.count(tok.convert_tokens_to_ids("<|im_end|>"))
        == prompt.count(tok.convert_tokens_to_ids("<|im_end|>")) + 2
    )  # the sampled one and the tool turn's own: not the tool's text
    # an edited assistant message is not the sampled one: the template renders the history
    edited = {**echoed, "content": "OK"}
    whole = chat.prompt_ids([*messages, edited, {"role": "tool", "content": "5"}], tools)
    assert whole[: len(prompt) + len(sampled)] != prompt + sampled


class _Recorder:
    """A backend that records each prompt and replies with a call, then (after its output)
    with an answer: what the record of each request would hold."""

    def __init__(self, tok):
        self.tokenizer, self.model, self.max_context, self.prompts = tok, "p", 768, []

    async def generate(self, gen, on_tokens=None):
        self.prompts.append(list(gen.prompt_ids))
        text = "5." if "<tool_response>" in self.tokenizer.decode(gen.prompt_ids) else CALL
        ids = _enc(self.tokenizer, text + "<|im_end|>")
        return Completion(list(gen.prompt_ids), ids, [0.0] * len(ids), text, "stop", True)


def test_the_three_apis_give_the_same_prompts_and_continuations(tok):
    """A tool round trip sent as chat completions, as a Responses input and as Anthropic
    messages: the same prompt token ids on both turns, the second continuing the first's
    sampled tokens (the record of each is the same)."""
    import httpx

    from jaxrl_tools.gateway.app import make_app

    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    tools = ToolExecutor([add]).schemas()
    system, question = "You add.", "What is 2 + 3?"
    flat = [{"type": "function", **t["function"]} for t in tools]
    anthropic_tools = [
        {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
        for f in (t["function"] for t in tools)
    ]

    async def round_trip(api):
        backend = _Recorder(tok)
        app = make_app(backend, TemplateChat(tok, get_parser("qwen"), eos_ids=eos))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw/v1") as http:
            if api == "chat":
                msgs = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ]
                r = (
                    await http.post("/chat/completions", json={"messages": msgs, "tools": tools})
                ).json()
                msg = r["choices"][0]["message"]
                msgs += [
                    msg,
                    {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "5"},
                ]
                await http.post("/chat/completions", json={"messages": msgs, "tools": tools})
            elif api == "responses":
                body = {"instructions": system, "input": question, "tools": flat}
                r = (await http.post("/responses", json=body)).json()
                (call,) = r["output"]
                out = {"type": "function_call_output", "call_id": call["call_id"], "output": "5"}
                body["input"] = [{"role": "user", "content": question}, call, out]
                await http.post("/responses", json=body)
            else:
                msgs = [{"role": "user", "content": question}]
                body = {
                    "system": system,
                    "messages": msgs,
                    "tools": anthropic_tools,
                    "max_tokens": 99,
                }
                r = (await http.post("/messages", json=body)).json()
                use = r["content"][0]
                result = {"type": "tool_result", "tool_use_id": use["id"], "content": "5"}
                msgs += [
                    {"role": "assistant", "content": r["content"]},
                    {"role": "user", "content": [result]},
                ]
                await http.post("/messages", json=body)
        return backend.prompts

    chat, responses, messages = (
        asyncio.run(round_trip(api)) for api in ("chat", "responses", "messages")
    )
    assert chat == responses == messages and len(chat) == 2
    first, second = chat
    sampled = _enc(tok, CALL + "<|im_end|>")
    assert second[: len(first) + len(sampled)] == first + sampled  # continued, token-exact


def test_concurrent_requests_decode_as_if_alone(tok_model, tok):
    """Requests of different lengths, stops and seeds share the engine's slots (more requests
    than slots); each gets what it gets alone, its text cut before its stop string."""
    eng, params = _engine(tok_model, tok, [-1] * SCRIPT_LEN, slots=2)
    prompts = [_enc(tok, t) for t in ("Hello there", "Compute 12 * 7", "x", "The answer is")]
    gens = [
        Generation(tuple(p), max_tokens=n, temperature=t, seed=7, stop=stop)
        for p, n, t, stop in zip(
            prompts, (9, 17, 4, 12), (0.0, 1.0, 0.0, 1.0), ((), (), (), (" ",))
        )
    ]

    async def serve(batch):
        backend = EngineBackend(
            eng, params, tok, limits=RolloutLimits(max_response_tokens=700, chunk_size=4)
        )
        try:
            return await asyncio.gather(*(backend.generate(g) for g in batch))
        finally:
            await backend.aclose()

    together = asyncio.run(serve(gens))
    alone = [asyncio.run(serve([g]))[0] for g in gens]
    for a, b, g in zip(together, alone, gens):
        assert a.token_ids == b.token_ids and a.text == b.text
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert a.prompt_ids == list(g.prompt_ids)
        assert len(a.token_ids) <= g.max_tokens
    assert [len(c.token_ids) for c in together[:3]] == [9, 17, 4]
    assert all(c.finish_reason == "length" for c in together[:3])
    if together[3].finish_reason == "stop":  # sampled a space: the text ends before it
        assert " " not in together[3].text


def test_a_request_whose_caller_is_gone_frees_its_slot_and_nothing_of_it_stays(tok_model, tok):
    """A cancelled request (its HTTP client hung up: the app cancels its `generate`) stops at
    its next chunk, not at max_tokens; a finished request leaves nothing in the driver."""
    eng, params = _engine(tok_model, tok, [-1] * SCRIPT_LEN, slots=2)
    prompt = tuple(_enc(tok, "Hello there"))

    async def main():
        backend = EngineBackend(
            eng, params, tok, limits=RolloutLimits(max_response_tokens=700, chunk_size=4)
        )
        got = []

        def on_tokens(ids, lps):  # the client hangs up once it has 8 tokens
            got.extend(ids)
            if len(got) >= 8:
                hung_up.cancel()

        hung_up = asyncio.ensure_future(
            backend.generate(Generation(prompt, max_tokens=600), on_tokens)
        )
        while not hung_up.done():
            await asyncio.sleep(0.01)
        driver = backend.driver
        while driver.samples:  # its slot is freed at the next chunk
            await asyncio.sleep(0.01)
        decoded = len(got)
        others = await asyncio.gather(
            *(backend.generate(Generation(prompt, max_tokens=5, seed=k)) for k in range(20))
        )
        left = (dict(driver.samples), list(driver.done), dict(driver.group), dict(driver.tasks))
        await backend.aclose()
        return decoded, others, left

    decoded, others, left = asyncio.run(main())
    assert decoded <= 8 + 2 * 4  # the next chunk after the hang-up, not 600 tokens
    assert all(len(c.token_ids) == 5 for c in others)
    assert left == ({}, [], {}, {})  # nothing per request outlives it


def test_the_demo_agent_trains_beside_the_built_in_loop_in_a_smoke_run(tmp_path, monkeypatch):
    """`demo --baseline-agent`: SFT, then RL with the built-in loop and RL with the shipped
    tool-math agent from the same SFT policy (its rollouts the agent's episodes, its sandboxed
    tool calls counted), and one report with both."""
    from jaxrl_tools.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["demo", "--smoke", "rollout.protocol=qwen", "tokenizer.vocab_size=1024"]
    argv += ["rollout.max_prompt_len=272", "sft.max_len=384"]  # the tool's declaration
    argv += ["--baseline-agent", "jaxrl_tools.demo.agent:tool_math_agent"]
    assert main(argv) == 0
    logs = tmp_path / "runs/smoke/grpo_tool_math/logs"
    steps = [json.loads(line) for line in (logs / "baseline/metrics.jsonl").open()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["agent/calls_per_run"] >= 1 and s["agent/rewrites"] == 0 for s in steps)
    assert all(np.isfinite(s["actor/loss"]) for s in steps)
    report = (logs / "report.md").read_text()
    assert "| SFT + RL (math, agent tool_math_agent) |" in report
    assert "| SFT + RL (math) |" in report


def test_agent_settings_that_cannot_work_are_one_line_errors(tmp_path):
    from jaxrl_tools import configs
    from jaxrl_tools.check import check_tools
    from jaxrl_tools.config import ConfigError, RolloutSection
    from jaxrl_tools.config_loader import load_config

    with pytest.raises(ConfigError, match=r"rollout.agent.*'package.module:function'"):
        RolloutSection(agent="not a path")
    with pytest.raises(ConfigError, match=r"max_turn_tokens .*an agent caps its own"):
        RolloutSection(agent="my_agents:run", max_turn_tokens=8)
    with pytest.raises(ConfigError, match=r"rollout.agent is 'my_agents:run', but data.verif"):
        verifiers = ["data.task=null", "data.verifiers={taskset: t, train: {}}"]
        load_config(configs.path("grpo_tool_math"), ["rollout.agent=my_agents:run", *verifiers])
    with pytest.raises(ConfigError, match=r"rollout.agent.*got rollout.protocol='retool'"):
        load_config(configs.path("grpo_tool_math"), ["rollout.agent=my_agents:run"])
    with pytest.raises(
        ConfigError, match=r"rollout.agent='nowhere:run' cannot be loaded: No module named"
    ):
        from jaxrl_tools.agents.rollouts import load_agent

        load_agent("nowhere:run")
    with pytest.raises(ConfigError, match=r"must be an async function"):
        load_agent("json:dumps")
    with pytest.raises(ConfigError, match=r"must take \(client, record\): too many"):
        load_agent("test_agents:one_argument_agent")
    with pytest.raises(ConfigError, match=r"rollout.agent_timeout_s must be > 0"):
        RolloutSection(agent="my_agents:run", agent_timeout_s=0)
    # `check` loads the agent before anything is built: a missing module is one line
    agent = ["rollout.agent=nowhere:run", "rollout.protocol=none"]
    cfg = load_config(configs.path("grpo_tool_math"), agent)
    with pytest.raises(ConfigError, match=r"^rollout.agent='nowhere:run' cannot be loaded"):
        check_tools(cfg)


def test_sft_traces_past_sft_max_len_are_one_line(tmp_path, monkeypatch, capsys):
    """Tool declarations make every trace longer (the demo's with Qwen function calling: about
    490 tokens): a trace past sft.max_len says what to raise, without a traceback."""
    from jaxrl_tools.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["train", "--config", "grpo_tool_math", "--smoke", "rollout.protocol=qwen"]
    assert main([*argv, "rollout.max_prompt_len=512"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (
        err.strip().splitlines()[-1].startswith("jaxrl-tools: sft.max_len=256: an SFT trace has ")
    )
