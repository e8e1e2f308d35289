"""What GGUF files of Llama / Qwen2 / Qwen3 look like: llama.cpp's tensor names, its q/k row
order, the `gguf` package (an extra, imported when needed). Shared by `gguf_io` (reading) and
`gguf_write`.
"""

import numpy as np

from jaxrl_tools.models.config import ModelConfig, rope_inv_freq

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
LLAMA3_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


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


def permuted(array: np.ndarray, heads: int, *, inverse: bool) -> np.ndarray:
    """llama.cpp's q/k row order (inverse=False) or HF's (True), for `heads` heads."""
    half = array.shape[0] // heads // 2
    if inverse:
        split = array.reshape(heads, half, 2, *array.shape[1:])
    else:
        split = array.reshape(heads, 2, half, *array.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(array.shape))


def rope_heads(config: ModelConfig, hf_name: str) -> int | None:
    """Heads of a Llama q/k tensor that llama.cpp permutes; None for every other tensor."""
    if config.model_type != "llama":
        return None
    if ".q_proj." in hf_name:
        return config.num_attention_heads
    if ".k_proj." in hf_name:
        return config.num_key_value_heads
    return None


def llama3_divisors(config: ModelConfig) -> np.ndarray:
    """Llama 3 rope scaling as llama.cpp keeps it (`rope_freqs`): each frequency's divisor."""
    plain = ModelConfig(**{**config.__dict__, "rope_scaling": None})
    return (rope_inv_freq(plain) / rope_inv_freq(config)).astype(np.float32)
