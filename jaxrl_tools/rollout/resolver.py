"""What an ended model segment becomes: a tool observation, an environment step, a budget
notice, or the end of the trajectory.

A segment ends when the stop scan (`stops.scan_chunk`) finds a tool stop string, an EOS token
or a final stop string. `Resolver.end_segment` decides:

- tool stop string (the parser's `stop_strings`): parse, then execute the calls (at most C in
  the whole trajectory); a parse error is an error observation. The observation is the parser's
  inline format (ToRL, ReTool, Search-R1) or, for chat protocols, tool turns of the tokenizer's
  chat template.
- EOS / final stop string (or the parser's `turn_stops`): with a parser, a segment that parses
  into calls without error (Qwen turns of several calls) is a tool turn; with a chat protocol a
  parse error (an unclosed <tool_call>, a call inside <think>) is one too: the model sees the
  error. Otherwise, with an environment (RAGEN style), the turn's text (without its end token)
  steps the environment and its observation comes back as a user turn, until it says done
  ("done"). Otherwise, with `rollout.invalid_action` "notice" and a segment without the
  parser's answer (Search-R1: neither <search> nor <answer>), the notice is inserted (the EOS
  that ended the segment dropped, as Search-R1 decodes without special tokens) and the model
  tries again; the turn counts as a tool turn. Otherwise the trajectory ends ("eos" / "stop" /
  "turn_length").

Budgets, in this order: a turn whose calls are all past the tool budget C gets the recipe's
`rollout.over_budget` whatever the turn limit: "ignore" (no answer, the model writes on; not a
turn), "end" ("tool_budget") or "notice" (the notice, then the model resumes: the first notice
always comes). Then the turn limit: a tool turn past `max_turns` tool turns ends the trajectory
("turns"); the answer turn after them is not counted. Environment turns count every model
segment: the trajectory ends at the `max_turns`-th ("turns").

Tool calls and environment steps take time: they come back as a coroutine whose result is an
`Append` (observation tokens) or a `Finish`; `bounded` turns an `Append` that would pass the
response or context budget into `Finish("length")` / `Finish("budget")`. `Sample` is the host
state of one trajectory while it runs; `step_environment` is the one place an environment step
is taken and recorded (the windowed loop uses it too).
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple

from jaxrl_tools.prompts import chat_continuation, encode_observation
from jaxrl_tools.tools import Observation
from jaxrl_tools.tools.executor import (  # noqa: F401 -- re-exported
    BUDGET_NOTICE,
    INVALID_ACTION,
    INVALID_NOTICE,
    OVER_BUDGET,
)
from jaxrl_tools.types import Span, ToolCallRecord, Trajectory


class Append(NamedTuple):
    """Observation tokens to append (loss mask 0), the environment's reward for the turn (None
    for tools), and the observation's markup with its texts left out (`Trajectory.model_text`)."""

    tokens: list[int]
    reward: float | None
    markup: str


class Finish(NamedTuple):
    """The trajectory ends, with this finish reason."""

    reason: str


Outcome = Append | Finish


