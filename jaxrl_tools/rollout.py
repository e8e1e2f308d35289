"""The host-side agent loop: continuous batching over the engine's slots, tools run async.

`run_rollouts` turns prompts into `Trajectory`s (G samples per prompt). The device only runs
fixed-shape jitted work (a chunk of `chunk_size` decode steps for all slots, bucketed writes);
the host scans each slot's new tokens, dispatches tool calls / environment steps as asyncio
tasks, and appends their observation tokens to that slot's KV cache when they arrive. A slot
waiting for a tool is paused (it does not advance); the other slots keep decoding, and a
finished trajectory frees its slot for the next queued sample.

Stop rule (token-in-token-out): generation is never re-tokenised. A segment is cut after the
first token at which (a) the token is an EOS id, or (b) the decoded text of the segment so far
contains a stop string. With byte-level BPE a stop string may end inside a token (e.g. "</code>"
merged with "\\n"); that whole token is kept (it was sampled), the tokens after it are dropped
(and rolled back in the cache), and the parser sees the text only up to the end of the stop
string. EOS wins a tie with a stop string on the same token.

Segment end handling:
- tool stop string (the parser's `stop_strings`): parse -> execute the calls (at most C in the
  whole trajectory; later calls get the notice "tool budget exhausted, answer directly"), a parse
  error becomes an error observation; the parser's `format_observation` text is appended.
- EOS / a final stop string: with a parser, a segment that parses into calls without error (Qwen
  multi-call turns ending in <|im_end|>) is a tool turn; otherwise the trajectory ends
  ("eos" / "stop"). With an environment (RAGEN style), the turn text goes to `env.step` and the
  returned observation is appended as a user turn until `done` ("done") or `max_turns`.

Finish reasons: "eos", "stop", "length" (max_response_tokens reached; observations count),
"budget" (the slot's KV cache / context `max_len` is full), "turns" (max_turns model segments
reached with a tool call or env turn still pending), "done" (environment finished).

Observation text: errors are reduced to the traceback's last line; outputs longer than
`max_obs_tokens` tokens become head + "..." + tail. Observation tokens have loss_mask 0 and
log-prob 0.
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

from jaxrl_tools.sampling import SamplingParams

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
    """

    max_response_tokens: int = 512
    max_tool_calls: int = 3
    max_turns: int = 8
    max_obs_tokens: int = 256
    chunk_size: int = 16

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < (0 if f.name == "max_tool_calls" else 1):
                raise ValueError(f"RolloutLimits.{f.name} must be a positive int, got {v!r}")


@dataclasses.dataclass
class ToolCallRecord:
    """One tool call of a trajectory (or a malformed attempt: name None, error set)."""

    name: str | None
    arguments: dict | None
    ok: bool
    error: str | None
    latency_s: float
    executed: bool
    turn: int
    observation: str = ""


@dataclasses.dataclass
class Span:
    """A contiguous run of response tokens: kind "model" or "observation", [start, end)."""

    kind: str
    start: int
    end: int
    reward: float | None = None  # environment reward of an observation turn


@dataclasses.dataclass
class Trajectory:
    """One sampled response (token-in-token-out).

    Attributes:
      prompt_index, sample_index: which prompt / which of its G samples.
      prompt_ids: the prompt tokens.
      response_ids: every token after the prompt, exactly as sampled or inserted.
      loss_mask: 1 on model-sampled response tokens, 0 on inserted ones (aligned with
        response_ids).
      logprobs: behaviour log-probs of sampled tokens (0.0 on inserted ones).
      spans: model / observation turns in response coordinates.
      tool_calls: ToolCallRecord per call attempt (executed or not).
      num_tool_calls: calls actually executed.
      finish_reason: "eos" | "stop" | "length" | "budget" | "turns" | "done".
      env_rewards: rewards returned by the environment, one per env step.
      response_text: decoded response (when a tokenizer was given).
    """

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    spans: list[Span] = dataclasses.field(default_factory=list)
    tool_calls: list[ToolCallRecord] = dataclasses.field(default_factory=list)
    num_tool_calls: int = 0
    finish_reason: str = ""
    env_rewards: list[float] = dataclasses.field(default_factory=list)
    response_text: str = ""

    @property
    def token_ids(self) -> list[int]:
        """prompt_ids + response_ids."""
        return self.prompt_ids + self.response_ids

    @property
    def full_loss_mask(self) -> list[int]:
        """loss_mask over token_ids (0 on the prompt)."""
        return [0] * len(self.prompt_ids) + self.loss_mask

    @property
    def num_turns(self) -> int:
        return sum(s.kind == "model" for s in self.spans)


