"""Agents written as plain client code, trained token-in-token-out (`rollout.agent`).

An agent is an async function `agent(client, record)`: `client` is the official
`openai.AsyncOpenAI`, in process (httpx's ASGI transport, no socket), on the gateway's routes
(`gateway.app`) over the policy being trained. The agent sends chat completions (tools
declared, tool calls returned as OpenAI `tool_calls`), runs its tools, loops and branches as it
likes, and returns its reward (a number, or a dict with "reward"), or None to be scored by the
recipe's reward like a built-in rollout. The record it gets carries "messages" (its prompt as
chat messages, with the recipe's system prompt) and "tool_schemas" (the recipe's tools).

Every completion is a segment of a sample of the one rollout driver (`rollout.driver.Driver`),
decoded with the recipe's sampling (a request's temperature and top_p do not change the
behaviour policy) and token limits per request (max_tokens) and per episode
(`rollout.max_response_len`). A request whose prompt ids extend the episode's context exactly
(the gateway's chat keeps sampled turns token-exact: `gateway.chat`) continues it: the tokens in
between are appended to the cached row (loss mask 0) and decoding goes on without a prefill.
A request that does not (the agent rewrote or cut its history) is refused (HTTP 400) or, up to
`rollout.agent_max_samples`, starts another sample of the same episode: every episode is then
trained as `Trajectory.turns`, each sample a row with the episode's advantage (counted in
`agent/rewrites`).

A run is bounded by `rollout.agent_timeout_s` (wall clock): past it, it is cancelled (its
awaits raise CancelledError) and its trajectory, what the policy sampled so far, ends with
finish reason AGENT_TIMEOUT; the trainer leaves its group out of the update (its ending is not
the policy's, and any score given it would bias the group's baseline) and counts it in
`agent/timeouts`. An agent that blocks the event loop (a synchronous sleep, a busy loop)
cannot be bounded so: make its waits awaits.

Group sampling runs the agent G times per record, concurrently. One process only: the agent is
arbitrary code, and the multi-controller driver would need every process to run it alike.
"""

from __future__ import annotations

import asyncio
import logging
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxrl_tools.agents.routes import CURRENT_GATEWAY, Gateway, Runs, http_base_url
from jaxrl_tools.config.checks import agent_function
from jaxrl_tools.engine.sampling import SamplingParams
from jaxrl_tools.gateway.backend import BadRequest, Completion, Generation, OnTokens
from jaxrl_tools.gateway.chat import TemplateChat
from jaxrl_tools.gateway.engine_backend import EngineBackend, RequestResolver, completion_of
from jaxrl_tools.rollout.loop import RolloutLimits
from jaxrl_tools.rollout.resolver import Append, Finish, Sample
from jaxrl_tools.types import AGENT_TIMEOUT, ToolCallRecord, Trajectory

# http_base_url lives in `routes`; agents import it from here (docs/guide/your-own-agent.md).
__all__ = ["AgentError", "arun_agent_rollouts", "http_base_url", "load_agent", "run_agent_rollouts"]

Agent = Callable[[Any, dict], Any]
log = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """An agent raised, or made no model call: the run stops and names the record."""


def load_agent(spec: str) -> Agent:
    """The async function `spec` names ("package.module:function")."""
    return agent_function(spec)


class _Episode:
    """One run of the agent: its samples (several when it rewrote its history)."""

    def __init__(self, prompt_index: int, sample_index: int, key):
        self.prompt_index, self.sample_index, self.key = prompt_index, sample_index, key
        self.parts: list[Sample] = []
        self.waiting: asyncio.Future | None = None  # the last part's next Outcome
        self.last_reason = ""
        self.rewrites = 0
        self.calls = 0
        self.ended = False  # the agent returned, raised or was cancelled
        self.timed_out = False

    def end(self) -> None:
        """No more requests: the last sample finishes with its last segment's reason."""
        self.ended = True
        self.settle(Finish(self.last_reason or "stop"))

    def settle(self, outcome) -> None:
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_result(outcome)
        self.waiting = None


class _EpisodeResolver(RequestResolver):
    """A request's segment ends: its completion goes back to the agent, and the sample waits
    for the agent's next request (`_EpisodeBackend.generate`) or its end."""

    def end_segment(self, s: Sample, reason: str, stop_end: int | None):
        ep: _Episode = s.episode
        done = completion_of(s, reason, stop_end, self.decode, s.stops or ())
        ep.last_reason = reason
        if not s.reply.done():  # (an agent cancelled meanwhile no longer waits)
            s.reply.set_result(done)
        if reason == "budget" or ep.ended:  # the context is full, or the run is over
            return Finish(reason)
        ep.waiting = asyncio.get_running_loop().create_future()
        return ep.waiting


