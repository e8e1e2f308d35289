"""An OpenAI Agents SDK agent trained as it is: `Agent` + `Runner` with a function tool, its
model `OpenAIResponsesModel` (the SDK's default: `POST /v1/responses`) on the gateway's client.

    rollout.agent=jaxrl_tools.demo.agents.openai_agents:agent     (pip install openai-agents)

For the chat completions route instead, use `OpenAIChatCompletionsModel(model="policy",
openai_client=client)`: the same prompt, the same record.
"""

from __future__ import annotations

from jaxrl_tools.demo.agents import MAX_TURNS, calculate


async def agent(client, record: dict) -> None:
    from agents import (  # noqa: PLC0415 -- the SDK is optional
        Agent,
        MaxTurnsExceeded,
        ModelBehaviorError,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # traces would be sent to OpenAI's servers
    solver = Agent(
        name="solver",
        tools=[function_tool(calculate)],
        model=OpenAIResponsesModel(model="policy", openai_client=client),
    )
    try:  # the record's messages (its system prompt included) as the input items
        await Runner.run(solver, record["messages"], max_turns=MAX_TURNS)
    except (MaxTurnsExceeded, ModelBehaviorError):
        pass  # the episode ends here; the reward scores what the policy wrote
