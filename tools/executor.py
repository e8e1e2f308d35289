"""ToolExecutor: validates a parsed call against its tool's schema and runs it, concurrently."""

from __future__ import annotations

import asyncio
import time

from jaxrl_tools.tools.base import (
    Observation,
    Tool,
    checked_observation,
    describe_exception,
    json_value_error,
    safe_repr,
    truncate_middle,
)
from jaxrl_tools.tools.parsers import ToolCall

# A call past the tool budget (`rollout.over_budget`, carried out by `rollout.resolver`): the
# notice's text as its observation, ignored, or the episode ended.
BUDGET_NOTICE = "tool budget exhausted, answer directly"
OVER_BUDGET = ("notice", "ignore", "end")
# A turn with neither a call nor an answer (`rollout.invalid_action`): the response ends there,
# or the notice is inserted and the model tries again. The wording is Search-R1's
# (search_r1/llm_agent/generation.py, `execute_predictions`).
INVALID_ACTION = ("end", "notice")
INVALID_NOTICE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer "
    "between <answer> and </answer>. Let me try again.\n"
)

_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


def validate_arguments(arguments, schema: dict, path: str = "arguments") -> str | None:
    """Checks `arguments` against a JSON-schema subset; returns an error message or None.

    Supported: type (one or a list), properties, required, additionalProperties (False),
    enum, items, minimum/maximum, minLength/maxLength. Unknown keywords are ignored. The
    keywords are checked in `_CHECKS`'s order and the first error is returned.
    """
    for keyword, check in _CHECKS.items():
        if schema.get(keyword, _ABSENT) is not _ABSENT:
            err = check(arguments, schema, path)
            if err:
                return err
    return None


_ABSENT = object()


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)  # JSON true is not a number


def _has_type(x, t) -> bool:
    py = _TYPES.get(t)
    if py is None or (isinstance(x, bool) and t in ("integer", "number")):
        return False
    if t == "integer" and isinstance(x, float) and x.is_integer():
        return True
    return isinstance(x, py)


def _check_type(x, schema: dict, path: str) -> str | None:
    types = schema["type"]
    if types is None:
        return None
    tlist = [types] if isinstance(types, str) else list(types)
    if any(_has_type(x, t) for t in tlist):
        return None
    return f"{path} must be of type {' or '.join(tlist)}, got {_json_type(x)} ({_short(x)})"


def _check_enum(x, schema: dict, path: str) -> str | None:
    if x not in schema["enum"]:
        return f"{path} must be one of {schema['enum']}, got {_short(x)}"
    return None


def _check_minimum(x, schema: dict, path: str) -> str | None:
    if _is_number(x) and x < schema["minimum"]:
        return f"{path} must be >= {schema['minimum']}, got {_short(x)}"
    return None


def _check_maximum(x, schema: dict, path: str) -> str | None:
    if _is_number(x) and x > schema["maximum"]:
        return f"{path} must be <= {schema['maximum']}, got {_short(x)}"
    return None


def _check_min_length(x, schema: dict, path: str) -> str | None:
    if isinstance(x, str) and len(x) < schema["minLength"]:
        return f"{path} must have at least {schema['minLength']} characters"
    return None


def _check_max_length(x, schema: dict, path: str) -> str | None:
    if isinstance(x, str) and len(x) > schema["maxLength"]:
        return f"{path} must have at most {schema['maxLength']} characters"
    return None


def _check_required(x, schema: dict, path: str) -> str | None:
    if isinstance(x, dict):
        for req in schema["required"]:
            if req not in x:
                return f"missing required argument {_join(path, req)!r}"
    return None


def _check_additional_properties(x, schema: dict, path: str) -> str | None:
    if isinstance(x, dict) and schema["additionalProperties"] is False:
        props = schema.get("properties", {})
        extra = sorted(set(x) - set(props), key=str)
        if extra:
            return f"unknown argument {_join(path, extra[0])!r}; expected: {sorted(props)}"
    return None


def _check_properties(x, schema: dict, path: str) -> str | None:
    if isinstance(x, dict):
        props = schema["properties"]
        for k, v in x.items():
            if k in props:
                err = validate_arguments(v, props[k], _join(path, k))
                if err:
                    return err
    return None


def _check_items(x, schema: dict, path: str) -> str | None:
    if isinstance(x, (list, tuple)) and isinstance(schema["items"], dict):
        for i, v in enumerate(x):
            err = validate_arguments(v, schema["items"], f"{path}[{i}]")
            if err:
                return err
    return None


