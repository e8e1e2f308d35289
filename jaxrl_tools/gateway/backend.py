"""What the OpenAI-compatible gateway asks of the engine and of the chat layer.

The HTTP routes (`gateway.app`) translate OpenAI requests into `Generation`s for a `Backend`
(the rollout engine: `gateway.engine_backend`) and chat messages into prompt token ids with a
`Chat` (the tokenizer's chat template, with token-exact continuations: `gateway.chat`). Both are
protocols so that the routes are tested with small fakes and served with the real things.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class BadRequest(ValueError):
    """A request the gateway refuses (HTTP 400): `param` names the field, the message says what
    to send instead."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Generation:
    """One sequence to decode.

    Attributes:
      prompt_ids: the context, token ids.
      max_tokens: most tokens to sample (None: up to the engine's context).
      temperature, top_p: sampling (temperature 0: greedy).
      stop: strings that end the sequence (found in text; not returned in `Completion.text`).
      seed: the sequence's own RNG seed (None: the backend picks one).
      opener: text the reply was made to start with (a forced tool call, `tool_choice`): its
        tokens end `prompt_ids`, given, not sampled.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    opener: str = ""


@dataclasses.dataclass
class Completion:
    """A decoded sequence.

    Attributes:
      prompt_ids: the context it continued.
      token_ids: every token sampled, the end-of-turn token or the tokens of a stop string
        included (what the model produced, for training).
      logprobs: the engine's log-prob of each sampled token.
      text: the tokens as text, cut before the stop string or end token that ended them.
      finish_reason: "stop" (an end token or a stop string) or "length" (max_tokens, or the
        context is full).
      ended_with_eos: whether the last token is an end token (it closes the assistant turn).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    ended_with_eos: bool = False


# Streaming: called with each run of new tokens (ids, log-probs) as they are decoded.
OnTokens = Callable[[list[int], list[float]], None]


class Backend(Protocol):
    """Decodes `Generation`s, many at once (each call awaits its own sequence)."""

    tokenizer: Any
    model: str  # the model name `GET /v1/models` lists
    max_context: int  # prompt + completion tokens one sequence may hold

    async def generate(self, gen: Generation, on_tokens: OnTokens | None = None) -> Completion: ...


class Chat(Protocol):
    """Chat messages to prompt ids, and completions back to assistant messages."""

    def prompt_ids(
        self, messages: Sequence[dict], tools: Sequence[dict] | None, opener: str = ""
    ) -> list[int]:
        """The prompt of a chat request: its messages (OpenAI format, as dicts) through the
        chat template with `tools`, ending with the assistant generation prompt and the tokens
        of `opener` (the tokenizer's encoding of it alone: the start a tool_choice forces). An
        assistant message this chat returned earlier keeps the exact tokens sampled for it.
        Raises BadRequest naming the message that cannot be rendered."""
        ...

    def reply(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None,
        completion: Completion,
    ) -> tuple[dict, str]:
        """The assistant message of `completion` (OpenAI format: "content", and "tool_calls"
        where the text holds calls the recipe's parser reads) and its finish reason
        ("tool_calls" where it has calls, else the completion's). Remembers the message's exact
        tokens for later requests that send it back."""
        ...


@dataclasses.dataclass
class ChatCall:
    """A chat request as every route reads it (chat completions, responses, messages): its
    messages and tools (OpenAI chat format), prompt and generations (one per choice), and the
    start of the reply its tool_choice forces (`opener`, its tokens `forced` ending `prompt`)."""

    messages: list[dict]
    tools: list[dict] | None
    gens: list[Generation]
    prompt: list[int]
    opener: str = ""
    forced: list[int] = dataclasses.field(default_factory=list)

    def written(self, c: Completion) -> Completion:
        """`c` as the chat reads it: the forced opener moved from the prompt to the front of
        the reply (the tokens the reply's text and tool calls are read from)."""
        n = len(self.forced)
        if not n or list(c.prompt_ids[-n:]) != self.forced:
            return c
        return dataclasses.replace(
            c,
            prompt_ids=list(c.prompt_ids[:-n]),
            token_ids=[*self.forced, *c.token_ids],
            logprobs=[0.0] * n + list(c.logprobs),
            text=self.opener + c.text,
        )