class Sample:
    """Host state of one trajectory while it runs.

    Args:
      traj: the trajectory being built (its prompt set).
      key: its PRNG key (uint32 [2]).
      index: its position among all samples: the scheduler's id and the engine's sequence id.
      env: its environment, or None.
    """

    def __init__(self, traj: Trajectory, key, index: int, env=None):
        self.traj = traj
        self.key = key
        self.index = index
        self.env = env
        # The G samples of a prompt share its prefill; a request's sample has its own.
        self.prefix_key: Any = traj.prompt_index
        # A request's own settings (None: the driver's): sampling, final stop strings, tokens
        # per segment, and a callback given each run of kept tokens (streaming).
        self.sampling = None
        self.stops: tuple[str, ...] | None = None
        self.max_new: int | None = None
        self.on_tokens: Callable[[list[int], list[float]], None] | None = None
        self.reply: asyncio.Future | None = None  # a request's Completion, when it ends
        self.episode: Any = None  # the agent run it belongs to (agents.rollouts)
        self.owned = True  # this process runs its tools and environment (multi-controller)
        self.seg_start = 0  # response index where the current model segment began
        self.turns = 0  # model segments ended
        self.tool_turns = 0  # turns answered with tool results (the turn limit's count)
        self.noticed = False  # shown the budget notice
        self.session_id = f"{traj.prompt_index}-{traj.sample_index}-{uuid.uuid4().hex[:8]}"
        self.markups: list[str] = []  # each observation's markup, its texts left out

    @property
    def length(self) -> int:
        """Tokens in its cache row: prompt + response."""
        return len(self.traj.prompt_ids) + len(self.traj.response_ids)

    @property
    def seg_tokens(self) -> list[int]:
        return self.traj.response_ids[self.seg_start :]

    @property
    def sampled(self) -> int:
        """Model tokens kept so far (the engine's `sampled` counter of its row)."""
        return sum(self.traj.loss_mask)

    def add_model(self, toks, lps, version: int | None = None) -> None:
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
        if version is not None:
            t.versions.extend([version] * len(toks))

    def drop_last_token(self) -> None:
        """Takes back the last model token (an EOS the next observation replaces; the engine's
        row is rewritten from `length` on when the observation is appended)."""
        t = self.traj
        t.response_ids.pop()
        t.loss_mask.pop()
        t.logprobs.pop()
        if t.versions:
            t.versions.pop()
        t.spans[-1].end -= 1
        if t.spans[-1].end == t.spans[-1].start:
            t.spans.pop()

    def add_observation(self, obs: Append) -> None:
        t = self.traj
        n = len(obs.tokens)
        self.seg_start = len(t.response_ids) + n
        if n == 0:  # nothing inserted (a call past the budget, ignored): the model writes on
            return
        self.markups.append(obs.markup)
        t.spans.append(
            Span("observation", len(t.response_ids), len(t.response_ids) + n, obs.reward)
        )
        t.response_ids.extend(int(x) for x in obs.tokens)
        t.loss_mask.extend([0] * n)
        t.logprobs.extend([0.0] * n)


