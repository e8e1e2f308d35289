"""Params + tokenizer -> one GGUF file (llama.cpp's format) for Llama, Qwen2, Qwen3.

Tensors are fetched (one parameter leaf at a time on the host), encoded and written one by one,
in F32, F16, BF16 or Q8_0; norms and biases stay F32, and a matrix whose rows are not whole
quantisation blocks falls back to F16, as llama.cpp's converter does. Llama's q/k rows are put
in llama.cpp's order. The tokenizer goes into the metadata (`gguf_vocab`).
"""

import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxrl_tools.models import gguf_vocab
from jaxrl_tools.models.config import ModelConfig
from jaxrl_tools.models.gguf_layout import (
    GGUF_ARCHS,
    GGUF_DTYPES,
    gguf_name,
    llama3_divisors,
    permuted,
    require_gguf,
    rope_heads,
)
from jaxrl_tools.models.hf_io import hf_tensor_items
from jaxrl_tools.models.transformer import Params

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
            heads = rope_heads(config, hf)
            return array if heads is None else permuted(array, heads, inverse=False)

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
    freqs = llama3_divisors(config) if config.rope_type == "llama3" else None
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
