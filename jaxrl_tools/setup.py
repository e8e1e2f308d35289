"""A run's parts built from its config: the mesh, the tokenizer, the model, the tools, the
environment's episodes, the reward, imported adapters and the checkpoint folder (`run` composes
them).

    mesh = make_mesh(cfg)
    tokenizer = setup_tokenizer(cfg)             # opened once; records and SFT take it
    model_cfg, params = setup_model(cfg, tokenizer, mesh)
    tools = setup_tools(cfg)                     # started: close_tools(tools) when done
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import jax

from jaxrl_tools import envs, models, prompts, records, sharding
from jaxrl_tools.config import ConfigError, RunConfig, TrainerSection
from jaxrl_tools.rewards import CompositeReward
from jaxrl_tools.tasks.tokenizer import build_mismatch, build_tokenizer
from jaxrl_tools.tools import McpServer, SandboxPool, create_tool
from jaxrl_tools.train.checkpoint import Checkpointer

log = logging.getLogger(__name__)

_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.msgpack", "*.h5")


def use_compile_cache(cfg: RunConfig) -> str | None:
    """Points jax's persistent compilation cache at `trainer.compile_cache_dir` (unless the
    JAX_COMPILATION_CACHE_DIR environment variable names one, or the field is null), before
    anything compiles; returns the folder in use."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    folder = cfg.trainer.compile_cache_dir
    if folder is not None:
        jax.config.update("jax_compilation_cache_dir", folder)
    return folder


def make_mesh(cfg: RunConfig):
    """The run's mesh, or None for the trivial 1x1x1 shape (one device, the default one)."""
    shape = cfg.trainer.mesh_shape
    if shape is None:
        return sharding.make_mesh((1, -1, 1))
    if shape == (1, 1, 1):
        return None
    return sharding.make_mesh(shape)


def make_rollout_mesh(cfg: RunConfig, mesh):
    """The engine's mesh: `rollout.mesh` over the trainer mesh's devices, or `mesh` itself."""
    shape = cfg.rollout.mesh_shape
    if shape is None:
        return mesh
    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    return None if len(devices) == 1 else sharding.make_mesh(shape, devices)


# --------------------------------------------------------------------------------- tokenizer


def _model_files(path: Path) -> list[str]:
    found = [p.name for g in _WEIGHT_GLOBS for p in path.glob(g)]
    if (path / "config.json").is_file():
        found.append("config.json")
    return sorted(found)


def tokenizer_action(cfg: RunConfig) -> str:
    """Whether the tokenizer folder holds a tokenizer ("load") or may have one built into it
    ("build").

    A tokenizer is built only for a tiny model (`model.path: null`), only with `tokenizer.build`,
    and never into a folder that holds a model; a folder built earlier is reused only when it
    was built with this config's `vocab_size` and `seed`.

    Raises:
      ConfigError: none may be loaded or built there, in one line naming the field and the fix.
    """
    t = cfg.tokenizer
    path = Path(cfg.tokenizer_path)
    field = "tokenizer.path" if t.path is not None else "model.path (tokenizer.path is null)"
    if (path / "tokenizer.json").is_file():
        if cfg.model.path is None and t.build:
            extra = len(records.tokenizer_texts(cfg))
            mismatch = build_mismatch(
                path, vocab_size=t.vocab_size, seed=t.seed, n_extra_texts=extra
            )
            if mismatch is not None:
                raise ConfigError(f"tokenizer.path={path} {mismatch}")
        return "load"
    if cfg.model.path is not None:
        raise ConfigError(
            f"no tokenizer.json in {path} ({field}): point tokenizer.path at the model's "
            "tokenizer folder (tokenizers are built only for a tiny model, model.path: null)"
        )
    if not t.build:
        raise ConfigError(
            f"no tokenizer.json in tokenizer.path={path}: set tokenizer.build=true to build "
            "one there, or point tokenizer.path at a tokenizer folder"
        )
    if path.exists() and not path.is_dir():
        raise ConfigError(f"tokenizer.path={path} is a file: give a folder for the tokenizer")
    if path.is_dir():
        held = _model_files(path)
        if held:
            raise ConfigError(
                f"tokenizer.path={path} holds model files ({', '.join(held[:3])}): a tokenizer "
                "is built only into a folder of its own; set tokenizer.path to a new folder, "
                "e.g. runs/<run_name>/tokenizer"
            )
    return "build"


