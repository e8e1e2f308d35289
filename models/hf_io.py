"""Hugging Face checkpoints <-> params: a declarative key table per family, safetensors I/O.

Each family's table lists, for every HF tensor, the param path it fills, whether the HF matrix is
stored transposed (torch Linear weights are [out, in]; our kernels are [in, out...]) and where our
axes split into the two HF matrix dimensions (q_proj [D, H, Dh] <-> HF [H*Dh, D]). Layer tensors
("{i}" in the name) fill one slice of a [layers, ...] stacked parameter.

safetensors files are read and written with a tiny reader/writer over the documented format
(8-byte header length, JSON header, raw little-endian data) rather than `safetensors.safe_open`,
because the numpy backend of safetensors cannot represent bfloat16; numpy + ml_dtypes can.
Reading memory-maps each file and converts one tensor at a time into one parameter leaf, which
then goes straight to its (sharded) device placement, so the host never holds a second copy of
the whole model, only of the leaf being filled.
"""

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_tools.models.config import ModelConfig, load_config
from jaxrl_tools.models.transformer import Params, logical_axes, param_shapes
from jaxrl_tools.sharding import tree_shardings

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class KeySpec:
    """One HF tensor name (template; "{i}" = layer index) <-> one param path.

    transpose: the HF tensor is the transpose of our (flattened) kernel.
    split: our axes [:split] form the first, axes [split:] the second HF dimension (before any
      transpose); an empty group is dropped (vectors).
    when: a condition on the config ("attention_bias", "qk_norm", "untied"), or None.
    """

    hf: str
    path: tuple[str, ...]
    transpose: bool = False
    split: int = 1
    when: str | None = None


_L = "model.layers.{i}."
_ATTN = ("layers", "attn")
_COMMON = (
    KeySpec("model.embed_tokens.weight", ("embed", "embedding")),
    KeySpec(_L + "input_layernorm.weight", ("layers", "input_norm", "scale")),
    KeySpec(_L + "self_attn.q_proj.weight", (*_ATTN, "q_proj", "kernel"), transpose=True),
    KeySpec(_L + "self_attn.k_proj.weight", (*_ATTN, "k_proj", "kernel"), transpose=True),
    KeySpec(_L + "self_attn.v_proj.weight", (*_ATTN, "v_proj", "kernel"), transpose=True),
    KeySpec(_L + "self_attn.o_proj.weight", (*_ATTN, "o_proj", "kernel"), transpose=True, split=2),
    KeySpec(_L + "post_attention_layernorm.weight", ("layers", "post_attention_norm", "scale")),
    KeySpec(_L + "mlp.gate_proj.weight", ("layers", "mlp", "gate_proj", "kernel"), transpose=True),
    KeySpec(_L + "mlp.up_proj.weight", ("layers", "mlp", "up_proj", "kernel"), transpose=True),
    KeySpec(_L + "mlp.down_proj.weight", ("layers", "mlp", "down_proj", "kernel"), transpose=True),
    KeySpec("model.norm.weight", ("final_norm", "scale")),
    KeySpec("lm_head.weight", ("lm_head", "kernel"), transpose=True, when="untied"),
)
_QKV_BIAS = tuple(
    KeySpec(
        _L + f"self_attn.{p}_proj.bias",
        (*_ATTN, f"{p}_proj", "bias"),
        split=2,
        when="attention_bias",
    )
    for p in "qkv"
)
_QK_NORM = tuple(
    KeySpec(_L + f"self_attn.{p}_norm.weight", (*_ATTN, f"{p}_norm", "scale"), when="qk_norm")
    for p in "qk"
)
KEY_TABLES: dict[str, tuple[KeySpec, ...]] = {
    "qwen2": _COMMON + _QKV_BIAS,
    "qwen3": _COMMON + _QKV_BIAS + _QK_NORM,
    "llama": _COMMON + _QKV_BIAS,
}
# Tensors some checkpoints carry that we recompute or do not need.
_IGNORED = re.compile(r"(.*rotary_emb\.inv_freq$)")


def key_table(config: ModelConfig) -> tuple[KeySpec, ...]:
    """The KeySpecs that apply to this config (conditions resolved)."""
    conditions = {
        "attention_bias": config.attention_bias,
        "qk_norm": config.qk_norm,
        "untied": not config.tie_word_embeddings,
        None: True,
    }
    return tuple(s for s in KEY_TABLES[config.model_type] if conditions[s.when])


