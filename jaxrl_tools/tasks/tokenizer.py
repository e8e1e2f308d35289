"""A small Qwen-style byte-level BPE tokenizer, trained locally for tests and the demo.

No network: instead of downloading Qwen's tokenizer we train a byte-level BPE (HF `tokenizers`)
on generated text (arithmetic, chat turns, Python snippets, tool-call JSON) with Qwen2.5's
special tokens, its pre-tokenizer regex (digits split one by one, so that arithmetic is
learnable) and a Qwen2.5-style Jinja chat template. The result is saved as an ordinary HF
tokenizer folder (tokenizer.json + tokenizer_config.json with `chat_template`) that
`transformers.AutoTokenizer.from_pretrained` loads.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxrl_tools.config import ConfigError
from jaxrl_tools.prompts import load_tokenizer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Real special tokens (skipped by decode(skip_special_tokens=True)).
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Added, non-special tokens, as in Qwen2.5: single ids, but kept by decode(skip_special_tokens).
TOOL_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
ALL_ADDED_TOKENS = SPECIAL_TOKENS + TOOL_TOKENS

# Qwen2's pre-tokenizer regex: \p{N} matches ONE digit, so numbers split into single digits.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2.5's chat template, with a neutral default system prompt. Tools go in the system turn as
# JSON schemas inside <tools></tools>; assistant tool_calls become
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>; consecutive tool messages are
# grouped into one user turn of <tool_response> blocks. `arguments` given as a JSON string
# (OpenAI style) is inserted verbatim instead of being double-encoded.
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- '" + DEFAULT_SYSTEM_PROMPT + "' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user '
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    '\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name '
    'and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {%- if tool_call.arguments is string %}\n"
    "                {{- tool_call.arguments }}\n"
    "            {%- else %}\n"
    "                {{- tool_call.arguments | tojson }}\n"
    "            {%- endif %}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

_BUILD_INFO = "jaxrl_tools_build.json"

# Function-declaration JSON for the BPE corpus: training text, not a declaration any prompt uses
# (prompts and SFT traces declare `PythonTool.default_schema()`); kept fixed, since any change
# to the corpus changes the demo's tokenizer.
_CORPUS_DECLARATION = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source code"}},
            "required": ["code"],
        },
    },
}


def _arith_texts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 10 ** rng.randint(1, 5)), rng.randint(0, 10 ** rng.randint(1, 4))
        op = rng.choice(["+", "-", "*"])
        val = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append(
            rng.choice(
                [
                    f"What is {a} {op} {b}?",
                    f"Compute {a}{op}{b}. The answer is \\boxed{{{val}}}.",
                    f"{a} {op} {b} = {val}",
                    f"```python\nprint({a}*{b})\n```\n```output\n{a * b}\n```\n",
                    f"<code>print({a} {op} {b})</code><interpreter>{val}</interpreter>",
                    f"So the final answer is \\boxed{{{val}}}.",
                ]
            )
        )
    return out


_WORDS = (
    "the a of to and in is it that for you with on as are this be at or have from by not but "
    "what all were when we there can an your which their said if do will each about how up out "
    "them then she many some so these would other into has more her two like him see time could "
    "no make than first been its who now people my made over did down only way find use may water "
    "long little very after words called just where most know answer question compute result "
    "number tool call search python code output error think let me check value sum product"
).split()


def _chat_texts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 20)))
        sentence = words[0].upper() + words[1:] + rng.choice([".", "?", "!", ","])
        out.append(f"{IM_START}user\n{sentence}{IM_END}\n{IM_START}assistant\n")
        out.append(f"<think>\n{sentence}\n</think>\n\n<answer>{rng.choice(_WORDS)}</answer>")
        out.append(f"<search>{sentence}</search>\n<information>{words}</information>")
    return out


def _code_texts(rng: random.Random, n: int) -> list[str]:
    names = ["x", "y", "total", "result", "n", "i", "value", "items"]
    out = []
    for _ in range(n):
        v, w = rng.choice(names), rng.choice(names)
        k = rng.randint(0, 999)
        out.append(
            rng.choice(
                [
                    f"def f({v}):\n    return {v} * {k}\n\nprint(f({k}))\n",
                    f"for {v} in range({k}):\n    {w} += {v}\nprint({w})\n",
                    f"import math\n{v} = math.sqrt({k})\nprint(round({v}, 3))\n",
                    f"{v} = [{k}, {k + 1}]\nprint(sum({v}))\n",
                    'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n'
                    f"NameError: name '{v}' is not defined\n",
                ]
            )
        )
    return out


def _tool_json_texts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99999), rng.randint(0, 999)
        args = rng.choice(
            [
                {"code": f"print({a}*{b})"},
                {"query": " ".join(rng.sample(_WORDS, 3))},
                {"expression": f"{a}+{b}"},
            ]
        )
        name = rng.choice(["python", "search", "calculator"])
        call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        out.append(f"<tool_call>\n{call}\n</tool_call>")
        out.append(f"<tool_response>\n{a * b}\n</tool_response>")
    out.append(json.dumps(_CORPUS_DECLARATION, ensure_ascii=False))
    return out


def generate_corpus(seed: int = 0, n: int = 2000) -> list[str]:
    """Generate the training text for the tokenizer (arithmetic, chat, code, tool JSON).

    Args:
      seed: random seed; the same seed gives the same corpus.
      n: number of samples of each kind.

    Returns:
      A list of strings.
    """
    rng = random.Random(seed)
    texts = _arith_texts(rng, n) + _chat_texts(rng, n // 2) + _code_texts(rng, n // 2)
    texts += _tool_json_texts(rng, n // 2)
    # The rendered chat template itself (system prompt, tool preamble) should be cheap to encode.
    texts += [CHAT_TEMPLATE] * 4
    # A pinch of non-ASCII so that common multi-byte characters get merges too.
    texts += ["π ≈ 3.14159, √2 ≈ 1.414, 你好, ∑ x² — café, naïve"] * 8
    return texts


def _is_built(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()


def _train(vocab_size: int, texts: Sequence[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        # All added tokens first, so that they get the lowest ids and fit inside vocab_size.
        special_tokens=list(ALL_ADDED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # The trainer registers every token in `special_tokens` as special; Qwen marks the tool/think
    # tags as added but non-special (so decode(skip_special_tokens=True) keeps them).
    spec = json.loads(tok.to_str())
    for entry in spec["added_tokens"]:
        entry["special"] = entry["content"] in SPECIAL_TOKENS
        entry["normalized"] = False
    return Tokenizer.from_str(json.dumps(spec))


def _wrap(tok: Tokenizer):
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=AddedToken(IM_END, special=True, normalized=False),
        pad_token=AddedToken(ENDOFTEXT, special=True, normalized=False),
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        extra_special_tokens=[IM_START, IM_END],
    )


def build_mismatch(
    path: str | os.PathLike, *, vocab_size: int, seed: int = 0, n_extra_texts: int = 0
) -> str | None:
    """Why the tokenizer built at `path` is not the one these settings would build ("holds a
    tokenizer built with vocab_size=512, not vocab_size=1024: delete the folder ..."), or None
    when it is (or when `path` holds a tokenizer this module did not build: used as it is)."""
    info_path = Path(path) / _BUILD_INFO
    if not info_path.is_file():
        return None
    old = json.loads(info_path.read_text())
    want = {"vocab_size": vocab_size, "seed": seed, "n_extra_texts": n_extra_texts}
    diff = {k: v for k, v in want.items() if old.get(k) != v}
    if not diff:
        return None
    built = ", ".join(f"{k}={old.get(k)}" for k in diff)
    asked = ", ".join(f"{k}={v}" for k, v in diff.items())
    fix = " or ".join(f"tokenizer.{k}={old.get(k)}" for k in diff if k != "n_extra_texts")
    return f"holds a tokenizer built with {built}, not {asked}: delete the folder to rebuild it" + (
        f", or set {fix}" if fix else ""
    )


def build_tokenizer(
    path: str | os.PathLike,
    *,
    vocab_size: int = 1024,
    seed: int = 0,
    texts: Iterable[str] | None = None,
):
    """Train (or load from cache) a Qwen-style byte-level BPE tokenizer and save it at `path`.

    Args:
      path: output folder. If it already holds a tokenizer (tokenizer.json and
        tokenizer_config.json), that tokenizer is loaded instead of training a new one.
      vocab_size: total vocabulary size including the 256 bytes and the 9 added tokens.
      seed: seed of the generated training corpus (same seed -> same tokenizer).
      texts: extra training text, appended to the generated corpus.

    Returns:
      A `transformers.PreTrainedTokenizerFast` (eos <|im_end|>, pad <|endoftext|>, chat template).

    Raises:
      ConfigError: `path` holds a tokenizer built with other settings (`build_mismatch`).
    """
    path = Path(path)
    extra = list(texts) if texts is not None else []
    if _is_built(path):
        mismatch = build_mismatch(path, vocab_size=vocab_size, seed=seed, n_extra_texts=len(extra))
        if mismatch is not None:
            raise ConfigError(f"tokenizer folder {path} {mismatch}")
        return load_tokenizer(path)
    if vocab_size < 256 + len(ALL_ADDED_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: needs >= {256 + len(ALL_ADDED_TOKENS)} "
            "(256 bytes + added tokens)"
        )
    info = {"vocab_size": vocab_size, "seed": seed, "n_extra_texts": len(extra)}
    tok = _train(vocab_size, generate_corpus(seed) + extra)
    hf_tok = _wrap(tok)
    # Build in a temporary sibling folder and rename, so that concurrent builders never see a
    # half-written tokenizer.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        hf_tok.save_pretrained(str(tmp), save_jinja_files=False)
        (tmp / _BUILD_INFO).write_text(json.dumps(info))
        try:
            os.rename(tmp, path)
        except OSError:
            if _is_built(path):  # someone else won the race (or an empty dir was there)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                if path.exists():
                    path.rmdir()  # an empty placeholder folder (e.g. a pytest tmp dir)
                os.rename(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return load_tokenizer(path)
