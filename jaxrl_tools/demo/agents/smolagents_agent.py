"""A smolagents agent trained as it is: `ToolCallingAgent` with `OpenAIServerModel` on the
gateway's loopback URL (smolagents is synchronous: it runs in a thread, its HTTP client on the
loopback port `http_base_url` opens).

    rollout.agent=jaxrl_tools.demo.agents.smolagents_agent:agent  (pip install smolagents openai)

Two things to know: smolagents asks for a tool call on every step (tool_choice "required",
which the gateway forces as given tokens: see docs/guide/your-own-agent.md), and it sends its
history back as its own text (a call as "Calling tools: ..."), not as the messages the
gateway returned, so every step after the first is a new sample of the episode: set
rollout.agent_max_samples to its max_steps. Its own long system prompt is replaced by the
record's.
"""

from __future__ import annotations

import asyncio

from jaxrl_tools.demo.agents import MAX_TURNS, calculate


async def agent(client, record: dict) -> None:
    from smolagents import LogLevel, OpenAIServerModel, Tool, ToolCallingAgent  # noqa: PLC0415

    from jaxrl_tools.agents.rollouts import http_base_url  # noqa: PLC0415

    class Calculate(Tool):
        name = "calculate"
        description = calculate.__doc__
        inputs = {"expression": {"type": "string", "description": "e.g. 2 + 3 * 4"}}
        output_type = "string"

        def forward(self, expression: str) -> str:
            return calculate(expression)

    model = OpenAIServerModel("policy", api_base=await http_base_url(client), api_key="loopback")
    solver = ToolCallingAgent(
        tools=[Calculate()], model=model, max_steps=MAX_TURNS, verbosity_level=LogLevel.OFF
    )
    system = [m["content"] for m in record["messages"] if m["role"] == "system"]
    solver.prompt_templates["system_prompt"] = "\n".join(system) or "Solve the task."
    task = "\n".join(m["content"] for m in record["messages"] if m["role"] == "user")
    await asyncio.to_thread(solver.run, task)  # the event loop serves its requests meanwhile
