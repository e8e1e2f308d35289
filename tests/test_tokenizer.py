"""Tests for jaxrl_tools.tasks.tokenizer: byte-level round trip, special tokens, Qwen chat template."""

import json

import pytest
from transformers import AutoTokenizer

from jaxrl_tools.config import ConfigError
from jaxrl_tools.prompts import load_tokenizer
from jaxrl_tools.tasks.tokenizer import (
    ALL_ADDED_TOKENS,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    build_tokenizer,
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    build_tokenizer(path, vocab_size=512, seed=0)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


@pytest.mark.parametrize(
    "text",
    [
        "What is 4821 * 397?",
        "naïve café — 你好世界 🎉 \u200b emoji 👩‍👩‍👧 and Ωmega",
        "  leading spaces\n\n\ttabs\r\nCRLF  trailing  ",
        "```python\nprint(4821*397)\n```\n```output\n1913937\n```",
        '\\boxed{\\frac{1}{2}} and {"name": "python", "arguments": {}}',
        "",
        "\x00\x01 control \U0010ffff",
    ],
)
def test_roundtrip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_digits_split_individually(tok):
    toks = tok.convert_ids_to_tokens(tok.encode("4821397", add_special_tokens=False))
    assert toks == list("4821397")


def test_special_tokens_single_ids(tok):
    for t in ALL_ADDED_TOKENS:
        ids = tok.encode(f"a{t}b", add_special_tokens=False)
        assert tok.convert_tokens_to_ids(t) in ids
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert len(tok) == 512
    assert max(tok.convert_tokens_to_ids(list(ALL_ADDED_TOKENS))) < 512


def test_skip_special_keeps_tool_tags(tok):
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><think>x</think><|im_end|>"
    text += "<tool_response>\n1\n</tool_response><|endoftext|>"
    out = tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True)
    for t in TOOL_TOKENS:
        assert t in out
    for t in SPECIAL_TOKENS:
        assert t not in out


def test_autotokenizer_loads_folder(tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert "chat_template" in cfg and cfg["eos_token"] == "<|im_end|>"
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    assert hf.encode("12 + 34") == load_tokenizer(tok_dir).encode("12 + 34")


EXPECTED_TOOLS_CHAT = (
    "<|im_start|>system\nYou solve math.\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "python", "description": "Run Python code and '
    'return what it prints.", "parameters": {"type": "object", "properties": {"code": {"type": '
    '"string", "description": "Python source code"}}, "required": ["code"]}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n"
    "<|im_start|>assistant\nLet me compute.\n<tool_call>\n"
    '{"name": "python", "arguments": {"code": "print(12*34)"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n1\n"
    "</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n\\boxed{408}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


SCHEMA = {  # the golden text below renders this declaration
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


def test_chat_template_qwen_format(tok):
    messages = [
        {"role": "system", "content": "You solve math."},
        {"role": "user", "content": "What is 12 * 34?"},
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "python", "arguments": {"code": "print(12*34)"}},
                },
                # OpenAI style: arguments as a JSON string, inserted verbatim.
                {
                    "type": "function",
                    "function": {"name": "python", "arguments": '{"code": "print(1)"}'},
                },
            ],
        },
        {"role": "tool", "content": "408"},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "\\boxed{408}"},
    ]
    out = tok.apply_chat_template(
        messages, tools=[SCHEMA], tokenize=False, add_generation_prompt=True
    )
    assert out == EXPECTED_TOOLS_CHAT


def test_chat_template_no_tools_default_system(tok):
    out = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=False
    )
    assert out == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )
    # Rendered template text encodes with the special tokens as single ids.
    ids = tok.encode(out, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_deterministic_with_seed(tmp_path):
    a = build_tokenizer(tmp_path / "a", vocab_size=400, seed=3)
    b = build_tokenizer(tmp_path / "b", vocab_size=400, seed=3)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_text()
    assert a.get_vocab() == b.get_vocab()


def test_cache_reuse(tmp_path):
    path = tmp_path / "tok"
    build_tokenizer(path, vocab_size=400, seed=1)
    mtime = (path / "tokenizer.json").stat().st_mtime_ns
    assert len(build_tokenizer(path, vocab_size=400, seed=1)) == 400
    # Other settings: an error that says what to do, and the folder is left as it was.
    with pytest.raises(
        ConfigError,
        match=r"built with vocab_size=400, seed=1, not vocab_size=999, seed=5: delete the folder .* tokenizer.vocab_size=400",
    ):
        build_tokenizer(path, vocab_size=999, seed=5)
    assert (path / "tokenizer.json").stat().st_mtime_ns == mtime


def test_vocab_too_small(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path / "t", vocab_size=100)
