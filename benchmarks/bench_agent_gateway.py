"""The gateway's overhead: an agent written as OpenAI-client code against the built-in loop, on
the same batch, in one process.

Both roll out the same records (G samples each) on the same engine, greedy: the policy writes a
few tokens of its own, a tool call (forced, so that every episode makes one), the tool's output
comes back, and it answers. The built-in loop parses the call and runs the tool itself; the agent
(`AGENT`) gets it as OpenAI `tool_calls` through the official client, in process, runs it and
sends the history back. Their trajectories must be equal token for token; the figure is the
agent's rollout time over the built-in loop's (best of `--repeats`, after a warm-up of each).

    python benchmarks/bench_agent_gateway.py [--records 16] [--group 4] [--slots 32]
        [--hidden 64 --layers 2]  (a wider, deeper policy: decoding's share grows)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_tools import models
from jaxrl_tools.config import RolloutSection
from jaxrl_tools.engine.core import EngineCore
from jaxrl_tools.models.config import ModelConfig
from jaxrl_tools.rollout import Sampler
from jaxrl_tools.tasks.tokenizer import build_tokenizer
from jaxrl_tools.tools import ToolCall, ToolExecutor, function_tool

AGENT = "bench_agent_gateway:add_agent"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@function_tool
def add(a: int, b: int) -> str:
    """Adds two integers."""
    return str(a + b)


async def add_agent(client, record):
    """The built-in loop's turn, as client code: one call per turn, run here, sent back."""
    messages = list(record["messages"])
    tools = ToolExecutor([add])
    for _ in range(4):
        r = await client.chat.completions.create(
            model="policy", messages=messages, tools=record["tool_schemas"], stop=["</tool_call>"]
        )
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return None
        for call in msg.tool_calls:
            out = await tools.execute(
                ToolCall(call.function.name, json.loads(call.function.arguments))
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out.text})
    return None


def free_or_forced(logits_BV, sampled_B, seq_B, data):
    """The script's token where it is >= 0, the model's own (no special token) elsewhere."""
    script_K, added_V = data
    want_B = script_K[jnp.minimum(sampled_B, script_K.shape[0] - 1)]
    forced_BV = jnp.where(jnp.arange(logits_BV.shape[-1])[None] == want_B[:, None], 0.0, -1e9)
    free_BV = jnp.where(added_V[None], -1e9, logits_BV)
    return jnp.where((want_B >= 0)[:, None], forced_BV, free_BV)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--free", type=int, default=16, help="the policy's own tokens per turn")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64, help="the policy's width (heads of 16)")
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()

    tok = build_tokenizer(Path(tempfile.mkdtemp()) / "tok", vocab_size=512)
    config = ModelConfig(
        model_type="qwen2", vocab_size=len(tok), hidden_size=a.hidden,
        intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 16, num_key_value_heads=max(1, a.hidden // 32),
        head_dim=16, max_position_embeddings=1024,
    )  # fmt: skip
    params = models.init_params(config, jax.random.PRNGKey(0))
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    script = [-1] * a.free + enc(CALL) + [-1] * a.free + enc("The answer is 5.<|im_end|>")
    script += [script[-1]] * 8
    added = np.zeros((config.vocab_size,), bool)
    added[list(tok.get_added_vocab().values())] = True
    engine = EngineCore(
        config, params, slots=a.slots, max_len=1024, max_prefill_length=512, tokenizer=tok,
        logits_hook=free_or_forced, hook_data=(jnp.asarray(script, jnp.int32), jnp.asarray(added)),
    )  # fmt: skip
    records = [
        {"id": str(i), "prompt": f"What is {i} + {i + 1}?", "ground_truth": str(2 * i + 1)}
        for i in range(a.records)
    ]

    def sampler(agent):
        settings = RolloutSection(
            protocol="qwen", group_size=a.group, temperature=0.0, max_prompt_len=512,
            max_response_len=400, max_tool_calls=3, chunk_size=16, slots=a.slots, agent=agent,
        )  # fmt: skip
        return Sampler(engine, tok, ToolExecutor([add]), settings, system_prompt="You add.")

    runs = {"built-in loop": sampler(None), "agent (OpenAI client)": sampler(AGENT)}
    seconds, trajs = {k: [] for k in runs}, {}
    for k, s in runs.items():
        trajs[k] = s(records, a.group, params)  # warm-up: compiles
    for _ in range(a.repeats):
        for k, s in runs.items():
            t0 = time.perf_counter()
            s(records, a.group, params)
            seconds[k].append(time.perf_counter() - t0)
    built, agent = trajs.values()
    same = all(
        x.prompt_ids == y.prompt_ids and x.response_ids == y.response_ids
        and x.loss_mask == y.loss_mask
        for x, y in zip(built, agent)
    )  # fmt: skip
    tokens = sum(len(t.response_ids) for t in built)
    print(f"{a.records} records x {a.group} samples on {a.slots} slots, {tokens} response tokens")
    for k, v in seconds.items():
        print(f"  {k:24s} best {min(v):.3f} s  (runs: {', '.join(f'{x:.3f}' for x in v)})")
    best = [min(v) for v in seconds.values()]
    requests = sum(t.num_turns for t in agent)  # a completion request per model turn
    extra_ms = 1e3 * (best[1] - best[0]) / requests
    print(
        f"agent / built-in: {best[1] / best[0]:.2f}x, {extra_ms:.2f} ms more per request "
        f"({requests} requests); trajectories equal token for token: {same}"
    )


if __name__ == "__main__":
    main()
