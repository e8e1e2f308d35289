"""`RolloutLimits`: the per-trajectory limits of a rollout, and the resolver they set."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxrl_tools.rollout.resolver import (
    BUDGET_NOTICE,
    INVALID_ACTION,
    INVALID_NOTICE,
    OVER_BUDGET,
    Resolver,
)

if TYPE_CHECKING:
    from jaxrl_tools.config import RolloutSection


@dataclasses.dataclass(frozen=True)
class RolloutLimits:
    """Per-trajectory limits.

    Attributes:
      max_response_tokens: response tokens (model + observation) before finishing with "length".
      max_tool_calls: C, tool calls executed per trajectory; a later call gets `budget_notice`
        as its observation (`over_budget` "notice"), no answer ("ignore": the model writes
        on), or ends the trajectory ("end": finish reason "tool_budget").
      max_turns: tool turns per trajectory (model turns answered with tool results; the
        answer turn after them and calls past the budget, which get `over_budget`'s policy
        first, do not count); with an environment, model turns (each an environment step).
      max_turn_tokens: tokens one model segment may generate (None: no cap); a segment cut
        there ends with "turn_length" (`Resolver.end_segment`).
      max_obs_tokens: cap per tool output (head + "..." + tail beyond it).
      chunk_size: decode steps per jitted generate call.
      max_context_tokens: prompt + response tokens of one trajectory (None: the engine's
        max_len); a segment or observation that would pass it ends the trajectory ("budget").
      max_parked: trajectories waiting on a tool that may give up their slot to a waiting
        sample (each keeps its cache row, up to its live length, in host memory meanwhile);
        None: as many as the engine has slots; 0: a trajectory keeps its slot while it waits.
      invalid_action: a segment with neither a call nor the protocol's answer: "end" (the
        trajectory ends) or "notice" (`invalid_notice` inserted, counted as a tool turn).
    """

    max_response_tokens: int = 512
    max_tool_calls: int = 3
    max_turns: int = 8
    max_obs_tokens: int = 256
    chunk_size: int = 16
    max_context_tokens: int | None = None
    max_parked: int | None = None
    max_turn_tokens: int | None = None
    over_budget: str = "notice"
    budget_notice: str = BUDGET_NOTICE
    invalid_action: str = "end"
    invalid_notice: str = INVALID_NOTICE

    def __post_init__(self):
        if self.over_budget not in OVER_BUDGET:
            raise ValueError(f"RolloutLimits.over_budget must be one of {OVER_BUDGET}")
        if self.invalid_action not in INVALID_ACTION:
            raise ValueError(f"RolloutLimits.invalid_action must be one of {INVALID_ACTION}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("over_budget", "budget_notice", "invalid_action", "invalid_notice"):
                continue
            if v is None and f.name in ("max_context_tokens", "max_parked", "max_turn_tokens"):
                continue
            least = 0 if f.name in ("max_tool_calls", "max_parked") else 1
            if not isinstance(v, int) or v < least:
                raise ValueError(f"RolloutLimits.{f.name} must be an int >= {least}, got {v!r}")

    @classmethod
    def from_section(cls, section: RolloutSection) -> RolloutLimits:
        """The limits a run's `rollout` section sets (no context budget: the engine's)."""
        return cls(
            max_response_tokens=section.max_response_len,
            max_tool_calls=section.max_tool_calls,
            max_turns=section.max_turns,
            max_turn_tokens=section.max_turn_tokens,
            over_budget=section.over_budget,
            budget_notice=section.budget_notice,
            invalid_action=section.invalid_action,
            invalid_notice=section.invalid_notice,
            max_obs_tokens=section.max_obs_tokens,
            chunk_size=section.chunk_size,
            max_parked=section.max_parked,
        )

    def resolver(self, *, tokenizer, parser, executor, env_format, ctx_limit: int) -> Resolver:
        """The resolver of trajectories under these limits whose context ends at `ctx_limit`."""
        return Resolver(
            tokenizer=tokenizer,
            parser=parser,
            executor=executor,
            env_format=env_format,
            max_tool_calls=self.max_tool_calls,
            over_budget=self.over_budget,
            budget_notice=self.budget_notice,
            invalid_action=self.invalid_action,
            invalid_notice=self.invalid_notice,
            max_turns=self.max_turns,
            max_obs_tokens=self.max_obs_tokens,
            max_response_tokens=self.max_response_tokens,
            ctx_limit=ctx_limit,
        )
