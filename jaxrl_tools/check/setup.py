"""Checks of what a run sets up: tools (built, not started), rewards, devices against the mesh,
the batch split, and output folders."""

from __future__ import annotations

import inspect
import math
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jaxrl_tools import rewards, sharding, tools
from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.config.checks import agent_function
from jaxrl_tools.errors import reject_unknown_keys
from jaxrl_tools.rollout import declares_tools

WRITE_PROBE_TIMEOUT_S = 10.0


# ------------------------------------------------------------------------- tools and rewards


def build_tools(cfg: RunConfig) -> list[tools.Tool]:
    """The config's tools, built and not started (no worker pool, no index; an MCP server is
    started to list its tools, one tool each, and stopped)."""
    built = []
    declared: dict[str, str] = {}  # tool name -> the entry declaring it
    for i, spec in enumerate(cfg.tools):
        where = f"tools[{i}]"
        for key, value in spec.config.items():
            if key.endswith("_path") and isinstance(value, str) and not Path(value).exists():
                raise ConfigError(
                    f"{where}.config.{key}={value}: no such file (give the path of the "
                    f"{key.removesuffix('_path')} file)"
                )
        try:
            tool = tools.create_tool(spec.cls, dict(spec.config))
            if isinstance(tool, tools.McpServer):  # listed from the server, which then stops
                try:
                    new = tool.tools(prefix=spec.name)
                finally:
                    tool.stop()
            else:
                tool.name = spec.name or tool.name
                new = [tool]
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where} ({spec.cls}): {e}") from None
        for t in new:  # an MCP server's names, which the config's own check cannot see
            if t.name in declared:
                raise ConfigError(
                    f"{where} ({spec.cls}) declares a tool {t.name!r}, as {declared[t.name]} "
                    "does: give the mcp entry a name (its tools are then declared as "
                    "<name>_<tool>) or list the tool in its exclude"
                )
            declared[t.name] = where
        built += new
    return built


def budget_warning(cfg: RunConfig) -> str | None:
    """One line when the turn limit would end responses before their tool budget is spent
    (one call per turn and fewer tool turns than calls), else None."""
    r = cfg.rollout
    several = r.protocol in ("qwen", "hermes") and r.multi_call
    if r.protocol == "none" or cfg.env.name is not None or r.agent is not None or several:
        return None
    if r.max_turns >= r.max_tool_calls:
        return None
    return (
        f"rollout.max_turns={r.max_turns} ends a response after {r.max_turns} tool turns, "
        f"before its max_tool_calls={r.max_tool_calls} calls (one per turn): raise max_turns "
        "to the budget"
    )


def check_tools(cfg: RunConfig) -> list[tools.Tool]:
    """The agent loads, the tools build, the protocol has a tool to call, and the Python
    sandbox can start.

    Returns:
      The built (not started) tools.
    """
    if cfg.rollout.agent is not None:  # before the model and engine are built
        agent_function(cfg.rollout.agent)
    built = build_tools(cfg)
    protocol = cfg.rollout.protocol
    if protocol != "none" and not built and cfg.rollout.agent is None:  # agents bring theirs
        example = (
            "{class: search, config: {corpus_path: ...}}"
            if "search" in protocol
            else "{class: python}"
        )
        raise ConfigError(
            f"rollout.protocol={protocol} needs a tool; add tools: [{example}] (or set "
            "rollout.protocol=none for no tools)"
        )
    for i, tool in enumerate(built):
        if isinstance(tool, tools.PythonTool):
            missing = tools.check_isolation(tools.SandboxConfig())
            if missing:
                raise ConfigError(
                    f"tools[{i}] (python): the sandbox cannot start on this machine: "
                    f"{'; '.join(missing)}"
                )
    return built


def tools_schema(cfg: RunConfig, built: Sequence[tools.Tool]) -> list[dict] | None:
    """The declarations the prompts render (as the sampler's): function-calling protocols only."""
    if not built or not declares_tools(cfg.rollout.protocol):
        return None
    return [t.schema() for t in built]


