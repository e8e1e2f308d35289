"""Safe calculator: an ast whitelist evaluator (no eval), with bounded number sizes."""

from __future__ import annotations

import ast
import math
import operator

from jaxrl_tools.tools.base import (
    Observation,
    Tool,
    clean_text,
    format_int,
    register_tool,
    safe_repr,
    string_argument,
)

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {
    "sqrt": math.sqrt,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "log": math.log,
    "log2": math.log2,
    "log10": math.log10,
    "exp": math.exp,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "factorial": math.factorial,
    "gcd": math.gcd,
    "min": min,
    "max": max,
}
_CONSTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
MAX_INT_BITS = 4096
MAX_FACTORIAL = 500
MAX_ROUND_DIGITS = 10000  # round(5, -10**12) would build 10**(10**12)


class CalculatorError(ValueError):
    """An expression outside the calculator's language or limits (message for the model)."""


def safe_eval(expression: str, max_int_bits: int = MAX_INT_BITS) -> int | float:
    """Evaluates an arithmetic expression without eval.

    Allowed: numbers, + - * / // % **, unary +/-, parentheses, the constants pi/e/tau and the
    functions sqrt, sin, cos, tan, asin, acos, atan, log, log2, log10, exp, abs, round, floor,
    ceil, factorial (n <= 500), gcd, min, max. `^` is read as power. Integers are kept below
    `max_int_bits` bits (so 9**9**9 is refused before it is computed).

    Raises:
      CalculatorError: with a message that names the offending part; nothing else, whatever
        `expression` holds (deep nesting, null characters, unpaired surrogates included).
    """
    if len(expression) > 1000:
        raise CalculatorError("expression longer than 1000 characters")
    if clean_text(expression) != expression:
        raise CalculatorError("expression holds an unpaired UTF-16 surrogate (invalid unicode)")
    if "\x00" in expression:
        raise CalculatorError("invalid expression: null character")
    try:
        tree = ast.parse(expression.replace("^", "**").strip(), mode="eval")
        return _eval(tree.body, max_int_bits)
    except SyntaxError as e:
        raise CalculatorError(f"invalid expression: {e.msg}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("expression nested too deeply") from None


def _check(x, max_bits):
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise CalculatorError(f"unsupported value {safe_repr(x)}")
    if isinstance(x, int) and x.bit_length() > max_bits:
        raise CalculatorError(f"result too large (more than {max_bits} bits)")
    return x


def _eval(node, max_bits):
    if isinstance(node, ast.Constant):
        return _check(node.value, max_bits)
    if isinstance(node, ast.Name):
        if node.id in _CONSTS:
            return _CONSTS[node.id]
        raise CalculatorError(f"unknown name {node.id!r}")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _check(_UNOPS[type(node.op)](_eval(node.operand, max_bits)), max_bits)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left, max_bits), _eval(node.right, max_bits)
        if isinstance(node.op, ast.Pow):
            _check_pow(a, b, max_bits)
        if isinstance(node.op, ast.Mult) and isinstance(a, int) and isinstance(b, int):
            if a.bit_length() + b.bit_length() > max_bits + 1:
                raise CalculatorError(f"result too large (more than {max_bits} bits)")
        try:
            return _check(_BINOPS[type(node.op)](a, b), max_bits)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("numeric overflow") from None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        fn = _FUNCS.get(node.func.id)
        if fn is None:
            raise CalculatorError(
                f"unknown function {node.func.id!r}; allowed: {', '.join(sorted(_FUNCS))}"
            )
        args = [_eval(a, max_bits) for a in node.args]
        if fn is math.factorial and (
            len(args) != 1 or not isinstance(args[0], int) or args[0] > MAX_FACTORIAL
        ):
            raise CalculatorError(f"factorial needs one integer <= {MAX_FACTORIAL}")
        if (
            fn is round
            and len(args) == 2
            and isinstance(args[1], int)
            and abs(args[1]) > MAX_ROUND_DIGITS
        ):
            raise CalculatorError(f"round: ndigits must be within +-{MAX_ROUND_DIGITS}")
        try:
            return _check(fn(*args), max_bits)
        except ZeroDivisionError:  # log(x, 1)
            raise CalculatorError(f"{node.func.id}: division by zero") from None
        except (ValueError, TypeError, OverflowError) as e:
            raise CalculatorError(f"{node.func.id}: {e}") from None
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def _check_pow(a, b, max_bits):
    if isinstance(b, int) and isinstance(a, int):
        if b > 0 and abs(a) > 1 and a.bit_length() * b > max_bits:
            raise CalculatorError(f"result too large (more than {max_bits} bits)")
    elif abs(b) > 10000:
        raise CalculatorError("exponent too large")


def format_number(x: int | float) -> str:
    """Integers exactly; floats with 12 significant digits (integral floats without '.0')."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return format_int(x) if isinstance(x, int) else format(x, ".12g")


@register_tool("calculator")
class CalculatorTool(Tool):
    """Evaluates an arithmetic expression safely (see `safe_eval`)."""

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression, e.g. '(3 + 4) * sqrt(2) / 7'. Supports "
        "+ - * / // % ** and sqrt, sin, cos, tan, log, exp, factorial, pi, e."
    )
    parameters = string_argument("expression", "The expression to evaluate.")

    async def _call(self, arguments: dict, session_id: str | None) -> Observation:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return Observation.error("Error: 'expression' must be a string, e.g. \"2 * (3 + 4)\"")
        try:
            return Observation(format_number(safe_eval(expression)))
        except CalculatorError as e:
            return Observation.error(f"Error: {e}")
