"""Tool protocol: Observation, the Tool base class, a registry and verl-style YAML declarations.

A tool is a name, a JSON-schema declaration in the OpenAI/Qwen function format, and an async
`call(arguments, session_id) -> Observation`. Failures come back as an Observation with ok=False
(errors as data), never as exceptions into the rollout loop.

YAML (as verl users write it)::

    tools:
      - class_name: python            # a registry name or a dotted path "pkg.module.Class"
        config: {mode: session, timeout_s: 5}
        tool_schema:                  # optional: overrides the class's own declaration
          type: function
          function: {name: python, description: ..., parameters: {...}}
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from pathlib import Path
from typing import Any

import yaml


@dataclasses.dataclass
class Observation:
    """What a tool call returns to the rollout.

    Attributes:
      text: the text inserted into the context (already truncated/reduced by the tool).
      ok: False if the call failed (bad arguments, tool error, timeout).
      latency_s: wall-clock seconds of the call.
      reward: optional per-call reward the tool computed.
      metrics: free-form numbers for logging (e.g. {"timeout": 1.0}).
    """

    text: str
    ok: bool = True
    latency_s: float = 0.0
    reward: float | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def error(cls, text: str, **metrics: float) -> Observation:
        return cls(text=text, ok=False, metrics=dict(metrics))


def truncate_middle(text: str, max_chars: int) -> str:
    """Cuts `text` to at most `max_chars` characters as head + "..." + tail."""
    if max_chars <= 0:
        return ""
    if len(text) <= max_chars:
        return text
    if max_chars <= 3:
        return text[:max_chars]
    keep = max_chars - 3
    head = (keep + 1) // 2
    tail = keep - head
    return text[:head] + "..." + (text[-tail:] if tail else "")


def last_traceback_line(stderr: str) -> str:
    """The error line of a Python traceback ("ZeroDivisionError: division by zero")."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    for ln in reversed(lines):  # skip trailing notes like "...", keep the "Type: msg" line
        s = ln.strip()
        if not s.startswith(("File ", "^", "~")) and s != "...":
            return s
    return lines[-1].strip()


class Tool:
    """Base class of all tools.

    Subclasses set `name`, `description`, `parameters` (JSON schema of the arguments object) and
    implement `_call`. `call` wraps it: timing, and any exception turned into an error
    Observation naming the tool.
    """

    name: str = "tool"
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}, "required": []}

    def __init__(self, *, tool_schema: dict | None = None):
        if tool_schema is not None:
            fn = tool_schema.get("function", tool_schema)
            self.name = fn.get("name", self.name)
            self.description = fn.get("description", self.description)
            self.parameters = fn.get("parameters", self.parameters)

    def schema(self) -> dict:
        """OpenAI/Qwen function declaration: {"type": "function", "function": {...}}."""
        return {"type": "function", "function": {"name": self.name,
                                                  "description": self.description,
                                                  "parameters": self.parameters}}

    async def call(self, arguments: dict, session_id: str | None = None) -> Observation:
        """Runs the tool; never raises (errors come back as Observation(ok=False))."""
        t0 = time.monotonic()
        try:
            obs = await self._call(arguments, session_id)
        except Exception as e:  # noqa: BLE001 -- errors are data for the model
            obs = Observation.error(f"Error in tool {self.name!r}: {type(e).__name__}: {e}")
        obs.latency_s = time.monotonic() - t0
        return obs

    async def _call(self, arguments: dict, session_id: str | None) -> Observation:
        raise NotImplementedError

    async def close_session(self, session_id: str) -> None:
        """Forgets the state of one trajectory (no-op for stateless tools)."""

    async def close(self) -> None:
        """Releases resources (worker pools, files)."""


TOOL_REGISTRY: dict[str, type[Tool]] = {}


def register_tool(name: str):
    """Class decorator: makes a Tool subclass constructible by `name` (e.g. from YAML)."""

    def deco(cls):
        if name in TOOL_REGISTRY and TOOL_REGISTRY[name] is not cls:
            raise ValueError(f"tool {name!r} already registered by {TOOL_REGISTRY[name]}")
        TOOL_REGISTRY[name] = cls
        return cls

    return deco


def create_tool(class_name: str, config: dict | None = None,
                tool_schema: dict | None = None) -> Tool:
    """Builds a tool from a registry name or a dotted class path, `config` as kwargs."""
    if class_name in TOOL_REGISTRY:
        cls = TOOL_REGISTRY[class_name]
    elif "." in class_name:
        mod, _, attr = class_name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"tool class {class_name!r} not importable: {e}") from e
    else:
        raise ValueError(f"unknown tool class {class_name!r}; registered: "
                         f"{sorted(TOOL_REGISTRY)} (or give a dotted path)")
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"{class_name!r} is not a Tool subclass")
    kwargs = dict(config or {})
    kwargs.pop("type", None)  # verl's `type: native`
    if tool_schema is not None:
        kwargs["tool_schema"] = tool_schema
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"bad config for tool {class_name!r}: {e}") from e


def load_tools_yaml(source: str | Path) -> list[Tool]:
    """Builds the tools declared in a YAML file (or YAML text) with a top-level `tools:` list."""
    text = Path(source).read_text() if _is_path(source) else str(source)
    data = yaml.safe_load(text) or {}
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{source if _is_path(source) else 'YAML'}: expected a top-level "
                         "'tools:' list")
    tools = []
    for i, entry in enumerate(entries):
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown or "class_name" not in entry:
            raise ValueError(f"tools[{i}]: keys must be class_name (required), config, "
                             f"tool_schema; got {sorted(entry)}")
        tools.append(create_tool(entry["class_name"], entry.get("config"),
                                 entry.get("tool_schema")))
    return tools


def _is_path(source: Any) -> bool:
    if isinstance(source, Path):
        return True
    return "\n" not in source and source.endswith((".yaml", ".yml"))
