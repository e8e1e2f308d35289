"""The optimised HLO text of a compiled executable (`compiled.as_text()`), parsed far enough to
count its work (`targets.cost`): computations, instructions, shapes, called computations."""

from __future__ import annotations

import dataclasses
import json
import math
import re

ITEM_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\](\{[^}]*\})?")
_NAME = re.compile(r"%[\w.\-]+")
NO_TRAFFIC = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "iota", "add-dependency", "domain",
}  # fmt: skip
COLLECTIVES = {
    "all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
    "collective-permute", "collective-broadcast",
}  # fmt: skip
SLICING = {"dynamic-slice", "slice", "gather"}
IN_PLACE = {"dynamic-update-slice", "scatter"}  # write their updates into operand 0 (operands)


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    args: str  # the text between the opcode's parentheses (a parameter's index, a constant)
    attrs: str
    root: bool


def arrays(shape: str) -> list[tuple[str, list[int], bool]]:
    """(dtype, dims, in HBM) of each array of a shape; a TPU layout's S(n), n > 0, is on-chip
    memory (VMEM, SMEM, sync flags), not HBM."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype not in ITEM_BYTES:
            continue
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append(([int(d) for d in dims.split(",") if d], dtype, not space or space[1] == "0"))
    return [(dtype, dims, hbm) for dims, dtype, hbm in out]


def nbytes(shape: str, hbm_only: bool = True) -> float:
    return sum(ITEM_BYTES[t] * math.prod(d) for t, d, hbm in arrays(shape) if hbm or not hbm_only)


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (a non-tuple: itself)."""
    if not shape.startswith("("):
        return [shape]
    parts, depth, start = [], 0, 1
    for k, ch in enumerate(shape):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(shape[start:k].strip())
            start = k + 1
    parts.append(shape[start:-1].strip())
    return [p for p in parts if p]


def dims(shape: str) -> list[int]:
    found = arrays(shape)
    return found[0][1] if found else []


def _close(text: str, opening: str, closing: str, depth: int = 0) -> int:
    """The index in `text` where the bracket open at `depth` (plus those opened in it) closes."""
    for k, ch in enumerate(text):
        depth += (ch == opening) - (ch == closing)
        if depth == 0:
            return k
    return len(text) - 1


def _split_instruction(line: str) -> Instr | None:
    s = line.strip()
    root = s.startswith("ROOT ")
    if root:
        s = s[5:]
    if not s.startswith("%") or " = " not in s:
        return None
    name, rest = s.split(" = ", 1)
    # the shape: one array token, or a parenthesised tuple (layouts hold parentheses too)
    if rest.startswith("("):
        end = _close(rest, "(", ")")
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op, paren, rest = rest.partition("(")
    if not paren:
        return None
    end = _close(rest, "(", ")", depth=1)
    args = rest[:end]
    return Instr(name, shape, op.strip(), _NAME.findall(args), args, rest[end + 1 :], root)


def parse(text: str) -> tuple[dict[str, list[Instr]], str | None]:
    """{computation name: instructions}, the entry computation's name."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            head = line.strip()
            if head.endswith("{") and ("->" in head or head.startswith(("%", "ENTRY"))):
                is_entry = head.startswith("ENTRY ")
                m = _NAME.search(head)
                current = m[0] if m else None
                if current is not None:
                    comps[current] = []
                    if is_entry:
                        entry = current
            elif head == "}":
                current = None
            continue
        if current is not None:
            instr = _split_instruction(line)
            if instr is not None:
                comps[current].append(instr)
    return comps, entry


def in_place_targets(i: Instr) -> list[str]:
    """The operands a dynamic-update-slice or scatter writes into (in place)."""
    if i.op == "scatter":  # operands..., indices, updates...
        return i.operands[: (len(i.operands) - 1) // 2]
    return i.operands[:1]


def in_place_updates(i: Instr) -> list[str]:
    """What it writes: the updates (and reads: the indices are small)."""
    if i.op == "scatter":
        return i.operands[(len(i.operands) - 1) // 2 + 1 :]
    return i.operands[1:2]


def called(attrs: str, *keys: str) -> list[str]:
    out = []
    for key in keys:
        m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)", attrs)
        if m:
            out += _NAME.findall(m[1])
    return out


def backend_config(attrs: str) -> dict:
    m = re.search(r"backend_config=(\{.*\})", attrs)
    if not m:
        return {}
    text = m[1]
    try:
        return json.loads(text[: _close(text, "{", "}") + 1])
    except ValueError:
        return {}