def setup_tokenizer(cfg: RunConfig):
    """The run's tokenizer: loaded, or built when `tokenizer_action` allows it (a tiny model
    with `tokenizer.build`; never into a model's folder; a folder built with another vocab_size
    or seed is an error). In a multi-process job process 0 builds it and the others wait for it
    (one folder on shared storage: processes building it at once would race)."""
    if not sharding.is_multiprocess():
        tokenizer = _open_tokenizer(cfg)
    else:
        tokenizer = _open_tokenizer(cfg) if sharding.is_main_process() else None
        sharding.agree(None)  # a barrier: process 0's tokenizer is on disk
        tokenizer = tokenizer if tokenizer is not None else _open_tokenizer(cfg)
    return prompts.use_template(tokenizer, cfg.rollout.template, cfg.rollout.plain_format)


def _open_tokenizer(cfg: RunConfig):
    if tokenizer_action(cfg) == "build":
        t = cfg.tokenizer
        return build_tokenizer(
            cfg.tokenizer_path,
            vocab_size=t.vocab_size,
            seed=t.seed,
            texts=records.tokenizer_texts(cfg),
        )
    return prompts.load_tokenizer(cfg.tokenizer_path)


# ------------------------------------------------------------------------------------- model


def tiny_model_config(cfg: RunConfig, vocab_size: int, **token_ids) -> models.ModelConfig:
    """The architecture of `model.tiny` with the tokenizer's vocabulary (and `token_ids`:
    eos_token_id, pad_token_id)."""
    tiny = dataclasses.asdict(cfg.model.tiny)
    tiny.pop("seed")
    return models.ModelConfig(
        **tiny,
        vocab_size=vocab_size,
        attention_bias=tiny["model_type"] == "qwen2",
        qk_norm=tiny["model_type"] == "qwen3",
        **token_ids,
    )


