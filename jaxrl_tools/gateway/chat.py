"""Chat messages to prompt tokens and completions back to messages, token-exact across turns.

An agent sends its whole history with every request. Put through the chat template again, the
assistant turns it sampled come back as other tokens (the template writes tool calls its own
way; a tokenizer may split a text differently from how it was sampled), and a policy trained
on them would see tokens it never produced. `TemplateChat` remembers every assistant message it
returned with the exact tokens of its context (the prompt it continued and the tokens sampled).
A request whose messages start with such a message is that context followed by the template's
markup for the messages after it (tool results, a user turn: the text the template puts after
an assistant turn, as the built-in loop appends it: `prompts.chat_continuation`), so an agent
that appends to its history continues the very tokens it sampled. Any other request is
rendered whole by the template.

Tool calls are read with the recipe's parser (Qwen/Hermes `<tool_call>` JSON) from the text
the model wrote, stop string included.
"""

from __future__ import annotations

import collections
import json
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_tools.gateway.backend import BadRequest, Completion
from jaxrl_tools.prompts import encode_observation

_MARKER = "\u2063jaxrl-gateway-assistant\u2063"


def _arguments(raw: Any) -> Any:
    """A call's arguments as a value: JSON text is parsed, so re-serialised text matches."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def canonical(messages: Sequence[dict], tools: Sequence[dict] | None) -> str:
    """A key for a history: what the template renders of it (role, text, tool calls), not how
    a client spells it (null or "" content, extra fields, re-serialised arguments, call ids)."""
    rows = []
    for m in messages:
        row = [m.get("role"), m.get("content") or ""]
        for call in m.get("tool_calls") or ():
            fn = call.get("function", call) if isinstance(call, dict) else {}
            row.append([fn.get("name"), _arguments(fn.get("arguments"))])
        if m.get("role") == "tool" and m.get("name"):
            row.append(m["name"])
        rows.append(row)
    return json.dumps([rows, list(tools or ())], sort_keys=True, default=str)


class TemplateChat:
    """The `Chat` of a tokenizer's chat template.

    Args:
      tokenizer: an HF tokenizer with a chat template.
      parser: reads tool calls from a completion's text (`tools.get_parser("qwen")`); None:
        replies are plain text.
      eos_ids: the end-of-turn tokens (a completion ending with one has closed its turn).
      remember: how many returned messages to keep (least recently used dropped first; their
        contexts are kept as int32 arrays: 4 bytes a token).
    """

    def __init__(self, tokenizer, parser=None, *, eos_ids=(), remember: int = 4096):
        self.tokenizer, self.parser = tokenizer, parser
        self.eos_ids = set(eos_ids)
        self.remember = int(remember)
        # history key -> (context ids: prompt + sampled, whether it ended with an end token)
        self._contexts: collections.OrderedDict[str, tuple[np.ndarray, bool]] = (
            collections.OrderedDict()
        )
        # a continued prompt's ids (as bytes) -> (its context's length, the markup after it)
        self._continuations: collections.OrderedDict[bytes, tuple[int, str]] = (
            collections.OrderedDict()
        )

    # ------------------------------------------------------------------ prompts
    def prompt_ids(
        self, messages: Sequence[dict], tools: Sequence[dict] | None, opener: str = ""
    ) -> list[int]:
        messages = [self._normal(m) for m in messages]
        for k in range(len(messages) - 1, -1, -1):
            if messages[k]["role"] != "assistant":
                continue
            hit = self._contexts.get(canonical(messages[: k + 1], tools))
            if hit is not None:
                self._contexts.move_to_end(canonical(messages[: k + 1], tools))
                return self._continue(hit, messages[k + 1 :], opener)
        return self._render(messages, tools) + self._encode(opener)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    @staticmethod
    def _normal(m: dict) -> dict:
        """A message (as the routes checked it: `gateway.app`) as the template takes it: text
        content, tool-call arguments as values."""
        out = {"role": m["role"], "content": m.get("content") or ""}
        if m["role"] == "assistant" and m.get("tool_calls"):
            out["tool_calls"] = [
                {
                    "id": call.get("id"),
                    "type": "function",
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": _arguments(call["function"].get("arguments")),
                    },
                }
                for call in m["tool_calls"]
            ]
        if m["role"] == "tool" and m.get("name"):
            out["name"] = m["name"]
        return out

    def _render(self, messages: list[dict], tools) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as e:  # noqa: BLE001 -- a template's own error, e.g. a role order
            raise BadRequest(f"the chat template cannot render messages: {e}", "messages") from e
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _continue(self, hit: tuple[np.ndarray, bool], rest: list[dict], opener: str) -> list[int]:
        """The remembered context, then the template's markup of `rest` after an assistant
        turn (without the end token the model sampled, if it did), then `opener`'s tokens (in
        the markup: what the model reads, not what it wrote)."""
        context, ended_with_eos = hit[0].tolist(), hit[1]
        if not rest:  # the assistant turn is to be continued: the context as it is
            return list(context) + self._encode(opener)
        contents = [m["content"] for m in rest]

        def render(texts: list[str]) -> str:
            msgs = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARKER}]
            msgs += [{**m, "content": t} for m, t in zip(rest, texts)]
            text = self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True
            )
            return text[text.index(_MARKER) + len(_MARKER) :]

        last = (
            self.tokenizer.decode(context[-1:], skip_special_tokens=False) if ended_with_eos else ""
        )
        ids, markup = encode_observation(self.tokenizer, render, contents, drop_prefix=last)
        prompt = context + ids + self._encode(opener)
        self._keep(self._continuations, _key(prompt), (len(context), markup + opener))
        return prompt

    def markup(self, prompt_ids: Sequence[int], context_len: int) -> str | None:
        """The markup (texts left out) of what this chat appended after the first
        `context_len` tokens to make `prompt_ids`; None if it did not."""
        known = self._continuations.get(_key(prompt_ids))
        return known[1] if known is not None and known[0] == context_len else None

    # ------------------------------------------------------------------ replies
    def reply(self, messages, tools, completion: Completion) -> tuple[dict, str]:
        ids = completion.token_ids
        if completion.ended_with_eos:
            ids = ids[:-1]
        written = self.tokenizer.decode(ids, skip_special_tokens=False)
        message: dict[str, Any] = {"role": "assistant", "content": completion.text}
        finish = completion.finish_reason
        parsed = self.parser.parse(written) if self.parser is not None and tools else None
        if parsed is not None and parsed.calls and not parsed.error:
            content = written
            for call in parsed.calls:  # the text around the calls is the content
                content = content.replace(call.raw, "")
            content = content.replace("<tool_call>", "").replace("</tool_call>", "").strip()
            message = {
                "role": "assistant",
                "content": content or None,
                "tool_calls": [
                    {
                        "id": f"call_{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                    }
                    for c in parsed.calls
                ],
            }
            finish = "tool_calls"
        history = [self._normal(m) for m in [*messages, message]]
        ids = np.asarray([*completion.prompt_ids, *completion.token_ids], np.int32)
        context = (ids, completion.ended_with_eos)
        self._keep(self._contexts, canonical(history, tools), context)
        return message, finish

    def _keep(self, table: collections.OrderedDict, key, value) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.remember:
            table.popitem(last=False)


def _key(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, np.int32).tobytes()
