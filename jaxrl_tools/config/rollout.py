"""The rollout section, tool declarations and the multi-turn environment section."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from jaxrl_tools import envs, tools
from jaxrl_tools.config.checks import ConfigError, _at_least, _check, _check_choice
from jaxrl_tools.errors import reject_unknown_keys
from jaxrl_tools.prompts import PLAIN_FORMAT
from jaxrl_tools.shapes import next_pow2
from jaxrl_tools.tools.executor import (
    BUDGET_NOTICE,
    INVALID_ACTION,
    INVALID_NOTICE,
    OVER_BUDGET,
)
from jaxrl_tools.tools.parsers import ARTIST_TAG_FORMS, declares_tools

PROTOCOLS = (*sorted(tools.PARSERS), "none")
TEMPLATES = ("chat", "plain")
# The engines that can decode (`rollout.engine`; their classes: rollout.sampler.ENGINE_CLASSES).
ENGINES = ("core", "jetstream")


@dataclass(frozen=True)
class RolloutSection:
    """Sampling and the agent loop."""

    protocol: str = "qwen"  # tool-call format: a jaxrl_tools.tools parser name
    # How prompts are rendered: "chat" (the tokenizer's chat template) or "plain" (text for a
    # base model, in `plain_format`'s words: {system} the system prompt and a newline, {prompt}
    # the question; prompts.plain_template).
    template: str = "chat"
    plain_format: str = PLAIN_FORMAT
    group_size: int = 8  # G responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_prompt_len: int = 512
    max_response_len: int = 1024  # model + observation tokens of one response
    max_tool_calls: int = 3  # C: what a later call gets is `over_budget`'s
    # A call past the budget: "notice" (its observation is `budget_notice`; ZeroTIR words it its
    # own way), "ignore" (not answered: the model writes on, ToRL; inline protocols) or "end"
    # (the response ends there, finish reason "tool_budget").
    over_budget: str = "notice"
    budget_notice: str = BUDGET_NOTICE
    # A turn with neither a call nor an answer (the protocol's answer tag): "end" (the response
    # ends there) or "notice" (Search-R1: `invalid_notice` is inserted, masked out of the loss,
    # and the model tries again; the turn counts against max_turns like a tool turn).
    invalid_action: str = "end"
    invalid_notice: str = INVALID_NOTICE
    # Tool turns per response: model turns answered with tool results. The answer turn after
    # them is not counted, and a call past max_tool_calls gets over_budget's policy first. With
    # an env section, env.max_turns rules.
    max_turns: int = 4
    # Qwen/Hermes protocol: every <tool_call> of an assistant turn runs (concurrently, within
    # tool_concurrency), their results in one tool turn, in order; generation runs to the
    # turn's end. false: it stops at the first </tool_call>, one call per turn. Inline
    # protocols make one call per segment whatever this says.
    multi_call: bool = True
    # ARTIST's tool tags (protocol artist): "tool", every call in a literal <tool>..</tool>
    # whose body names the tool; "named", the paper's <tool_name>..</tool_name>: the tag is one
    # of the run's tools (<python>code</python>, <get_weather>{"city": ..}</get_weather>).
    tool_tags: str = "tool"
    # Tokens one model turn may generate (Search-R1's per-turn cap); a turn cut there ends the
    # response ("turn_length"), or is an environment's action as written. null = no cap.
    max_turn_tokens: int | None = None
    chunk_size: int = 32  # tokens decoded per jitted chunk before the host looks for tool calls
    slots: int = 64  # concurrent sequences in the decode engine's KV cache
    # Trajectories waiting on a tool that may hand their slot to a waiting sample, their cache
    # rows kept in host memory (up to their live length) meanwhile. null = slots; 0 = off.
    max_parked: int | None = None
    max_obs_tokens: int = 512  # observation cap (head + ... + tail)
    # The engine that decodes (ENGINES): "core" (EngineCore) or "jetstream" (the
    # same engine as a JetStream Engine, engine.jetstream.DecodeEngine; the [serve] extra).
    engine: str = "core"
    # The engine's own mesh (DxFxT over the trainer's devices, e.g. tensor-parallel decode beside
    # an fsdp update): the weights are resharded onto it after each update. null = trainer.mesh.
    mesh: str | None = None
    tool_timeout_s: float = 10.0
    tool_concurrency: int = 8
    eval_temperature: float = 0.0  # 0 = greedy
    eval_group_size: int = 1
    # An agent written as client code, "package.module:function" (agents.rollouts): an async
    # function(client, record) on an in-process OpenAI client over the policy. null: the
    # built-in loop (protocol, tools, environment).
    agent: str | None = None
    # Samples one agent run may make: a request that does not continue the run's context (a
    # rewritten history) starts another, trained as a row of its own with the run's advantage;
    # past this many it is refused (HTTP 400). Above 1, the update has this many rows per run.
    agent_max_samples: int = 1
    # Wall-clock bound of one agent run: past it the run is cancelled, its group left out of
    # the update and counted in agent/timeouts (a run that never returns cannot hang training).
    agent_timeout_s: float = 600.0

    def __post_init__(self):
        _check_choice(self.protocol, "rollout.protocol", PROTOCOLS)
        _check_choice(self.engine, "rollout.engine", ENGINES)
        _check_choice(self.template, "rollout.template", TEMPLATES)
        _check(
            self.template == "chat" or not declares_tools(self.protocol),
            "rollout.template",
            f"'plain' has no tool turns, which protocol {self.protocol!r} answers in: use an "
            "inline protocol (torl, zerotir, retool, search_r1, artist) or none",
        )
        _check(
            isinstance(self.plain_format, str) and self.plain_format.count("{prompt}") == 1,
            "rollout.plain_format",
            f"must hold {{prompt}} (where the question goes) once, got {self.plain_format!r}",
        )
        _check_choice(self.over_budget, "rollout.over_budget", OVER_BUDGET)
        _check_choice(self.invalid_action, "rollout.invalid_action", INVALID_ACTION)
        _check(
            self.invalid_action == "end"
            or getattr(tools.PARSERS.get(self.protocol), "answer_pattern", None) is not None,
            "rollout.invalid_action",
            f"'notice' needs a protocol with an answer tag (search_r1), got {self.protocol!r}",
        )
        _check_choice(self.tool_tags, "rollout.tool_tags", ARTIST_TAG_FORMS)
        _check(
            self.tool_tags == "tool" or self.protocol == "artist",
            "rollout.tool_tags",
            f"'named' is ARTIST's tag form: it needs protocol artist, got {self.protocol!r}",
        )
        _check(
            self.over_budget != "ignore" or not declares_tools(self.protocol),
            "rollout.over_budget",
            f"'ignore' lets the model write on after its call, which a chat protocol "
            f"({self.protocol}) ends with its turn: use notice or end",
        )
        _check(self.group_size >= 1, "rollout.group_size", f"must be >= 1, got {self.group_size}")
        _check(self.temperature >= 0, "rollout.temperature", "must be >= 0")
        _check(self.eval_temperature >= 0, "rollout.eval_temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "rollout.top_k", "must be >= 0")
        _at_least(
            self,
            "rollout",
            1,
            "max_prompt_len",
            "max_response_len",
            "chunk_size",
            "slots",
            "max_turns",
            "max_obs_tokens",
            "tool_concurrency",
            "eval_group_size",
            "agent_max_samples",
        )
        _check(self.max_tool_calls >= 0, "rollout.max_tool_calls", "must be >= 0")
        _check(self.agent_timeout_s > 0, "rollout.agent_timeout_s", "must be > 0 seconds")
        _check(
            self.max_turn_tokens is None or 1 <= self.max_turn_tokens <= self.max_response_len,
            "rollout.max_turn_tokens",
            f"must be in [1, max_response_len={self.max_response_len}] or null, got "
            f"{self.max_turn_tokens}",
        )
        _check(
            self.max_turn_tokens is None or self.agent is None,
            "rollout.max_turn_tokens",
            "caps the built-in loop's turns; an agent caps its own (max_tokens per request)",
        )
        _check(
            self.max_parked is None or self.max_parked >= 0,
            "rollout.max_parked",
            f"must be >= 0 or null, got {self.max_parked}",
        )
        _check(self.tool_timeout_s > 0, "rollout.tool_timeout_s", "must be > 0")
        _check(
            self.agent is None or re.fullmatch(r"[\w.]+:\w+", self.agent) is not None,
            "rollout.agent",
            f"must look like 'package.module:function' or null, got {self.agent!r}",
        )
        _check(
            self.mesh is None or re.fullmatch(r"\d+x\d+x\d+", self.mesh) is not None,
            "rollout.mesh",
            f"must look like 'DxFxT' (e.g. '1x1x8') or null, got {self.mesh!r}",
        )

    @property
    def prefill_len(self) -> int:
        """The engine's prompt bucket: `max_prompt_len` up to a power of two (>= 16)."""
        return next_pow2(self.max_prompt_len, 16)

    @property
    def context_len(self) -> int:
        """Positions of one engine slot: the prompt bucket and the response."""
        return self.prefill_len + self.max_response_len

    @property
    def mesh_shape(self) -> tuple[int, int, int] | None:
        """The engine's (data, fsdp, tensor), or None: the trainer's mesh."""
        return None if self.mesh is None else tuple(int(x) for x in self.mesh.split("x"))


