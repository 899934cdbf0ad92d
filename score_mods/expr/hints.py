"""Error hints for torch and math calls on symbolic values: the score_mods spelling to use instead."""

from __future__ import annotations

from typing import Any

#: torch functions users reach for, and the score_mods spelling to use instead.
TORCH_TO_SM = {
    "where": "sm.where(cond, x, y)", "clamp": "sm.clamp(x, lo, hi) or x.clamp(lo, hi)",
    "clip": "sm.clamp(x, lo, hi)", "clamp_min": "sm.maximum(x, lo)", "clamp_max": "sm.minimum(x, hi)",
    "floor": "sm.floor(x)", "ceil": "sm.ceil(x)", "abs": "sm.abs(x) or x.abs()", "exp": "sm.exp(x)",
    "exp2": "sm.pow(2.0, x) or 2.0 ** x", "log": "sm.log(x)", "log2": "sm.log(x) / math.log(2)",
    "tanh": "sm.tanh(x)", "sigmoid": "sm.sigmoid(x)", "sqrt": "sm.sqrt(x)", "erf": "sm.erf(x)",
    "pow": "sm.pow(x, y) or x ** y", "minimum": "sm.minimum(x, y)", "maximum": "sm.maximum(x, y)",
    "min": "sm.minimum(x, y)", "max": "sm.maximum(x, y)", "remainder": "x % y", "fmod": "x % y (Python sign)",
    "div": "x / y, or x // y for rounding_mode='floor'", "floor_divide": "x // y",
    "bitwise_and": "x & y", "bitwise_or": "x | y", "bitwise_xor": "x ^ y", "bitwise_not": "~x",
    "bitwise_left_shift": "x << n", "bitwise_right_shift": "x >> n",
    "logical_and": "a & b", "logical_or": "a | b", "logical_not": "~a", "logical_xor": "a ^ b",
    "eq": "a == b", "ne": "a != b", "lt": "a < b", "le": "a <= b", "gt": "a > b", "ge": "a >= b",
    "neg": "-x", "add": "x + y", "sub": "x - y", "mul": "x * y", "square": "x * x",
    "__getitem__": "a tensor parameter (name=sm.TensorParam()) indexed in the body, e.g. table[h, q_idx - kv_idx + 8]",
}

_MATH_HINT = (
    "use the score_mods namespace instead of math/numpy functions: sm.tanh, exp, log, sqrt, sigmoid, erf, "
    "pow (or **), floor, ceil, abs, clamp, minimum, maximum, where"
)


def _torch_hint(func: Any) -> str:
    name = getattr(func, "__name__", str(func))
    alt = TORCH_TO_SM.get(name)
    if alt is None:
        alt = "the score_mods namespace (sm.where, clamp, floor, ceil, abs, exp, log, tanh, erf, pow, ...)"
    what_ = f"torch.{name}" if name != "__getitem__" else "indexing a torch.Tensor"
    return f"{what_} was called on a symbolic score_mod value; a traced score_mod cannot run torch code: use {alt}"