class _EpisodeBackend:
    """The `Backend` one agent run sees: its requests continue its episode's sample or start
    another one, all on the shared engine backend."""

    def __init__(
        self,
        shared: EngineBackend,
        chat: TemplateChat,
        episode: _Episode,
        sampling,
        max_samples: int,
    ):
        self.shared, self.chat, self.episode, self.sampling = shared, chat, episode, sampling
        self.max_samples = max_samples
        self.tokenizer, self.model = shared.tokenizer, shared.model
        self.max_context = shared.max_context

    async def generate(self, gen: Generation, on_tokens: OnTokens | None = None) -> Completion:
        ep, driver = self.episode, self.shared.running()
        ep.calls += 1
        ids = list(gen.prompt_ids)
        last = ep.parts[-1] if ep.parts else None
        if last is not None and ep.waiting is not None:
            context = last.traj.token_ids
            if len(ids) > len(context) and ids[: len(context)] == context:
                markup = self.chat.markup(ids, len(context)) or ""
                self.shared.configure(last, gen, on_tokens, sampling=self.sampling)
                ep.settle(Append(ids[len(context) :], None, markup))
                driver.wake()
                return self._record(last, await last.reply, gen.opener)
            if len(ep.parts) >= self.max_samples:
                raise BadRequest(
                    f"this run's history was rewritten (the messages do not continue what the "
                    f"policy sampled) and it already has rollout.agent_max_samples="
                    f"{self.max_samples} samples; raise it, or send the history as returned",
                    "messages",
                )
            ep.rewrites += 1
            ep.settle(Finish(ep.last_reason))
            driver.wake()
        key = jax.random.fold_in(ep.key, len(ep.parts))
        traj = Trajectory(ep.prompt_index, ep.sample_index, ids)
        # sampled by the recipe's behaviour policy, whatever the request says
        s = self.shared.sample(gen, traj=traj, key=key, sampling=self.sampling)
        s.episode = ep
        s.on_tokens = on_tokens
        ep.parts.append(s)
        driver.add(s)
        return self._record(s, await s.reply, gen.opener)

    def _record(self, s: Sample, done: Completion, opener: str = "") -> Completion:
        """The calls the model wrote (in the recipe's format: the reply returns them as
        tool_calls where the request declared tools; after the `opener` a tool_choice forced),
        in the trajectory's tool statistics; whether the agent runs them is its business."""
        parser = self.chat.parser
        if parser is not None and done.token_ids:
            t = s.traj
            written = self.tokenizer.decode(done.token_ids, skip_special_tokens=False)
            parsed = parser.parse(opener + written)
            for call in parsed.calls if not parsed.error else ():
                t.tool_calls.append(
                    ToolCallRecord(call.name, call.arguments, True, None, 0.0, True, t.num_turns)
                )
                t.num_tool_calls += 1
        return done


def _reward(result: Any, where: str) -> float | None:
    if result is None:
        return None
    if isinstance(result, dict) and "reward" in result:
        result = result["reward"]
    if isinstance(result, numbers.Real) and not isinstance(result, bool):
        return float(result)
    raise AgentError(
        f"{where}: the agent returned {type(result).__name__}; return a number, a dict with "
        "'reward', or None (the recipe's reward scores the episode)"
    )


def _episode_trajectory(
    ep: _Episode, reward: float | None, as_turns: bool, prompt_ids: list[int]
) -> Trajectory:
    """The episode as one trajectory, or (`as_turns`: it may have several samples) as its
    samples' `turns`; a run cut before its first request: its prompt, no response."""
    if not ep.parts:
        t = Trajectory(ep.prompt_index, ep.sample_index, list(prompt_ids))
        t.finish_reason = AGENT_TIMEOUT
        return t
    parts = [s.traj for s in ep.parts]
    if not as_turns:
        t = parts[0]
    else:
        t = Trajectory(ep.prompt_index, ep.sample_index, list(parts[0].prompt_ids), turns=[])
        for p in parts:
            t.add_turn(p)
            t.tool_calls += p.tool_calls
        t.finish_reason = parts[-1].finish_reason
        t.response_text = "\n".join(p.response_text for p in parts)
        t.model_text = "\n".join(p.model_text for p in parts)
    t.agent_reward = reward
    if ep.timed_out:
        t.finish_reason = AGENT_TIMEOUT
    return t


def _prompt_ids(chat: TemplateChat, record: dict) -> list[int]:
    return chat.prompt_ids(record["messages"], record.get("tool_schemas") or None)