@dataclass(frozen=True)
class ToolSpec:
    """A tool declaration: `cls` ("python", "search", "calculator" or "module:Class") + kwargs.

    YAML may spell the key `class:`; it is read as `cls`.
    """

    cls: str = "python"
    name: str | None = None  # the function name the model sees (default: the tool's own)
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        _check(bool(self.cls), "tools[].cls", "must be non-empty")


def _check_tool(spec: ToolSpec, where: str) -> None:
    """The tool class exists and takes the `config` keys (checked against its signature, so a
    recipe with a wrong key fails at load, before any model or worker pool starts)."""
    try:
        cls = tools.tool_class(spec.cls)
    except ValueError as e:
        raise ConfigError(f"{where}.cls: {e}") from None
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if n != "self" and p.kind is not p.VAR_POSITIONAL]
    keys = [key for key in spec.config if key != "type"]  # verl's tool YAML names the type
    reject_unknown_keys(keys, valid, f"{where}.config", f"tool {spec.cls!r}")


ENV_HISTORY = ("full", "last_k", "state")


@dataclass(frozen=True)
class EnvSection:
    """A multi-turn environment (`jaxrl_tools.envs`): every prompt is one episode.

    Episodes replace the data files: the prompt is the environment's instructions and first
    observation, and the G samples of a prompt share its seed (one start state per group, as
    GiGPO's anchor states need). Training seeds are `seed`, `seed + 1`, ...; held-out seeds
    start at `seed + envs.EVAL_SEED_OFFSET`. Grid games (sokoban, frozenlake) are played in
    RAGEN turns (`<think>..</think><answer>..</answer>`).

    History (what the model sees each turn):
    - `full`: each episode is one sequence holding its whole history. Budget (`context_budget`,
      prompt + response tokens): an episode whose next turn or observation would pass it ends
      there (finish reason "budget"); nothing is cut from the middle and no earlier turn is
      dropped; the turns played keep their rewards, and a turn cut mid-way gets no environment
      step (step mask 0).
    - `last_k`: every turn is a fresh prompt: the instructions, the last `history_length`
      (observation, answer) pairs and the current observation (GiGPO's history_length), so
      long horizons (30-100 turns) cost a bounded prompt. Truncation: a window longer than
      `rollout.max_prompt_len` drops its oldest pairs until it fits; an episode whose current
      observation does not fit alone ends there ("budget"). Each turn is its own training row;
      `rollout.max_response_len` and `context_budget` bound one turn.
    - `state`: the same with no earlier turns (the current observation only: an MDP).
    Windowed history needs an estimator whose advantage is one value per turn
    (`algorithms.turn_level`): no critic, no token rewards.
    """

    name: str | None = None  # a registered environment (envs.env_names()); null = none
    kwargs: dict[str, Any] = field(default_factory=dict)  # the environment's constructor's
    max_turns: int = 5  # turns per episode (the environment ends the episode after these)
    max_actions_per_turn: int = 1  # grid games: actions taken from one answer (RAGEN)
    format_penalty: float = -0.1  # grid games: reward of a turn not in RAGEN's form
    history: str = "full"  # what the model sees each turn: full | last_k | state
    history_length: int = 2  # last_k: earlier (observation, answer) pairs in each prompt
    context_budget: int | None = None  # prompt + response tokens per episode (null: engine's)
    seed: int = 0  # first training episode seed
    train_episodes: int = 2000  # distinct training seeds (repeated by the loader)
    eval_episodes: int = 64  # held-out seeds
    sandbox_workers: int = 2  # sandbox pool of environments that run code (refine)

    @property
    def windowed(self) -> bool:
        """Whether each turn is a fresh prompt (history last_k or state) of an environment."""
        return self.name is not None and self.history != "full"

    def __post_init__(self):
        if self.name is None:
            return
        _check_choice(self.name, "env.name", envs.env_names())
        _check_choice(self.history, "env.history", ENV_HISTORY)
        _at_least(self, "env", 1, "history_length")
        _at_least(self, "env", 1, "max_turns", "max_actions_per_turn", "train_episodes")
        _at_least(self, "env", 1, "eval_episodes", "sandbox_workers")
        _check(
            self.context_budget is None or self.context_budget >= 2,
            "env.context_budget",
            "must be >= 2 tokens (or null)",
        )
        valid = envs.env_kwargs(self.name)
        reject_unknown_keys(self.kwargs, valid, "env.kwargs", f"environment {self.name!r}")