def check_rewards(cfg: RunConfig) -> None:
    """Every reward imports and takes its `kwargs` (checked against its signature)."""
    for i, spec in enumerate(cfg.reward):
        try:
            fn = rewards.get_reward(spec.name)
        except KeyError as e:
            raise ConfigError(f"reward[{i}].name: {e.args[0]}") from None
        params = inspect.signature(fn).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        valid = [
            n
            for n, p in params.items()
            if n not in ("response", "ground_truth", "info") and p.kind is not p.VAR_POSITIONAL
        ]
        reject_unknown_keys(spec.kwargs, valid, f"reward[{i}].kwargs", f"reward {spec.name!r}")


def check_ground_truths(cfg: RunConfig, records: dict[str, Sequence[dict]]) -> None:
    """Every record's ground truth is of a kind the run's rewards accept (a number where
    exact match wants strings fails at `check`, not hours in, when the policy first answers)."""
    if cfg.data.verifiers is not None:  # the taskset's rubric scores its episodes
        return
    reward = rewards.CompositeReward(cfg.reward)
    for split, recs in records.items():
        for n, rec in enumerate(recs):
            msg = reward.truth_error(rec.get("ground_truth"))
            if msg is not None:
                where = rec.get("source") or f"{split} record {rec.get('id', n)}"
                raise ConfigError(
                    f"{where}: field {cfg.data.answer_key!r}: {msg} (fix the record, or the "
                    "recipe's reward)"
                )


# ------------------------------------------------------------------------- devices, batches


def check_mesh(cfg: RunConfig) -> tuple[tuple[int, int, int], int, list[str]]:
    """The mesh fits the visible devices, and the rollout's mesh (`rollout.mesh`) and
    rollouts ahead of the update (`trainer.max_staleness`) fit the run.

    Returns:
      ((data, fsdp, tensor) the run will use, visible device count, warnings).
    """
    sharding.initialize_distributed()
    n = jax.device_count()
    shape = cfg.trainer.mesh_shape
    warn = []
    if shape is None:
        shape = (1, n, 1)
    elif shape == (1, 1, 1) and jax.process_count() > 1:
        # One device is no mesh: each process would train a copy of its own on its own device,
        # and the first checkpoint would fail (host-local arrays cannot be saved).
        raise ConfigError(
            f"trainer.mesh=1x1x1 is one device, but this run has {jax.process_count()} "
            f"processes: set trainer.mesh to a DATAxFSDPxTENSOR shape over all {n} devices "
            f"(e.g. 1x{n}x1), or auto"
        )
    elif shape == (1, 1, 1):
        warn = [] if n == 1 else [f"trainer.mesh=1x1x1 uses 1 of the {n} visible devices"]
    elif math.prod(shape) != n:
        kind = jax.devices()[0].platform
        raise ConfigError(
            f"trainer.mesh={cfg.trainer.mesh} needs {math.prod(shape)} devices, but {n} {kind} "
            f"device(s) are visible: set trainer.mesh to a DATAxFSDPxTENSOR shape whose product "
            f"is {n} (e.g. 1x{n}x1), or auto"
        )
    _check_rollout_placement(cfg, math.prod(shape))
    return shape, n, warn


def _check_rollout_placement(cfg: RunConfig, n_devices: int) -> None:
    r, t = cfg.rollout, cfg.trainer
    if r.mesh_shape is not None:
        if math.prod(r.mesh_shape) != n_devices:
            raise ConfigError(
                f"rollout.mesh={r.mesh} needs {math.prod(r.mesh_shape)} devices, but the "
                f"trainer's mesh has {n_devices}: the engine runs on the trainer's devices, give "
                f"rollout.mesh a DATAxFSDPxTENSOR shape whose product is {n_devices} (or null)"
            )
        if cfg.model.lora.enabled and cfg.model.lora.decode == "adapters":
            raise ConfigError(
                "rollout.mesh with model.lora.decode=adapters: the engine would need the frozen "
                "base on its mesh too; use model.lora.decode=merged or drop rollout.mesh"
            )
    if t.max_staleness and not cfg.algorithm.corrects_off_policy:
        raise ConfigError(
            f"trainer.max_staleness={t.max_staleness} samples batches with weights up to "
            f"{t.max_staleness} update(s) old: set algorithm.off_policy (e.g. {{weight: token, "
            "cap: 2.0}) or algorithm.tis_cap (2.0 is usual)"
        )
    if r.agent is not None and jax.process_count() > 1:
        raise ConfigError(
            f"rollout.agent runs in one process, not {jax.process_count()}: the agent is "
            "arbitrary code, and every process would have to make the same requests in the "
            "same order; run it on one host"
        )