async def arun_agent_rollouts(
    engine,
    params,
    records: Sequence[dict],
    agent: Agent,
    *,
    tokenizer,
    parser=None,
    num_samples: int = 1,
    limits: RolloutLimits | None = None,
    sampling: SamplingParams | None = None,
    rng: jax.Array | int = 0,
    max_samples: int = 1,
    timeout_s: float | None = None,
    stats: dict | None = None,
) -> list[Trajectory]:
    """Runs `agent` `num_samples` times per record (concurrently) on the policy `params`.

    Args:
      engine, params: the decode engine and the weights it serves.
      records: each handed to the agent (with "messages" and "tool_schemas": see the module
        docstring).
      agent: an async function(client, record).
      tokenizer: the HF tokenizer (chat template).
      parser: the tool-call parser of the gateway's replies (`tools.get_parser("qwen")`).
      num_samples: G runs per record.
      limits: `max_response_tokens` bounds each episode's sampled and inserted tokens,
        `chunk_size` the decode calls.
      sampling: the behaviour policy's sampling (every request's).
      rng: int seed or PRNG key; run g of record i samples with fold_in(fold_in(rng, i), g).
      max_samples: samples one run may make (a rewritten history starts another; past this
        many the request is refused). Above 1, every run's trajectory holds its samples as
        `turns` (trained a row each).
      timeout_s: wall-clock bound of each run (None: none); past it the run is cancelled and
        its trajectory's finish reason is AGENT_TIMEOUT.
      stats: filled with rewrites, calls, samples, runs and timeouts.

    Returns:
      One trajectory per run, sorted by (record, run); `agent_reward` set where the agent
      returned a reward.
    """
    limits = limits or RolloutLimits()
    sampling = sampling or SamplingParams()
    base = jax.random.PRNGKey(rng) if isinstance(rng, int) else rng
    eos = list(engine.eos_token_ids)
    chat = TemplateChat(tokenizer, parser, eos_ids=eos)
    resolver = _EpisodeResolver(tokenizer, engine.max_len, limits.max_response_tokens)
    shared = EngineBackend(engine, params, tokenizer, limits=limits, resolver=resolver)
    driver = shared.running()
    episodes = []
    runs = Runs(shared)
    gateway = Gateway(runs, chat)
    CURRENT_GATEWAY.set(gateway)

    async def run(pi: int, g: int, record: dict) -> Any:
        ep = _Episode(pi, g, jax.random.fold_in(jax.random.fold_in(base, pi), g))
        episodes.append(ep)
        name = f"{pi}-{g}"
        runs.runs[name] = _EpisodeBackend(shared, chat, ep, sampling, max_samples)
        client = gateway.client_for(name)
        where = f"record {record.get('id', pi)}, run {g}"
        try:
            result = await asyncio.wait_for(agent(client, dict(record)), timeout_s)
        except TimeoutError:
            log.warning("rollout.agent ran past rollout.agent_timeout_s=%s on %s", timeout_s, where)
            ep.timed_out = True
            return None
        except Exception as e:
            raise AgentError(f"rollout.agent raised on {where}: {type(e).__name__}: {e}") from e
        finally:
            ep.end()
            driver.wake()
        if not ep.parts:
            raise AgentError(f"{where}: the agent made no model call; nothing to train")
        return _reward(result, where)

    jobs = [
        asyncio.ensure_future(run(pi, g, rec))
        for pi, rec in enumerate(records)
        for g in range(num_samples)
    ]
    try:
        rewards = await asyncio.gather(*jobs)
    except BaseException:  # one run failed: the others stop too
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        raise
    finally:
        for ep in episodes:
            ep.end()
        await shared.aclose()
        await gateway.aclose()
    episodes.sort(key=lambda e: (e.prompt_index, e.sample_index))
    by_key = {}
    for (pi, g), r in zip(
        ((pi, g) for pi in range(len(records)) for g in range(num_samples)), rewards
    ):
        by_key[pi, g] = r
    out = [
        _episode_trajectory(
            ep,
            by_key[ep.prompt_index, ep.sample_index],
            max_samples > 1,
            [] if ep.parts else _prompt_ids(chat, records[ep.prompt_index]),
        )
        for ep in episodes
    ]
    if stats is not None:
        stats.update(
            rewrites=sum(e.rewrites for e in episodes),
            calls=sum(e.calls for e in episodes),
            samples=sum(len(e.parts) for e in episodes),
            runs=len(episodes),
            timeouts=sum(e.timed_out for e in episodes),
        )
    return out


def run_agent_rollouts(engine, params, records, agent, **kwargs) -> list[Trajectory]:
    """`arun_agent_rollouts` in a fresh event loop (same arguments)."""
    return asyncio.run(arun_agent_rollouts(engine, params, records, agent, **kwargs))
