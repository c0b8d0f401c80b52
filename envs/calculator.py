"""A safe arithmetic evaluator over Python's ``ast`` (never ``eval``): numbers, + - * / // % **, unary +/-,
parentheses and the functions abs, min, max, round, sqrt. Sizes are bounded so no input can hang or eat
memory: expression length, node count, exponent and result magnitude."""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 500
MAX_NODES = 200
MAX_ABS = 10**100  # largest magnitude of any intermediate result
MAX_POW_BITS = 400  # |base|.bit_length() * exponent must stay under this for integer powers


class CalcError(ValueError):
    """An expression the calculator rejects; the message says why."""


def _pow(a: float, b: float) -> float:
    if isinstance(a, int) and isinstance(b, int) and b >= 0 and abs(a) > 1 and abs(a).bit_length() * b > MAX_POW_BITS:
        raise CalcError("result too large")
    if abs(b) > 10_000:
        raise CalcError("exponent too large")
    return a**b


def _div(a: float, b: float) -> float:
    if b == 0:
        raise CalcError("division by zero")
    return a / b


def _floordiv(a: float, b: float) -> float:
    if b == 0:
        raise CalcError("division by zero")
    return a // b


def _mod(a: float, b: float) -> float:
    if b == 0:
        raise CalcError("modulo by zero")
    return a % b


def _sqrt(x: float) -> float:
    if x < 0:
        raise CalcError("square root of a negative number")
    return math.sqrt(x)


def _round(x: float, ndigits: int | None = None) -> float:
    if ndigits is not None and (not isinstance(ndigits, int) or abs(ndigits) > 100):
        raise CalcError("round() digits must be an integer in -100..100")
    return round(x, ndigits)


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: _div,
    ast.FloorDiv: _floordiv,
    ast.Mod: _mod,
    ast.Pow: _pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"abs": abs, "min": min, "max": max, "round": _round, "sqrt": _sqrt}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        value = _BINOPS[type(node.op)](_eval(node.left), _eval(node.right))
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalcError("'^' is not supported; use ** for powers")
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval(node.operand))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS:
        if node.keywords or not node.args:
            raise CalcError(f"{node.func.id}() takes positional number arguments only")
        try:
            value = _FUNCS[node.func.id](*[_eval(a) for a in node.args])
        except TypeError as e:
            raise CalcError(f"{node.func.id}(): {e}") from None
    elif isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
        raise CalcError(f"unknown function {name!r} (functions: {', '.join(_FUNCS)})")
    elif isinstance(node, ast.Name):
        raise CalcError(f"unknown name {node.id!r}; use numbers only (functions: {', '.join(_FUNCS)})")
    else:
        raise CalcError(f"unsupported syntax: {type(node).__name__}")
    if isinstance(value, complex) or abs(value) > MAX_ABS:
        raise CalcError("result too large" if not isinstance(value, complex) else "complex result")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result is not a finite number")
    return value


def evaluate(expression: str) -> float:
    """Value of ``expression``; raises ``CalcError`` with a readable reason for anything it rejects."""
    expr = expression.strip().rstrip("=").strip()
    if not expr:
        raise CalcError("empty expression")
    if len(expr) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise CalcError(f"invalid expression: {e.msg}") from None
    except ValueError as e:  # e.g. null bytes
        raise CalcError(f"invalid expression: {e}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"expression has more than {MAX_NODES} parts")
    try:
        return _eval(tree.body)
    except OverflowError:
        raise CalcError("result too large") from None


def format_number(value: float) -> str:
    """Integers (and integral floats below 1e15) print without a decimal point; other floats to 12 digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)
