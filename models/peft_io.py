"""LoRA adapters <-> the PEFT format: `adapter_config.json` + `adapter_model.safetensors`.

PEFT names a causal LM's adapter tensors after the module path inside `PeftModel`:
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r] (torch Linear layout: transposes of our A [*in, r] and B [r, *out] with the in / out
axes flattened in HF order). The scale is not stored: PEFT recomputes lora_alpha / r, as we do.
Only plain LoRA is read: rsLoRA, DoRA, per-module rank / alpha patterns, biases and layer subsets
are refused by name (they would load silently wrong).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_tools.models.config import ModelConfig
from jaxrl_tools.models.hf_io import SafetensorsFile, _np_dtype, write_safetensors
from jaxrl_tools.models.lora import LORA_TARGETS, LoraConfig, get_path, lora_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_MODULES = {  # target -> its module under model.layers.{i} in transformers' decoders
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
_PREFIX = "base_model.model.model.layers.{i}."
# adapter_config.json fields that change what the tensors mean, and the value we support.
_PLAIN = {
    "use_rslora": False,
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "modules_to_save": None,
    "lora_bias": False,
    "exclude_modules": None,
    "target_parameters": None,
}
# Fields of newer PEFT versions: checked when read, not written (older versions refuse them).
_NEWER = ("lora_bias", "exclude_modules", "target_parameters")


def peft_names(config: ModelConfig, lora: LoraConfig) -> dict[str, tuple[str, str, int]]:
    """PEFT tensor name -> (target, "lora_a" | "lora_b", layer index)."""
    out = {}
    for name in lora.targets:
        for i in range(config.num_hidden_layers):
            stem = _PREFIX.format(i=i) + _MODULES[name]
            out[f"{stem}.lora_A.weight"] = (name, "lora_a", i)
            out[f"{stem}.lora_B.weight"] = (name, "lora_b", i)
    return out


def _to_peft(which: str, x: np.ndarray) -> np.ndarray:
    """One layer's A [*in, r] -> [r, in], or B [r, *out] -> [out, r]."""
    if which == "lora_a":
        return np.ascontiguousarray(x.reshape(-1, x.shape[-1]).T)
    return np.ascontiguousarray(x.reshape(x.shape[0], -1).T)


def to_peft_tensors(config: ModelConfig, lora: LoraConfig, adapters: Any) -> dict[str, np.ndarray]:
    """The adapter tree as PEFT-named, PEFT-shaped host arrays."""
    leaves: dict[tuple[str, str], np.ndarray] = {}
    out = {}
    for name, (target, which, i) in peft_names(config, lora).items():
        if (target, which) not in leaves:
            leaf = get_path(adapters, LORA_TARGETS[target][0])[which]
            leaves[(target, which)] = np.asarray(jax.device_get(leaf))
        out[name] = _to_peft(which, leaves[(target, which)][i])
    return out


def peft_adapter_config(
    lora: LoraConfig, base_model_name_or_path: str | None = None
) -> dict[str, Any]:
    """The adapter_config.json dict `peft.PeftConfig.from_pretrained` reads."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.targets),
        "init_lora_weights": True,
        "inference_mode": True,
        **{k: v for k, v in _PLAIN.items() if k not in _NEWER},
    }


def save_peft(
    config: ModelConfig,
    lora: LoraConfig,
    adapters: Any,
    path: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
) -> None:
    """Writes `path`/adapter_config.json and adapter_model.safetensors (adapters' dtype), which
    `peft.PeftModel.from_pretrained(hf_base_model, path)` loads."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = to_peft_tensors(config, lora, adapters)
    dtype = _np_dtype(jax.tree.leaves(adapters)[0].dtype)
    write_safetensors(
        os.path.join(path, WEIGHTS_FILE),
        [(n, (lambda t=t: t.astype(dtype), t.shape, dtype)) for n, t in sorted(tensors.items())],
    )
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(peft_adapter_config(lora, base_model_name_or_path), f, indent=2)


def read_peft_config(path: str | os.PathLike) -> LoraConfig:
    """The LoraConfig of a PEFT adapter folder.

    Raises:
      FileNotFoundError: no adapter_config.json in the folder.
      ValueError: not a LoRA adapter, or a variant we do not read (names the field).
    """
    file = os.path.join(os.fspath(path), CONFIG_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no {CONFIG_FILE} in PEFT adapter folder {os.fspath(path)!r}")
    with open(file) as f:
        raw = json.load(f)
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type {raw.get('peft_type')!r} is not 'LORA'")
    for key, plain in _PLAIN.items():
        value = raw.get(key)
        # None, the plain value, or an empty list / dict where the plain value is empty.
        if value is not None and value != plain and (plain or value):
            raise ValueError(f"{file}: {key}={raw[key]!r} is not supported (only {plain!r})")
    targets = raw.get("target_modules")
    if not isinstance(targets, list):
        raise ValueError(f"{file}: target_modules must be a list of names, got {targets!r}")
    try:
        return LoraConfig(
            rank=int(raw["r"]),
            alpha=float(raw["lora_alpha"]),
            dropout=float(raw.get("lora_dropout", 0.0)),
            targets=tuple(sorted(targets)),
        )
    except (KeyError, ValueError) as e:
        raise ValueError(f"{file}: {e}") from None


def load_peft(
    config: ModelConfig, path: str | os.PathLike, *, dtype=jnp.float32
) -> tuple[LoraConfig, Any]:
    """Reads a PEFT LoRA adapter folder into (LoraConfig, adapter tree of `dtype`).

    Raises:
      ValueError: a tensor missing or of the wrong shape (names it and both shapes), or an
        unsupported adapter_config.json (see `read_peft_config`).
    """
    path = os.fspath(path)
    lora = read_peft_config(path)
    weights = SafetensorsFile(os.path.join(path, WEIGHTS_FILE))
    shapes = lora_shapes(config, lora, dtype)
    np_dtype = _np_dtype(dtype)
    hosts: dict[tuple[str, str], np.ndarray] = {}
    for name, (target, which, i) in peft_names(config, lora).items():
        shape = get_path(shapes, LORA_TARGETS[target][0])[which].shape
        layer_shape = shape[1:]
        if which == "lora_a":
            expected = (layer_shape[-1], math.prod(layer_shape[:-1]))
        else:
            expected = (math.prod(layer_shape[1:]), layer_shape[0])
        if name not in weights.header:
            raise ValueError(f"{path}: tensor {name} is missing from {WEIGHTS_FILE}")
        if weights.shape(name) != expected:
            raise ValueError(
                f"{path}: tensor {name} has shape {weights.shape(name)}, the model needs {expected}"
            )
        host = hosts.setdefault((target, which), np.empty(shape, np_dtype))
        host[i] = np.asarray(weights.get(name)).T.reshape(layer_shape).astype(np_dtype)
    out: dict = {}
    for (target, which), host in hosts.items():
        node = out
        for p in LORA_TARGETS[target][0]:
            node = node.setdefault(p, {})
        node[which] = jnp.asarray(host)
    return lora, out
