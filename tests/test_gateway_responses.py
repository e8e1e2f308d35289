"""POST /v1/responses (`gateway.responses`) with the official `openai` client over the fakes of
`test_gateway_app`: the same prompt as the equivalent chat request, output items, streamed
events, and 400s naming the field."""

import asyncio
import contextlib
import json

import httpx
import openai
import pytest
from test_gateway_app import TOOLS, async_client, dec, make, user

FLAT_TOOLS = [{**t["function"], "type": "function", "strict": True} for t in TOOLS]


async def events_of(stream) -> list:
    return [e async for e in stream]


def test_a_response_renders_the_chat_requests_prompt_and_reads_back_its_items():
    app, backend, _ = make(served_name="policy-R")

    async def main():
        client = async_client(app)
        # instructions + a string input: the chat's system and user messages
        r = await client.responses.create(model="m", instructions="be brief", input="hi")
        assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
        assert r.model == "policy-R" and r.output_text == "Hello! seed=None"
        (msg,) = r.output
        assert msg.type == "message" and msg.role == "assistant"
        assert msg.content[0].type == "output_text"
        as_response = list(backend.gens[-1].prompt_ids)
        chat = await client.chat.completions.create(
            model="m", messages=[{"role": "system", "content": "be brief"}, *user("hi")]
        )
        assert as_response == list(backend.gens[-1].prompt_ids)
        assert r.model_extra["prompt_token_ids"] == as_response
        assert r.usage.input_tokens == len(as_response)
        assert r.usage.output_tokens == len(r.model_extra["token_ids"])
        assert dec(r.model_extra["token_ids"]) == dec(chat.choices[0].model_extra["token_ids"])

        # a tool round trip as the Agents SDK sends it: the reply's items back as input, then
        # the call's output; the same prompt as the chat history of the same turns
        items = [{"role": "user", "content": "what is the weather in Paris?"}]
        r = await client.responses.create(model="m", input=items, tools=FLAT_TOOLS)
        text, call = r.output
        assert text.content[0].text == "Let me check." and call.type == "function_call"
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        assert call.call_id.startswith("call_") and call.status == "completed"
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "18"})
        r = await client.responses.create(model="m", input=items, tools=FLAT_TOOLS)
        assert r.output_text == "It is 18°C in Paris ☀️."
        as_response = list(backend.gens[-1].prompt_ids)
        history = [
            *user("what is the weather in Paris?"),
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "18"},
        ]
        await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
        assert as_response == list(backend.gens[-1].prompt_ids)

        # tool_choice named (flat), max_output_tokens -> incomplete
        r = await client.responses.create(
            model="m",
            input="hello",
            tools=FLAT_TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
        )
        assert [o.type for o in r.output] == ["function_call"]
        assert backend.gens[-1].opener.endswith('"arguments": ')
        r = await client.responses.create(model="m", input="long", max_output_tokens=5)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert backend.gens[-1].max_tokens == 5

    asyncio.run(main())


def test_a_streamed_response_sends_the_events_the_agents_sdk_reads():
    app, _, _ = make()

    async def main():
        client = async_client(app)
        stream = await client.responses.create(
            model="m", input="what is the weather?", tools=FLAT_TOOLS, stream=True
        )
        events = await events_of(stream)
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == "Let me check."
        args = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [a.name for a in args] == ["get_weather"]
        done = [e.item for e in events if e.type == "response.output_item.done"]
        final = events[-1].response
        assert [i.type for i in done] == [o.type for o in final.output]
        assert final.output[1].arguments == args[0].arguments
        assert final.output_text == "Let me check." and final.usage.output_tokens > 0
        added = [e.output_index for e in events if e.type == "response.output_item.added"]
        assert added == [0, 1]

        # the same request unstreamed: the same items
        r = await client.responses.create(model="m", input="what is the weather?", tools=FLAT_TOOLS)
        assert [o.type for o in r.output] == [o.type for o in final.output]
        assert r.output_text == final.output_text

    asyncio.run(main())


@pytest.mark.parametrize(
    "fields, param, says",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "send the whole history"),
        ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "not supported"),
        ({"input": [{"role": "critic", "content": "x"}]}, "input[0]", "role must be one of"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content",
            "text only",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id", "a string"),
        ({"tools": [{"type": "web_search"}]}, "tools", "function tool"),
        ({"tool_choice": "required"}, "tool_choice", "no tools are declared"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format", "not supported"),
        ({"input": 3}, "input", "a string or a non-empty list"),
        ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ],
)
def test_bad_responses_requests_are_400s_naming_the_field(fields, param, says):
    app, _, _ = make()

    async def main():
        client = async_client(app)
        body = {"model": "m", "input": "hi", **fields}
        with pytest.raises(openai.BadRequestError) as e:
            await client.post("/responses", body=body, cast_to=object)
        assert e.value.body["param"] == param and says in e.value.message

    asyncio.run(main())