def _largest_divisor(n: int, cap: int) -> int:
    return max(k for k in range(1, min(n, cap) + 1) if n % k == 0)


def check_batch(cfg: RunConfig, mesh_shape: tuple[int, int, int]) -> None:
    """Each RL step's sequences split into mini-batches of micro-batches, and over the devices
    of the mesh's batch axes."""
    o, d, r = cfg.optim, cfg.data, cfg.rollout
    rows = cfg.update_rows
    rows_name, factors = "data.batch_size x rollout.group_size", f"{d.batch_size} x {r.group_size}"
    if cfg.env.windowed:  # a row per turn
        rows_name, factors = f"{rows_name} x env.max_turns", f"{factors} x {cfg.env.max_turns}"
    split = o.num_mini_batches * o.micro_batch_size
    if rows % split:
        if rows % o.num_mini_batches == 0:
            mbs = _largest_divisor(rows // o.num_mini_batches, o.micro_batch_size)
            fix = f"e.g. optim.micro_batch_size={mbs}"
        else:
            fix = f"e.g. optim.num_mini_batches={_largest_divisor(rows, o.num_mini_batches)}"
        raise ConfigError(
            f"{rows_name} = {factors} = {rows} sequences do not split into "
            f"optim.num_mini_batches x optim.micro_batch_size = "
            f"{o.num_mini_batches} x {o.micro_batch_size}: make {rows} a multiple of {split}, "
            f"{fix}"
        )
    axes = sharding.logical_to_spec(("batch",), None)[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    sizes = dict(zip(sharding.MESH_AXES, mesh_shape, strict=True))
    n = math.prod(sizes[a] for a in axes)
    for what, size in (
        (rows_name, rows),
        ("optim.micro_batch_size", o.micro_batch_size),
    ):
        if size % n:
            raise ConfigError(
                f"{what} = {size} does not split over the {n} devices of the mesh's batch axes "
                f"{'x'.join(axes)} (trainer.mesh={'x'.join(map(str, mesh_shape))}): make it a "
                f"multiple of {n}"
            )


# ---------------------------------------------------------------------------- output folders


def check_writable(path: str, field: str, *, timeout_s: float = WRITE_PROBE_TIMEOUT_S) -> None:
    """`path` is a folder that takes a file, or one that can be made: a probe file is created and
    removed in it or in its nearest existing parent, within `timeout_s` (a hung mount is an
    error, not a hang). No folder is made or removed: processes of one host probe the same path
    at once, and one's clean-up must not pull a folder from under another's probe."""
    result: dict[str, Any] = {}

    def probe():
        try:
            p = q = Path(path).absolute()
            while not q.exists():
                q = q.parent
            if not q.is_dir():
                result["error"] = "it is a file" if q == p else "Not a directory"
                return
            f = q / f".jaxrl_tools_probe_{uuid.uuid4().hex}"
            f.write_bytes(b"")
            f.unlink()
        except OSError as e:
            result["error"] = e.strerror or str(e)
        finally:
            result["done"] = True

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result.get("done"):
        raise ConfigError(
            f"{field}={path}: the file system did not answer in {timeout_s:g} s (a hung "
            "mount?): give a local folder"
        )
    if "error" in result:
        raise ConfigError(
            f"{field}={path} is not writable ({result['error']}): give a folder you can write to"
        )


def check_new_output(out: str, flag: str = "--out") -> None:
    """`out` (a Hugging Face folder to write) is new or an empty folder: nothing is overwritten."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {out} is an existing file: give a new folder")
    if p.is_dir() and any(p.iterdir()):
        raise ConfigError(
            f"{flag} {out} is a folder that is not empty: give a new or empty folder (nothing "
            "is overwritten)"
        )
