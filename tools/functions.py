"""`function_tool(fn)`: any typed Python function as a tool (schema from signature + docstring)."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing

from jaxrl_tools.errors import import_object
from jaxrl_tools.tools.base import (
    Observation,
    Tool,
    describe_exception,
    format_int,
    register_tool,
    truncate_middle,
)

_PRIMS = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    dict: "object",
    list: "array",
    tuple: "array",
    type(None): "null",
}


def type_schema(tp) -> dict:
    """JSON schema of a Python annotation (str/int/float/bool, list[T], dict, Literal, Optional)."""
    if tp is inspect.Parameter.empty or tp is typing.Any:
        return {}
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return type_schema(non_none[0])
        return {"anyOf": [type_schema(a) for a in non_none]}
    if origin in (list, tuple, set, frozenset):
        out = {"type": "array"}
        if args and args[0] is not Ellipsis:
            out["items"] = type_schema(args[0])
        return out
    if origin is dict:
        return {"type": "object"}
    if tp in _PRIMS:
        return {"type": _PRIMS[tp]}
    raise TypeError(f"unsupported annotation {tp!r}")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {arg: description}) from a Google-style docstring with an Args: section."""
    if not doc:
        return "", {}
    doc = inspect.cleandoc(doc)
    sections = re.split(
        r"^(Args|Arguments|Returns|Raises|Yields|Examples?):\s*$", doc, flags=re.MULTILINE
    )
    description = sections[0].strip()
    args: dict[str, str] = {}
    for title, body in zip(sections[1::2], sections[2::2]):
        if title not in ("Args", "Arguments"):
            continue
        current = None
        for line in body.splitlines():
            m = re.match(r"^\s{0,8}(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
            if m and (current is None or len(line) - len(line.lstrip()) <= 4):
                current = m.group(1).lstrip("*")
                args[current] = m.group(3).strip()
            elif current and line.strip():
                args[current] = (args[current] + " " + line.strip()).strip()
    return description, args


class FunctionTool(Tool):
    """Wraps a (sync or async) Python function; see `function_tool`."""

    def __init__(
        self,
        fn,
        name: str | None = None,
        description: str | None = None,
        max_output_chars: int = 4000,
    ):
        super().__init__()
        self.fn = fn
        self.name = name or fn.__name__
        doc_desc, arg_docs = parse_docstring(fn.__doc__)
        self.description = description if description is not None else doc_desc
        hints = typing.get_type_hints(fn)
        props, required = {}, []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            s = type_schema(hints.get(p.name, inspect.Parameter.empty))
            if p.name in arg_docs:
                s["description"] = arg_docs[p.name]
            props[p.name] = s
            if p.default is inspect.Parameter.empty:
                required.append(p.name)
        self.parameters = {"type": "object", "properties": props, "required": required}
        self.max_output_chars = max_output_chars

    async def _call(self, arguments: dict, session_id: str | None) -> Observation:
        try:
            if inspect.iscoroutinefunction(self.fn):
                out = await self.fn(**arguments)
            else:
                out = await asyncio.to_thread(self.fn, **arguments)
        except Exception as e:  # noqa: BLE001 -- errors are data for the model
            return Observation.error(f"Error: {describe_exception(e)}")
        if isinstance(out, Observation):
            return out
        if isinstance(out, str):
            text = out
        elif isinstance(out, int) and not isinstance(out, bool):
            text = format_int(out)  # json.dumps/str raise past the int-string digit limit
        else:
            try:
                text = json.dumps(out, ensure_ascii=False, default=str)
            except (ValueError, TypeError, RecursionError) as e:
                return Observation.error(
                    f"Error: the result of {self.name!r} cannot be written "
                    f"as JSON: {describe_exception(e, 200)}"
                )
        return Observation(truncate_middle(text, self.max_output_chars))


@register_tool("function")
class ImportedFunction(FunctionTool):
    """A typed Python function named by import path, as a tool a config can declare:
    `tools: [{class: function, config: {function: "mypkg.tools:get_weather"}}]`. It runs in the
    trainer's process: trusted code of the user's, whose arguments the model chooses (the
    executor validates them against the schema first)."""

    def __init__(
        self,
        function: str,
        name: str | None = None,
        description: str | None = None,
        max_output_chars: int = 4000,
    ):
        fn = import_object(function, "config.function", "function")
        if not callable(fn):
            raise ValueError(f"config.function={function!r} is not a function")
        super().__init__(fn, name, description, max_output_chars)


def function_tool(fn=None, *, name: str | None = None, description: str | None = None):
    """Exposes a typed Python function as a Tool (usable as `@function_tool` or a call).

    The schema comes from the signature (parameters without defaults are required; str, int,
    float, bool, list[T], dict, Literal[...], Optional[T]) and the docstring (first paragraph =
    description, `Args:` lines = parameter descriptions). Return values become the observation
    text (str as is, others as JSON); exceptions become error observations.
    """
    if fn is None:
        return lambda f: FunctionTool(f, name=name, description=description)
    return FunctionTool(fn, name=name, description=description)
