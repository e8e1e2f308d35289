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

import copy
import dataclasses
import decimal
import importlib
import math
import re
import time
from pathlib import Path
from typing import Any

import yaml

from jaxrl_tools.registry import Registry


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


def string_argument(name: str, description: str) -> dict:
    """The JSON schema of a tool's arguments when they are one required string, `name`."""
    return {
        "type": "object",
        "properties": {name: {"type": "string", "description": description}},
        "required": [name],
    }


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


MAX_JSON_DEPTH = 100
MAX_ERROR_CHARS = 1000
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
_EXACT_INT_BITS = 1 << 17  # past ~40k digits a decimal conversion costs seconds (quadratic)


def format_int(n: int) -> str:
    """Decimal text of `n`, also past Python's int-to-str digit limit (which makes str(n) raise).

    Integers of more than 2**17 bits (~40k digits) are described, not written out:
    "<integer of about 123456 digits>".
    """
    try:
        return str(n)
    except ValueError:  # more digits than sys.get_int_max_str_digits() (checked before converting)
        pass
    if n.bit_length() > _EXACT_INT_BITS:
        digits = int((n.bit_length() - 1) * math.log10(2)) + 1
        return f"<{'negative ' if n < 0 else ''}integer of about {digits} digits>"
    return str(decimal.Decimal(n))  # Decimal's conversion is not bound by the digit limit


def safe_repr(x, max_chars: int = 60) -> str:
    """repr(x) cut to `max_chars` (head...tail); never raises, e.g. on an int past the
    int-to-str digit limit, a structure too deep for repr, or a broken __repr__."""
    if isinstance(x, int) and not isinstance(x, bool):
        text = format_int(x)
    else:
        try:
            text = repr(x)
        except Exception:  # noqa: BLE001 -- ValueError (digit limit), RecursionError, any __repr__
            text = f"<unprintable {type(x).__name__}>"
    return truncate_middle(text, max_chars)


def describe_exception(e: BaseException, max_chars: int = MAX_ERROR_CHARS) -> str:
    """The "Type: message" of an exception, cut to `max_chars`; never raises (a message that
    cannot be made into text, e.g. ValueError(10**5000)'s, reads "<unprintable message>")."""
    try:
        msg = str(e)
    except Exception:  # noqa: BLE001 -- str() of the exception's arguments may raise anything
        msg = "<unprintable message>"
    return truncate_middle(f"{type(e).__name__}: {clean_text(msg)}", max_chars)


def clean_text(text: str) -> str:
    """`text` with unpaired UTF-16 surrogates (which no encoder accepts) replaced by U+FFFD."""
    return _SURROGATE_RE.sub("\ufffd", text)


