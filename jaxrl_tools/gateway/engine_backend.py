"""The gateway's `Backend` on the rollout engine: every request a sample of one open `Driver`.

Requests decode together on the engine's slots, continuously batched, by the same driver the
RL rollout runs (`rollout.driver.Driver`): a request is queued as a sample with its own sampling
settings, stop strings, token limit and streaming callback, and when its segment ends the
`RequestResolver` hands the `Completion` back to its caller. An engine error fails every
request waiting on it (nothing hangs).
"""

from __future__ import annotations

import asyncio

import jax
import numpy as np

from jaxrl_tools.engine.sampling import SamplingParams
from jaxrl_tools.gateway.backend import Completion, Generation, OnTokens
from jaxrl_tools.rollout.driver import Driver
from jaxrl_tools.rollout.limits import RolloutLimits
from jaxrl_tools.rollout.resolver import Finish, Outcome, Sample, model_text
from jaxrl_tools.types import Trajectory


def completion_of(s: Sample, reason: str, stop_end: int | None, decode, stops) -> Completion:
    """The sample's ended segment as a Completion: text cut before the stop that ended it."""
    t = s.traj
    ids = list(t.response_ids[s.seg_start :])
    eos = reason == "eos"
    text = decode(ids[:-1] if eos else ids)
    if stop_end is not None:
        text = text[:stop_end]
        for stop in stops:
            if text.endswith(stop):
                text = text[: -len(stop)]
                break
    return Completion(
        prompt_ids=t.prompt_ids + t.response_ids[: s.seg_start],
        token_ids=ids,
        logprobs=list(t.logprobs[s.seg_start :]),
        text=text,
        finish_reason="length" if reason in ("length", "budget") else "stop",
        ended_with_eos=eos,
    )


class RequestResolver:
    """What an ended segment of a request becomes: its Completion, handed to the waiting
    caller (`Sample.reply`), and the end of the sample. Subclasses may keep a sample going
    instead (`agents.rollouts`: an agent's next request that continues it)."""

    def __init__(self, tokenizer, ctx_limit: int, max_response_tokens: int | None = None):
        self.tokenizer, self.ctx_limit = tokenizer, ctx_limit
        self.max_response_tokens = max_response_tokens

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def end_segment(self, s: Sample, reason: str, stop_end: int | None):
        done = completion_of(s, reason, stop_end, self.decode, s.stops or ())
        if not s.reply.done():
            s.reply.set_result(done)
        return Finish(reason)

    def bounded(self, s: Sample, outcome: Outcome) -> Outcome:
        if isinstance(outcome, Finish):
            return outcome
        n = len(outcome.tokens)
        if self.max_response_tokens and len(s.traj.response_ids) + n >= self.max_response_tokens:
            return Finish("length")
        if s.length + n >= self.ctx_limit:
            return Finish("budget")
        return outcome

    async def finish(self, s: Sample, reason: str) -> None:
        if s.reply is not None and not s.reply.done():  # its next request's context is full
            t = s.traj
            s.reply.set_result(Completion(t.token_ids, [], [], "", "length"))
        s.traj.finish_reason = reason
        s.traj.response_text = self.decode(s.traj.response_ids)
        s.traj.model_text = model_text(s.traj, s.markups, self.decode)


class EngineBackend:
    """A `Backend` over an engine and the weights it serves.

    Args:
      engine: an `engine.protocol.Engine` (`EngineCore`, or JetStream's).
      params: the weights to serve.
      tokenizer: HF tokenizer (stop strings, text).
      model: the name `GET /v1/models` lists.
      limits: `chunk_size` (decode steps per engine call), `max_response_tokens` (sampled and
        inserted tokens of one sample; default: the engine's context), `max_parked`.
      seed: the base key's seed. A request with a `seed` samples with a key of that seed alone
        (the same reply whenever it comes); one without, with a key of its arrival number.
      resolver: what ended segments become (default `RequestResolver`).
    """

    def __init__(
        self,
        engine,
        params,
        tokenizer,
        *,
        model: str = "policy",
        limits: RolloutLimits | None = None,
        seed: int = 0,
        resolver: RequestResolver | None = None,
    ):
        self.engine, self.params, self.tokenizer, self.model = engine, params, tokenizer, model
        self.max_context = int(engine.max_len)
        self.limits = limits or RolloutLimits(max_response_tokens=self.max_context, chunk_size=16)
        self.base_key = jax.random.PRNGKey(seed)
        self.resolver = resolver or RequestResolver(tokenizer, self.max_context)
        self.driver: Driver | None = None
        self._task: asyncio.Task | None = None

    def running(self) -> Driver:
        """The driver requests join (started on first use, in the running event loop)."""
        if self.driver is None:
            self.driver = Driver(
                self.engine,
                self.params,
                [],
                self.resolver,
                self.limits,
                sampling=SamplingParams(),
                eos=set(self.engine.eos_token_ids),
                tool_stops=(),
                final_stops=(),
            )
            self.driver.open = True
            self._task = asyncio.ensure_future(self.driver.run())
            self._task.add_done_callback(self._stopped)
        return self.driver

    def _stopped(self, task: asyncio.Task) -> None:
        """The driver ended: fail whatever still waits (an engine error reaches every caller)."""
        error = None if task.cancelled() else task.exception()
        for s in self.driver.samples.values() if self.driver is not None else ():
            if s.reply is not None and not s.reply.done():
                s.reply.set_exception(error or RuntimeError("the gateway's engine stopped"))
        self.driver, self._task = None, None

    def sample(
        self, gen: Generation, traj: Trajectory | None = None, key=None, sampling=None
    ) -> Sample:
        """A new sample of the running driver for `gen` (queued by the caller: `driver.add`),
        sampled as `gen` says or with `sampling`."""
        d = self.running()
        index = d.next_index
        if key is None:  # a request's own seed, else its number: two streams that never meet
            stream, n = (0, index) if gen.seed is None else (1, gen.seed)
            key = jax.random.fold_in(jax.random.fold_in(self.base_key, stream), n)
        traj = traj or Trajectory(-1, index, list(gen.prompt_ids))
        s = Sample(traj, np.asarray(key), index)
        self.configure(s, gen, sampling=sampling)
        # Requests with the same prompt and sampling queued together share one prefill (the G
        # runs of an agent send the same first request), each sampling with its own key.
        s.prefix_key = ("request", s.sampling, tuple(traj.prompt_ids))
        return s

    def configure(
        self, s: Sample, gen: Generation, on_tokens: OnTokens | None = None, sampling=None
    ) -> None:
        """The sample's settings for its next segment (a request's)."""
        s.sampling = sampling or SamplingParams(temperature=gen.temperature, top_p=gen.top_p)
        s.stops = tuple(gen.stop)
        s.max_new = gen.max_tokens
        s.on_tokens = on_tokens
        s.reply = asyncio.get_running_loop().create_future()

    async def generate(self, gen: Generation, on_tokens: OnTokens | None = None) -> Completion:
        s = self.sample(gen)
        s.on_tokens = on_tokens
        self.driver.add(s)
        return await s.reply

    async def aclose(self) -> None:
        """Lets the queued requests finish, then stops the driver."""
        if self.driver is not None:
            self.driver.close()
            await asyncio.shield(self._task)
