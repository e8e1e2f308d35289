"""The host-side agent loop: continuous batching over the engine's slots, tools run async.

`run_rollouts` turns prompts into `Trajectory`s (G samples per prompt). The device only runs
fixed-shape jitted work (a chunk of `chunk_size` decode steps for all slots, bucketed writes);
the host scans each slot's new tokens, dispatches tool calls / environment steps as asyncio
tasks, and appends their observation tokens to that slot's KV cache when they arrive. A slot
waiting for a tool is paused (it does not advance); the other slots keep decoding, and a
finished trajectory frees its slot for the next queued sample.

More trajectories than slots can be in flight: when samples wait for a slot (queued, or back
from a tool), a paused trajectory is parked: its cache row and sampling state are lifted out of
the engine (`EngineCore.park`), its slot decodes another sample, and once its observation has
arrived it comes back into whichever slot frees first (`unpark`) and decodes on exactly as if it
had stayed. `RolloutLimits.max_parked` bounds the rows kept aside (in host memory).

Stop rule (token-in-token-out): generation is never re-tokenised; where a chunk ends is decided
by `stops.scan_chunk` (EOS ids and stop strings, which may end inside a token).

Segment end handling:
- tool stop string (the parser's `stop_strings`): parse -> execute the calls (at most C in the
  whole trajectory; later calls get the notice "tool budget exhausted, answer directly"), a parse
  error becomes an error observation; the observation is appended as the parser's inline format
  (ToRL, ReTool, Search-R1) or, for chat protocols, as tool turns in the tokenizer's template.
- EOS / a final stop string: with a parser, a segment that parses into calls without error (Qwen
  multi-call turns ending in <|im_end|>) is a tool turn; otherwise the trajectory ends
  ("eos" / "stop"). With an environment (RAGEN style), the turn text (without its end token)
  goes to `env.step` and the returned observation is appended as a user turn until `done`
  ("done") or `max_turns`.

Finish reasons: "eos", "stop", "length" (max_response_tokens reached; observations count),
"budget" (the slot's KV cache / context `max_len` is full), "turns" (max_turns model segments
reached with a tool call or env turn still pending), "done" (environment finished).

Observation text: what the tool returned (tools shape their own errors), cut to head + "..." +
tail beyond `max_obs_tokens` tokens. Observation tokens have loss_mask 0 and log-prob 0.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_tools.prompts import chat_continuation, encode_observation, render_prompt
from jaxrl_tools.rollout.sampling import SamplingParams
from jaxrl_tools.rollout.stops import scan_chunk
from jaxrl_tools.sharding.distributed import agree, to_host
from jaxrl_tools.tools import Observation, get_parser
from jaxrl_tools.types import Span, ToolCallRecord, Trajectory

BUDGET_NOTICE = "tool budget exhausted, answer directly"


@dataclasses.dataclass(frozen=True)
class RolloutLimits:
    """Per-trajectory limits.

    Attributes:
      max_response_tokens: response tokens (model + observation) before finishing with "length".
      max_tool_calls: C, tool calls executed per trajectory; later calls get BUDGET_NOTICE.
      max_turns: model segments per trajectory.
      max_obs_tokens: cap per tool output (head + "..." + tail beyond it).
      chunk_size: decode steps per jitted generate call.
      max_context_tokens: prompt + response tokens of one trajectory (None: the engine's
        max_len); a segment or observation that would pass it ends the trajectory ("budget").
      max_parked: trajectories waiting on a tool that may give up their slot to a waiting
        sample (each keeps its cache row, up to its live length, in host memory meanwhile);
        None: as many as the engine has slots; 0: a trajectory keeps its slot while it waits.
    """

    max_response_tokens: int = 512
    max_tool_calls: int = 3
    max_turns: int = 8
    max_obs_tokens: int = 256
    chunk_size: int = 16
    max_context_tokens: int | None = None
    max_parked: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and f.name in ("max_context_tokens", "max_parked"):
                continue
            least = 0 if f.name in ("max_tool_calls", "max_parked") else 1
            if not isinstance(v, int) or v < least:
                raise ValueError(f"RolloutLimits.{f.name} must be an int >= {least}, got {v!r}")


class _Sample:
    """Host state of one trajectory while it runs."""

    def __init__(self, traj: Trajectory, key, index: int):
        self.traj = traj
        self.key = key
        self.index = index  # position among all samples: the engine's sequence id
        self.slot = -1  # -1: queued or parked
        self.owned = True  # this process runs its tools and environment (multi-controller)
        self.paused_at = 0  # chunks decoded when its current tool / environment task began
        self.seg_start = 0  # response index where the current model segment began
        self.turns = 0
        self.session_id = f"{traj.prompt_index}-{traj.sample_index}-{uuid.uuid4().hex[:8]}"
        self.env = None
        self.markups: list[str] = []  # each observation's markup, its texts left out

    @property
    def length(self) -> int:
        return len(self.traj.prompt_ids) + len(self.traj.response_ids)

    @property
    def seg_tokens(self) -> list[int]:
        return self.traj.response_ids[self.seg_start :]

    @property
    def sampled(self) -> int:
        return sum(self.traj.loss_mask)

    def add_model(self, toks, lps):
        t = self.traj
        if not toks:
            return
        if t.spans and t.spans[-1].kind == "model" and t.spans[-1].end == len(t.response_ids):
            t.spans[-1].end += len(toks)
        else:
            t.spans.append(Span("model", len(t.response_ids), len(t.response_ids) + len(toks)))
        t.response_ids.extend(int(x) for x in toks)
        t.loss_mask.extend([1] * len(toks))
        t.logprobs.extend(float(x) for x in lps)

    def add_observation(self, toks, reward, markup: str):
        t = self.traj
        self.markups.append(markup)
        t.spans.append(
            Span("observation", len(t.response_ids), len(t.response_ids) + len(toks), reward)
        )
        t.response_ids.extend(int(x) for x in toks)
        t.loss_mask.extend([0] * len(toks))
        t.logprobs.extend([0.0] * len(toks))
        self.seg_start = len(t.response_ids)


def _render_prompt(prompt, tokenizer, tools_schema) -> list[int]:
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if prompt and isinstance(prompt[0], dict):
        if tokenizer is None:
            raise ValueError("chat-message prompts need a tokenizer (for its chat template)")
        text = render_prompt(tokenizer, {"prompt": list(prompt)}, tools_schema or None)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return [int(x) for x in prompt]


def _fit_observation(text: str, tokenizer, max_tokens: int) -> str:
    """The observation cut to `max_tokens` tokens: head + "..." + tail (the rollout's budget;
    how a tool reports errors, e.g. a traceback's last line, is the tool's business)."""
    if tokenizer is None:
        return text
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    head = max(1, (max_tokens - 1) // 2)
    tail = max(1, max_tokens - 1 - head)
    return (
        tokenizer.decode(ids[:head], skip_special_tokens=False)
        + "..."
        + tokenizer.decode(ids[-tail:], skip_special_tokens=False)
    )


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
      engine: an EngineCore / DecodeEngine (its slots and max_len bound the batch).
      params: model params (the engine's, or new ones from training).
      prompts: each a list of token ids, a string, or chat messages (rendered with the
        tokenizer's chat template and `tools_schema`).
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
    sampling = sampling or SamplingParams()
    parser = None
    if protocol is not None:
        if isinstance(protocol, str):
            parser = get_parser(protocol)
        else:
            parser = protocol
    if (parser is not None or stop_strings) and tokenizer is None:
        raise ValueError("a protocol or stop_strings needs a tokenizer (stops are found in text)")
    if parser is not None and executor is None:
        raise ValueError(f"protocol {getattr(parser, 'name', parser)!r} needs a ToolExecutor")
    tool_stops = tuple(parser.stop_strings) if parser is not None else ()
    final_stops = tuple(stop_strings)
    eos = set(engine.eos_token_ids if eos_token_ids is None else eos_token_ids)
    if tools_schema is None and executor is not None and hasattr(executor, "schemas"):
        tools_schema = executor.schemas()
    base_key = jax.random.PRNGKey(rng) if isinstance(rng, int) else rng

    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer else None

    # Where a trajectory's context ends: the KV cache, or a smaller per-episode budget.
    ctx_limit = min(engine.max_len, limits.max_context_tokens or engine.max_len)
    queue: collections.deque[_Sample] = collections.deque()
    done: list[Trajectory] = []
    for pi, prompt in enumerate(prompts):
        ids = _render_prompt(prompt, tokenizer, tools_schema)
        if not ids or len(ids) >= ctx_limit:
            raise ValueError(f"prompt {pi} has {len(ids)} tokens; need 1..{ctx_limit - 1}")
        pkey = jax.random.fold_in(base_key, pi)
        for g in range(num_samples):
            key = np.asarray(jax.random.fold_in(pkey, g))
            s = _Sample(Trajectory(pi, g, list(ids)), key, len(queue))
            if env_factory is not None:
                s.env = env_factory(pi, g)
            queue.append(s)

    B = engine.slots
    max_parked = B if limits.max_parked is None else limits.max_parked
    by_index = list(queue)
    free = list(range(B))
    running: dict[int, _Sample] = {}  # slot -> the sample in it
    # sample index -> its tool / environment task; None where another process runs it
    waiting: dict[int, asyncio.Task | None] = {}
    parked: dict = {}  # sample index -> its engine row (`EngineCore.park`) while out of a slot
    # (parked sample, observation tokens, reward, markup)
    resume: collections.deque = collections.deque()
    # Multi-controller (one process per host): every process runs this loop over all samples
    # and must make the same device calls. A process runs the tool calls and environment steps
    # of the samples it first admitted into its own block of slots; at the top of each pass the
    # processes agree on which of those have finished and share their results, so every host
    # applies the same observations in the same pass, and sees the same trajectories.
    n_proc, me = jax.process_count(), jax.process_index()
    shared = n_proc > 1
    owns = lambda slot: not shared or slot * n_proc // B == me  # noqa: E731
    state = engine.init_decode_state()
    loop = asyncio.get_running_loop()
    t_gen = 0.0
    n_chunks = n_parks = max_in_flight = 0
    t0 = time.perf_counter()

    async def finish(s: _Sample, reason: str):
        s.traj.finish_reason = reason
        if decode is not None:
            s.traj.response_text = decode(s.traj.response_ids)
            s.traj.model_text = _model_text(s.traj, s.markups, decode)
        if executor is not None and s.owned:
            await executor.close_session(s.session_id)
        if s.slot >= 0:
            del running[s.slot]
            free.append(s.slot)
        parked.pop(s.index, None)
        done.append(s.traj)

    async def run_calls(s: _Sample, parsed) -> list[str]:
        texts: list[str] = []
        if parsed.error:
            s.traj.tool_calls.append(
                ToolCallRecord(None, None, False, parsed.error, 0.0, False, s.turns)
            )
            return [parsed.error]
        jobs, slots_idx = [], []
        for call in parsed.calls:
            if s.traj.num_tool_calls < limits.max_tool_calls:
                s.traj.num_tool_calls += 1
                rec = ToolCallRecord(call.name, call.arguments, False, None, 0.0, True, s.turns)
                jobs.append((rec, executor.execute(call, s.session_id)))
            else:
                rec = ToolCallRecord(
                    call.name, call.arguments, False, "budget", 0.0, False, s.turns, BUDGET_NOTICE
                )
            s.traj.tool_calls.append(rec)
            slots_idx.append(rec)
        results = await asyncio.gather(*(_safe(c) for _, c in jobs))
        for (rec, _), obs in zip(jobs, results):
            rec.ok, rec.latency_s = bool(obs.ok), float(obs.latency_s)
            rec.error = None if obs.ok else obs.text
            rec.observation = _fit_observation(obs.text, tokenizer, limits.max_obs_tokens)
        for rec in slots_idx:
            texts.append(rec.observation)
        return texts

    def continuation(role: str) -> Callable[[list[str]], str]:
        """How texts are shaped after a model segment: inline (the parser's format) or, for chat
        protocols and environment turns, the chat template's own turn markup."""
        if role == "tool" and not getattr(parser, "chat_role", None):
            return parser.format_observation
        if role == "user" and env_format is not None:
            return lambda texts: env_format(texts[0])
        return lambda texts: chat_continuation(tokenizer, role, texts)

    async def resolve(s: _Sample, kind: str, seg_text: str, parsed, ended_with_eos: bool):
        """Returns ("append", tokens, reward, markup) or ("finish", reason)."""
        reward = None
        if kind == "tool":
            role, texts = "tool", await run_calls(s, parsed)
        else:
            step = s.env.step(seg_text)
            step = (await step) if inspect.isawaitable(step) else step
            obs_text, reward, is_done = step  # a tuple, or an envs.StepResult
            s.traj.env_rewards.append(float(reward))
            info = getattr(step, "info", {})
            s.traj.env_states.append(info.get("anchor_state"))
            s.traj.env_success = bool(info.get("success"))
            if is_done:
                return ("finish", "done")
            role, texts, reward = "user", [obs_text], float(reward)
        # (an EOS token the model sampled already closed the turn)
        last = decode([s.traj.response_ids[-1]]) if ended_with_eos else ""
        ids, markup = encode_observation(tokenizer, continuation(role), texts, drop_prefix=last)
        return ("append", ids, reward, markup)

    def end_segment(s: _Sample, reason: str, stop_end: int | None):
        """After a segment ended with reason in {tool, eos, stop}: a coroutine or a finish."""
        seg_text = decode(s.seg_tokens) if decode else ""
        if stop_end is not None:
            seg_text = seg_text[:stop_end]
        s.turns += 1
        parsed = None
        kind = None
        if reason == "tool":
            parsed = parser.parse(seg_text)
            kind = "tool"
        elif parser is not None:
            parsed = parser.parse(seg_text)
            if parsed.calls and not parsed.error:
                kind = "tool"
        if kind is None and s.env is not None:
            kind = "env"
            if reason == "eos":  # the environment gets the turn's text, not its end token
                seg_text = decode(s.seg_tokens[:-1])
        if kind is None:
            return reason
        if s.turns >= limits.max_turns:
            return "turns"
        return resolve(s, kind, seg_text, parsed, reason == "eos")

    while queue or running or parked:
        # 1) observations that arrived: append them (one bucketed call), resume those slots
        appends, finishing = [], []
        ready = [(i, t.result()) for i, t in list(waiting.items()) if t and t.done()]
        if shared:
            ready = _share_results(ready, by_index)
        for i, res in ready:
            del waiting[i]
            s = by_index[i]
            if res[0] == "finish":
                finishing.append((s, res[1]))
                continue
            toks = res[1]
            if len(s.traj.response_ids) + len(toks) >= limits.max_response_tokens:
                finishing.append((s, "length"))
            elif s.length + len(toks) >= ctx_limit:
                finishing.append((s, "budget"))
            elif s.slot >= 0:
                appends.append((s, *res[1:]))
            else:
                resume.append((s, *res[1:]))
        for s, reason in finishing:
            await finish(s, reason)
        # 2) samples that want a slot: parked ones back from their tools first, then queued
        # ones. When they outnumber the free slots, samples still waiting after a whole chunk
        # (or while no slot decodes) are parked, the latest paused first: an instant result,
        # such as an environment step's, arrives within the chunk it was dispatched in, and
        # moving that row out and back would gain nothing.
        want = len(resume) + len(queue) - len(free)
        if want > 0 and len(parked) < max_parked:
            decoding = any(x.index not in waiting for x in running.values())
            in_slots = [
                x
                for x in running.values()
                if x.index in waiting and (x.paused_at < n_chunks or not decoding)
            ]
            in_slots.sort(key=lambda x: (-x.paused_at, x.slot))
            for s in in_slots[: min(want, max_parked - len(parked))]:
                parked[s.index] = engine.park(state, s.slot, s.length)
                del running[s.slot]
                free.append(s.slot)
                s.slot = -1
                n_parks += 1
        free.sort()
        while free and resume:
            s, *obs = resume.popleft()
            s.slot = free.pop(0)
            state = engine.unpark(state, s.slot, parked.pop(s.index))
            running[s.slot] = s
            appends.append((s, *obs))
        if appends:
            state = engine.write_slots(
                params,
                state,
                [a[0].slot for a in appends],
                [a[1] for a in appends],
                starts=[a[0].length for a in appends],
                sampled=[a[0].sampled for a in appends],
            )
            for s, toks, reward, markup in appends:
                s.add_observation(toks, reward, markup)
        new = []
        while free and queue:
            s = queue.popleft()
            s.slot = free.pop(0)
            s.owned = owns(s.slot)
            running[s.slot] = s
            new.append(s)
        if new:
            state = engine.write_slots(
                params,
                state,
                [s.slot for s in new],
                [s.traj.prompt_ids for s in new],
                starts=[0] * len(new),
                reset=[(s.key, sampling) for s in new],
                seq_ids=[s.index for s in new],
            )
        max_in_flight = max(max_in_flight, len(running) + len(parked))
        active = np.zeros((B,), bool)
        for slot, s in running.items():
            active[slot] = s.index not in waiting
        if not active.any():
            mine = [t for t in waiting.values() if t is not None]
            if mine:  # (multi-controller: a short wait, then agree on what others finished)
                await asyncio.wait(
                    mine, return_when=asyncio.FIRST_COMPLETED, timeout=0.05 if shared else None
                )
            continue
        # 3) one chunk for all active slots, off the event loop so tool tasks keep running
        tg = time.perf_counter()

        def chunk(st, act):
            st, out = engine.generate_steps(params, st, limits.chunk_size, active=act)
            return st, to_host(out.tokens), to_host(out.logprobs)

        state, toks_BN, lps_BN = await loop.run_in_executor(None, chunk, state, active)
        t_gen += time.perf_counter() - tg
        n_chunks += 1
        # 4) host scan of each active slot's new tokens
        for slot in np.nonzero(active)[0].tolist():
            s = running[slot]
            toks, lps = toks_BN[slot].tolist(), lps_BN[slot]
            cut, reason, stop_end = scan_chunk(
                toks,
                segment=s.seg_tokens,
                decode=decode,
                eos_ids=eos,
                tool_stops=tool_stops,
                final_stops=final_stops,
                room=limits.max_response_tokens - len(s.traj.response_ids),
                context=ctx_limit - s.length,
            )
            s.add_model(toks[:cut], lps[:cut])
            if reason is None:
                continue
            if reason in ("length", "budget"):
                await finish(s, reason)
                continue
            out = end_segment(s, reason, stop_end)
            s.paused_at = n_chunks
            if isinstance(out, str):
                await finish(s, out)
            elif s.owned:
                waiting[s.index] = asyncio.ensure_future(out)
            else:  # another process runs it; its result comes through _share_results
                out.close()
                waiting[s.index] = None

    if stats is not None:
        stats.update(
            wall_s=time.perf_counter() - t0,
            generate_s=t_gen,
            chunks=n_chunks,
            parks=n_parks,
            max_in_flight=max_in_flight,
        )
    done.sort(key=lambda t: (t.prompt_index, t.sample_index))
    return done


def _share_results(ready: list, samples: list[_Sample]) -> list:
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


# What `run_calls` and `resolve` write into a trajectory besides the observation tokens.
_TASK_FIELDS = ("tool_calls", "num_tool_calls", "env_rewards", "env_states", "env_success")


def _model_text(traj: Trajectory, markups: list[str], decode) -> str:
    """The response as the model wrote it: its own spans decoded, each observation replaced by
    its markup alone (what rewards score: a tool cannot print the answer for the model)."""
    it = iter(markups)
    return "".join(
        decode(traj.response_ids[sp.start : sp.end]) if sp.kind == "model" else next(it)
        for sp in traj.spans
    )


async def _safe(coro):
    try:
        return await coro
    except Exception as e:  # noqa: BLE001 -- a failing tool is an observation, not a crash
        return Observation(text=f"Error: {type(e).__name__}: {e}", ok=False)


def run_rollouts(engine, params, prompts: Sequence[Any], **kwargs) -> list[Trajectory]:
    """`arun_rollouts` in a fresh event loop (same arguments)."""
    return asyncio.run(arun_rollouts(engine, params, prompts, **kwargs))
