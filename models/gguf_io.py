"""GGUF (llama.cpp's file format) -> Hugging Face tensors and folders: Llama, Qwen2, Qwen3.

Reading dequantises each tensor with the `gguf` library (every type it implements: F32, F16,
BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, the K-quants...) into the float32 tensor transformers' own GGUF
loader makes of it. llama.cpp stores a Llama's q/k rows permuted (its rotary pairs dimensions
2j, 2j+1 of a head; HF's pairs j, j + head_dim/2): reading undoes it (`gguf_layout`).

Writing (`save_gguf`, from `gguf_write`): params and tokenizer -> one GGUF file.
`gguf` is an extra (`pip install 'jaxrl-tools[gguf]'`), imported when a function needs it.
"""

import json
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl_tools.models import gguf_vocab
from jaxrl_tools.models.config import ModelConfig
from jaxrl_tools.models.gguf_layout import (
    GGUF_ARCHS,
    GGUF_DTYPES,
    INSTALL_HINT,
    LLAMA3_ROPE,
    gguf_name,
    llama3_divisors,
    permuted,
    require_gguf,
    rope_heads,
)
from jaxrl_tools.models.gguf_write import save_gguf
from jaxrl_tools.models.hf_io import SINGLE_FILE, hf_shapes, write_safetensors

log = logging.getLogger(__name__)

__all__ = [
    "GGUF_ARCHS",
    "GGUF_DTYPES",
    "INSTALL_HINT",
    "gguf_name",
    "gguf_to_hf",
    "open_gguf",
    "read_config",
    "read_tensors",
    "require_gguf",
    "save_gguf",
]

