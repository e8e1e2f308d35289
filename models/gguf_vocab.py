"""Tokenizers in GGUF metadata: an HF tokenizer -> llama.cpp's `tokenizer.ggml.*` keys, and a GGUF
file's -> an HF tokenizer folder.

GGUF describes a byte-level BPE tokenizer (Qwen, Llama 3, SmolLM) by its tokens in id order,
their types (normal, control = special, user-defined = added but not special, unused = padding
to the model's vocabulary), its merges, the name of its pre-tokenizer's split regex
(`tokenizer.ggml.pre`), the special ids and the chat template. Reading goes through transformers'
own GGUF tokenizer conversion (`AutoTokenizer.from_pretrained(..., gguf_file=...)`).
"""

import json
import os
from pathlib import Path

from transformers import AutoTokenizer

# llama.cpp's names of the pre-tokenizer split regexes the supported families use.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {_QWEN2_SPLIT: "qwen2", _LLAMA3_SPLIT: "llama-bpe"}
# tokenizer_config.json key keeping the pre-tokenizer name a GGUF file gave (e.g. "smollm"), so
# that writing the tokenizer back names it the same.
PRE_KEY = "gguf_pre_tokenizer"
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5  # llama.cpp's token types


def _pre_tokenizer(data: dict, tokenizer) -> str:
    """`tokenizer.ggml.pre` for a tokenizer.json: the name its split regex has in llama.cpp."""
    kept = getattr(tokenizer, "init_kwargs", {}).get(PRE_KEY)
    if kept:
        return kept
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") or [pre]
    splits = [s for s in steps if s.get("type") == "Split"]
    if not splits and any(s.get("type") == "ByteLevel" and s.get("use_regex") for s in steps):
        return "gpt-2"  # ByteLevel's own (GPT-2) regex
    regex = splits[0].get("pattern", {}).get("Regex") if len(splits) == 1 else None
    if regex not in PRE_TOKENIZERS:
        raise ValueError(
            "GGUF export: the tokenizer's pre-tokenizer split is not one llama.cpp names "
            f"(Qwen2's, Llama 3's or GPT-2's): {json.dumps(pre)[:200]}"
        )
    return PRE_TOKENIZERS[regex]


def add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """Adds an HF fast tokenizer's vocabulary, merges, special ids and chat template to a
    `gguf.GGUFWriter`; ids the tokenizer lacks up to `vocab_size` become unused "[PAD<id>]".

    Raises:
      ValueError: not a byte-level BPE tokenizer, a token id past `vocab_size`, a pre-tokenizer
        llama.cpp has no name for.
    """
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    model = data["model"]
    byte_level = "ByteLevel" in json.dumps(data.get("pre_tokenizer")) + json.dumps(
        data.get("decoder")
    )
    if model.get("type") != "BPE" or not byte_level:
        raise ValueError(
            f"GGUF export supports byte-level BPE tokenizers (Qwen, Llama 3, SmolLM); this one is "
            f"{model.get('type')}{'' if byte_level else ' without byte-level pre-tokenization'}"
        )
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    if max(vocab.values()) >= vocab_size:
        raise ValueError(
            f"GGUF export: the tokenizer has token id {max(vocab.values())}, past the model's "
            f"vocab_size {vocab_size}"
        )
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [_UNUSED] * vocab_size
    for token, i in vocab.items():
        tokens[i], types[i] = token, _NORMAL
    for added in data.get("added_tokens", []):
        types[added["id"]] = _CONTROL if added.get("special") else _USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(data, tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for attr, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
        ("unk_token_id", writer.add_unk_token_id),
        ("pad_token_id", writer.add_pad_token_id),
    ):
        if getattr(tokenizer, attr, None) is not None:
            add(int(getattr(tokenizer, attr)))
    # Whether encoding puts a BOS first is the tokenizer's post-processor's say, not a flag's.
    bos = tokenizer.bos_token_id
    plain, full = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a")
    writer.add_add_bos_token(bos is not None and full[:1] == [bos] and plain[:1] != [bos])
    writer.add_add_eos_token(False)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        writer.add_chat_template(template)


def save_tokenizer(path: str | os.PathLike, out: str | os.PathLike, pre: str | None = None):
    """Writes a GGUF file's tokenizer as an HF folder (tokenizer.json, tokenizer_config.json with
    the chat template and the special tokens) and returns it.

    The chat template also goes into tokenizer_config.json (transformers 5 writes it to
    chat_template.jinja only, which transformers 4 does not read), and the tokenizer class is the
    generic fast one that both versions load. `pre`: the file's `tokenizer.ggml.pre`, kept for
    writing the tokenizer back.
    """
    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))
    config_file = Path(out) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(tokenizer.chat_template, str):
        config["chat_template"] = tokenizer.chat_template
    if pre:
        config[PRE_KEY] = pre
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return AutoTokenizer.from_pretrained(str(out))
