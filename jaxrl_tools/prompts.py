"""The only prompt renderer: a record's prompt through the tokenizer's chat template with its
tool declarations, the template's own markup for tool and environment turns, and prompt lengths.

    tok = load_tokenizer("runs/demo/tokenizer")
    text = render_prompt(tok, record, tools_schema, system_prompt)
    ids = encode_prompt(tok, record, tools_schema, system_prompt, max_len=512)
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxrl_tools.data import DataError

# `rollout.template: plain`, for base models: the prompt in `rollout.plain_format`'s words, where
# {system} is the system prompt and a newline (nothing without one) and {prompt} the user's text;
# the default is R1-Zero's form. Tool declarations are not rendered (an inline protocol's tools
# are described in the system prompt); a trace's response follows, then the end-of-text token.
PLAIN_FORMAT = "{system}User: {prompt}\nAssistant:"
_PLAIN_SLOTS = {"{system}": "{{ ns.system }}", "{prompt}": "{{ ns.prompt }}"}


def plain_template(fmt: str = PLAIN_FORMAT) -> str:
    """A chat template (Jinja) that renders `fmt` (above), so that every renderer of the run
    (prompts, SFT traces, the server) writes the same plain text."""
    head = (
        "{%- set ns = namespace(system='', prompt='') -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + '\\n' -%}"
        "{%- elif m['role'] == 'user' and not ns.prompt -%}{%- set ns.prompt = m['content'] -%}"
        "{%- elif m['role'] != 'assistant' or not loop.last -%}"
        "{{ raise_exception('the plain template renders a system prompt, one user turn and the "
        "response; it has no ' + m['role'] + ' turn here') }}"
        "{%- endif -%}"
        "{%- endfor -%}"
    )
    body = [
        _PLAIN_SLOTS.get(part) or "{{ " + json.dumps(part, ensure_ascii=False) + " }}"
        for part in re.split(r"(\{system\}|\{prompt\})", fmt)
        if part
    ]
    tail = (
        "{%- if messages[-1]['role'] == 'assistant' -%}"
        "{{ messages[-1]['content'] + eos_token }}"
        "{%- endif -%}"
    )
    return head + "".join(body) + tail


def use_template(tokenizer, template: str, plain_format: str = PLAIN_FORMAT):
    """The tokenizer, rendering with `rollout.template`: its own chat template ("chat"), or
    `plain_template(plain_format)` ("plain")."""
    if template == "plain":
        tokenizer.chat_template = plain_template(plain_format)
    return tokenizer


def _schema_name(schema: Mapping) -> str | None:
    fn = schema.get("function", schema)
    return fn.get("name") if isinstance(fn, Mapping) else None


def select_tools(record_tools: Any, tools_schema: Any) -> list[dict] | None:
    """The tool declarations for one record.

    Args:
      record_tools: the record's `tools` (None, a list of tool names, or a list of schemas).
      tools_schema: all available declarations (a list of JSON schemas, or a name -> schema
        mapping), or None.

    Returns:
      The schemas to render (None = no tools). A record that names tools gets those (an unknown
      name is a DataError); a record with its own schemas uses them; a record without `tools`
      gets all of `tools_schema`.
    """
    if isinstance(tools_schema, Mapping):
        by_name = dict(tools_schema)
    else:
        by_name = {_schema_name(s): s for s in (tools_schema or [])}
    if record_tools is None:
        return list(by_name.values()) or None
    out = []
    for t in record_tools:
        if isinstance(t, Mapping):
            out.append(dict(t))
        elif t in by_name:
            out.append(by_name[t])
        else:
            raise DataError(f"record names unknown tool {t!r}; declared tools: {sorted(by_name)}")
    return out or None


def prompt_messages(record: Mapping[str, Any], system_prompt: str | None = None) -> list[dict]:
    """The record's prompt as chat messages, with `system_prompt` first unless it has one."""
    prompt = record["prompt"]
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and (not msgs or msgs[0].get("role") != "system"):
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return msgs


def record_tools(record: Mapping[str, Any], tools_schema: Any = None) -> list[dict] | None:
    """The tool declarations a record's prompt is rendered with (`select_tools`; without
    `tools_schema`, the full schemas a record may carry itself)."""
    if tools_schema is not None:
        return select_tools(record.get("tools"), tools_schema)
    if record.get("tools") and all(isinstance(t, Mapping) for t in record["tools"]):
        return [dict(t) for t in record["tools"]]
    return None


def render_prompt(
    tokenizer,
    record: Mapping[str, Any],
    tools_schema: Any = None,
    system_prompt: str | None = None,
) -> str:
    """Apply the tokenizer's chat template to a record's prompt, with its tool declarations,
    ending with the assistant generation prompt.

    Args:
      tokenizer: an HF tokenizer with a chat template.
      record: a record from `RecordSource` (or any mapping with "prompt" and optional "tools").
      tools_schema: available tool declarations (see `select_tools`); None = no tools.
      system_prompt: optional system message (the record's own system message wins).

    Returns:
      The prompt text (tokenize with add_special_tokens=False).
    """
    return tokenizer.apply_chat_template(
        prompt_messages(record, system_prompt),
        tools=record_tools(record, tools_schema),
        tokenize=False,
        add_generation_prompt=True,
    )


def chat_continuation(tokenizer, role: str, contents: Sequence[str]) -> str:
    """The text the tokenizer's chat template puts after an assistant turn for `role` messages
    (tool results, or an environment's user turn), up to the next assistant generation prompt.

    For Qwen: "<|im_end|>\n<|im_start|>user\n<tool_response>\n...\n</tool_response><|im_end|>
    \n<|im_start|>assistant\n". The template is the only owner of turn markup: SFT traces
    (rendered whole by it) and rollouts (which append this) see the same text.
    """
    marker = "\u2063jaxrl-assistant-turn\u2063"
    msgs = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}]
    msgs += [{"role": role, "content": c} for c in contents]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return text[text.index(marker) + len(marker) :]


