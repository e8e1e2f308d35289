"""Training on `verifiers` environments (the `verifiers` package, 0.4's `verifiers.v1`): a
taskset's tasks are the records, each run of the agent is one of its episodes against the
policy, and the episode's reward (the taskset's rubric) is the run's reward.

    data:
      verifiers: {taskset: my-env, train: {split: train}, eval: {split: test}}

`taskset` is what `verifiers` loads by name (a hub id or an installed module: "my-env" imports
`my_env`); `train` and `eval` are its taskset config for each split (no `eval`: no held-out
records). The episode is verifiers' own: its `SingleAgentEnv`, its interception server, the
task's tool servers (MCP, as local subprocesses) and its rewards. Only the agent program is
ours, an in-process chat loop (`GatewayHarness`, verifiers' `null` loop without the subprocess
that `uv` would provision), whose model calls reach the gateway of the run over loopback HTTP
(`agents.http_base_url`), so every sampled token is recorded as for any agent.
"""

from __future__ import annotations

import functools
import importlib.machinery
import json
import sys
from contextlib import AsyncExitStack

from jaxrl_tools.agents import rollouts as agents
from jaxrl_tools.config import ConfigError

HARNESS_ID = "jaxrl-gateway"  # the harness verifiers loads for our episodes (see `_verifiers`)


@functools.cache
def _verifiers():
    """`verifiers.v1`, with `GatewayHarness` where verifiers looks harnesses up by id."""
    try:
        import verifiers.v1 as vf  # noqa: PLC0415 -- the [verifiers] extra
    except ImportError as e:
        raise ConfigError(
            f"data.verifiers needs the verifiers package ({e}): "
            "pip install 'jaxrl-tools[verifiers]'"
        ) from None
    module = _harness()
    sys.modules.setdefault(module.__name__, module)
    return vf


@functools.cache
def _harness():
    """A module holding the harness class (verifiers imports a harness as a module whose
    `__all__` exports one `Harness` subclass)."""
    import types  # noqa: PLC0415

    import verifiers.v1 as vf  # noqa: PLC0415
    from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp  # noqa: PLC0415

    class GatewayHarness(vf.Harness[vf.HarnessConfig]):
        """verifiers' plain chat loop, in process: the model answers, its tool calls go to the
        task's MCP servers, until a reply without calls."""

        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_MCP = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
            import openai  # noqa: PLC0415

            messages = _chat_messages(*self.resolve_prompt(data))
            client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            servers = {"mcpServers": {n: {"url": u} for n, u in mcp_urls.items()}}
            async with AsyncExitStack() as stack:
                stack.push_async_callback(client.close)
                tools, dispatch, connected = await connect_mcp(servers, stack)
                while True:
                    kwargs = {"tools": tools} if tools else {}
                    reply = await client.chat.completions.create(
                        model=ctx.model, messages=messages, **kwargs
                    )
                    choice = reply.choices[0]
                    messages.append(choice.message.model_dump(exclude_none=True))
                    if not choice.message.tool_calls or choice.finish_reason == "length":
                        break  # an answer, or the episode's token budget is spent
                    for call in choice.message.tool_calls:
                        messages.append(await _tool_message(call, dispatch, connected))
            return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    async def _tool_message(call, dispatch, connected) -> dict:
        name = call.function.name
        try:
            args = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError as e:
            content = f"error: the arguments are not JSON ({e})"
        else:
            if name not in dispatch:
                content = f"error: unknown tool {name!r}"
            elif not isinstance(args, dict):
                content = "error: the arguments must be a JSON object"
            else:
                content = await call_mcp(connected, dispatch, name, args)
        return {"role": "tool", "tool_call_id": call.id, "content": content, "name": name}

    name = f"verifiers.v1.harnesses.{HARNESS_ID.replace('-', '_')}"
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.GatewayHarness = GatewayHarness
    module.__all__ = ["GatewayHarness"]
    return module


def _chat_messages(system: str | None, prompt) -> list[dict]:
    """A task's system prompt and prompt (a string, or verifiers' messages) as chat messages."""
    from verifiers.v1.dialects.chat import message_to_wire  # noqa: PLC0415

    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt:
        messages += [message_to_wire(m) for m in prompt]
    return messages


@functools.cache
def _environment(spec_json: str):
    """The verifiers environment of a record's spec ({"taskset", "config"}), loaded once."""
    vf = _verifiers()
    spec = json.loads(spec_json)
    taskset = {"id": spec["taskset"], **spec["config"]}
    try:
        env = vf.load_environment(
            vf.SingleAgentEnvConfig(
                taskset=taskset,
                agent={"harness": {"id": HARNESS_ID}, "runtime": vf.SubprocessConfig()},
                interception={"type": "server"},
            )
        )
    except Exception as e:  # the taskset's own errors: not installed, a bad config key
        raise ConfigError(
            f"data.verifiers: taskset {spec['taskset']!r} with {spec['config']}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    return env, list(env.taskset)


def records(section: dict, split: str) -> list[dict]:
    """The records of a split: one per task, its prompt as chat messages."""
    config = section.get(split)
    if config is None:
        return []
    spec = json.dumps({"taskset": section["taskset"], "config": config}, sort_keys=True)
    _, tasks = _environment(spec)
    out = []
    for i, task in enumerate(tasks):
        data = task.data
        messages = _chat_messages(data.system_prompt, data.prompt)
        rid = data.id or data.name or f"{section['taskset']}-{split}-{i}"
        out.append({"id": rid, "prompt": messages, "verifiers": {"spec": spec, "index": i}})
    return out


async def episode(client, record: dict) -> float:
    """`rollout.agent` of `data.verifiers`: one episode of the record's task, its reward."""
    vf = _verifiers()
    env, tasks = _environment(record["verifiers"]["spec"])
    base_url = await agents.http_base_url(client)
    ctx = vf.ModelContext(model="policy", client=vf.EvalClientConfig(base_url=base_url))
    result = await env.run_episode(tasks[record["verifiers"]["index"]], ctx)
    errors = [*result.errors, *(e for t in result.traces for e in t.errors)]
    if not result.ok or errors:
        raise RuntimeError(f"the verifiers episode failed: {errors[0].message if errors else ''}")
    return float(result.traces[0].reward)


__all__ = ["HARNESS_ID", "episode", "records"]