# One check a supported keyword, run in this order when the keyword is in the schema; each
# check applies only to the JSON types its keyword is about.
_CHECKS = {
    "type": _check_type,
    "enum": _check_enum,
    "minimum": _check_minimum,
    "maximum": _check_maximum,
    "minLength": _check_min_length,
    "maxLength": _check_max_length,
    "required": _check_required,
    "additionalProperties": _check_additional_properties,
    "properties": _check_properties,
    "items": _check_items,
}


def _join(path: str, key) -> str:
    key = truncate_middle(key, 60) if isinstance(key, str) else safe_repr(key)
    return key if path == "arguments" else f"{path}.{key}"


def _json_type(x) -> str:
    for name, py in (
        ("boolean", bool),
        ("integer", int),
        ("number", float),
        ("string", str),
        ("array", (list, tuple)),
        ("object", dict),
        ("null", type(None)),
    ):
        if isinstance(x, py):
            return name
    return type(x).__name__


def _short(x) -> str:
    return safe_repr(x, 60)


class ToolExecutor:
    """Runs parsed tool calls against a set of tools.

    Args:
      tools: the tools, looked up by `tool.name` (names must be unique).
      max_concurrency: calls running at once across all trajectories (others wait).
      timeout_s: optional overall limit per call; exceeding it yields an error Observation.
    """

    def __init__(
        self, tools: list[Tool], max_concurrency: int = 64, timeout_s: float | None = None
    ):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"duplicate tool name {t.name!r}")
            self.tools[t.name] = t
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = timeout_s
        self._sems: dict[int, asyncio.Semaphore] = {}

    def schemas(self) -> list[dict]:
        """The function declarations of all tools (for the chat template's system turn)."""
        return [t.schema() for t in self.tools.values()]

    def _sem(self) -> asyncio.Semaphore:
        # One semaphore per event loop: a Semaphore must not be shared across loops.
        loop = asyncio.get_running_loop()
        sem = self._sems.get(id(loop))
        if sem is None:
            sem = self._sems[id(loop)] = asyncio.Semaphore(self.max_concurrency)
        return sem

    async def execute(self, call: ToolCall, session_id: str | None = None) -> Observation:
        """Validates and runs one call; never raises: every failure is an Observation(ok=False).

        Refused before the tool runs: an unknown tool, arguments that are not a plain JSON
        object (non-string keys, non-finite numbers, unpaired surrogates, nesting deeper than
        MAX_JSON_DEPTH: see `json_value_error`) or that do not match the tool's schema.
        """
        t0 = time.monotonic()
        try:
            obs = await self._execute(call, session_id)
        except Exception as e:  # noqa: BLE001 -- a bug here must not end the rollout either
            obs = Observation(
                text=f"Error: tool call failed: {describe_exception(e)}",
                ok=False,
                metrics={"internal_error": 1.0},
            )
        obs.latency_s = time.monotonic() - t0
        return obs

    async def _execute(self, call: ToolCall, session_id: str | None) -> Observation:
        name = call.name
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return Observation(
                text=f"Error: unknown tool {_short(name)}; available tools: "
                f"{', '.join(sorted(self.tools)) or '(none)'}",
                ok=False,
                metrics={"unknown_tool": 1.0},
            )
        if not isinstance(call.arguments, dict):
            err = f"arguments must be a JSON object, got {_json_type(call.arguments)}"
        else:
            err = json_value_error(call.arguments) or validate_arguments(
                call.arguments, tool.parameters or {"type": "object"}
            )
        if err:
            return Observation(
                text=f"Error: invalid call to {name!r}: {err}",
                ok=False,
                metrics={"invalid_args": 1.0},
            )
        async with self._sem():
            try:
                coro = tool.call(call.arguments, session_id)
                obs = await (asyncio.wait_for(coro, self.timeout_s) if self.timeout_s else coro)
            except TimeoutError:
                obs = Observation(
                    text=f"Error: tool {name!r} timed out after {self.timeout_s} s",
                    ok=False,
                    metrics={"timeout": 1.0},
                )
            except (Exception, SystemExit) as e:  # noqa: BLE001 -- errors are data
                obs = Observation(text=f"Error in tool {name!r}: {describe_exception(e)}", ok=False)
        return checked_observation(obs, name)

    async def execute_many(
        self, calls: list[ToolCall], session_id: str | None = None
    ) -> list[Observation]:
        """Runs several calls of one turn concurrently, results in call order."""
        return list(await asyncio.gather(*(self.execute(c, session_id) for c in calls)))

    async def close_session(self, session_id: str) -> None:
        """Ends one trajectory's state in every tool."""
        for t in self.tools.values():
            try:
                await t.close_session(session_id)
            except Exception:  # noqa: BLE001,S110 -- closing must not fail the rollout
                pass

    async def close(self) -> None:
        """Closes every tool."""
        for t in self.tools.values():
            try:
                await t.close()
            except Exception:  # noqa: BLE001,S110
                pass