def setup_model(cfg: RunConfig, tokenizer, mesh=None) -> tuple[models.ModelConfig, Any]:
    """The policy: loaded from `model.path`, or a random-init tiny model, in the dtype of the
    master weights (`model.param_dtype`; the compute dtype is applied per pass)."""
    dtype = models.PARAM_DTYPES[cfg.model.param_dtype]
    if cfg.model.path is not None:
        return models.from_pretrained(cfg.model.path, dtype=dtype, mesh=mesh)
    model_cfg = tiny_model_config(
        cfg,
        len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    key = jax.random.key(cfg.model.tiny.seed)
    return model_cfg, models.init_params(model_cfg, key, dtype=dtype, mesh=mesh)


def import_adapters(cfg: RunConfig, model_cfg) -> Any:
    """The PEFT adapter of `model.lora.init_from` (None: not set); its rank, alpha and targets
    must be the section's."""
    lora = cfg.model.lora
    if not lora.enabled or lora.init_from is None:
        return None
    dtype = models.PARAM_DTYPES[cfg.model.param_dtype]
    try:
        found, adapters = models.peft_io.load_peft(model_cfg, lora.init_from, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.lora.init_from: {e}") from None
    for name in ("rank", "alpha", "targets"):
        want, got = getattr(lora.config, name), getattr(found, name)
        if (sorted(want) != sorted(got)) if name == "targets" else want != got:
            raise ConfigError(
                f"model.lora.{name}={want!r} but the adapter in model.lora.init_from="
                f"{lora.init_from} has {got!r}"
            )
    return adapters


# ------------------------------------------------------------------ tools, episodes, reward


def setup_tools(cfg: RunConfig) -> list:
    """The tools the config declares, started (the Python tool's worker pool starts here; an MCP
    server starts here and declares each of its tools as a tool of its own)."""
    tools = []
    try:
        for i, spec in enumerate(cfg.tools):
            tool = create_tool(spec.cls, dict(spec.config))
            if isinstance(tool, McpServer):  # one server, several tools; `name` prefixes them
                try:
                    tools += tool.tools(prefix=spec.name)
                except ValueError as e:
                    raise ConfigError(f"tools[{i}] (mcp): {e}") from None
                continue
            tool.name = spec.name or tool.name
            tools.append(tool)
        for tool in tools:
            tool.start()
    except BaseException:
        close_tools(tools)  # the servers started so far
        raise
    return tools


def close_tools(tools: list) -> None:
    for tool in tools:
        try:
            asyncio.run(tool.close())
        except Exception as e:  # noqa: BLE001 - closing must not hide the run's own error
            log.warning("closing tool %s: %s", tool.name, e)


def setup_episodes(cfg: RunConfig) -> envs.Episodes | None:
    """The `env` section's episodes (None without one); environments that run code get a
    sandbox pool of `env.sandbox_workers` workers (closed by `close_episodes`)."""
    if cfg.env.name is None:
        return None
    pool = SandboxPool(cfg.env.sandbox_workers) if envs.needs_sandbox(cfg.env.name) else None
    return envs.Episodes.from_section(cfg.env, pool)


def close_episodes(episodes: envs.Episodes | None) -> None:
    if episodes is not None and episodes.pool is not None:
        episodes.pool.close()


def make_reward(cfg: RunConfig) -> CompositeReward:
    return CompositeReward(cfg.reward)


# ------------------------------------------------------------------------------ checkpoints


def run_checkpoints(t: TrainerSection) -> tuple[Checkpointer, bool]:
    """The checkpoints of a run to train, and whether it resumes (it holds some): locked for the
    run's life, before anything loads, so that a second run on the folder is refused.

    Raises:
      ConfigError: the folder holds a run's checkpoints and `trainer.resume` is not set.
    """
    ckpt = Checkpointer(
        t.checkpoint_dir,
        every=t.checkpoint_every or t.steps or 1,
        keep=t.keep_checkpoints,
        lock=True,
    )
    latest = ckpt.latest_step()
    if latest is not None and not t.resume:
        ckpt.close()
        raise ConfigError(
            f"trainer.checkpoint_dir {ckpt.directory} already holds checkpoints of a run (latest "
            f"step {latest}): continue it with --resume (trainer.resume=true), or give "
            "trainer.checkpoint_dir a new folder"
        )
    return ckpt, latest is not None


def saved_checkpoints(t: TrainerSection, step: int | None = None) -> Checkpointer:
    """The checkpoints of a trained run, to restore one (`step`, or the newest) from.

    Raises:
      ConfigError: no checkpoint folder or no checkpoint in it, or no checkpoint of `step` (the
        message lists the steps there); nothing is written.
    """
    directory = t.checkpoint_dir
    if not Path(directory).is_dir():
        raise ConfigError(
            f"trainer.checkpoint_dir={directory} does not exist: train first, or set "
            "trainer.checkpoint_dir to the run's checkpoint folder"
        )
    ckpt = Checkpointer(directory)
    steps = sorted(ckpt.all_steps())
    if not steps:
        error = (
            f"no checkpoints in trainer.checkpoint_dir={directory}: train first, or set "
            "trainer.checkpoint_dir to the run's checkpoint folder"
        )
    elif step is not None and step not in steps:
        error = (
            f"--step {step}: there is no checkpoint of step {step} in {directory}; steps "
            f"there: {', '.join(map(str, steps))}"
        )
    else:
        return ckpt
    ckpt.close()
    raise ConfigError(error)
