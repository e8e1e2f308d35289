"""Model configuration: one frozen dataclass for Qwen2/2.5, Qwen3 and Llama 3.x decoders.

`ModelConfig.from_hf` reads the dict of a Hugging Face `config.json` as written by transformers 4.x
(`rope_theta` + `rope_scaling` at the top level) and 5.x (`rope_parameters` holding `rope_theta`,
`rope_type` and the scaling fields). `to_hf` writes both spellings so that either version loads it.
"""

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
# Parameter / compute dtypes a policy may be loaded in, by config name (float16 has no loss
# scaling here: not offered).
PARAM_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")

_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}
# Defaults of the transformers config classes, used when a config.json leaves a field out.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, attention_bias=True),
    "qwen3": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, attention_bias=False),
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, attention_bias=False),
}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _freeze(x: Any) -> Any:
    """A hashable stand-in for dicts/lists (the config is a static argument of jitted functions)."""
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, list | tuple):
        return tuple(_freeze(v) for v in x)
    return x


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Qwen2/2.5, Qwen3, Llama 3.x).

    Hashable (usable as a static argument of `jax.jit`) although `rope_scaling` is a dict.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None  # None: the family's (qwen2: True, else False)
    qk_norm: bool | None = None  # None: the family's (qwen3: True, else False)
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        # Resolve family defaults (the dataclass is frozen, hence object.__setattr__).
        if self.head_dim is None and isinstance(self.num_attention_heads, int):
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.attention_bias is None:
            object.__setattr__(self, "attention_bias", self.model_type == "qwen2")
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", self.model_type == "qwen3")
        for name in (*_REQUIRED, "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config field {name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling type {rope_type!r} is not supported; supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            needed = _LLAMA3_KEYS if rope_type == "llama3" else ("factor",)
            missing = [k for k in needed if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope_scaling of type {rope_type!r} is missing {missing}")

    def __hash__(self):
        return hash(tuple(_freeze(getattr(self, f.name)) for f in dataclasses.fields(self)))

    @property
    def rope_type(self) -> str:
        """ "default", "llama3" or "linear"."""
        if self.rope_scaling is None:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head (GQA ratio)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds a config from the dict of a Hugging Face `config.json` (transformers 4.x or 5.x).

        Args:
          hf: the parsed config.json.

        Returns:
          The ModelConfig.

        Raises:
          ValueError: unsupported model_type, a missing required field, sliding-window attention,
            an unsupported rope type.
        """
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in _REQUIRED if k not in hf]
        if missing:
            raise ValueError(f"{model_type} config is missing required field(s) {missing}")
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true (sliding-window attention) is not supported")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        defaults = _FAMILY_DEFAULTS[model_type]

        # transformers 5.x: rope_parameters = {rope_theta, rope_type, factor, ...};
        # transformers 4.x: rope_theta at the top level, rope_scaling = {rope_type|type, ...}.
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_scaling = hf.get("rope_scaling") or None
        if rope_params and all(isinstance(v, dict) for v in rope_params.values()):
            raise ValueError("per-layer-type rope_parameters are not supported")
        rope_theta = rope_params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
        if rope_params.get("rope_type", rope_params.get("type", "default")) != "default":
            rope_scaling = rope_params
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.pop("rope_theta", None)
            rope_type = rope_scaling.pop("type", None) or rope_scaling.get("rope_type", "default")
            rope_scaling["rope_type"] = rope_type
            if rope_type == "default":
                rope_scaling = None
            elif rope_type == "llama3":
                rope_scaling.setdefault(
                    "original_max_position_embeddings",
                    hf.get("max_position_embeddings", defaults["max_position_embeddings"]),
                )

        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        if model_type == "qwen2":
            attention_bias = True  # Qwen2 always has q/k/v biases (no config field)
        else:
            attention_bias = bool(hf.get("attention_bias", defaults["attention_bias"]))
        if model_type == "qwen3" and not hf.get("head_dim"):
            head_dim = 128  # Qwen3Config's default
        eos = hf.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=hf.get(
                "max_position_embeddings", defaults["max_position_embeddings"]
            ),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=list(eos) if isinstance(eos, list | tuple) else eos,
            pad_token_id=hf.get("pad_token_id"),
        )

    def to_hf(self, dtype: str | None = None) -> dict[str, Any]:
        """The config.json dict that transformers 4.x and 5.x load.

        Args:
          dtype: optional torch dtype name recorded in the file ("float32", "bfloat16").

        Returns:
          A JSON-serialisable dict.
        """
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 checkpoints always have q/k/v biases (attention_bias=True)")
        if self.model_type == "qwen3" and not self.qk_norm:
            raise ValueError("qwen3 checkpoints always have q/k norms (qk_norm=True)")
        if self.model_type != "qwen3" and self.qk_norm:
            raise ValueError(f"{self.model_type} has no q/k norms (qk_norm=False)")
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling)
            rope_parameters["rope_type"] = self.rope_type
            rope_parameters.pop("type", None)
        out: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            # 4.x reads rope_theta (+ rope_scaling below); 5.x reads rope_parameters.
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "attention_dropout": 0.0,
            "use_cache": True,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
        if self.model_type != "qwen2":
            out["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            out["mlp_bias"] = False
        else:
            out["use_sliding_window"] = False
            out["sliding_window"] = None
        if dtype is not None:
            out["torch_dtype"] = dtype
            out["dtype"] = dtype
        return out


@dataclasses.dataclass(frozen=True)
class DTypePolicy:
    """The dtypes of a policy, in one place (mixed precision).

    - `param`: the master weights and the optimizer state (AdamW moments): what the train state
      holds and updates are applied to. float32, so that small updates (lr 1e-6 on weights of
      order 1e-2, far below bfloat16's resolution) are not rounded away.
    - `compute`: every forward and backward pass (matmuls, activations) and the rollout engine's
      copy of the weights, cast from the master weights after each update; gradients flow back
      through the cast into `param`-dtype gradients.
    - `cache`: the KV cache of the decode engine (None: the compute dtype).

    Always float32, whatever the policy: logits and log-softmax, losses and advantages, gradient
    accumulation, and the RMSNorm, rotary and attention-softmax internals.
    Names are keys of PARAM_DTYPES ("float32", "bfloat16").
    """

    param: str = "float32"
    compute: str = "float32"
    cache: str | None = None

    def __post_init__(self):
        for name in ("param", "compute", "cache"):
            value = getattr(self, name)
            if value is None and name == "cache":
                continue
            if value not in PARAM_DTYPES:
                raise ValueError(f"DTypePolicy.{name}={value!r} is not one of {list(PARAM_DTYPES)}")

    @property
    def param_dtype(self):
        return PARAM_DTYPES[self.param]

    @property
    def compute_dtype(self):
        return PARAM_DTYPES[self.compute]

    @property
    def cache_dtype(self):
        return PARAM_DTYPES[self.cache or self.compute]

    @property
    def mixed(self) -> bool:
        """Compute runs in another dtype than the master weights."""
        return self.param != self.compute

    def cast_for_compute(self, params: Any) -> Any:
        """The compute-dtype copy of (master) params; the params themselves when already so."""
        return cast_floating(params, self.compute_dtype)


def cast_floating(tree: Any, dtype) -> Any:
    """Floating leaves of `tree` cast to `dtype`; the tree itself when nothing changes (so that
    a float32 run keeps its very arrays)."""
    dtype = jnp.dtype(dtype)
    leaves = jax.tree.leaves(tree)
    if all(x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating) for x in leaves):
        return tree
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Reads `config.json` from a Hugging Face model folder (or the file itself).

    Raises:
      FileNotFoundError: no config.json in the folder (names the folder).
      ValueError: unsupported model_type (names it and the supported ones) or a bad field.
    """
    path = os.fspath(path)
    file = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json in model folder {path!r}")
    with open(file) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from None
    try:
        return ModelConfig.from_hf(hf)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def rope_inv_freq(config: ModelConfig):
    """Inverse rotary frequencies [head_dim // 2], float32 numpy, computed as transformers does."""
    dim = config.head_dim
    inv_freq = (1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(
        np.float32
    )
    if config.rope_type == "linear":
        return (inv_freq / np.float32(config.rope_scaling["factor"])).astype(np.float32)
    if config.rope_type != "llama3":
        return inv_freq
    rs = config.rope_scaling
    factor = rs["factor"]
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)