class Resolver:
    """Turns ended segments into observations, environment steps, notices or finishes.

    Args:
      tokenizer: HF tokenizer (None: token-id runs with no protocol and no stop strings).
      parser: the tool-call parser, or None.
      executor: the ToolExecutor (with a parser).
      env_format: f(obs_text) -> text inserted after an environment step (None: a user turn of
        the chat template).
      max_tool_calls, max_turns, max_obs_tokens, max_response_tokens: as `RolloutLimits`.
      ctx_limit: cache positions a trajectory may fill (prompt + response).
    """

    def __init__(
        self,
        *,
        tokenizer,
        parser,
        executor,
        env_format: Callable[[str], str] | None,
        max_tool_calls: int,
        max_turns: int,
        max_obs_tokens: int,
        max_response_tokens: int,
        ctx_limit: int,
        over_budget: str = "notice",
        budget_notice: str = BUDGET_NOTICE,
        invalid_action: str = "end",
        invalid_notice: str = INVALID_NOTICE,
    ):
        self.tokenizer, self.parser, self.executor = tokenizer, parser, executor
        self.env_format = env_format
        self.max_tool_calls, self.max_turns = max_tool_calls, max_turns
        self.over_budget, self.budget_notice = over_budget, budget_notice
        # the answer rule of invalid turns, None when they end the response
        self.answer_pattern = None
        if invalid_action == "notice":
            self.answer_pattern = getattr(parser, "answer_pattern", None)
            if self.answer_pattern is None:
                raise ValueError(
                    f"invalid_action 'notice' needs a protocol with an answer tag, got "
                    f"{getattr(parser, 'name', parser)!r}"
                )
        self.invalid_notice = invalid_notice
        self.max_obs_tokens, self.max_response_tokens = max_obs_tokens, max_response_tokens
        self.ctx_limit = ctx_limit

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def end_segment(
        self, s: Sample, reason: str, stop_end: int | None
    ) -> Finish | Coroutine[Any, Any, Outcome]:
        """After a segment ended with `reason` in {"tool", "eos", "stop", "length", "budget",
        "turn_length"}: a Finish now, or a coroutine (the tool calls or environment step) whose
        result is an Outcome. A turn cut at `max_turn_tokens` is an environment's action as
        written (RAGEN: most likely a malformed one); else it ends the trajectory."""
        if reason in ("length", "budget"):
            return Finish(reason)
        if reason == "turn_length" and s.env is None and self.answer_pattern is None:
            return Finish(reason)
        seg_text = self.decode(s.seg_tokens) if self.tokenizer is not None else ""
        if stop_end is not None:
            seg_text = seg_text[:stop_end]
        s.turns += 1
        parsed = None
        if reason == "tool" or self.parser is not None:
            parsed = self.parser.parse(seg_text)
        # a chat protocol's turn that ended malformed: the model sees the error, not the end
        chat_error = getattr(self.parser, "chat_role", None) and parsed and parsed.error
        if reason == "tool" or (parsed is not None and parsed.calls and not parsed.error):
            kind = "tool"
        elif chat_error:
            kind = "tool"
        elif s.env is not None:
            kind = "env"
        elif self.answer_pattern is not None and not self.answer_pattern.search(seg_text):
            return self._invalid_turn(s, reason)
        else:
            return Finish(reason)
        ended = reason in ("eos", "stop") and getattr(self.parser, "chat_role", None)
        if kind == "tool":
            return self._budgeted_turn(s, parsed, ended_with_eos=reason == "eos" or ended)
        if s.turns >= self.max_turns:
            return Finish("turns")
        if reason == "eos":  # the environment gets the turn's text, not its end token
            seg_text = self.decode(s.seg_tokens[:-1])
        return self._env_turn(s, seg_text, ended_with_eos=reason == "eos")

    def _budgeted_turn(self, s: Sample, parsed, ended_with_eos: bool):
        """A tool turn under the budgets: the over-budget policy before the turn limit."""
        over = not parsed.error and s.traj.num_tool_calls >= self.max_tool_calls
        if over and self.over_budget == "ignore":
            s.turns -= 1  # the same turn goes on
        elif over and self.over_budget == "notice" and not s.noticed:
            s.noticed = True
            s.tool_turns += 1
        elif not (over and self.over_budget == "end"):
            s.tool_turns += 1
            if s.tool_turns > self.max_turns:
                return Finish("turns")
        return self._tool_turn(s, parsed, ended_with_eos)

    def _invalid_turn(self, s: Sample, reason: str):
        """A turn with neither a call nor an answer: the notice, or "turns" at the turn limit
        (Search-R1's loop counts it as one of its turns)."""
        s.traj.invalid_actions += 1
        s.tool_turns += 1
        if s.tool_turns > self.max_turns:
            return Finish("turns")
        if reason == "eos":
            s.drop_last_token()
        ids = self.tokenizer.encode(self.invalid_notice, add_special_tokens=False)
        # markup "": rewards must not read the notice's own <answer> tags as the model's
        return _ready(Append(list(ids), None, ""))

    def bounded(self, s: Sample, outcome: Outcome) -> Outcome:
        """`outcome`, or the finish it becomes when its observation would fill the response
        ("length") or the context ("budget")."""
        if isinstance(outcome, Finish):
            return outcome
        n = len(outcome.tokens)
        if len(s.traj.response_ids) + n >= self.max_response_tokens:
            return Finish("length")
        if s.length + n >= self.ctx_limit:
            return Finish("budget")
        return outcome

    async def finish(self, s: Sample, reason: str) -> None:
        """Ends the trajectory: its reason, its texts, its tool session closed."""
        s.traj.finish_reason = reason
        if self.tokenizer is not None:
            s.traj.response_text = self.decode(s.traj.response_ids)
            s.traj.model_text = model_text(s.traj, s.markups, self.decode)
        if self.executor is not None and s.owned:
            await self.executor.close_session(s.session_id)

    # ------------------------------------------------------------------ turns
    async def _tool_turn(self, s: Sample, parsed, ended_with_eos: bool) -> Outcome:
        texts = await self._run_calls(s, parsed)
        if self.over_budget == "end" and any(r.error == "budget" for r in s.traj.tool_calls):
            return Finish("tool_budget")  # (calls within the budget ran, and are recorded)
        if not texts:  # "ignore": every call was past the budget; the model writes on
            return Append((), None, "")
        return self._observation(s, "tool", texts, None, ended_with_eos)

    async def _env_turn(self, s: Sample, text: str, ended_with_eos: bool) -> Outcome:
        observation, reward, done = await step_environment(s.env, text, s.traj)
        if done:
            return Finish("done")
        return self._observation(s, "user", [observation], reward, ended_with_eos)

    async def _run_calls(self, s: Sample, parsed) -> list[str]:
        """Executes the segment's calls within the tool budget; their observation texts (a
        parse error, a notice for calls past the budget), one per call, in order."""
        if parsed.error:
            s.traj.tool_calls.append(
                ToolCallRecord(None, None, False, parsed.error, 0.0, False, s.turns)
            )
            return [parsed.error]
        records, jobs = [], []
        for call in parsed.calls:
            if s.traj.num_tool_calls < self.max_tool_calls:
                s.traj.num_tool_calls += 1
                rec = ToolCallRecord(call.name, call.arguments, False, None, 0.0, True, s.turns)
                jobs.append((rec, self.executor.execute(call, s.session_id)))
            else:
                notice = self.budget_notice
                rec = ToolCallRecord(
                    call.name, call.arguments, False, "budget", 0.0, False, s.turns, notice
                )
            s.traj.tool_calls.append(rec)
            records.append(rec)
        results = await asyncio.gather(*(_safe(c) for _, c in jobs))
        for (rec, _), obs in zip(jobs, results):
            rec.ok, rec.latency_s = bool(obs.ok), float(obs.latency_s)
            rec.error = None if obs.ok else obs.text
            rec.observation = fit_observation(obs.text, self.tokenizer, self.max_obs_tokens)
        ignored = self.over_budget == "ignore"
        return [r.observation for r in records if not (ignored and r.error == "budget")]

    def _observation(
        self, s: Sample, role: str, texts: list[str], reward: float | None, ended_with_eos: bool
    ) -> Append:
        # (an EOS token the model sampled already closed its turn)
        last = self.decode([s.traj.response_ids[-1]]) if ended_with_eos else ""
        ids, markup = encode_observation(self.tokenizer, self._shape(role), texts, drop_prefix=last)
        return Append(ids, reward, markup)

    def _shape(self, role: str) -> Callable[[list[str]], str]:
        """How texts are put after a model segment: inline (the parser's format) or, for chat
        protocols and environment turns, the chat template's own turn markup."""
        if role == "tool" and not getattr(self.parser, "chat_role", None):
            return self.parser.format_observation
        if role == "user" and self.env_format is not None:
            return lambda texts: self.env_format(texts[0])
        return lambda texts: chat_continuation(self.tokenizer, role, texts)


