"""The records stages exchange, and the protocols modules meet at.

    records (data) -> Sampler -> [Trajectory] -> make_batch (train.batch) -> Batch -> RLTrainer

A `Record` is one prompt row (a plain mapping: "prompt", "ground_truth", optional "tools",
"id", "difficulty", ...). Trajectories are token-in-token-out: `response_ids` are exactly the
tokens sampled or inserted, with `loss_mask` 1 on model tokens and 0 on observations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

AGENT_TIMEOUT = "agent_timeout"  # finish reason of an agent run cut at its timeout

Record = Mapping[str, Any]


class Tokenizer(Protocol):
    """What the library uses of a Hugging Face tokenizer."""

    eos_token_id: int | None
    pad_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Sequence[Mapping], **kwargs: Any) -> Any: ...


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
      finish_reason: "eos" | "stop" | "length" | "budget" | "turns" | "done", or
        AGENT_TIMEOUT (an agent run cut at rollout.agent_timeout_s).
      env_rewards: rewards returned by the environment, one per env step.
      env_states: per env step, the state its action was taken in (`info["anchor_state"]`,
        GiGPO's anchor; None when the environment gives none).
      env_success: whether the environment's last step reached the goal (`info["success"]`).
      env_metrics: per env step, the step's other numeric `info` entries (e.g. refine's
        "hacking"); their means over a batch's steps are logged as `env/<name>`.
      response_text: decoded response, observations included (when a tokenizer was given).
      model_text: what the model wrote: the response with each observation's text left out
        (its markup kept, e.g. "<interpreter>\n\n</interpreter>" or the chat template's tool
        turn), so that a tool's output or a retrieved passage cannot answer for the model.
        Rewards and answer checks score this.
      env_seed: the seed its environment episode was reset with (None without an environment;
        the G samples of a prompt share it, so GiGPO's anchor states line up).
      turns: with windowed history (`env.history` last_k / state), the episode's turns, each
        a trajectory of its own (its windowed prompt, that turn's tokens): what is trained.
        The episode itself then holds the first prompt and every turn's tokens back to back
        (no observations), for rewards and statistics. None: the episode is one sequence.
        An agent's episode (`rollout.agent`) whose history was rewritten holds its samples here
        the same way.
      agent_reward: the reward an agent written as client code returned (`rollout.agent`);
        None: the recipe's reward scores the trajectory.
      versions: the policy version each model token was sampled with, in order (one per 1 of
        loss_mask), when rollouts run ahead of the update (`rollout.ahead`); empty otherwise.
      invalid_actions: model turns with neither a call nor an answer (`rollout.invalid_action`:
        each got the notice, or the last one ended the response).
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
    env_states: list = dataclasses.field(default_factory=list)
    env_success: bool = False
    env_metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)
    response_text: str = ""
    model_text: str = ""
    env_seed: int | None = None
    turns: list[Trajectory] | None = None
    agent_reward: float | None = None
    versions: list[int] = dataclasses.field(default_factory=list)
    invalid_actions: int = 0  # last: the fields before it are also given by position

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

    def add_turn(self, turn: Trajectory) -> None:
        """Appends `turn` (a sample of this episode's) to `turns` and its response to this one's
        as one model span: what an episode of several samples trains on."""
        self.turns.append(turn)
        start = len(self.response_ids)
        self.response_ids += turn.response_ids
        self.loss_mask += turn.loss_mask
        self.logprobs += turn.logprobs
        self.versions += turn.versions
        self.spans.append(Span("model", start, len(self.response_ids)))


@dataclasses.dataclass(frozen=True)
class Batch:
    """One RL update's input: trajectories packed into right-padded [R, T] host arrays.

    Rows past `num_rows` are padding (all-zero masks): they change no sum and no denominator,
    and advantage estimators never see them. R (rows) is fixed per run so the update compiles
    once per length bucket T.

    Attributes:
      tokens_RT, positions_RT, attention_RT: the sequences (prompt + response).
      loss_mask_RT: 1 on model-sampled response tokens.
      behaviour_logp_RT: the sampler's log-probs of those tokens (0 elsewhere).
      scores_R: the trajectory rewards (0 on padding rows).
      num_rows: real rows, G consecutive ones per kept prompt group.
      metrics: host statistics of the rollout (rewards, tool use, lengths, filters).
      step_rewards_RS, step_mask_RS, anchor_ids_RS, token_step_RT: per-turn environment
        rewards, which turns are real, state ids (equal ids = same anchor state within the
        batch) and each token's turn index (`train.batch.step_arrays`; None when not built).
      baseline_R: the greedy rollout's reward of each row's prompt (ReMax; None otherwise).

    Windowed history (`Trajectory.turns`): the rows are turns, each trained on its own prompt;
    the estimators see the episodes as [E, S] layouts of one entry per turn. `scores_R` is
    then each turn's episode score, the step arrays are [E, S] over episodes,
    `episode_scores_E` the episodes' scores, `num_episodes` the real ones, and `turn_slot_R`
    the index e * S + k of the row's turn in the [E, S] layout (-1 on padding);
    `token_step_RT` and `baseline_R` are None (ReMax is not turn-level).
    """

    tokens_RT: np.ndarray
    positions_RT: np.ndarray
    attention_RT: np.ndarray
    loss_mask_RT: np.ndarray
    behaviour_logp_RT: np.ndarray
    scores_R: np.ndarray
    num_rows: int
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    step_rewards_RS: np.ndarray | None = None
    step_mask_RS: np.ndarray | None = None
    anchor_ids_RS: np.ndarray | None = None
    token_step_RT: np.ndarray | None = None
    baseline_R: np.ndarray | None = None
    episode_scores_E: np.ndarray | None = None
    num_episodes: int = 0
    turn_slot_R: np.ndarray | None = None


class Sampler(Protocol):
    """Records -> trajectories, `group_size` consecutive ones per record."""

    def __call__(
        self,
        records: Sequence[Record],
        group_size: int,
        params: Any,
        *,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> list[Trajectory]: ...