def trace_segments(
    tokenizer, record: Mapping[str, Any], system_prompt: str | None, observation=None
) -> list[list]:
    """An SFT trace from a prompt record and its whole response: the prompt as the rollout
    renders it (not trained), then the response and the template's end of turn (trained),
    except the observations in it (`observation`: a regex of the protocol's markup, e.g.
    ReTool's <interpreter> block), which the rollout inserts and the loss leaves out."""
    context = render_prompt(tokenizer, record, None, system_prompt)
    msgs = prompt_messages(record, system_prompt)
    full = tokenizer.apply_chat_template(
        [*msgs, {"role": "assistant", "content": record["response"]}], tokenize=False
    )
    if not full.startswith(context):
        raise DataError(
            f"the chat template renders the response of {record.get('prompt')!r} after a "
            "prompt other than the rollout's: it cannot be trained as one"
        )
    turn = full[len(context) :].rstrip("\n")  # the newline after the end token: never sampled
    segments, pos = [[context, False]], 0
    for m in observation.finditer(turn) if observation is not None else ():
        segments += [[turn[pos : m.start()], True], [m.group(), False]]
        pos = m.end()
    segments += [[turn[pos:], True], [full[len(context) + len(turn) :], False]]
    return [s for s in segments if s[0]]


def observation_pattern(format_observation: Callable[[list[str]], str]) -> re.Pattern:
    """A regex of a protocol's observation markup (`Parser.format_observation`), any text in."""
    head, _, tail = format_observation([_slot(0)]).partition(_slot(0))
    return re.compile(re.escape(head) + ".*?" + re.escape(tail), re.DOTALL)


def _slot(i: int) -> str:
    return f"\u2063jaxrl-observation-{i}\u2063"


def encode_observation(
    tokenizer, render: Callable[[list[str]], str], contents: Sequence[str], *, drop_prefix: str = ""
) -> tuple[list[int], str]:
    """An observation's tokens, and its markup with the contents left out.

    `render(contents)` puts tool outputs (or an environment's text) into their markup: a
    parser's inline format, or the chat template's tool / user turn. The markup is the
    template's and may hold special tokens; the contents are untrusted text and never do: a tool
    that prints "<|im_end|>" gets those characters, not an end-of-turn token. Where no content
    spells a special token, the whole observation is encoded at once (the tokens the template's
    whole text gives, as in SFT traces); where one does, each content is encoded apart with
    special tokens split.

    Args:
      tokenizer: an HF tokenizer.
      render: contents -> observation text; must insert each content verbatim, in order.
      contents: the texts.
      drop_prefix: text to drop from the front of the markup (an end-of-turn token the model
        already sampled).

    Returns:
      (token ids, markup text): the markup is what rewards see in place of the observation
      (`Trajectory.model_text`).
    """
    contents = list(contents)
    shaped = render([_slot(i) for i in range(len(contents))])
    markup, rest = [], shaped
    for i in range(len(contents)):
        head, found, rest = rest.partition(_slot(i))
        if not found:
            raise ValueError(
                f"observation format {render!r} does not insert its texts verbatim and in "
                "order; it must (they are encoded apart from its markup)"
            )
        markup.append(head)
    markup.append(rest)
    if drop_prefix and markup[0].startswith(drop_prefix):
        markup[0] = markup[0][len(drop_prefix) :]

    def encode(text: str, split: bool = False) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split))

    if all(encode(c) == encode(c, split=True) for c in contents):
        whole = "".join(m + c for m, c in zip(markup, contents + [""]))
        return encode(whole), "".join(markup)
    ids: list[int] = []
    for m, c in zip(markup, contents + [""]):
        ids += encode(m) + (encode(c, split=True) if c else [])
    return ids, "".join(markup)


def encode_prompt(
    tokenizer,
    record: Mapping[str, Any],
    tools_schema: Any = None,
    system_prompt: str | None = None,
    *,
    max_len: int | None = None,
) -> list[int]:
    """`render_prompt` tokenized; a prompt over `max_len` tokens is a DataError naming it."""
    ids = tokenizer.encode(
        render_prompt(tokenizer, record, tools_schema, system_prompt), add_special_tokens=False
    )
    if max_len is not None and len(ids) > max_len:
        name = record.get("id", record.get("prompt"))
        raise DataError(
            f"prompt of record {name!r} has {len(ids)} tokens, more than "
            f"rollout.max_prompt_len={max_len}"
        )
    return list(ids)


def prompt_lengths(
    tokenizer,
    records: Sequence[Mapping[str, Any]],
    tools_schema: Any = None,
    system_prompt: str | None = None,
) -> list[int]:
    """Token counts of the records' rendered prompts (`encode_prompt`, no length limit)."""
    return [len(encode_prompt(tokenizer, r, tools_schema, system_prompt)) for r in records]


def fit_prompts(
    records: Sequence[Mapping[str, Any]], lengths: Sequence[int], max_len: int
) -> tuple[list, list[tuple[Any, int]]]:
    """Splits records by prompt length.

    Returns:
      (the records whose prompt has at most `max_len` tokens, in order; (record, length) of the
      others).
    """
    kept, dropped = [], []
    for rec, n in zip(records, lengths, strict=True):
        if n <= max_len:
            kept.append(rec)
        else:
            dropped.append((rec, n))
    return kept, dropped


def load_tokenizer(path: str | os.PathLike):
    """A Hugging Face tokenizer folder (tokenizer.json), as a `transformers` fast tokenizer."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    # transformers (which imports torch where installed: seconds) only when a tokenizer loads
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(str(path))
