"""The host-side agent loop: continuous batching over the engine's slots, tools run async.

`run_rollouts` turns prompts into `Trajectory`s (G samples per prompt). Three parts:

- `scheduler.SlotScheduler` (host only) decides which sample decodes in which slot: queued
  samples are admitted into free slots, a sample waiting on its tool pauses, and when samples
  wait for a slot a paused one is parked (its cache row lifted out of the engine, kept in host
  memory) and comes back into whichever slot frees first once its observation has arrived,
  decoding on exactly as if it had stayed. `RolloutLimits.max_parked` bounds the rows aside.
- `resolver.Resolver` decides what an ended segment becomes (tool observation, environment
  step, budget notice, finish; see there for the rules and the finish reasons).
- the driver (`driver.Driver.run`) turns those decisions into engine calls, one pass at a
  time, over JetStream's Engine API (see there for the calls and for multi-controller runs).

The same driver serves requests that arrive while it runs (`Driver.add`, `open`): the OpenAI
gateway's sequences and the episodes of agents written as client code (`jaxrl_tools.gateway`),
with a resolver of their own for what an ended segment becomes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_tools.engine.sampling import SamplingParams
from jaxrl_tools.prompts import encode_prompt
from jaxrl_tools.rollout.driver import Driver
from jaxrl_tools.rollout.limits import RolloutLimits
from jaxrl_tools.rollout.resolver import BUDGET_NOTICE, Sample
from jaxrl_tools.tools import get_parser
from jaxrl_tools.types import Trajectory

# Driver and RolloutLimits live in their own modules; their import path here stays.
__all__ = ["BUDGET_NOTICE", "Driver", "RolloutLimits", "arun_rollouts", "run_rollouts"]


async def arun_rollouts(
    engine,
    params,
    prompts: Sequence[Any],
    *,
    tokenizer=None,
    num_samples: int = 1,
    protocol: str | Any | None = None,
    executor=None,
    env_factory: Callable[[int, int], Any] | None = None,
    env_format: Callable[[str], str] | None = None,
    limits: RolloutLimits | None = None,
    sampling: SamplingParams | None = None,
    rng: jax.Array | int = 0,
    stop_strings: Sequence[str] = (),
    eos_token_ids: Sequence[int] | None = None,
    tools_schema: list[dict] | None = None,
    stats: dict | None = None,
) -> list[Trajectory]:
    """Samples `num_samples` trajectories per prompt with tools, continuously batched (inside a
    running event loop; `run_rollouts` starts one).

    Args:
      engine: an `engine.protocol.Engine` (`EngineCore` or `engine.jetstream.DecodeEngine`);
        its slots and max_len bound the batch.
      params: model params (the engine's, or new ones from training).
      prompts: each a list of token ids, a text (tokenized as it is), or chat messages
        (`prompts.encode_prompt`: the tokenizer's chat template with `tools_schema`).
      tokenizer: HF tokenizer (needed for stop strings, protocols, messages).
      num_samples: G samples per prompt (each its own RNG key: fold_in(rng, prompt, sample)).
      protocol: a parser name ("qwen", "torl", "retool", "search_r1"), a parser object, or None.
      executor: a ToolExecutor (needed with a protocol).
      env_factory: f(prompt_index, sample_index) -> env with step(action_text) ->
        (obs_text, reward, done) or a `jaxrl_tools.envs.StepResult` (sync or async):
        RAGEN-style multi-turn environments.
      env_format: f(obs_text) -> text inserted after an env step (default: a user turn in the
        tokenizer's chat template).
      limits: RolloutLimits (max response tokens, C, max turns, observation cap, chunk size).
      sampling: SamplingParams for every sample (default temperature 1.0).
      rng: int seed or PRNG key.
      stop_strings: strings that end the response ("stop"), e.g. "</answer>".
      eos_token_ids: default the engine's.
      tools_schema: tool declarations for the chat template (default executor.schemas()).
      stats: optional dict filled with wall_s, generate_s, chunks, parks (times a trajectory
        gave up its slot while waiting), max_in_flight (most trajectories started and not done).

    Returns:
      Trajectories sorted by (prompt_index, sample_index).
    """
    limits = limits or RolloutLimits()
    parser = get_parser(protocol) if isinstance(protocol, str) else protocol
    if (parser is not None or stop_strings) and tokenizer is None:
        raise ValueError("a protocol or stop_strings needs a tokenizer (stops are found in text)")
    if parser is not None and executor is None:
        raise ValueError(f"protocol {getattr(parser, 'name', parser)!r} needs a ToolExecutor")
    if tools_schema is None and executor is not None and hasattr(executor, "schemas"):
        tools_schema = executor.schemas()
    # Where a trajectory's context ends: the KV cache, or a smaller per-episode budget.
    ctx_limit = min(engine.max_len, limits.max_context_tokens or engine.max_len)
    base_key = jax.random.PRNGKey(rng) if isinstance(rng, int) else rng
    samples = []
    for pi, prompt in enumerate(prompts):
        ids = _prompt_ids(prompt, tokenizer, tools_schema)
        if not ids or len(ids) >= ctx_limit:
            raise ValueError(f"prompt {pi} has {len(ids)} tokens; need 1..{ctx_limit - 1}")
        pkey = jax.random.fold_in(base_key, pi)
        for g in range(num_samples):
            key = np.asarray(jax.random.fold_in(pkey, g))
            env = env_factory(pi, g) if env_factory is not None else None
            samples.append(Sample(Trajectory(pi, g, list(ids)), key, len(samples), env))
    resolver = limits.resolver(
        tokenizer=tokenizer,
        parser=parser,
        executor=executor,
        env_format=env_format,
        ctx_limit=ctx_limit,
    )
    driver = Driver(
        engine,
        params,
        samples,
        resolver,
        limits,
        sampling=sampling or SamplingParams(),
        eos=set(engine.eos_token_ids if eos_token_ids is None else eos_token_ids),
        tool_stops=tuple(parser.stop_strings) if parser is not None else (),
        # a turn of several calls ends at the turn's end, like an answer (`Resolver`)
        final_stops=tuple(stop_strings) + tuple(getattr(parser, "turn_stops", ())),
    )
    t0 = time.perf_counter()
    done = await driver.run()
    if stats is not None:
        sched = driver.sched
        stats.update(
            wall_s=time.perf_counter() - t0,
            generate_s=driver.generate_s,
            chunks=sched.chunks,
            parks=sched.parks,
            max_in_flight=sched.max_in_flight,
        )
    done.sort(key=lambda t: (t.prompt_index, t.sample_index))
    return done


def _prompt_ids(prompt, tokenizer, tools_schema) -> list[int]:
    """A prompt's token ids: ids as given, a text tokenized as it is, chat messages through
    the one prompt renderer (`prompts.encode_prompt`)."""
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if prompt and isinstance(prompt[0], dict):
        if tokenizer is None:
            raise ValueError("chat-message prompts need a tokenizer (for its chat template)")
        return encode_prompt(tokenizer, {"prompt": list(prompt)}, tools_schema or None)
    return [int(x) for x in prompt]


def run_rollouts(engine, params, prompts: Sequence[Any], **kwargs) -> list[Trajectory]:
    """`arun_rollouts` in a fresh event loop (same arguments)."""
    return asyncio.run(arun_rollouts(engine, params, prompts, **kwargs))