def _get(tree: Params, path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _hf_shape(spec: KeySpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """HF tensor shape for one (per-layer) param slice of `shape`."""
    groups = [g for g in (shape[: spec.split], shape[spec.split :]) if g]
    dims = tuple(math.prod(g) for g in groups)
    return dims[::-1] if spec.transpose else dims


def _to_param(spec: KeySpec, hf_array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return (hf_array.T if spec.transpose else hf_array).reshape(shape)


def _to_hf(spec: KeySpec, array: np.ndarray) -> np.ndarray:
    flat = array.reshape(
        _hf_shape(spec, array.shape)[::-1] if spec.transpose else _hf_shape(spec, array.shape)
    )
    return np.ascontiguousarray(flat.T if spec.transpose else flat)


def _entries(config: ModelConfig) -> Iterator[tuple[str, KeySpec, int | None]]:
    """(HF name, spec, layer index or None) for every tensor of the checkpoint, in file order."""
    for spec in key_table(config):
        if "{i}" in spec.hf:
            for i in range(config.num_hidden_layers):
                yield spec.hf.format(i=i), spec, i
        else:
            yield spec.hf, spec, None


def hf_names(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], int | None]]:
    """HF tensor name -> (param path, layer index or None): the mapping as a table.

    ``model.layers.1.mlp.up_proj.weight`` is ``params["layers"]["mlp"]["up_proj"]["kernel"][1]``
    (transposed). A tied model has no ``lm_head.weight``: the head is ``embed.embedding``.
    """
    return {name: (spec.path, layer) for name, spec, layer in _entries(config)}


def to_hf_tensors(config: ModelConfig, tree: Params) -> dict[str, np.ndarray]:
    """Any param-shaped tree (params, gradients, Adam moments) as HF-named, HF-shaped arrays.

    The same names, shapes and transposes as ``save_pretrained`` writes, without a file, so a
    gradient can be compared with ``{n: p.grad for n, p in torch_model.named_parameters()}``.
    """
    out = {}
    for name, spec, layer in _entries(config):
        leaf = np.asarray(jax.device_get(_get(tree, spec.path)))
        out[name] = _to_hf(spec, leaf if layer is None else leaf[layer])
    return out


def from_hf_tensors(config: ModelConfig, tensors: dict[str, Any], dtype=jnp.float32) -> Params:
    """The inverse of ``to_hf_tensors``: HF-named arrays (numpy, or anything np.asarray takes)
    into a param tree of ``dtype``. A missing name is a KeyError naming it."""
    shapes = param_shapes(config, dtype)
    leaves: dict[tuple[str, ...], np.ndarray] = {}
    for name, spec, layer in _entries(config):
        if name not in tensors:
            raise KeyError(f"from_hf_tensors: tensor {name} (for params{list(spec.path)}) missing")
        shape = _get(shapes, spec.path).shape
        host = leaves.setdefault(spec.path, np.empty(shape, _np_dtype(dtype)))
        value = np.asarray(tensors[name])
        if layer is None:
            host[...] = _to_param(spec, value, shape)
        else:
            host[layer] = _to_param(spec, value, shape[1:])

    def build(tree, prefix=()):
        return {
            k: build(v, (*prefix, k)) if isinstance(v, dict) else jnp.asarray(leaves[(*prefix, k)])
            for k, v in tree.items()
        }

    return build(shapes)


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> the shape the config needs, for every tensor of the checkpoint."""
    shapes = param_shapes(config, jnp.float32)
    out = {}
    for name, spec, layer in _entries(config):
        leaf_shape = _get(shapes, spec.path).shape
        out[name] = _hf_shape(spec, leaf_shape if layer is None else leaf_shape[1:])
    return out


def hf_tensor_items(config: ModelConfig, params: Params) -> list[tuple[str, tuple[Any, ...]]]:
    """(HF name, (make, shape, dtype)) for every tensor, as `write_safetensors` takes them.

    Grouped by parameter leaf, and `make()` fetches a leaf from the devices (gathered across
    processes) once for all its layers, so one leaf at a time is on the host.
    """
    leaf_dtype = _np_dtype(params["embed"]["embedding"].dtype)
    cache: dict[tuple[str, ...], np.ndarray] = {}

    def fetch(spec: KeySpec, layer: int | None):
        def make():
            if spec.path not in cache:
                cache.clear()  # one leaf on the host at a time (entries are grouped by leaf)
                cache[spec.path] = _to_host(_get(params, spec.path))
            leaf = cache[spec.path]
            return _to_hf(spec, leaf if layer is None else leaf[layer]).astype(leaf_dtype)

        return make

    items = []
    for name, spec, layer in sorted(_entries(config), key=lambda e: (e[1].path, e[2] or 0)):
        leaf = _get(params, spec.path)
        shape = _hf_shape(spec, leaf.shape if layer is None else leaf.shape[1:])
        items.append((name, (fetch(spec, layer), shape, leaf_dtype)))
    return items


# ---------------------------------------------------------------------------------------------
# safetensors format

_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(bool),
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """Memory-mapped read access to one .safetensors file, tensor by tensor."""

    def __init__(self, filename: str):
        self.filename = filename
        with open(filename, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{filename}: not a safetensors file (too short)")
            n = int.from_bytes(raw, "little")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{filename}: bad safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.header = header
        self._offset = 8 + n
        self._mmap = np.memmap(filename, dtype=np.uint8, mode="r")

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """A read-only view of one tensor (no copy until it is used)."""
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(
                f"{self.filename}: tensor {name} has unsupported dtype {info['dtype']}"
            )
        begin, end = info["data_offsets"]
        buf = self._mmap[self._offset + begin : self._offset + end]
        return buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def write_safetensors(
    filename: str,
    tensors: list[tuple[str, Any]],
    metadata: dict[str, str] | None = None,
    *,
    write: bool = True,
) -> None:
    """Writes tensors given as (name, (make, shape, dtype)); `make()` returns the array.

    Arrays are made one at a time when their bytes are written, so writing a file needs the
    memory of one tensor, not of the file. With write=False every `make()` still runs (they may
    be collectives that all processes must join) but nothing is written.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    specs = []
    for name, item in tensors:
        shape, dtype = tuple(item[1]), np.dtype(item[2])
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        specs.append((name, item[0], shape, dtype, nbytes))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    if not write:
        for _, make, *_ in specs:
            make()
        return
    with open(filename, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, make, shape, dtype, _ in specs:
            array = np.ascontiguousarray(make(), dtype=dtype)
            if array.shape != shape:
                raise ValueError(f"{filename}: tensor {name} has shape {array.shape}, not {shape}")
            f.write(array.tobytes())


# ---------------------------------------------------------------------------------------------
# loading


def _index_checkpoint(path: str) -> dict[str, SafetensorsFile]:
    """HF tensor name -> the file holding it."""
    index_file = os.path.join(path, INDEX_FILE)
    files: dict[str, SafetensorsFile] = {}
    if os.path.isfile(index_file):
        with open(index_file) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not names:
            raise FileNotFoundError(f"no *.safetensors files in model folder {path!r}")
    where: dict[str, SafetensorsFile] = {}
    for name in names:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"{index_file} lists {name!r}, which is not in {path!r}")
        files[name] = SafetensorsFile(full)
        for key in files[name].keys():
            where[key] = files[name]
    return where


def _np_dtype(dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)


def _place(host: np.ndarray, sharding) -> jax.Array:
    """One host leaf -> device(s): each device gets only its own shard."""
    if sharding is None:
        return jax.device_put(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def from_pretrained(
    path: str | os.PathLike, *, dtype=jnp.float32, mesh=None, rules=None
) -> tuple[ModelConfig, Params]:
    """Loads a Hugging Face Qwen2/Qwen3/Llama folder (config.json + *.safetensors [+ index]).

    Tensors are converted one at a time into the parameter leaf they belong to; each finished
    leaf is placed on the devices (sharded by `logical_axes(config)` when `mesh` is given) before
    the next is read.

    Args:
      path: the model folder.
      dtype: parameter dtype (checkpoint tensors are cast to it).
      mesh: optional device mesh; parameters are placed sharded on it.
      rules: logical -> mesh axes table (default `sharding.DEFAULT_RULES`).

    Returns:
      (config, params).

    Raises:
      FileNotFoundError: no config.json / no safetensors file in the folder.
      ValueError: a tensor is missing or has the wrong shape (names the tensor and both shapes),
        an unsupported model_type, a mesh that does not divide a parameter.
    """
    path = os.fspath(path)
    config = load_config(path)
    where = _index_checkpoint(path)
    shapes = param_shapes(config, dtype)

    # Check every name and shape before reading any data.
    entries = list(_entries(config))
    for name, spec, layer in entries:
        leaf_shape = _get(shapes, spec.path).shape
        expected = _hf_shape(spec, leaf_shape if layer is None else leaf_shape[1:])
        if name not in where:
            raise ValueError(
                f"tensor {name} (for params{list(spec.path)}) is missing from the "
                f"checkpoint in {path!r}"
            )
        found = where[name].shape(name)
        if found != expected:
            raise ValueError(
                f"tensor {name} in {where[name].filename} has shape {found}, but "
                f"the config needs {expected}"
            )
    used = {name for name, _, _ in entries}
    extra = [
        k
        for k in where
        if k not in used
        and not _IGNORED.match(k)
        and not (k == "lm_head.weight" and config.tie_word_embeddings)
    ]
    if extra:
        log.warning("%s: ignoring %d unexpected tensors, e.g. %s", path, len(extra), extra[:5])

    shardings = None
    if mesh is not None:
        shardings = tree_shardings(logical_axes(config), mesh, rules, shapes=shapes)

    np_dtype = _np_dtype(dtype)
    by_path: dict[tuple[str, ...], list[tuple[str, KeySpec, int | None]]] = {}
    for entry in entries:
        by_path.setdefault(entry[1].path, []).append(entry)

    leaves: dict[tuple[str, ...], jax.Array] = {}
    for leaf_path, group in by_path.items():
        shape = _get(shapes, leaf_path).shape
        host = np.empty(shape, np_dtype)
        for name, spec, layer in group:
            tensor = where[name].get(name)
            if layer is None:
                host[...] = _to_param(spec, tensor, shape).astype(np_dtype)
            else:
                host[layer] = _to_param(spec, tensor, shape[1:]).astype(np_dtype)
        leaves[leaf_path] = _place(host, None if shardings is None else _get(shardings, leaf_path))
        del host  # the next leaf reuses the memory

    def build(tree, prefix=()):
        return {
            k: build(v, (*prefix, k)) if isinstance(v, dict) else leaves[(*prefix, k)]
            for k, v in tree.items()
        }

    return config, build(shapes)


# ---------------------------------------------------------------------------------------------
# saving

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*", size.upper())
    if not m:
        raise ValueError(f"max_shard_size {size!r} is not like 5GB / 500MB / 10KB or an int")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _to_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host (gathered from the other processes when multi-host)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def save_pretrained(
    config: ModelConfig,
    params: Params,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
) -> None:
    """Writes a HF folder (config.json + safetensors) that AutoModelForCausalLM loads.

    Above `max_shard_size` the tensors are split over model-0000k-of-0000n.safetensors files with
    a model.safetensors.index.json, as transformers does. Tensors are fetched from the devices one
    parameter leaf at a time. The dtype of the files is the dtype of the params. Multi-host: every
    process must call it (parameters are gathered leaf by leaf); only process 0 writes.

    Args:
      config: the architecture.
      params: the parameters (as from `init_params` / `from_pretrained`).
      path: output folder (created).
      max_shard_size: bytes per file, an int or a string like "5GB", "10KB".
    """
    path = os.fspath(path)
    if jax.process_index() == 0:
        os.makedirs(path, exist_ok=True)
    limit = _parse_size(max_shard_size)
    leaf_dtype = _np_dtype(params["embed"]["embedding"].dtype)

    tensors = hf_tensor_items(config, params)
    shards: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, item in tensors:
        nbytes = math.prod(item[1]) * item[2].itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, item))
        size += nbytes

    main = jax.process_index() == 0
    dtype_name = "bfloat16" if leaf_dtype == np.dtype(ml_dtypes.bfloat16) else leaf_dtype.name
    if main:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config.to_hf(dtype=dtype_name), f, indent=2)
        for stale in os.listdir(path):  # files of an earlier save would confuse the loader
            if stale.endswith(".safetensors") or stale == INDEX_FILE:
                os.remove(os.path.join(path, stale))
    if len(shards) == 1:
        write_safetensors(os.path.join(path, SINGLE_FILE), shards[0], write=main)
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(path, fname), shard, write=main)
        weight_map.update({name: fname for name, _ in shard})
    if not main:
        return
    total = sum(math.prod(item[1]) * item[2].itemsize for _, item in tensors)
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
