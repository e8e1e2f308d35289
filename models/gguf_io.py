"""GGUF (llama.cpp's file format) <-> Hugging Face tensors and params: Llama, Qwen2, Qwen3.

Reading dequantises each tensor with the `gguf` library (every type it implements: F32, F16,
BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, the K-quants...) into the float32 tensor transformers' own GGUF
loader makes of it. llama.cpp stores a Llama's q/k rows permuted (its rotary pairs dimensions
2j, 2j+1 of a head; HF's pairs j, j + head_dim/2): reading undoes it, writing redoes it.

Writing takes the params (one leaf at a time on the host) and a tokenizer (`gguf_vocab`), in
F32, F16, BF16 or Q8_0; norms and biases stay F32, and a matrix whose rows are not whole
quantisation blocks falls back to F16, as llama.cpp's converter does.

`gguf` is an extra (`pip install 'jaxrl-tools[gguf]'`), imported when a function needs it.
"""

import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxrl_tools.models import gguf_vocab
from jaxrl_tools.models.config import ModelConfig, rope_inv_freq
from jaxrl_tools.models.hf_io import SINGLE_FILE, hf_shapes, hf_tensor_items, write_safetensors
from jaxrl_tools.models.transformer import Params

log = logging.getLogger(__name__)

GGUF_ARCHS = ("llama", "qwen2", "qwen3")
GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")
INSTALL_HINT = "pip install 'jaxrl-tools[gguf]'"

