"""The math namespace a traced function calls (tanh, exp, where, ..., q_len / kv_len), the
tracing state the lengths consult, and `TensorParam`, which declares tensor parameters."""

from __future__ import annotations

import threading

from .dag import Node, what
from .symbols import Sym, Value, _cond, arith, clamp, lift, unary

__all__ = [
    "tanh", "exp", "log", "abs", "sqrt", "sigmoid", "erf", "floor", "ceil", "pow", "minimum", "maximum", "clamp",
    "where", "logical_and", "logical_or", "logical_xor", "logical_not", "q_len", "kv_len", "tracing",
    "TensorParam", "TENSOR_KINDS",
]

# --------------------------------------------------------------------------- tracing state

_STATE = threading.local()


def tracing() -> bool:
    return getattr(_STATE, "depth", 0) > 0


class _TraceScope:
    def __enter__(self):
        _STATE.depth = getattr(_STATE, "depth", 0) + 1

    def __exit__(self, *exc):
        _STATE.depth -= 1


# --------------------------------------------------------------------------- math namespace

def tanh(x: Value) -> Value:
    """Hyperbolic tangent."""
    return unary("tanh", x)


def exp(x: Value) -> Value:
    """Exponential (exp(1000.0) folds to inf)."""
    return unary("exp", x)


def log(x: Value) -> Value:
    """Natural logarithm (log(0.0) folds to -inf)."""
    return unary("log", x)


def abs(x: Value) -> Value:  # noqa: A001 - mirrors torch.abs
    """Absolute value (integers stay integers)."""
    return unary("abs", x)


def sqrt(x: Value) -> Value:
    """Square root."""
    return unary("sqrt", x)


def sigmoid(x: Value) -> Value:
    """Logistic sigmoid 1 / (1 + exp(-x))."""
    return unary("sigmoid", x)


def erf(x: Value) -> Value:
    """Error function (exact GELU: x * 0.5 * (1 + erf(x / sqrt(2))))."""
    return unary("erf", x)


def floor(x: Value) -> Value:
    """Largest integer <= x, as an integer (usable as an index); identity on integers."""
    return unary("floor", x)


def ceil(x: Value) -> Value:
    """Smallest integer >= x, as an integer; identity on integers."""
    return unary("ceil", x)


def pow(x: Value, y: Value) -> Value:  # noqa: A001 - mirrors torch.pow
    """x ** y (an integer when both are integers and y is a non-negative int constant)."""
    return arith("pow", x, y)


def minimum(x: Value, y: Value) -> Value:
    """Element-wise minimum."""
    return arith("minimum", x, y)


def maximum(x: Value, y: Value) -> Value:
    """Element-wise maximum."""
    return arith("maximum", x, y)


def where(cond: Sym, x: Value, y: Value) -> Sym:
    """x where cond holds, else y (cond: a comparison or a logical combination of comparisons).
    On Python values only it is Python's `x if cond else y`."""
    if isinstance(cond, bool) and not isinstance(x, Sym) and not isinstance(y, Sym):
        lift(x, "where()"), lift(y, "where()")
        return x if cond else y
    if isinstance(cond, bool):
        raise TypeError(
            f"where() got the Python bool {cond!r} with symbolic branches; write Python's x if flag else y for a "
            "condition known before tracing, or compare symbols for one that is not"
        )
    c = _cond(cond, "where")
    xs, ys = lift(x, "where()"), lift(y, "where()")
    for n in (xs, ys):
        if n.dtype == "b":
            raise TypeError(
                f"where() branches must be values, got {what(n)}; combine conditions with &, |, ^, ~ instead"
            )
    kind = "i" if xs.dtype == ys.dtype == "i" else "f"
    return Sym(Node("where", (c, xs, ys), dtype=kind))


def logical_and(a: Sym, b: Sym) -> Sym:
    return Sym(Node("and", (_cond(a, "logical_and"), _cond(b, "logical_and")), dtype="b"))


def logical_or(a: Sym, b: Sym) -> Sym:
    return Sym(Node("or", (_cond(a, "logical_or"), _cond(b, "logical_or")), dtype="b"))


def logical_xor(a: Sym, b: Sym) -> Sym:
    return Sym(Node("xor", (_cond(a, "logical_xor"), _cond(b, "logical_xor")), dtype="b"))


def logical_not(a: Sym) -> Sym:
    return Sym(Node("not", (_cond(a, "logical_not"),), dtype="b"))


def q_len() -> Sym:
    """Length of the current query sequence (an integer; inside a traced score_mod only).

    Dense problems: Sq. With flex_attention (`to_flex`): the full Sq given to `to_flex`.
    """
    return _length("q_len")


def kv_len() -> Sym:
    """Length of the current key/value sequence (an integer; inside a traced score_mod only); see q_len."""
    return _length("kv_len")


def _length(name: str) -> Sym:
    if not tracing():
        raise RuntimeError(f"score_mods.{name}() can only be called inside a function traced by @score_mod")
    return Sym(Node("length", attr=name, dtype="i"))


# --------------------------------------------------------------------------- tensor parameters

TENSOR_KINDS = ("float", "int", "bool")


class TensorParam:
    """Declares a tensor parameter: `def f(score, b, h, q_idx, kv_idx, bias=TensorParam()): ...`.

    kind "float" (bias, slopes, learned tables: any floating dtype), "int" (ids, distances:
    int32/int64) or "bool" (flags: gathered values are conditions). The tensor is bound per call
    (`f(bias=t)`) and indexed in the body by integer expressions, one per dim:
    `slopes[h]`, `bias[b, h, q_idx, kv_idx]`, `table[h, q_idx - kv_idx + 8]`, `offsets[doc[q_idx]]`.
    """

    def __init__(self, kind: str = "float"):
        if kind not in TENSOR_KINDS:
            raise ValueError(f"TensorParam kind must be one of {TENSOR_KINDS}, got {kind!r}")
        self.kind = kind

    def __repr__(self) -> str:
        return f"TensorParam({self.kind!r})"
