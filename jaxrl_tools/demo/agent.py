"""The tool-math demo's task as an agent written as plain OpenAI-client code.

    jaxrl-tools demo rollout.protocol=qwen tokenizer.vocab_size=1024 rollout.max_prompt_len=272 \
        sft.max_len=384 --baseline-agent jaxrl_tools.demo.agent:tool_math_agent

(SFT, then RL with the built-in loop and RL with this agent from the same SFT policy: the
docs/results/tool-math.md has the figures.)

It does what the built-in loop does for the demo: sends the problem with the Python tool
declared, runs each tool call itself in the sandbox, sends the output back as a tool message,
and stops at an answer without calls; the recipe's reward scores the episode. Greedy, its
trajectories are the built-in loop's, token for token (`tests/test_agents.py`). Copy it as the
start of your own agent: nothing in it is specific to this library but the sandboxed tool.
"""

from __future__ import annotations

import json
import uuid

from jaxrl_tools.tools import PythonTool, ToolCall, ToolExecutor

MAX_CALLS, MAX_TURNS = 1, 2  # the demo recipe's rollout.max_tool_calls and max_turns
BUDGET_NOTICE = "tool budget exhausted, answer directly"

_executor: ToolExecutor | None = None


def _tools() -> ToolExecutor:
    """One sandboxed Python tool for every run of the process (its worker pool is shared)."""
    global _executor
    if _executor is None:
        _executor = ToolExecutor([PythonTool(mode="stateless", n_workers=2, timeout_s=5.0)])
    return _executor


async def tool_math_agent(client, record: dict) -> None:
    """One episode: the record's messages (system prompt included) and tool declarations."""
    tools = _tools()
    session = uuid.uuid4().hex
    messages = list(record["messages"])
    calls = 0
    try:
        for _ in range(MAX_TURNS):
            reply = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=record["tool_schemas"],
                stop=["</tool_call>"],  # one call per turn, as the built-in Qwen protocol
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return None  # an answer: the recipe's reward scores it
            for call in message.tool_calls:
                if calls >= MAX_CALLS:
                    text = BUDGET_NOTICE
                else:
                    calls += 1
                    args = json.loads(call.function.arguments)
                    out = await tools.execute(ToolCall(call.function.name, args), session)
                    text = out.text
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        return None
    finally:
        await tools.close_session(session)