def json_value_error(value, root: str = "arguments", max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why `value` is not a plain JSON value that a tool may receive, or None if it is.

    Plain: dicts with string keys, lists (or tuples), strings without unpaired surrogates,
    finite numbers, booleans, None; at most `max_depth` levels of nesting. The message names the
    offending place, e.g. "arguments.a[2] must be a finite number, got nan" (`root` "" names
    places from the top: "a[2]"). Iterative, so any depth is checked without recursion.
    """
    stack = [(value, 0, None)]  # (value, depth, trail); trail = (parent trail, key) or None
    while stack:
        x, depth, trail = stack.pop()
        if isinstance(x, str):
            if _SURROGATE_RE.search(x):
                return (
                    f"{_trail_text(root, trail)} holds an unpaired UTF-16 surrogate "
                    "(invalid unicode)"
                )
        elif x is None or isinstance(x, (bool, int)):
            continue
        elif isinstance(x, float):
            if not math.isfinite(x):
                return f"{_trail_text(root, trail)} must be a finite number, got {x}"
        elif isinstance(x, (dict, list, tuple)):
            if depth >= max_depth:
                return f"{_trail_text(root, trail)} is nested deeper than {max_depth} levels"
            if isinstance(x, dict):
                for k, v in x.items():
                    if not isinstance(k, str):
                        return (
                            f"{_trail_text(root, trail)} has a key that is not a string: "
                            f"{safe_repr(k)}"
                        )
                    if _SURROGATE_RE.search(k):
                        return (
                            f"{_trail_text(root, trail)} has a key with an unpaired UTF-16 "
                            "surrogate"
                        )
                    stack.append((v, depth + 1, (trail, k)))
            else:
                stack.extend((v, depth + 1, (trail, i)) for i, v in enumerate(x))
        else:
            return f"{_trail_text(root, trail)} has type {type(x).__name__}, which is not JSON"
    return None


def _trail_text(root: str, trail) -> str:
    parts = []
    while trail is not None:
        trail, key = trail
        parts.append(f"[{key}]" if isinstance(key, int) else f".{truncate_middle(key, 40)}")
    text = root + "".join(reversed(parts))
    if not root:  # paths relative to an unnamed top-level value: "arguments.x", "[0].name"
        text = text.removeprefix(".") or "the JSON value"
    return truncate_middle(text, 80)


def checked_observation(obs, tool_name: str) -> Observation:
    """`obs` made safe to tokenize: an Observation whose text is a str without unpaired
    surrogates; anything else a tool returned becomes an error Observation."""
    if not isinstance(obs, Observation):
        return Observation.error(
            f"Error in tool {safe_repr(tool_name)}: it returned "
            f"{type(obs).__name__}, not an Observation"
        )
    if not isinstance(obs.text, str):
        obs.text = safe_repr(obs.text, MAX_ERROR_CHARS)
    obs.text = clean_text(obs.text)
    return obs


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
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    @classmethod
    def default_schema(cls) -> dict:
        """The declaration of an instance built without `tool_schema` (no instance needed: SFT
        traces declare exactly what the rollout's tool will)."""
        return copy.deepcopy(
            {
                "type": "function",
                "function": {
                    "name": cls.name,
                    "description": cls.description,
                    "parameters": cls.parameters,
                },
            }
        )

    async def call(self, arguments: dict, session_id: str | None = None) -> Observation:
        """Runs the tool; never raises (errors come back as Observation(ok=False)).

        Cancellation and KeyboardInterrupt propagate; every other exception, SystemExit
        included (a wrapped function calling exit()), becomes an error Observation.
        """
        t0 = time.monotonic()
        try:
            obs = await self._call(arguments, session_id)
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- errors are data for the model
            obs = Observation.error(f"Error in tool {self.name!r}: {describe_exception(e)}")
        obs = checked_observation(obs, self.name)
        obs.latency_s = time.monotonic() - t0
        return obs

    async def _call(self, arguments: dict, session_id: str | None) -> Observation:
        raise NotImplementedError

    def start(self) -> None:
        """Acquires what calls need (worker pools, indexes) before the first call; building a
        tool starts nothing, so a config can be checked cheaply."""

    async def close_session(self, session_id: str) -> None:
        """Forgets the state of one trajectory (no-op for stateless tools)."""

    async def close(self) -> None:
        """Releases resources (worker pools, files)."""


# The modules of the shipped tools: every lookup imports them first.
TOOL_MODULES = ("browse", "calculator", "functions", "mcp", "python_tool", "search")
TOOL_REGISTRY: Registry[type[Tool]] = Registry("tool class", "jaxrl_tools.tools", TOOL_MODULES)


def load_tools() -> None:
    """Imports the shipped tool modules (`TOOL_MODULES`), registering their classes."""
    TOOL_REGISTRY.load()


def register_tool(name: str):
    """Class decorator: makes a Tool subclass constructible by `name` (e.g. from YAML)."""
    return TOOL_REGISTRY.register(name)


def tool_class(class_name: str) -> type[Tool]:
    """The Tool subclass registered as `class_name`, or at a dotted path ("pkg.mod.Class")."""
    if class_name in TOOL_REGISTRY:
        cls = TOOL_REGISTRY.get(class_name)
    elif "." in class_name:
        mod, _, attr = class_name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"tool class {class_name!r} not importable: {e}") from e
    else:
        raise ValueError(
            f"unknown tool class {class_name!r}; registered: "
            f"{TOOL_REGISTRY.names()} (or give a dotted path)"
        )
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"{class_name!r} is not a Tool subclass")
    return cls


def create_tool(
    class_name: str, config: dict | None = None, tool_schema: dict | None = None
) -> Tool:
    """Builds a tool from a registry name or a dotted class path, `config` as kwargs."""
    cls = tool_class(class_name)
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
        raise ValueError(
            f"{source if _is_path(source) else 'YAML'}: expected a top-level 'tools:' list"
        )
    tools = []
    for i, entry in enumerate(entries):
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown or "class_name" not in entry:
            raise ValueError(
                f"tools[{i}]: keys must be class_name (required), config, "
                f"tool_schema; got {sorted(entry)}"
            )
        tools.append(
            create_tool(entry["class_name"], entry.get("config"), entry.get("tool_schema"))
        )
    return tools


def _is_path(source: Any) -> bool:
    if isinstance(source, Path):
        return True
    return "\n" not in source and source.endswith((".yaml", ".yml"))