# ---------------------------------------------------------------------------------------------
# reading


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` of `path`; a file that is not GGUF, or cut short, is a ValueError."""
    gguf = require_gguf()
    path = os.fspath(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader's errors are of many types; all mean a broken file
        why = f"{type(e).__name__}: {e}"
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({why})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(f"{path}: truncated GGUF file (tensor {t.name} runs past its end)")
    return reader


def _field(reader, key: str, default: Any = KeyError) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is KeyError:
            raise ValueError(f"{reader.data.filename}: GGUF metadata {key!r} is missing")
        return default
    return field.contents()


def _f32(value) -> float:
    """A float32 of the metadata as the decimal it was written from (1e-06, not 9.99999997e-07):
    numpy prints the shortest decimal that rounds to the same float32."""
    return float(str(np.float32(value)))


def _dequantizable(qtype) -> bool:
    """Whether the gguf library dequantises this tensor type (tried on one zero block)."""
    gguf = require_gguf()
    block = gguf.GGML_QUANT_SIZES[qtype][1]
    try:
        gguf.dequantize(np.zeros((1, block), np.uint8), qtype)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def read_config(reader) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata (and tensor shapes) describe.

    Raises:
      ValueError: an architecture other than llama/qwen2/qwen3 (checked first), missing metadata,
        unsupported rope scaling.
    """
    path = reader.data.filename
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(GGUF_ARCHS)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    for name in ("token_embd.weight", "blk.0.attn_q.weight"):
        if name not in tensors:
            raise ValueError(f"{path}: GGUF tensor {name} is missing")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    q_rows = int(tensors["blk.0.attn_q.weight"].shape[1])  # GGUF shapes list ne0 (columns) first
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size", None) or (
        len(tokens.data) if tokens is not None else int(tensors["token_embd.weight"].shape[1])
    )
    rope_scaling = _rope_scaling(reader, arch, tensors)
    eos = _field(reader, "tokenizer.ggml.eos_token_id", None)
    config = ModelConfig(
        model_type=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=q_rows // heads,
        rms_norm_eps=_f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=None if eos is None else int(eos),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id", None),
    )
    if config.rope_type == "llama3":
        _check_llama3(config, reader, tensors["rope_freqs.weight"])
    return config


def _rope_scaling(reader, arch: str, tensors: dict) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        factor = _f32(_field(reader, f"{arch}.rope.scaling.factor"))
        return {"rope_type": "linear", "factor": factor}
    if kind != "none":
        raise ValueError(
            f"{reader.data.filename}: rope scaling {kind!r} is not supported (none, linear, "
            "or Llama 3's rope_freqs)"
        )
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(tensors["rope_freqs.weight"].data, np.float32)
        return {"rope_type": "llama3", "factor": _f32(factors.max()), **LLAMA3_ROPE}
    return None


def _check_llama3(config: ModelConfig, reader, tensor) -> None:
    """llama.cpp keeps only the scaled frequencies' divisors; they must be the standard Llama 3
    scaling's, the one config.json can say."""
    if not np.allclose(np.asarray(tensor.data, np.float32), llama3_divisors(config), rtol=1e-4):
        raise ValueError(
            f"{reader.data.filename}: rope_freqs.weight is not Llama 3's standard rope scaling "
            f"({LLAMA3_ROPE}); it cannot be written as a config.json"
        )


def read_tensors(reader, config: ModelConfig) -> list[tuple[str, Callable[[], np.ndarray]]]:
    """(HF name, make) for every tensor the config needs; `make()` dequantises it to float32.

    Every name, shape and tensor type is checked before anything is dequantised.

    Raises:
      ValueError: a missing tensor, a shape other than the config's, a tensor type the gguf
        library cannot dequantise (names it and the tensor).
    """
    gguf = require_gguf()
    path = reader.data.filename
    by_name = {t.name: t for t in reader.tensors}
    checked: dict[Any, bool] = {}
    out = []
    for hf, shape in hf_shapes(config).items():
        name = gguf_name(hf)
        t = by_name.get(name)
        if t is None:
            raise ValueError(f"{path}: GGUF tensor {name} (for {hf}) is missing")
        found = tuple(int(d) for d in reversed(t.shape))
        if found != shape:
            raise ValueError(
                f"{path}: GGUF tensor {name} has shape {found}, the config needs {shape}"
            )
        if t.tensor_type not in checked:
            checked[t.tensor_type] = _dequantizable(t.tensor_type)
        if not checked[t.tensor_type]:
            raise ValueError(
                f"{path}: tensor {name} has type {t.tensor_type.name}, which the gguf library "
                "cannot dequantise; convert the model with another quantisation"
            )

        def make(t=t, hf=hf, shape=shape):
            array = gguf.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
            heads = rope_heads(config, hf)
            return array if heads is None else permuted(array, heads, inverse=True)

        out.append((hf, make))
    known = {gguf_name(hf) for hf in hf_shapes(config)} | {"rope_freqs.weight"}
    extra = [n for n in by_name if n not in known]
    if extra:
        log.warning("%s: ignoring %d GGUF tensors, e.g. %s", path, len(extra), extra[:5])
    return out


def generation_config(reader) -> dict[str, Any]:
    """generation_config.json's token ids (with the end-of-turn token among the eos ids)."""

    def get(key):
        return _field(reader, f"tokenizer.ggml.{key}", None)

    eos = [int(i) for i in (get("eos_token_id"), get("eot_token_id")) if i is not None]
    eos = list(dict.fromkeys(eos))
    return {
        "bos_token_id": get("bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": get("padding_token_id"),
    }


def gguf_to_hf(
    path: str | os.PathLike, out: str | os.PathLike, *, with_tokenizer: bool = True
) -> ModelConfig:
    """Writes a GGUF file's model as an HF folder: config.json, model.safetensors (float32,
    one tensor on the host at a time), generation_config.json and the tokenizer
    (`gguf_vocab.save_tokenizer`: tokenizer.json, tokenizer_config.json with the chat template).

    Raises:
      ImportError: no gguf package. ValueError: see `open_gguf`, `read_config`, `read_tensors`.
    """
    reader = open_gguf(path)
    config = read_config(reader)
    tensors = read_tensors(reader, config)  # checked before anything is written
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    shapes = hf_shapes(config)
    items = [(hf, (make, shapes[hf], np.float32)) for hf, make in tensors]
    write_safetensors(os.path.join(out, SINGLE_FILE), items)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config.to_hf(dtype="float32"), f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(generation_config(reader), f, indent=2)
    if with_tokenizer:
        pre = _field(reader, "tokenizer.ggml.pre", None)
        gguf_vocab.save_tokenizer(path, out, pre)
    return config
