"""The gateway's memory over many requests: the process's RSS after every 1,000 short chat
requests through the app (official `openai` client, in process) on the real engine.

Nothing of a request should outlive it (its sample, trajectory and prefix bookkeeping are
released when it finishes; the chat keeps at most `remember` contexts), so RSS should level off
once the compiled shapes and the chat's context cache are warm.

    python benchmarks/bench_gateway_memory.py [--requests 10000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import tempfile
from pathlib import Path

import httpx
import jax
import openai

from jaxrl_tools import models
from jaxrl_tools.engine.core import EngineCore
from jaxrl_tools.gateway.app import make_app
from jaxrl_tools.gateway.chat import TemplateChat
from jaxrl_tools.gateway.engine_backend import EngineBackend
from jaxrl_tools.models.config import ModelConfig
from jaxrl_tools.rollout import RolloutLimits
from jaxrl_tools.tasks.tokenizer import build_tokenizer


def rss_mib() -> float:
    """The process's resident memory now (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def main(args) -> None:
    tok = build_tokenizer(Path(tempfile.mkdtemp()) / "tok", vocab_size=512)
    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    engine = EngineCore(cfg, params, slots=16, max_len=256, max_prefill_length=128, tokenizer=tok)
    limits = RolloutLimits(max_response_tokens=64, chunk_size=4)
    backend = EngineBackend(engine, params, tok, limits=limits)
    app = make_app(backend, TemplateChat(tok, eos_ids=engine.eos_token_ids))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    client = openai.AsyncOpenAI(
        base_url="http://gw/v1", api_key="x", http_client=http, max_retries=0
    )
    gate = asyncio.Semaphore(args.concurrency)

    async def one(k: int) -> None:
        async with gate:
            messages = [{"role": "user", "content": f"Question {k}: what is {k} + {k}?"}]
            await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=4, seed=k
            )

    print(f"{'requests':>9} {'RSS MiB':>8}", flush=True)
    for done in range(0, args.requests, 1000):
        await asyncio.gather(*(one(k) for k in range(done, done + 1000)))
        print(f"{done + 1000:>9} {rss_mib():>8.1f}", flush=True)
    await backend.aclose()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=16)
    asyncio.run(main(p.parse_args()))