class _Sample:
    """Host state of one trajectory while it runs."""

    def __init__(self, traj: Trajectory, key):
        self.traj = traj
        self.key = key
        self.slot = -1
        self.seg_start = 0  # response index where the current model segment began
        self.turns = 0
        self.session_id = f"{traj.prompt_index}-{traj.sample_index}-{uuid.uuid4().hex[:8]}"
        self.env = None

    @property
    def length(self) -> int:
        return len(self.traj.prompt_ids) + len(self.traj.response_ids)

    @property
    def seg_tokens(self) -> list[int]:
        return self.traj.response_ids[self.seg_start:]

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

    def add_observation(self, toks, reward=None):
        t = self.traj
        t.spans.append(Span("observation", len(t.response_ids), len(t.response_ids) + len(toks),
                            reward))
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
        text = tokenizer.apply_chat_template(prompt, tools=tools_schema or None,
                                             add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return [int(x) for x in prompt]


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(end index, stop string) of the stop occurrence that ends first in `text`, or None."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i + len(s) < best[0]):
            best = (i + len(s), s)
    return best


def _clean_obs_text(text: str, ok: bool, tokenizer, max_tokens: int) -> str:
    if not ok and "Traceback (most recent call last)" in text:
        from jaxrl_tools.tools import last_traceback_line

        text = last_traceback_line(text)
    if tokenizer is None:
        return text
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    head = max(1, (max_tokens - 1) // 2)
    tail = max(1, max_tokens - 1 - head)
    return (tokenizer.decode(ids[:head], skip_special_tokens=False) + "..."
            + tokenizer.decode(ids[-tail:], skip_special_tokens=False))


def _default_env_format(obs: str, ended_with_eos: bool) -> str:
    # A Qwen-chat user turn; closes the assistant turn first unless EOS (<|im_end|>) did.
    close = "" if ended_with_eos else "<|im_end|>"
    return f"{close}\n<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n"


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
    env_format: Callable[[str, bool], str] = _default_env_format,
    limits: RolloutLimits | None = None,
    sampling: SamplingParams | None = None,
    rng: jax.Array | int = 0,
    stop_strings: Sequence[str] = (),
    eos_token_ids: Sequence[int] | None = None,
    tools_schema: list[dict] | None = None,
    stats: dict | None = None,
) -> list[Trajectory]:
    """Async version of `run_rollouts` (same arguments); use inside a running event loop."""
    limits = limits or RolloutLimits()
    sampling = sampling or SamplingParams()
    parser = None
    if protocol is not None:
        if isinstance(protocol, str):
            from jaxrl_tools.tools import get_parser

            parser = get_parser(protocol)
        else:
            parser = protocol
    if (parser is not None or stop_strings) and tokenizer is None:
        raise ValueError("a protocol or stop_strings needs a tokenizer (stops are found in text)")
    if parser is not None and executor is None:
        raise ValueError(f"protocol {getattr(parser, 'name', parser)!r} needs a ToolExecutor")
    tool_stops = tuple(parser.stop_strings) if parser is not None else ()
    final_stops = tuple(stop_strings)
    all_stops = tool_stops + final_stops
    eos = set(engine.eos_token_ids if eos_token_ids is None else eos_token_ids)
    if tools_schema is None and executor is not None and hasattr(executor, "schemas"):
        tools_schema = executor.schemas()
    base_key = jax.random.PRNGKey(rng) if isinstance(rng, int) else rng

    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer else None
    encode = (lambda s: list(tokenizer.encode(s, add_special_tokens=False))) if tokenizer else None

    queue: collections.deque[_Sample] = collections.deque()
    done: list[Trajectory] = []
    for pi, prompt in enumerate(prompts):
        ids = _render_prompt(prompt, tokenizer, tools_schema)
        if not ids or len(ids) >= engine.max_len:
            raise ValueError(f"prompt {pi} has {len(ids)} tokens; need 1..{engine.max_len - 1}")
        pkey = jax.random.fold_in(base_key, pi)
        for g in range(num_samples):
            s = _Sample(Trajectory(pi, g, list(ids)), np.asarray(jax.random.fold_in(pkey, g)))
            if env_factory is not None:
                s.env = env_factory(pi, g)
            queue.append(s)

    B = engine.slots
    free = list(range(B))
    running: dict[int, _Sample] = {}
    paused: dict[int, asyncio.Task] = {}
    state = engine.init_decode_state()
    loop = asyncio.get_running_loop()
    t_gen = 0.0
    n_chunks = 0
    t0 = time.perf_counter()

    async def finish(s: _Sample, reason: str):
        s.traj.finish_reason = reason
        if decode is not None:
            s.traj.response_text = decode(s.traj.response_ids)
        if executor is not None:
            await executor.close_session(s.session_id)
        done.append(s.traj)

    async def run_calls(s: _Sample, parsed) -> list[str]:
        texts: list[str] = []
        if parsed.error:
            s.traj.tool_calls.append(ToolCallRecord(None, None, False, parsed.error, 0.0, False,
                                                    s.turns))
            return [parsed.error]
        jobs, slots_idx = [], []
        for call in parsed.calls:
            if s.traj.num_tool_calls < limits.max_tool_calls:
                s.traj.num_tool_calls += 1
                rec = ToolCallRecord(call.name, call.arguments, False, None, 0.0, True, s.turns)
                jobs.append((rec, executor.execute(call, s.session_id)))
            else:
                rec = ToolCallRecord(call.name, call.arguments, False, "budget", 0.0, False,
                                     s.turns, BUDGET_NOTICE)
            s.traj.tool_calls.append(rec)
            slots_idx.append(rec)
        results = await asyncio.gather(*(_safe(c) for _, c in jobs))
        for (rec, _), obs in zip(jobs, results):
            rec.ok, rec.latency_s = bool(obs.ok), float(obs.latency_s)
            rec.error = None if obs.ok else obs.text
            rec.observation = _clean_obs_text(obs.text, obs.ok, tokenizer, limits.max_obs_tokens)
        for rec in slots_idx:
            texts.append(rec.observation)
        return texts

    async def resolve(s: _Sample, kind: str, seg_text: str, parsed, ended_with_eos: bool):
        """Returns ("append", tokens, reward) or ("finish", reason)."""
        if kind == "tool":
            texts = await run_calls(s, parsed)
            obs = parser.format_observation(texts)
            last = decode([s.traj.response_ids[-1]]) if ended_with_eos else ""
            if last and obs.startswith(last):  # the EOS token already closed the turn
                obs = obs[len(last):]
            return ("append", encode(obs), None)
        step = s.env.step(seg_text)
        obs_text, reward, is_done = (await step) if inspect.isawaitable(step) else step
        s.traj.env_rewards.append(float(reward))
        if is_done:
            return ("finish", "done")
        return ("append", encode(env_format(obs_text, ended_with_eos)), float(reward))

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
        if kind is None:
            return reason
        if s.turns >= limits.max_turns:
            return "turns"
        return resolve(s, kind, seg_text, parsed, reason == "eos")

    while queue or running:
        # 1) observations that arrived: append them (one bucketed call), resume those slots
        appends, finished_now = [], []
        for slot, task in list(paused.items()):
            if not task.done():
                continue
            del paused[slot]
            s = running[slot]
            res = task.result()
            if res[0] == "finish":
                finished_now.append((slot, res[1]))
                continue
            toks, reward = res[1], res[2]
            if len(s.traj.response_ids) + len(toks) >= limits.max_response_tokens:
                finished_now.append((slot, "length"))
            elif s.length + len(toks) >= engine.max_len:
                finished_now.append((slot, "budget"))
            else:
                appends.append((slot, s, toks, reward))
        for slot, reason in finished_now:
            await finish(running.pop(slot), reason)
            free.append(slot)
        if appends:
            state = engine.write_slots(
                params, state, [a[0] for a in appends], [a[2] for a in appends],
                starts=[a[1].length for a in appends], sampled=[a[1].sampled for a in appends])
            for _, s, toks, reward in appends:
                s.add_observation(toks, reward)
        # 2) new samples into free slots (one bucketed call)
        new = []
        free.sort()
        while free and queue:
            s = queue.popleft()
            s.slot = free.pop(0)
            running[s.slot] = s
            new.append(s)
        if new:
            state = engine.write_slots(
                params, state, [s.slot for s in new], [s.traj.prompt_ids for s in new],
                starts=[0] * len(new), reset=[(s.key, sampling) for s in new])
        active = np.zeros((B,), bool)
        for slot in running:
            active[slot] = slot not in paused
        if not active.any():
            if paused:
                await asyncio.wait(list(paused.values()), return_when=asyncio.FIRST_COMPLETED)
            continue
        # 3) one chunk for all active slots, off the event loop so tool tasks keep running
        tg = time.perf_counter()

        def chunk(st, act):
            st, out = engine.generate_steps(params, st, limits.chunk_size, active=act)
            return st, np.asarray(out.tokens), np.asarray(out.logprobs)

        state, toks_BN, lps_BN = await loop.run_in_executor(None, chunk, state, active)
        t_gen += time.perf_counter() - tg
        n_chunks += 1
        # 4) host scan of each active slot's new tokens
        for slot in np.nonzero(active)[0].tolist():
            s = running[slot]
            toks, lps = toks_BN[slot].tolist(), lps_BN[slot]
            cut, reason, stop_end = len(toks), None, None
            for i, t in enumerate(toks):
                if t in eos:
                    cut, reason = i + 1, "eos"
                    break
            if all_stops:
                seg = s.seg_tokens
                hit = _first_stop(decode(seg + toks[:cut]), all_stops)
                if hit is not None:
                    # smallest i whose decoded prefix contains a stop (monotone in i)
                    lo, hi = 1, cut
                    while lo < hi:
                        mid = (lo + hi) // 2
                        if _first_stop(decode(seg + toks[:mid]), all_stops) is not None:
                            hi = mid
                        else:
                            lo = mid + 1
                    if lo < cut or reason is None:
                        end, which = _first_stop(decode(seg + toks[:lo]), all_stops)
                        cut, stop_end = lo, end
                        reason = "tool" if which in tool_stops else "stop"
            room = limits.max_response_tokens - len(s.traj.response_ids)
            ctx = engine.max_len - s.length
            if cut >= room and (reason is None or cut > room):
                cut, reason, stop_end = room, "length", None
            if cut >= ctx and (reason is None or cut > ctx):
                cut, reason, stop_end = ctx, "budget", None
            s.add_model(toks[:cut], lps[:cut])
            if reason is None:
                continue
            if reason in ("length", "budget"):
                await finish(running.pop(slot), reason)
                free.append(slot)
                continue
            out = end_segment(s, reason, stop_end)
            if isinstance(out, str):
                await finish(running.pop(slot), out)
                free.append(slot)
            else:
                paused[slot] = asyncio.ensure_future(out)

    if stats is not None:
        stats.update(wall_s=time.perf_counter() - t0, generate_s=t_gen, chunks=n_chunks)
    done.sort(key=lambda t: (t.prompt_index, t.sample_index))
    return done


async def _safe(coro):
    from jaxrl_tools.tools import Observation

    try:
        return await coro
    except Exception as e:  # noqa: BLE001 -- a failing tool is an observation, not a crash
        return Observation(text=f"Error: {type(e).__name__}: {e}", ok=False)


def run_rollouts(
    engine,
    params,
    prompts: Sequence[Any],
    *,
    tokenizer=None,
    num_samples: int = 1,
    protocol: str | Any | None = None,
    executor=None,
    env_factory: Callable[[int, int], Any] | None = None,
    env_format: Callable[[str, bool], str] = _default_env_format,
    limits: RolloutLimits | None = None,
    sampling: SamplingParams | None = None,
    rng: jax.Array | int = 0,
    stop_strings: Sequence[str] = (),
    eos_token_ids: Sequence[int] | None = None,
    tools_schema: list[dict] | None = None,
    stats: dict | None = None,
) -> list[Trajectory]:
    """Samples `num_samples` trajectories per prompt with tools, continuously batched.

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
        (obs_text, reward, done) (sync or async): RAGEN-style multi-turn environments.
      env_format: f(obs_text, turn_ended_with_eos) -> text inserted after an env step.
      limits: RolloutLimits (max response tokens, C, max turns, observation cap, chunk size).
      sampling: SamplingParams for every sample (default temperature 1.0).
      rng: int seed or PRNG key.
      stop_strings: strings that end the response ("stop"), e.g. "</answer>".
      eos_token_ids: default the engine's.
      tools_schema: tool declarations for the chat template (default executor.schemas()).
      stats: optional dict filled with wall_s, generate_s, chunks.

    Returns:
      Trajectories sorted by (prompt_index, sample_index).
    """
    return asyncio.run(arun_rollouts(
        engine, params, prompts, tokenizer=tokenizer, num_samples=num_samples, protocol=protocol,
        executor=executor, env_factory=env_factory, env_format=env_format, limits=limits,
        sampling=sampling, rng=rng, stop_strings=stop_strings, eos_token_ids=eos_token_ids,
        tools_schema=tools_schema, stats=stats))
