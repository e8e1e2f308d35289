"""A LangChain agent trained as it is: `ChatOpenAI` with `bind_tools`, on the gateway's client
(in process: its chat completions resource), running the calls it gets back.

    rollout.agent=jaxrl_tools.demo.agents.langchain_agent:agent   (pip install langchain-openai)
"""

from __future__ import annotations

from jaxrl_tools.demo.agents import MAX_TURNS, calculate


async def agent(client, record: dict) -> None:
    from langchain_core.messages import ToolMessage  # noqa: PLC0415 -- the SDK is optional
    from langchain_core.tools import tool  # noqa: PLC0415
    from langchain_openai import ChatOpenAI  # noqa: PLC0415

    calculator = tool(calculate)
    llm = ChatOpenAI(
        model="policy",
        api_key="in-process",
        base_url=str(client.base_url),
        root_async_client=client,  # the gateway's own client: no socket
        async_client=client.chat.completions,
    ).bind_tools([calculator])
    messages: list = [(m["role"], m["content"]) for m in record["messages"]]
    for _ in range(MAX_TURNS):
        reply = await llm.ainvoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return None  # an answer: the recipe's reward scores it
        for call in reply.tool_calls:
            out = calculator.invoke(call["args"]) if call["name"] == "calculate" else "no such tool"
            messages.append(ToolMessage(out, tool_call_id=call["id"]))
    return None