@pytest.mark.parametrize("streamed", [False, True])
def test_the_agents_sdk_runs_on_the_responses_route(streamed):
    """The OpenAI Agents SDK's default model, unchanged: a tool call, its output, the answer."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    app, backend, _ = make()

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"18 degrees in {city}"

    async def main():
        model = agents.OpenAIResponsesModel(model="m", openai_client=async_client(app))
        bot = agents.Agent(name="w", instructions="be brief", tools=[get_weather], model=model)
        question = "what is the weather in Paris?"
        if not streamed:
            return await agents.Runner.run(bot, question)
        result = agents.Runner.run_streamed(bot, question)
        kinds = [e.type async for e in result.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return result

    result = asyncio.run(main())
    assert result.final_output == "It is 18°C in Paris ☀️."
    assert "tool: 18 degrees in Paris" in dec(backend.gens[-1].prompt_ids)


# ---------------------------------------------------------------------------- /v1/messages
def anthropic_client(app):
    anthropic = pytest.importorskip("anthropic")
    for hx in (httpx, pytest.importorskip("httpx2")):  # newer SDKs take httpx2's client only
        http = hx.AsyncClient(transport=hx.ASGITransport(app=app), base_url="http://gw")
        with contextlib.suppress(TypeError):
            return anthropic.AsyncAnthropic(
                base_url="http://gw", api_key="x", http_client=http, max_retries=0
            )
    raise AssertionError("no HTTP client the anthropic SDK takes")


ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


def test_anthropic_messages_render_the_chat_requests_prompt():
    app, backend, _ = make()

    async def main():
        client = anthropic_client(app)
        r = await client.messages.create(
            model="m", system="be brief", messages=user("hi"), max_tokens=50
        )
        assert r.type == "message" and r.stop_reason == "end_turn"
        assert [b.text for b in r.content] == ["Hello! seed=None"]
        as_message = list(backend.gens[-1].prompt_ids)
        await client_chat(app, [{"role": "system", "content": "be brief"}, *user("hi")])
        assert as_message == list(backend.gens[-1].prompt_ids) == r.model_extra["prompt_token_ids"]
        assert r.usage.output_tokens == len(r.model_extra["token_ids"])

        history = [{"role": "user", "content": "what is the weather in Paris?"}]
        r = await client.messages.create(
            model="m", messages=history, tools=ANTHROPIC_TOOLS, max_tokens=200
        )
        text, use = r.content
        assert r.stop_reason == "tool_use" and text.text == "Let me check."
        assert (
            use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
        )
        history += [
            {"role": "assistant", "content": [b.model_dump() for b in r.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18"}],
            },
        ]
        streamed = client.messages.stream(
            model="m", messages=history, tools=ANTHROPIC_TOOLS, max_tokens=200
        )
        async with streamed as stream:
            deltas = [e.delta.text async for e in stream if e.type == "content_block_delta"]
            final = await stream.get_final_message()
        assert "".join(deltas) == final.content[0].text == "It is 18°C in Paris ☀️."
        as_message = list(backend.gens[-1].prompt_ids)
        chat = [
            *user("what is the weather in Paris?"),
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(use.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": "18"},
        ]
        await client_chat(app, chat, tools=TOOLS)
        assert as_message == list(backend.gens[-1].prompt_ids)

        # tool_choice any: a forced call, streamed as a tool_use block; a stop sequence
        async with client.messages.stream(
            model="m",
            messages=user("hello"),
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "any"},
            max_tokens=200,
        ) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[0].input == {"city": "Paris"}
        r = await client.messages.create(
            model="m", messages=user("stops"), stop_sequences=["STOP"], max_tokens=50
        )
        assert (r.stop_reason, r.stop_sequence, r.content[0].text) == (
            "stop_sequence",
            "STOP",
            "one two ",
        )

    asyncio.run(main())


async def client_chat(app, messages, **kw):
    return await async_client(app).chat.completions.create(model="m", messages=messages, **kw)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"top_k": 5}, "top_k"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "x"}}, "tool_choice"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
    ],
)
def test_bad_anthropic_requests_are_400s_naming_the_field(fields, param):
    app, _, _ = make()

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
        body = {"model": "m", "max_tokens": 5, "messages": user("hi"), **fields}
        r = await http.post("/v1/messages", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param

    asyncio.run(main())
