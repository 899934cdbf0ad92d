"""Every score_mod op in one place: what it folds to on Python numbers, and its torch form.

Kinds of values (`Node.dtype`): "f" float, "i" integer, "b" condition (boolean).

Python folding follows Python's own semantics (ints stay ints, `-7 // 2 == -4`, `-7 % 2 == 1`)
but never raises for float math: where `math` would raise (exp overflow, log of 0, 1 / 0.0,
0.0 ** -1) the IEEE result torch would give is returned instead (inf, -inf, nan). Integer
division by zero has no integer answer: it folds to the IEEE float result too.

The torch forms (`TORCH`) are what `eager.evaluate` runs: exact integer semantics on int64
tensors (floor division, Python-sign remainder, bitwise ops), float math on float tensors.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Dict

import torch

#: Ops by family (the leaves -- score, grad, index, length, const, param, gather -- are not listed).
ARITH = ("add", "sub", "mul", "div", "floordiv", "mod", "minimum", "maximum", "pow")
UNARY_SAME = ("neg", "abs")                  # result kind = operand kind
UNARY_FLOAT = ("exp", "log", "tanh", "sqrt", "sigmoid", "erf")
ROUNDING = ("floor", "ceil")                 # float -> integer (identity on integers)
BITWISE = ("bitand", "bitor", "bitxor", "lshift", "rshift")
CMP_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
LOGIC = ("and", "or", "xor", "not")
BOOL_OPS = CMP_OPS + LOGIC
#: ops whose value never depends continuously on their inputs (zero derivative everywhere)
PIECEWISE_CONSTANT = ROUNDING + BITWISE + ("floordiv", "bitnot")

#: Python spelling, for error messages and the pretty printer.
SYMBOL = {
    "add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%", "pow": "**",
    "bitand": "&", "bitor": "|", "bitxor": "^", "lshift": "<<", "rshift": ">>",
    "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "&", "or": "|", "xor": "^",
}


def _ieee(fn: Callable[..., torch.Tensor], *args: Any) -> float:
    """fn on float64 scalars: the IEEE answer (inf / nan) where Python's math would raise."""
    return fn(*(torch.tensor(float(a), dtype=torch.float64) for a in args)).item()


def _guard(py: Callable[..., Any], ieee: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    def fold(*args: Any) -> Any:
        try:
            out = py(*args)
        except (OverflowError, ValueError, ZeroDivisionError):
            return _ieee(ieee, *args)
        if isinstance(out, complex):  # (-8) ** (1/3) in Python is complex; IEEE says nan
            return math.nan
        return out

    return fold


def _pow(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int) and b >= 0:
        return a ** b
    return math.pow(a, b)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _nan_aware(pick: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def fold(a: Any, b: Any) -> Any:
        if a != a or b != b:  # torch.minimum / maximum propagate NaN
            return math.nan
        return pick(a, b)

    return fold


def _floor(x: Any) -> Any:
    return x if isinstance(x, int) else math.floor(x)


def _ceil(x: Any) -> Any:
    return x if isinstance(x, int) else math.ceil(x)


FOLD: Dict[str, Callable[..., Any]] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul,
    "div": _guard(operator.truediv, torch.true_divide),
    "floordiv": _guard(operator.floordiv, lambda a, b: torch.div(a, b, rounding_mode="floor")),
    "mod": _guard(operator.mod, torch.remainder),
    "minimum": _nan_aware(lambda a, b: b if b < a else a),
    "maximum": _nan_aware(lambda a, b: b if b > a else a),
    "pow": _guard(_pow, torch.pow),
    "neg": operator.neg, "abs": operator.abs, "reciprocal": _guard(lambda x: 1.0 / x, torch.reciprocal),
    "exp": _guard(math.exp, torch.exp), "log": _guard(math.log, torch.log), "tanh": math.tanh,
    "sqrt": _guard(math.sqrt, torch.sqrt), "sigmoid": _guard(_sigmoid, torch.sigmoid), "erf": math.erf,
    "floor": _guard(_floor, torch.floor), "ceil": _guard(_ceil, torch.ceil),
    "bitand": operator.and_, "bitor": operator.or_, "bitxor": operator.xor,
    "lshift": operator.lshift, "rshift": operator.rshift, "bitnot": operator.invert,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne,
    "and": lambda a, b: bool(a and b), "or": lambda a, b: bool(a or b), "xor": lambda a, b: bool(a) != bool(b),
    "not": lambda a: not a,
    "where": lambda c, x, y: x if c else y,
}


def fold(op: str, *args: Any) -> Any:
    """Value of `op` on Python numbers / bools (see the module docstring for the semantics)."""
    return FOLD[op](*args)


#: torch forms used by the eager evaluator (operands already converted by eager.py).
TORCH: Dict[str, Callable[..., torch.Tensor]] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide,
    "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "mod": torch.remainder, "minimum": torch.minimum, "maximum": torch.maximum, "pow": torch.pow,
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "tanh": torch.tanh,
    "sqrt": torch.sqrt, "sigmoid": torch.sigmoid, "erf": torch.erf, "floor": torch.floor, "ceil": torch.ceil,
    "bitand": torch.bitwise_and, "bitor": torch.bitwise_or, "bitxor": torch.bitwise_xor,
    "lshift": torch.bitwise_left_shift, "rshift": torch.bitwise_right_shift, "bitnot": torch.bitwise_not,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "and": torch.logical_and, "or": torch.logical_or, "xor": torch.logical_xor, "not": torch.logical_not,
}