async def step_environment(env, action_text: str, traj: Trajectory) -> tuple[str, float, bool]:
    """Steps `env` with one turn's text and records the step in `traj`.

    Args:
      env: has step(action_text) -> (observation, reward, done) or an `envs.StepResult`
        (sync or async).
      action_text: the turn's text, without its end token.
      traj: gets the reward (`env_rewards`), the anchor state (`env_states`, from
        info["anchor_state"]), whether the goal was reached (`env_success`) and the step's
        other numeric info (`env_metrics`).

    Returns:
      (observation, reward, done).
    """
    res = env.step(action_text)
    res = (await res) if inspect.isawaitable(res) else res
    observation, reward, done = res  # a tuple, or an envs.StepResult
    info = getattr(res, "info", {})
    traj.env_rewards.append(float(reward))
    traj.env_states.append(info.get("anchor_state"))
    traj.env_success = bool(info.get("success"))
    traj.env_metrics.append(
        {
            k: float(v)
            for k, v in info.items()
            if k not in ("anchor_state", "success") and isinstance(v, int | float)
        }
    )
    return observation, float(reward), bool(done)


def fit_observation(text: str, tokenizer, max_tokens: int) -> str:
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


def model_text(traj: Trajectory, markups: list[str], decode) -> str:
    """The response as the model wrote it: its own spans decoded, each observation replaced by
    its markup alone (what rewards score: a tool cannot print the answer for the model)."""
    it = iter(markups)
    return "".join(
        decode(traj.response_ids[sp.start : sp.end]) if sp.kind == "model" else next(it)
        for sp in traj.spans
    )


async def _ready(outcome: Outcome) -> Outcome:
    """An outcome known now, as the coroutine the driver runs for tool turns."""
    return outcome


async def _safe(coro):
    try:
        return await coro
    except Exception as e:  # noqa: BLE001 -- a failing tool is an observation, not a crash
        return Observation(text=f"Error: {type(e).__name__}: {e}", ok=False)
