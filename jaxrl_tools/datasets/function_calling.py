"""Function-calling data as records: a generated set, converters from the public formats, and
Tool-N1's preprocessing.

A record is `{"prompt": [chat messages], "tools": [OpenAI/Qwen declarations], "ground_truth":
[{"name", "arguments"}]}` (an empty list: the right answer calls nothing), which the `qwen`
protocol renders through the model's chat template and the `toolrl` / `tool_n1` rewards score.

- `generate(n, seed)` (in `function_calling_generator`, re-exported here): several tools per
  prompt with JSON-schema parameters, single and two-call answers, distractor tools, and some
  prompts that need no call.
- Converters, one per format people have on disk: ToolACE (`from_toolace`), xLAM / APIGen
  (`from_xlam`), BFCL (`from_bfcl`, question + possible-answer rows) and Hermes function calling
  (`from_hermes`). Each takes one row (a dict, as read from the dataset's json/jsonl) and
  returns records; a row that cannot be read raises `DataError` naming the field.
- `split_turns` / `valid_record` (Tool-N1): one record per assistant turn that calls tools, with
  the conversation before it; drop turns whose calls cannot be read (not no-call records) and
  records whose calls name an undeclared tool or do not fit its schema.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from jaxrl_tools.data import DataError
from jaxrl_tools.datasets.function_calling_generator import SYSTEM, declaration, generate
from jaxrl_tools.tools.executor import validate_arguments

__all__ = [
    "SYSTEM",
    "call_metrics",
    "convert",
    "declaration",
    "from_bfcl",
    "from_hermes",
    "from_toolace",
    "from_xlam",
    "generate",
    "parse_python_calls",
    "split_turns",
    "valid_record",
]


# ------------------------------------------------------------------------------- converters
def _json_field(row: Mapping, key: str, source: str):
    if key not in row:
        raise DataError(f"{source} row has no {key!r} field")
    value = row[key]
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise DataError(f"{source} row: field {key!r} is not valid JSON ({e})") from None
    return value


def _as_declaration(tool: Mapping) -> dict:
    """An OpenAI/Qwen declaration from the shapes datasets use (nested or flat parameters)."""
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {}
    if "properties" not in params:  # xLAM: {param: {"type", "description", "default"}}
        props = {k: {kk: vv for kk, vv in v.items() if kk != "default"} for k, v in params.items()}
        required = [k for k, v in params.items() if "default" not in v]
        params = {"type": "object", "properties": props, "required": required}
    else:
        params = dict(params)
        if params.get("type") == "dict":  # BFCL writes "dict" for a JSON object
            params["type"] = "object"
    return {
        "type": "function",
        "function": {
            "name": fn["name"],
            "description": fn.get("description", ""),
            "parameters": params,
        },
    }


def from_xlam(row: Mapping) -> list[dict]:
    """xLAM / APIGen (`query`, `tools` and `answers` as JSON strings)."""
    tools = _json_field(row, "tools", "xLAM")
    answers = _json_field(row, "answers", "xLAM")
    return [
        {
            "prompt": [{"role": "user", "content": str(row.get("query", ""))}],
            "tools": [_as_declaration(t) for t in tools],
            "ground_truth": [
                {"name": a["name"], "arguments": a.get("arguments", {})} for a in answers
            ],
        }
    ]


_PY_CALL = re.compile(r"^\s*\[(.*)\]\s*$", re.DOTALL)


def parse_python_calls(text: str) -> list[dict] | None:
    """ToolACE's `[f(a=1, b="x"), g()]`; None if `text` is not such a list of calls."""
    m = _PY_CALL.match(text)
    if m is None:
        return None
    try:
        tree = ast.parse(f"[{m.group(1)}]", mode="eval").body
    except SyntaxError:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            return None
        calls.append({"name": name, "arguments": args})
    return calls


class UnparsableCalls(ValueError):
    """An assistant turn that writes tool calls which cannot be read."""


# ToolACE: a turn that opens like `[name(` is a call attempt, whatever follows.
_PY_CALL_START = re.compile(r"^\s*\[\s*[A-Za-z_][\w.]*\s*\(")


