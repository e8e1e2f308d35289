"""Qwen2/2.5, Qwen3 and Llama 3.x decoders as Flax modules, KV cache, HF safetensors <-> params,
LoRA adapters (`lora`) and their PEFT format (`peft_io`), GGUF files in and out (`gguf_io`:
`gguf_to_hf`, `save_gguf`; the [gguf] extra).

Layers are stacked along a leading "layers" axis and scanned (`nn.scan`): compile time stays flat
with depth. All functions are pure; jit them with the (hashable) `ModelConfig` static.
"""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.models import attention, gguf_io, peft_io
    from jaxrl_tools.models.cache import CACHE_AXES, KVCache, cache_axes, cache_bytes, init_cache
    from jaxrl_tools.models.config import (
        PARAM_DTYPES,
        SUPPORTED_MODEL_TYPES,
        DTypePolicy,
        ModelConfig,
        cast_floating,
        load_config,
        rope_inv_freq,
    )
    from jaxrl_tools.models.hf_io import KEY_TABLES, KeySpec, from_pretrained, save_pretrained
    from jaxrl_tools.models.lora import (
        LORA_TARGETS,
        LoraConfig,
        LoraParams,
        init_lora,
        lora_logical_axes,
        merge,
        with_lora,
    )
    from jaxrl_tools.models.transformer import (
        Decoder,
        default_positions,
        forward,
        forward_cached,
        has_stacked_layers,
        hidden_states,
        init_params,
        logical_axes,
        param_shapes,
        unembed,
        unstack_layers,
        untie_head,
    )

__all__ = [
    "CACHE_AXES",
    "KEY_TABLES",
    "PARAM_DTYPES",
    "SUPPORTED_MODEL_TYPES",
    "Decoder",
    "DTypePolicy",
    "KVCache",
    "KeySpec",
    "LORA_TARGETS",
    "LoraConfig",
    "LoraParams",
    "ModelConfig",
    "attention",
    "cache_axes",
    "cache_bytes",
    "cast_floating",
    "default_positions",
    "forward",
    "forward_cached",
    "from_pretrained",
    "gguf_io",
    "has_stacked_layers",
    "hidden_states",
    "init_cache",
    "init_lora",
    "init_params",
    "load_config",
    "logical_axes",
    "lora_logical_axes",
    "merge",
    "peft_io",
    "param_shapes",
    "rope_inv_freq",
    "save_pretrained",
    "unembed",
    "unstack_layers",
    "untie_head",
    "with_lora",
]

__getattr__, __dir__ = lazy_api(__name__)