# HF tensor names <-> llama.cpp's standard names ("{i}": the layer).
_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
# The standard Llama 3.x rope scaling, which llama.cpp stores only as a `rope_freqs` tensor.
_LLAMA3_ROPE = dict(
    low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def require_gguf():
    """The `gguf` module, or an ImportError that says how to install it."""
    try:
        import gguf  # noqa: PLC0415  (an optional extra)
    except ImportError:
        raise ImportError(f"GGUF needs the gguf package: {INSTALL_HINT}") from None
    return gguf


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of an HF tensor (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``)."""
    parts = hf_name.split(".")
    if hf_name.startswith("model.layers."):
        layer, key = parts[2], ".".join(["model.layers.{i}", *parts[3:]])
        return _NAMES[key].format(i=layer)
    return _NAMES[hf_name]


def _permuted(array: np.ndarray, heads: int, *, inverse: bool) -> np.ndarray:
    """llama.cpp's q/k row order (inverse=False) or HF's (True), for `heads` heads."""
    half = array.shape[0] // heads // 2
    if inverse:
        split = array.reshape(heads, half, 2, *array.shape[1:])
    else:
        split = array.reshape(heads, 2, half, *array.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(array.shape))


def _rope_heads(config: ModelConfig, hf_name: str) -> int | None:
    """Heads of a Llama q/k tensor that llama.cpp permutes; None for every other tensor."""
    if config.model_type != "llama":
        return None
    if ".q_proj." in hf_name:
        return config.num_attention_heads
    if ".k_proj." in hf_name:
        return config.num_key_value_heads
    return None


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
        return {"rope_type": "llama3", "factor": _f32(factors.max()), **_LLAMA3_ROPE}
    return None


def _check_llama3(config: ModelConfig, reader, tensor) -> None:
    """llama.cpp keeps only the scaled frequencies' divisors; they must be the standard Llama 3
    scaling's, the one config.json can say."""
    plain = ModelConfig(**{**config.__dict__, "rope_scaling": None})
    expected = rope_inv_freq(plain) / rope_inv_freq(config)
    if not np.allclose(np.asarray(tensor.data, np.float32), expected, rtol=1e-4):
        raise ValueError(
            f"{reader.data.filename}: rope_freqs.weight is not Llama 3's standard rope scaling "
            f"({_LLAMA3_ROPE}); it cannot be written as a config.json"
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
            heads = _rope_heads(config, hf)
            return array if heads is None else _permuted(array, heads, inverse=True)

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


# ---------------------------------------------------------------------------------------------
# writing

_FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # llama.cpp's LlamaFileType


def _target(shape: tuple, dtype: str, gguf) -> tuple[np.dtype, Any]:
    """(numpy dtype, raw GGML type or None) a tensor is written in: vectors in F32; matrices in
    `dtype`, or F16 when their rows are not whole blocks of it."""
    q = gguf.GGMLQuantizationType
    if len(shape) == 1 or dtype == "f32":
        return np.dtype(np.float32), None
    qtype = {"f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0}[dtype]
    if qtype == q.F16 or shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return np.dtype(np.float16), None
    return np.dtype(np.uint8), qtype


def _encode(array: np.ndarray, dtype: str, gguf) -> np.ndarray:
    np_dtype, qtype = _target(array.shape, dtype, gguf)
    if qtype is None:
        return array.astype(np_dtype)
    return gguf.quantize(array.astype(np.float32), qtype)


def _tensors(config: ModelConfig, params: Params) -> Iterator[tuple[str, Callable, tuple]]:
    for hf, (make, shape, _) in hf_tensor_items(config, params):

        def made(make=make, hf=hf):
            array = np.asarray(make(), np.float32)
            heads = _rope_heads(config, hf)
            return array if heads is None else _permuted(array, heads, inverse=False)

        yield gguf_name(hf), made, shape


def save_gguf(
    config: ModelConfig,
    params: Params,
    tokenizer,
    path: str | os.PathLike,
    dtype: str = "f16",
    *,
    name: str | None = None,
) -> None:
    """Writes the model and its tokenizer (vocabulary, merges, special ids, chat template) as one
    GGUF file that llama.cpp and transformers' GGUF loader read.

    Multi-host: every process must call it (parameters are gathered leaf by leaf); only process 0
    writes. Tensors are fetched, encoded and written one at a time.

    Args:
      config: the architecture (llama, qwen2 or qwen3).
      params: the parameters.
      tokenizer: a byte-level BPE HF tokenizer (Qwen, Llama 3, SmolLM).
      path: the .gguf file to write.
      dtype: "f32", "f16", "bf16" or "q8_0" (matrices; norms and biases are F32).
      name: general.name in the metadata.

    Raises:
      ValueError: another architecture or dtype, a tokenizer GGUF cannot describe.
    """
    gguf = require_gguf()
    if config.model_type not in GGUF_ARCHS:
        raise ValueError(f"GGUF export supports {', '.join(GGUF_ARCHS)}, not {config.model_type}")
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"GGUF dtype {dtype!r} is not one of {', '.join(GGUF_DTYPES)}")
    main = jax.process_index() == 0
    tensors = list(_tensors(config, params))
    if not main:
        for _, make, _ in tensors:
            make()  # the gathers every process joins
        return
    writer = gguf.GGUFWriter(os.fspath(path), config.model_type)
    _add_config(writer, config, dtype, name)
    gguf_vocab.add_tokenizer(writer, tokenizer, config.vocab_size)
    freqs = _rope_freqs(config)
    if freqs is not None:
        writer.add_tensor_info("rope_freqs.weight", freqs.shape, np.float32, freqs.nbytes)
    for gname, _, shape in tensors:
        np_dtype, qtype = _target(shape, dtype, gguf)
        if qtype is None:
            writer.add_tensor_info(gname, shape, np_dtype, math.prod(shape) * np_dtype.itemsize)
        else:  # the logical shape (a float dtype), and the bytes of its blocks
            nbytes = math.prod(gguf.quant_shape_to_byte_shape(shape, qtype))
            writer.add_tensor_info(gname, shape, np.float32, nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if freqs is not None:
        writer.write_tensor_data(freqs)
    for _, make, _ in tensors:
        writer.write_tensor_data(_encode(make(), dtype, gguf))
    writer.close()


def _rope_freqs(config: ModelConfig) -> np.ndarray | None:
    """Llama 3 rope scaling as llama.cpp keeps it: each frequency's divisor."""
    if config.rope_type != "llama3":
        return None
    plain = ModelConfig(**{**config.__dict__, "rope_scaling": None})
    return (rope_inv_freq(plain) / rope_inv_freq(config)).astype(np.float32)


def _add_config(writer, config: ModelConfig, dtype: str, name: str | None) -> None:
    writer.add_type("model")
    writer.add_name(name or f"jaxrl-tools {config.model_type}")
    writer.add_file_type(_FILE_TYPES[dtype])
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.rope_type == "linear":
        gguf = require_gguf()
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(config.rope_scaling["factor"]))