def _toolace_calls(text: str) -> list[dict] | None:
    calls = parse_python_calls(text)
    if calls is None and _PY_CALL_START.match(text):
        raise UnparsableCalls(text[:80])
    return calls


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_ROLES |= {"tool": "tool", "function": "tool", "observation": "tool", "system": "system"}


def _turns(conversations: Iterable[Mapping], source: str) -> list[dict]:
    out = []
    for i, turn in enumerate(conversations):
        role = _ROLES.get(str(turn.get("from", turn.get("role"))))
        if role is None:
            raise DataError(f"{source} row: conversations[{i}] has an unknown role")
        out.append({"role": role, "content": str(turn.get("value", turn.get("content", "")))})
    return out


def _tool_list(text: str) -> list:
    """The first JSON list of tool declarations in a system prompt."""
    start = text.find("[")
    while start != -1:
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
        except ValueError:
            start = text.find("[", start + 1)
            continue
        if isinstance(obj, list) and all(
            isinstance(t, Mapping) and ("name" in t or "function" in t) for t in obj
        ):
            return obj
        start = text.find("[", start + 1)
    return []


def from_toolace(row: Mapping) -> list[dict]:
    """ToolACE (`system` with a JSON tool list, `conversations`; calls as `[f(a=1)]`): one
    record per assistant turn (Tool-N1's split), the calls or [] as its ground truth."""
    tools = [_as_declaration(t) for t in _tool_list(str(row.get("system", "")))]
    if not tools:
        raise DataError("ToolACE row: no JSON tool list in its 'system' field")
    turns = _turns(_json_field(row, "conversations", "ToolACE"), "ToolACE")
    system = [{"role": "system", "content": SYSTEM}]
    return split_turns(system + turns, tools, _toolace_calls)


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _hermes_calls(text: str) -> list[dict] | None:
    blocks = _HERMES_CALL.findall(text)
    if not blocks:
        return None
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except ValueError:
            try:  # Hermes data often writes Python dicts
                obj = ast.literal_eval(block)
            except (ValueError, SyntaxError):
                raise UnparsableCalls(block[:80]) from None
        if not isinstance(obj, Mapping):
            raise UnparsableCalls(block[:80])
        calls.append({"name": obj.get("name"), "arguments": obj.get("arguments", {})})
    return calls


def from_hermes(row: Mapping) -> list[dict]:
    """Hermes function calling (`conversations` with a system turn holding <tools>[...]</tools>
    and <tool_call> blocks in gpt turns; or a `tools` field)."""
    turns = _turns(_json_field(row, "conversations", "Hermes"), "Hermes")
    if "tools" in row:
        tools = _json_field(row, "tools", "Hermes")
    else:
        system = next((t["content"] for t in turns if t["role"] == "system"), "")
        m = re.search(r"<tools>(.*?)</tools>", system, re.DOTALL)
        tools = _tool_list(m.group(1)) if m else []
    if not tools:
        raise DataError("Hermes row: no tools (neither a 'tools' field nor <tools> in the system)")
    turns = [t for t in turns if t["role"] != "system"]
    system = [{"role": "system", "content": SYSTEM}]
    return split_turns(system + turns, [_as_declaration(t) for t in tools], _hermes_calls)


def from_bfcl(question: Mapping, answer: Mapping) -> list[dict]:
    """BFCL: a question row (`question`: the turns, `function`: declarations) and its
    possible-answer row (`ground_truth`: [{name: {param: [accepted values]}}]). The first
    accepted value of each parameter is the ground truth ("" means optional: left out)."""
    if question.get("id") != answer.get("id"):
        raise DataError(f"BFCL: question {question.get('id')!r} != answer {answer.get('id')!r}")
    turns = question.get("question")
    if isinstance(turns, str):
        turns = [{"role": "user", "content": turns}]
    while turns and isinstance(turns[0], list):  # v3 nests the turns of each round
        turns = turns[0]
    calls = []
    for item in answer.get("ground_truth") or []:
        ((name, params),) = item.items()
        args = {k: v[0] for k, v in params.items() if v and v[0] != ""}
        calls.append({"name": name, "arguments": args})
    functions = _json_field(question, "function", "BFCL")
    return [
        {
            "prompt": _turns(turns, "BFCL"),
            "tools": [_as_declaration(f) for f in functions],
            "ground_truth": calls,
        }
    ]


