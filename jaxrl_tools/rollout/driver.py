"""The rollout driver: one rollout's passes over the engine's slots (`Driver.run`).

Each pass applies the observations that arrived, parks / unparks / admits samples
(`scheduler.SlotScheduler`), decodes one chunk of `chunk_size` steps for every active slot
(off the event loop, so tool tasks keep running), then scans each slot's new tokens
(`stops.scan_chunk`: EOS ids and stop strings, which may end inside a token; generation is never
re-tokenised) and hands ended segments to the resolver (`resolver.Resolver`), whose tool calls
and environment steps run as asyncio tasks. `loop.arun_rollouts` builds a driver for prompts;
the gateway keeps one open for its requests (`Driver.add`, `open`).

The driver speaks JetStream's Engine API, so the RL loop decodes on any engine with these
calls (`engine.protocol.Engine`: `EngineCore`, or `engine.jetstream.DecodeEngine`, the same
engine as a `jetstream.engine.engine_api.Engine`; `rollout.engine` picks one):

- `prefill` + `insert` (Engine API): a prompt's cache, computed once and inserted as each of its
  G samples with the sample's own key (`insert(..., rng=key, seq_id=index)`);
- `generate_steps` (the Engine API's `generate` with a step count, a mask of the slots that
  advance, and the log-probs JetStream's `ResultTokens` has no room for);
- `write_slots`: the cache append of observations into live slots (one bucketed call, no
  recompute of the prefix), which the Engine API lacks;
- `park` / `unpark`: a row out of the decode state and back (unpark is an insert of the parked
  row with its counters), which the Engine API lacks.

Multi-controller (one process per host): every process runs this loop over all samples and makes
the same device calls. A process runs the tool calls and environment steps of the samples it
first admitted into its own block of slots; at the top of each pass the processes agree on which
of those have finished and share their results (`_share_results`), so every host applies the
same observations in the same pass and sees the same trajectories.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import jax
import numpy as np

from jaxrl_tools.engine.sampling import SamplingParams
from jaxrl_tools.rollout import ahead
from jaxrl_tools.rollout.limits import RolloutLimits
from jaxrl_tools.rollout.resolver import Append, Finish, Resolver, Sample
from jaxrl_tools.rollout.scheduler import SlotScheduler
from jaxrl_tools.rollout.stops import scan_chunk
from jaxrl_tools.sharding.distributed import agree, to_host
from jaxrl_tools.types import Trajectory


class Driver:
    """One rollout's passes over the engine (see the module docstring).

    Samples may be added while it runs (`add`); with `open` set it keeps running while it has
    nothing to do, until `close()`. A sample's own settings (`Sample.sampling`, `stops`,
    `max_new`) override the driver's for it.
    """

    def __init__(
        self,
        engine,
        params,
        samples: list[Sample],
        resolver: Resolver,
        limits: RolloutLimits,
        *,
        sampling: SamplingParams,
        eos: set[int],
        tool_stops: tuple[str, ...],
        final_stops: tuple[str, ...],
    ):
        self.engine, self.params = engine, params
        # the samples not finished yet, by index (a finished one is released: an open driver
        # serves requests for as long as it runs)
        self.samples: dict[int, Sample] = {s.index: s for s in samples}
        self.next_index = len(samples)
        self.resolver, self.limits, self.sampling = resolver, limits, sampling
        self.eos, self.tool_stops, self.final_stops = eos, tool_stops, final_stops
        self.sched = SlotScheduler(len(samples), engine.slots, limits.max_parked)
        self.open = False  # keep running when idle: samples will be added (`add`, `close`)
        self._wake = asyncio.Event()
        # sample -> its tool / environment task; None where another process runs it
        self.tasks: dict[int, asyncio.Task | None] = {}
        self.arrived: dict[int, Append] = {}  # observations waiting for a parked sample's slot
        # prefix key (a prompt's index; a request's prompt) -> its prefilled cache, kept while
        # samples of it wait to be inserted (`group`: how many)
        self.prefixes: dict[Any, Any] = {}
        self.group = collections.Counter(s.prefix_key for s in samples)
        self.done: list[Trajectory] = []
        self.shared = jax.process_count() > 1
        self.generate_s = 0.0
        self.state = engine.init_decode_state()
        # Rollouts ahead of the update (`ahead.RolloutsAhead`): between passes the update's
        # device work runs and newer weights may come in; tokens record their weights' version.
        self.ahead = ahead.CURRENT.get()
        self.version = None if self.ahead is None else self.ahead.version

    def add(self, sample: Sample) -> None:
        """Queues a sample while the driver runs; its `index` must be `next_index`."""
        assert sample.index == self.next_index, (sample.index, self.next_index)
        self.next_index += 1
        self.samples[sample.index] = sample
        self.group[sample.prefix_key] += 1
        self.sched.queue.append(sample.index)
        self._wake.set()

    def close(self) -> None:
        """No more samples: `run` returns once those it has are done."""
        self.open = False
        self._wake.set()

    def wake(self) -> None:
        """Something the driver waits on changed (a result arrived outside its tasks)."""
        self._wake.set()

    async def run(self) -> list[Trajectory]:
        while self.sched.busy or self.open:
            if self.ahead is not None:
                self.ahead.at_pass()
                self.params, self.version = self.ahead.params, self.ahead.version
            appends = await self._take_results()
            self._schedule(appends)
            active = self.sched.active()
            if not active.any():
                await self._wait_for_tasks()
                continue
            toks_BN, lps_BN = await self._decode(active)
            for slot in np.nonzero(active)[0].tolist():
                await self._scan(self.sched.running[slot], toks_BN[slot].tolist(), lps_BN[slot])
        return self.done

    # ------------------------------------------------------------------ 1) results
    async def _take_results(self) -> list[int]:
        """Applies the tool / environment results that arrived: finishes, or observations to
        append. Returns the samples in slots whose observation is appended this pass."""
        ready = [(i, t.result()) for i, t in list(self.tasks.items()) if t and t.done()]
        if self.shared:
            ready = _share_results(ready, self.samples)
        appends, finishing = [], []
        for i, outcome in ready:
            del self.tasks[i]
            outcome = self.resolver.bounded(self.samples[i], outcome)
            if isinstance(outcome, Finish):
                finishing.append((i, outcome.reason))
                continue
            self.arrived[i] = outcome
            if self.sched.resolve(i):
                appends.append(i)
        for i, reason in finishing:
            await self._finish(i, reason)
        return appends

    # ------------------------------------------------------------------ 2) slots
    def _schedule(self, appends: list[int]) -> None:
        """Parks, unparks and admits (the scheduler's choices) and appends the observations
        of the samples in slots."""
        for i, slot in self.sched.to_park():
            row = self.engine.park(self.state, slot, self.samples[i].length)
            self.sched.park(i, row)
        for i, slot, row in self.sched.unpark():
            self.state = self.engine.unpark(self.state, slot, row)
            appends.append(i)
        if appends:
            samples = [self.samples[i] for i in appends]
            # Nothing to insert (a call ignored): the last kept token is written again, which
            # rolls back what the chunk sampled past the stop and gives the row its logits.
            empty = [not self.arrived[i].tokens for i in appends]
            self.state = self.engine.write_slots(
                self.params,
                self.state,
                [self.sched.slot(i) for i in appends],
                [
                    s.traj.token_ids[-1:] if e else self.arrived[i].tokens
                    for i, s, e in zip(appends, samples, empty)
                ],
                starts=[s.length - e for s, e in zip(samples, empty)],
                sampled=[s.sampled for s in samples],
            )
            for i, s in zip(appends, samples):
                s.add_observation(self.arrived.pop(i))
        for i, slot in self.sched.admit():
            self._insert(self.samples[i], slot)

    def _insert(self, s: Sample, slot: int) -> None:
        """Engine API: the prompt's prefix (prefilled once for its G samples), inserted into
        `slot` with the sample's key and id."""
        if self.shared:
            n_proc, me = jax.process_count(), jax.process_index()
            s.owned = slot * n_proc // self.engine.slots == me
        pi = s.prefix_key
        if pi not in self.prefixes:
            self.prefixes[pi] = self._prefill(s.traj.prompt_ids, s)
        self.state = self.engine.insert(
            self.prefixes[pi], self.state, slot, rng=s.key, seq_id=s.index
        )
        self.group[pi] -= 1
        if self.group[pi] == 0:  # the last queued sample of this prefix is in
            del self.prefixes[pi], self.group[pi]

    def _prefill(self, ids: list[int], s: Sample):
        """Engine API prefill, in pieces of `max_prefill_length` for a longer prompt (each
        continues the cache of the ones before)."""
        prefix, step = None, self.engine.max_prefill_length
        for start in range(0, len(ids), step):
            part = np.asarray(ids[start : start + step], np.int32)
            prefix = self.engine.prefill(
                params=self.params,
                existing_prefix=prefix,
                padded_tokens=part,
                true_length=len(part),
                sampling=s.sampling or self.sampling,
                rng=s.key,
            )
        return prefix

    async def _wait_for_tasks(self) -> None:
        """No slot decodes: wait for a task of this process, or (open) for a new sample (with
        several processes, a short wait, then the next pass agrees on what the others
        finished)."""
        waits = [t for t in self.tasks.values() if t is not None]
        wake = None
        if self.open:
            self._wake.clear()
            wake = asyncio.ensure_future(self._wake.wait())
            waits.append(wake)
        if waits:
            # Short waits where the next pass has work of its own: agreeing with the other
            # processes, or the update waiting for its turn while the tools run.
            timeout = 0.05 if self.shared or self.ahead is not None else None
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED, timeout=timeout)
        if wake is not None:
            wake.cancel()

    # ------------------------------------------------------------------ 3) decode
    async def _decode(self, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One chunk for the active slots, off the event loop so tool tasks keep running."""
        t0 = time.perf_counter()

        def chunk(state):
            state, out = self.engine.generate_steps(
                self.params, state, self.limits.chunk_size, active=active
            )
            return state, to_host(out.tokens), to_host(out.logprobs)

        loop = asyncio.get_running_loop()
        self.state, toks_BN, lps_BN = await loop.run_in_executor(None, chunk, self.state)
        self.generate_s += time.perf_counter() - t0
        self.sched.decoded()
        return toks_BN, lps_BN

    # ------------------------------------------------------------------ 4) scan
    async def _scan(self, i: int, toks: list[int], lps: np.ndarray) -> None:
        """Keeps the sample's new tokens up to its stop; an ended segment finishes it or
        starts its tool / environment task."""
        s = self.samples[i]
        room = self.limits.max_response_tokens - len(s.traj.response_ids)
        turn_cap = s.max_new if s.max_new is not None else self.limits.max_turn_tokens
        turn_room = room if turn_cap is None else turn_cap - len(s.seg_tokens)
        keep, reason, stop_end = scan_chunk(
            toks,
            segment=s.seg_tokens,
            decode=self.resolver.decode if self.resolver.tokenizer is not None else None,
            eos_ids=self.eos,
            tool_stops=self.tool_stops,
            final_stops=self.final_stops if s.stops is None else s.stops,
            room=min(room, turn_room),
            context=self.resolver.ctx_limit - s.length,
        )
        if reason == "length" and turn_room < room and s.max_new is None:
            reason = "turn_length"  # the turn's cap, not the response's
        if reason is None and s.reply is not None and s.reply.cancelled():
            reason = "cancelled"  # its caller is gone (a client hung up): free the slot
        s.add_model(toks[:keep], lps[:keep], self.version)
        if s.on_tokens is not None and keep:
            s.on_tokens(toks[:keep], [float(x) for x in lps[:keep]])
        if reason is None:
            return
        out = self.resolver.end_segment(s, reason, stop_end)
        if isinstance(out, Finish):
            await self._finish(i, out.reason)
            return
        self.sched.pause(i)
        if s.owned:
            self.tasks[i] = asyncio.ensure_future(out)
        else:  # another process runs it; its result comes through _share_results
            out.close()
            self.tasks[i] = None

    async def _finish(self, i: int, reason: str) -> None:
        s = self.samples.pop(i)
        await self.resolver.finish(s, reason)
        self.sched.finish(i)
        if not self.open:  # an open driver's callers have their samples' results
            self.done.append(s.traj)


def _share_results(ready: list, samples: dict[int, Sample]) -> list:
    """Every process's finished tool / environment results, in sample order, on every process.

    Each entry carries what the task recorded in its trajectory (`_TASK_FIELDS`), copied into
    the other processes' copies of that trajectory.
    """
    mine = [(i, res, [getattr(samples[i].traj, f) for f in _TASK_FIELDS]) for i, res in ready]
    out = []
    for i, res, values in sorted((e for part in agree(mine) for e in part), key=lambda e: e[0]):
        for field, value in zip(_TASK_FIELDS, values):
            setattr(samples[i].traj, field, value)
        out.append((i, res))
    return out


# What the resolver's tasks write into a trajectory besides the observation tokens.
_TASK_FIELDS = (
    "tool_calls",
    "num_tool_calls",
    "env_rewards",
    "env_states",
    "env_success",
    "env_metrics",
)
