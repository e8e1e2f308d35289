"""Records -> trajectories: the run's sampler, over the decode engine, the tools and the loop."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jaxrl_tools import models, prompts, seeds
from jaxrl_tools.engine import jetstream
from jaxrl_tools.engine.core import EngineCore
from jaxrl_tools.engine.protocol import Engine
from jaxrl_tools.engine.sampling import SamplingParams
from jaxrl_tools.rollout.loop import RolloutLimits, run_rollouts
from jaxrl_tools.rollout.windowed import run_windowed
from jaxrl_tools.tools import ToolExecutor, declares_tools, get_parser
from jaxrl_tools.types import Record, Tokenizer, Trajectory

if TYPE_CHECKING:
    from jaxrl_tools.config import RolloutSection

# The engines that decode the RL loop (`rollout.engine`): `EngineCore`, or the same engine as a
# `jetstream.engine.engine_api.Engine` (`engine.jetstream.DecodeEngine`; the [serve] extra,
# JetStream imported on first use).
ENGINE_CLASSES: dict[str, Callable[[], type[EngineCore]]] = {
    "core": lambda: EngineCore,
    "jetstream": lambda: jetstream.DecodeEngine,
}


def rollout_parser(settings: RolloutSection, tools: tuple[str, ...] = ()):
    """The rollout section's parser (None for protocol none): Qwen/Hermes with several calls
    per turn where `rollout.multi_call` asks; ARTIST with `rollout.tool_tags`, the tags of
    `tools` (the run's tool names) when they are "named"."""
    if settings.protocol == "none":
        return None
    if settings.protocol in ("qwen", "hermes"):
        return get_parser(settings.protocol, stop_at_each_call=not settings.multi_call)
    if settings.protocol == "artist" and settings.tool_tags != "tool":
        return get_parser("artist", tool_tags=settings.tool_tags, tools=tuple(tools))
    return get_parser(settings.protocol)


def make_engine(
    model_cfg,
    params,
    tokenizer: Tokenizer | None,
    rollout: RolloutSection,
    *,
    mesh=None,
    seed: int = 0,
    dtypes: models.DTypePolicy | None = None,
    engine: str | None = None,
    **options,
) -> EngineCore:
    """The `rollout.engine` engine (`ENGINE_CLASSES`), whose slots hold a bucketed `max_prompt_len`
    prompt plus the response; with `dtypes`, it serves the compute-dtype copy of the (master)
    params and caches in its dtype. `engine` names another class than `rollout.engine`, and
    `options` go to its constructor (gRPC serving: JetStream's, its sampling; `plan`: no
    weights, whole cache rows). `params` None: an engine without weights (`plan` lowers its
    decode step on abstract ones)."""
    dtype_kwargs = {}
    if dtypes is not None:
        dtype_kwargs = dict(dtype=dtypes.compute_dtype, cache_dtype=dtypes.cache_dtype)
    return ENGINE_CLASSES[engine or rollout.engine]()(
        model_cfg,
        params,
        slots=rollout.slots,
        max_len=rollout.context_len,
        max_prefill_length=rollout.prefill_len,
        tokenizer=tokenizer,
        mesh=mesh,
        seed=seed,
        **dtype_kwargs,
        **options,
    )


class Sampler:
    """Samples trajectories of prompt records with the decode engine and the tools.

    Args:
      engine: the decode engine over the policy's architecture (`make_engine`: an `EngineCore`,
        or a `DecodeEngine` with `rollout.engine: jetstream`).
      tokenizer: the HF tokenizer (chat template, stop strings).
      executor: the ToolExecutor (None: no tools; the protocol is then ignored).
      settings: the rollout section (protocol, limits, sampling).
      system_prompt: an optional system turn for every prompt.
      seed: the run seed: call k draws key k of its rollout stream (`seeds`); a call given its
        own `seed` (evaluations) draws key `seed` of the eval stream instead.
      episodes: a multi-turn environment (`envs.Episodes`): each record's samples play the
        episode of its "env_seed" (trajectories record it as `env_seed`); the environment ends
        an episode after its `max_turns` (the loop's turn limit is one above, so the last turn
        is still stepped) and `context_budget` bounds its tokens. With windowed history
        (`episodes.windowed`), every turn is a fresh prompt (`rollout.windowed`).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        executor: ToolExecutor | None,
        settings: RolloutSection,
        *,
        system_prompt: str | None = None,
        seed: int = 0,
        episodes=None,
    ):
        self.engine, self.tokenizer, self.executor = engine, tokenizer, executor
        self.settings, self.system_prompt, self.seed = settings, system_prompt, seed
        self.episodes = episodes
        self.limits = RolloutLimits.from_section(settings)
        if episodes is not None:
            self.limits = dataclasses.replace(
                self.limits,
                max_turns=episodes.max_turns + 1,
                max_context_tokens=episodes.context_budget,
            )
        function_calling = executor is not None and declares_tools(settings.protocol)
        self.tools_schema = executor.schemas() if function_calling else []
        self._calls = 0  # rollout keys drawn (`state()`: a resumed run continues the stream)
        self._parks, self._in_flight = 0, 0  # the agent loop's scheduling since take_metrics
        self.agent = None
        if settings.agent is not None:
            from jaxrl_tools.agents import rollouts as agents  # noqa: PLC0415 -- openai, starlette: [agents]

            self.agent = agents.load_agent(settings.agent)
        self._agent_stats: dict = {}

    def view(self) -> Sampler:
        """This sampler on a view of its engine (`EngineBase.view`), with scheduling counters
        of its own: it can sample while this one is mid-rollout (an evaluation inside a
        rollout ahead of the update)."""
        other = copy.copy(self)
        other.engine = self.engine.view()
        other._parks, other._in_flight, other._agent_stats = 0, 0, {}
        return other

    def state(self) -> dict:
        """What a checkpoint keeps of the sampler: how far its rollout stream has been drawn."""
        return {"calls": self._calls}

    def set_state(self, state: dict) -> None:
        self._calls = int(state["calls"])

    def __call__(
        self,
        records: Sequence[Record],
        group_size: int,
        params: Any,
        *,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> list[Trajectory]:
        r = self.settings
        temp = r.temperature if temperature is None else temperature
        sampling = SamplingParams(
            temperature=temp, top_k=r.top_k if temp > 0 else 0, top_p=r.top_p if temp > 0 else 1.0
        )
        if seed is None:
            key = seeds.call_key(self.seed, "rollout", self._calls)
            self._calls += 1
        else:
            key = seeds.call_key(self.seed, "eval", seed)
        env_factory, env_seeds = None, None
        if self.agent is not None:
            return self._agent_rollouts(records, group_size, params, sampling, key)
        if self.episodes is not None and self.episodes.windowed:
            return run_windowed(
                self.engine,
                params,
                self.episodes,
                [_env_seed(rec) for rec in records],
                encode=lambda text: prompts.encode_prompt(
                    self.tokenizer, {"prompt": text}, self.tools_schema or None, self.system_prompt
                ),
                max_prompt_len=r.max_prompt_len,
                tokenizer=self.tokenizer,
                num_samples=group_size,
                limits=self.limits,
                sampling=sampling,
                rng=key,
            )
        if self.episodes is not None:
            env_seeds = [_env_seed(rec) for rec in records]
            env_factory = lambda pi, g: self.episodes.start(env_seeds[pi])  # noqa: E731
        stats = {}
        trajs = run_rollouts(
            self.engine,
            params,
            [self.encode_prompt(rec) for rec in records],
            tokenizer=self.tokenizer,
            num_samples=group_size,
            protocol=rollout_parser(r, tuple(self.executor.tools))
            if self.executor is not None
            else None,
            executor=self.executor,
            limits=self.limits,
            sampling=sampling,
            rng=key,
            env_factory=env_factory,
            stats=stats,
        )
        self._parks += stats["parks"]
        self._in_flight = max(self._in_flight, stats["max_in_flight"])
        if env_seeds is not None:
            for t in trajs:
                t.env_seed = env_seeds[t.prompt_index]
        return trajs

    def _agent_rollouts(self, records, group_size, params, sampling, key) -> list[Trajectory]:
        """The recipe's agent, G runs per record (`agents.rollouts`); each record gets its prompt
        as chat messages and the recipe's tool declarations."""
        from jaxrl_tools.agents import rollouts as agents  # noqa: PLC0415 -- openai, starlette: [agents]

        given = []
        for rec in records:
            self.encode_prompt(rec)  # a prompt over rollout.max_prompt_len: the same DataError
            messages = prompts.prompt_messages(rec, self.system_prompt)
            tools = prompts.record_tools(rec, self.tools_schema or None)
            given.append({**rec, "messages": messages, "tool_schemas": tools or []})
        stats = {}
        trajs = agents.run_agent_rollouts(
            self.engine,
            params,
            given,
            self.agent,
            tokenizer=self.tokenizer,
            parser=get_parser(self.settings.protocol) if self.settings.protocol != "none" else None,
            num_samples=group_size,
            limits=self.limits,
            sampling=sampling,
            rng=key,
            max_samples=self.settings.agent_max_samples,
            timeout_s=self.settings.agent_timeout_s,
            stats=stats,
        )
        self._agent_stats = stats
        return trajs

    def take_metrics(self) -> dict[str, float]:
        """The agent loop's scheduling since the last call (then reset): trajectories parked
        out of their slots while waiting on a tool, and the most in flight at once; with
        `rollout.agent`, the requests per run, the rewritten histories and the runs cut at
        `rollout.agent_timeout_s`."""
        out = {
            "schedule/parks": float(self._parks),
            "schedule/in_flight_max": float(self._in_flight),
        }
        self._parks, self._in_flight = 0, 0
        if self._agent_stats:
            st = self._agent_stats
            out["agent/calls_per_run"] = st["calls"] / max(1, st["runs"])
            out["agent/rewrites"] = float(st["rewrites"])
            out["agent/timeouts"] = float(st["timeouts"])
            self._agent_stats = {}
        return out

    def encode_prompt(self, record: Record) -> list[int]:
        """The record's prompt through the chat template, with its tool declarations."""
        return prompts.encode_prompt(
            self.tokenizer,
            record,
            self.tools_schema or None,
            self.system_prompt,
            max_len=self.settings.max_prompt_len,
        )


def _env_seed(record: Record) -> int:
    if "env_seed" not in record:
        name = record.get("id", record.get("prompt"))
        raise ValueError(
            f"record {name!r} has no 'env_seed': with an environment, every prompt record is an "
            "episode (envs.Episodes.records)"
        )
    return int(record["env_seed"])