# ------------------------------------------------------------------------------- Tool-N1
def split_turns(messages: list[dict], tools: list[dict], read_calls) -> list[dict]:
    """One record per assistant turn: the messages before it as the prompt, its calls (or []
    for a plain answer) as the ground truth. A turn whose calls `read_calls` cannot read
    (`UnparsableCalls`) gives no record: as a no-call record it would reward not calling."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:
            continue
        try:
            calls = read_calls(m["content"])
        except UnparsableCalls:
            continue
        out.append({"prompt": messages[:i], "tools": tools, "ground_truth": calls or []})
    return out


def valid_record(record: Mapping) -> bool:
    """Tool-N1's filter: every ground-truth call names a declared tool and fits its schema."""
    by_name = {t["function"]["name"]: t["function"] for t in record.get("tools", [])}
    for call in record.get("ground_truth", []):
        fn = by_name.get(call.get("name"))
        if fn is None or not isinstance(call.get("arguments"), Mapping):
            return False
        if validate_arguments(dict(call["arguments"]), fn.get("parameters", {})) is not None:
            return False
    return True


def convert(rows: Iterable[Mapping], fmt: str, answers: Iterable[Mapping] = ()) -> list[dict]:
    """Records from a dataset's rows (`fmt`: toolace, xlam, hermes, bfcl; bfcl also needs its
    possible-answer rows), split into single steps and filtered as Tool-N1 does."""
    if fmt == "bfcl":
        by_id = {a.get("id"): a for a in answers}
        pairs = [(q, by_id.get(q.get("id"), {"id": None})) for q in rows]
        records = [r for q, a in pairs for r in from_bfcl(q, a)]
    else:
        readers = {"toolace": from_toolace, "xlam": from_xlam, "hermes": from_hermes}
        if fmt not in readers:
            raise DataError(
                f"unknown function-calling format {fmt!r}; known: bfcl, {sorted(readers)}"
            )
        records = [r for row in rows for r in readers[fmt](row)]
    return [r for r in records if valid_record(r)]


def call_metrics(predicted: Sequence[Sequence[Mapping]], truth: Sequence[Sequence[Mapping]]):
    """Exact-call accuracy, name F1, argument F1 and no-call precision over responses.

    exact: the multiset of (name, arguments) equals the ground truth's; name F1 over the
    multisets of names; argument F1 over (name, key, value) triples; no-call precision: of the
    responses that call nothing, the fraction whose ground truth calls nothing.
    """

    def canon(calls):
        return Counter(
            (c.get("name"), json.dumps(c.get("arguments", {}), sort_keys=True)) for c in calls
        )

    def triples(calls):
        return Counter(
            (c.get("name"), k, json.dumps(v, sort_keys=True))
            for c in calls
            for k, v in (c.get("arguments") or {}).items()
        )

    def f1(tp, n_pred, n_true):
        if n_pred == n_true == 0:
            return 1.0
        return 2 * tp / (n_pred + n_true) if n_pred + n_true else 0.0

    exact, names, args, silent, silent_right = 0, [], [], 0, 0
    for pred, gold in zip(predicted, truth, strict=True):
        exact += canon(pred) == canon(gold)
        pn, gn = Counter(c.get("name") for c in pred), Counter(c.get("name") for c in gold)
        names.append(f1(sum((pn & gn).values()), sum(pn.values()), sum(gn.values())))
        pa, ga = triples(pred), triples(gold)
        args.append(f1(sum((pa & ga).values()), sum(pa.values()), sum(ga.values())))
        if not pred:
            silent += 1
            silent_right += not gold
    n = max(len(truth), 1)
    return {
        "exact_call_accuracy": exact / n,
        "name_f1": sum(names) / n,
        "argument_f1": sum(args) / n,
        "no_call_precision": silent_right / silent if silent else float("nan"),
    }
