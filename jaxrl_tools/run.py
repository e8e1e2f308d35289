"""The composition root: builds a run's parts from a RunConfig and drives them.

Entry points (the CLI's subcommands) call `sft`, `train`, `evaluate`, `export` and `demo`
here; each only wires library pieces together.
"""

import asyncio
import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_tools import data as data_lib
from jaxrl_tools import models, sharding, tasks
from jaxrl_tools.config import RunConfig
from jaxrl_tools.tokenizer import build_tokenizer, load_tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# ---------------------------------------------------------------------------------- pieces


def make_mesh(cfg: RunConfig):
    """The run's mesh, or None on a single device with the trivial 1x1x1 shape."""
    shape = cfg.trainer.mesh_shape
    if shape is None:
        return sharding.make_mesh((1, -1, 1))
    if shape == (1, 1, 1) and jax.device_count() == 1:
        return None
    return sharding.make_mesh(shape)


def setup_tokenizer(cfg: RunConfig):
    t = cfg.tokenizer
    path = Path(cfg.tokenizer_path)
    if (path / "tokenizer.json").exists() or not t.build:
        return load_tokenizer(path)
    return build_tokenizer(path, vocab_size=t.vocab_size, seed=t.seed)


def tiny_model_config(cfg: RunConfig, tokenizer) -> models.ModelConfig:
    tiny = cfg.model.tiny
    return models.ModelConfig(
        model_type=tiny.model_type,
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.head_dim,
        rope_theta=tiny.rope_theta,
        tie_word_embeddings=tiny.tie_word_embeddings,
        attention_bias=tiny.model_type == "qwen2",
        qk_norm=tiny.model_type == "qwen3",
        max_position_embeddings=tiny.max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def setup_model(cfg: RunConfig, tokenizer, mesh=None) -> tuple[models.ModelConfig, Any]:
    """The policy: loaded from `model.path`, or a random-init tiny model."""
    dtype = DTYPES[cfg.model.dtype]
    if cfg.model.path is not None:
        return models.from_pretrained(cfg.model.path, dtype=dtype, mesh=mesh)
    model_cfg = tiny_model_config(cfg, tokenizer)
    params = models.init_params(model_cfg, jax.random.key(cfg.model.tiny.seed), dtype=dtype,
                                mesh=mesh)
    return model_cfg, params


def setup_tools(cfg: RunConfig) -> list:
    """The tools the config declares (the sandboxed Python tool starts its worker pool here)."""
    from jaxrl_tools.tools import create_tool

    out = []
    for spec in cfg.tools:
        tool = create_tool(spec.cls, dict(spec.config))
        if spec.name:
            tool.name = spec.name
        out.append(tool)
    return out


def task_records(cfg: RunConfig, split: str) -> list[dict]:
    """Records of the generated task (train and held-out eval use disjoint seeds)."""
    d = cfg.data
    n, seed = (d.task_train_size, d.shuffle_seed) if split == "train" else (
        d.task_eval_size, d.shuffle_seed + 10_000)
    levels = tuple(range(d.task_difficulty + 1)) if split == "train" else (d.task_difficulty,)
    return [p.to_record(tools=()) for p in tasks.make_problems(n, seed=seed, difficulty=levels)]


def eval_records(cfg: RunConfig) -> list[dict]:
    if cfg.data.task is not None:
        return task_records(cfg, "eval")
    loader = data_lib.loader_from_config(cfg.data, "eval")
    return [r for batch in loader for r in batch]


class EventLoop:
    """A private asyncio loop on a thread: the trainer calls async tools from sync code."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_json_default))


def _json_default(x):
    if isinstance(x, np.generic | np.ndarray):
        return x.tolist()
    return str(x)


__all__ = ["Sequence"]
