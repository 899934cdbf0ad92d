"""Symbolic values: `Sym` (a traced float, integer or condition) and `TensorSym` (a tensor
parameter), with the operator rules that build `Node`s from them.

Kinds follow Python: int op int stays an integer (`/` and negative powers give floats), anything
with a float is a float; conditions combine with & | ^ ~. Misuse (branching on a symbol, torch
or math calls, bit operations on floats) raises TypeError with the spelling to use instead.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .. import optable
from ..optable import SYMBOL, fold
from .dag import Node, const, show, what
from .hints import _MATH_HINT, _torch_hint


class Sym:
    """A symbolic value inside a traced score_mod (float, integer or condition)."""

    __slots__ = ("node",)

    def __init__(self, node: Node):
        self.node = node

    # arithmetic ------------------------------------------------------------
    def __add__(self, o): return arith("add", self, o)
    def __radd__(self, o): return arith("add", o, self)
    def __sub__(self, o): return arith("sub", self, o)
    def __rsub__(self, o): return arith("sub", o, self)
    def __mul__(self, o): return arith("mul", self, o)
    def __rmul__(self, o): return arith("mul", o, self)
    def __truediv__(self, o): return arith("div", self, o)
    def __rtruediv__(self, o): return arith("div", o, self)
    def __floordiv__(self, o): return arith("floordiv", self, o)
    def __rfloordiv__(self, o): return arith("floordiv", o, self)
    def __mod__(self, o): return arith("mod", self, o)
    def __rmod__(self, o): return arith("mod", o, self)
    def __divmod__(self, o): return arith("floordiv", self, o), arith("mod", self, o)
    def __rdivmod__(self, o): return arith("floordiv", o, self), arith("mod", o, self)
    def __neg__(self): return unary("neg", self)
    def __pos__(self): return self
    def __abs__(self): return unary("abs", self)

    def __pow__(self, o, modulo=None):
        if modulo is not None:
            raise TypeError("three-argument pow() is not supported in a score_mod; write (x ** y) % m")
        return arith("pow", self, o)

    def __rpow__(self, o): return arith("pow", o, self)
    def __floor__(self): return unary("floor", self)
    def __ceil__(self): return unary("ceil", self)

    # bitwise / logical -----------------------------------------------------
    def __and__(self, o): return bitwise("and", self, o)
    def __rand__(self, o): return bitwise("and", o, self)
    def __or__(self, o): return bitwise("or", self, o)
    def __ror__(self, o): return bitwise("or", o, self)
    def __xor__(self, o): return bitwise("xor", self, o)
    def __rxor__(self, o): return bitwise("xor", o, self)
    def __lshift__(self, o): return bitwise("lshift", self, o)
    def __rlshift__(self, o): return bitwise("lshift", o, self)
    def __rshift__(self, o): return bitwise("rshift", self, o)
    def __rrshift__(self, o): return bitwise("rshift", o, self)
    def __invert__(self): return invert(self)

    # comparisons -----------------------------------------------------------
    def __lt__(self, o): return compare("lt", self, o)
    def __le__(self, o): return compare("le", self, o)
    def __gt__(self, o): return compare("gt", self, o)
    def __ge__(self, o): return compare("ge", self, o)
    def __eq__(self, o): return compare("eq", self, o)  # type: ignore[override]
    def __ne__(self, o): return compare("ne", self, o)  # type: ignore[override]
    __hash__ = None  # type: ignore[assignment]

    # flex-style methods ----------------------------------------------------
    def clamp(self, min: Any = None, max: Any = None) -> "Sym":  # noqa: A002 - torch's names
        """x.clamp(lo, hi) / x.clamp(min=lo, max=hi), as torch.Tensor.clamp."""
        return clamp(self, min, max)

    def abs(self) -> "Sym":
        return unary("abs", self)

    # gathers: a gather at fewer indices than the tensor's rank can be indexed further ----
    def __getitem__(self, idx: Any) -> "Sym":
        if self.node.op != "gather":
            raise TypeError(
                f"{what(self.node)} cannot be indexed; only tensor parameters can, "
                "e.g. table[h, q_idx - kv_idx + 8] with table=sm.TensorParam()"
            )
        idx = idx if isinstance(idx, tuple) else (idx,)
        extra = tuple(_index_node(self.node.attr, len(self.node.args) + k, i) for k, i in enumerate(idx))
        return Sym(Node("gather", self.node.args + extra, self.node.attr, self.node.dtype))

    def __iter__(self):
        raise TypeError(
            f"{what(self.node)} cannot be iterated or unpacked; index it explicitly (row[0], row[1])"
        )

    # unsupported Python -----------------------------------------------------
    def __bool__(self):
        raise TypeError(
            "a score_mod cannot branch on a symbolic value (Python `if`, `and`, `or`, `not`, bool(), min()/max() "
            "or a chained comparison like a < b < c); use sm.where(cond, x, y), sm.minimum / sm.maximum and "
            "&, |, ~ instead"
        )

    def __float__(self):
        raise TypeError(
            "a score_mod cannot turn a symbolic value into a Python number (math.* functions, float(), int()); "
            + _MATH_HINT
        )

    def __int__(self):
        raise TypeError(
            "a score_mod cannot turn a symbolic value into a Python int (int(), math.trunc, round, range, list "
            "indexing); index arguments are already integers, and sm.floor(x) / sm.ceil(x) make integers of floats"
        )

    __index__ = __trunc__ = __int__

    def __round__(self, ndigits=None):
        raise TypeError("round() is not supported in a score_mod; use sm.floor(x + 0.5) or sm.ceil(x)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(_torch_hint(func))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"score_mod values have no attribute {name!r}: they support operators, .clamp(lo, hi) and .abs(); "
            "integers are exact already (no .long() / .to() needed), sm.floor / sm.ceil make integers of floats, "
            "and functions live in the score_mods namespace (sm.where, exp, log, ...)"
        )

    def __repr__(self) -> str:
        return f"Sym({show(self.node)})"


Value = Union[Sym, float, int]


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def lift(x: Any, what_: str = "operand") -> Node:
    """Node for a Sym or a Python number; TypeError for anything else."""
    if isinstance(x, Sym):
        return x.node
    if isinstance(x, bool):
        raise TypeError(f"score_mod {what_} got the Python bool {x!r}; conditions must be symbolic comparisons")
    if isinstance(x, TensorSym):
        raise TypeError(
            f"tensor parameter {x.name!r} must be indexed before use, e.g. {x.name}[h] or "
            f"{x.name}[b, h, q_idx, kv_idx] or {x.name}[h, q_idx - kv_idx + 8]"
        )
    if isinstance(x, torch.Tensor):
        raise TypeError(
            "a torch.Tensor was used in a traced score_mod; declare it as a parameter (name=sm.TensorParam(), bound "
            "with mod(name=tensor)) and index it in the body, or use a Python number"
        )
    if not _num(x):
        raise TypeError(f"score_mod {what_} must be a symbolic value or a Python float/int, got {type(x).__name__} ({x!r})")
    return const(x)


def _value(x: Any, op: str) -> Node:
    n = lift(x, f"{op}()")
    if n.dtype == "b":
        sym = SYMBOL.get(op, op + "()")
        raise TypeError(
            f"`{sym}` needs numbers, got {what(n)}; use sm.where(cond, x, y) to turn a condition into a value"
        )
    return n


def arith(op: str, a: Any, b: Any) -> Any:
    """Binary arithmetic with Python kinds: int op int -> int (but `/` and negative-power `**`
    give floats), anything with a float -> float; conditions are refused."""
    if _num(a) and _num(b):
        return fold(op, a, b)
    x, y = _value(a, op), _value(b, op)
    if op == "div":
        kind = "f"
    elif op == "pow":
        kind = "i" if x.dtype == y.dtype == "i" and y.op == "const" and y.attr >= 0 else "f"
    else:
        kind = "i" if x.dtype == y.dtype == "i" else "f"
    return Sym(Node(op, (x, y), dtype=kind))


def unary(op: str, a: Any) -> Any:
    if _num(a):
        return fold(op, a)
    x = _value(a, op)
    if op in optable.ROUNDING:
        return a if x.dtype == "i" else Sym(Node(op, (x,), dtype="i"))
    kind = x.dtype if op in optable.UNARY_SAME else "f"
    return Sym(Node(op, (x,), dtype=kind))


def _logic_operand(x: Any, sym: str) -> Node:
    if isinstance(x, bool):
        raise TypeError(f"`{sym}` got the Python bool {x!r}; conditions must be symbolic comparisons")
    return lift(x, f"`{sym}`")


def bitwise(op: str, a: Any, b: Any) -> Any:
    """& | ^ on conditions (logical) or on integers (bitwise); << >> on integers."""
    sym = SYMBOL.get(op, {"lshift": "<<", "rshift": ">>"}.get(op, op))
    if _num(a) and _num(b):
        return fold({"and": "bitand", "or": "bitor", "xor": "bitxor"}.get(op, op), a, b)
    x, y = _logic_operand(a, sym), _logic_operand(b, sym)
    kinds = {x.dtype, y.dtype}
    if kinds == {"b"} and op in ("and", "or", "xor"):
        return Sym(Node(op, (x, y), dtype="b"))
    if "b" in kinds and "i" in kinds:
        c, i = (x, y) if x.dtype == "b" else (y, x)
        raise TypeError(
            f"`{sym}` mixes {what(c)} with {what(i)}; compare the integer first (e.g. (x & 1) == 1) or turn the "
            "condition into a number with sm.where(cond, 1, 0)"
        )
    if "f" in kinds:
        f = x if x.dtype == "f" else y
        raise TypeError(
            f"bitwise `{sym}` needs integers, got {what(f)}; bit operations apply to index arguments, int constants "
            "and integer arithmetic (use sm.floor(x) to make an integer of a float)"
        )
    if "b" in kinds:  # shifts of conditions
        raise TypeError(f"`{sym}` needs integers, got {what(x if x.dtype == 'b' else y)}")
    bit = {"and": "bitand", "or": "bitor", "xor": "bitxor"}.get(op, op)
    return Sym(Node(bit, (x, y), dtype="i"))


def invert(a: Any) -> Any:
    """~ : logical not of a condition, bitwise not (-x - 1) of an integer."""
    if _num(a):
        return fold("bitnot", a)
    x = _logic_operand(a, "~")
    if x.dtype == "b":
        return Sym(Node("not", (x,), dtype="b"))
    if x.dtype == "i":
        return Sym(Node("bitnot", (x,), dtype="i"))
    raise TypeError(f"`~` needs a condition or an integer, got {what(x)}; for a float use -x")


def compare(op: str, a: Any, b: Any) -> Any:
    if isinstance(a, TensorSym) or isinstance(b, TensorSym):
        lift(a if isinstance(a, TensorSym) else b)
    if not isinstance(a, Sym) and not isinstance(b, Sym):
        return NotImplemented
    sym = SYMBOL[op]
    x, y = _logic_operand(a, sym), _logic_operand(b, sym)
    if x.dtype == y.dtype == "b":
        if op not in ("eq", "ne"):
            raise TypeError(f"`{sym}` cannot order two conditions; use ==, != (or &, |, ^, ~) on conditions")
        xor = Node("xor", (x, y), dtype="b")
        return Sym(xor if op == "ne" else Node("not", (xor,), dtype="b"))
    if "b" in (x.dtype, y.dtype):
        c, v = (x, y) if x.dtype == "b" else (y, x)
        raise TypeError(
            f"`{sym}` compares {what(c)} with {what(v)}; compare conditions with conditions "
            "(cond == other_cond) or use sm.where(cond, 1, 0) to make a number"
        )
    return Sym(Node(op, (x, y), dtype="b"))


def _cond(x: Any, fn: str) -> Node:
    if isinstance(x, bool):
        raise TypeError(f"{fn}() got the Python bool {x!r}; conditions must be symbolic comparisons")
    n = lift(x, f"{fn}()")
    if n.dtype != "b":
        raise TypeError(
            f"{fn}() needs a condition (a comparison such as kv_idx <= q_idx), got {what(n)}; "
            "compare it first, e.g. x != 0"
        )
    return n


def clamp(x: Value, min: Optional[Value] = None, max: Optional[Value] = None) -> Value:  # noqa: A002
    """minimum(maximum(x, min), max), as torch.clamp (either bound may be None)."""
    if min is None and max is None:
        raise TypeError("clamp() needs at least one of min / max")
    out = x if min is None else arith("maximum", x, min)
    return out if max is None else arith("minimum", out, max)


# --------------------------------------------------------------------------- tensor parameters

_KIND_DTYPE = {"float": "f", "int": "i", "bool": "b"}


def _index_node(name: str, k: int, i: Any) -> Node:
    if isinstance(i, slice) or i is Ellipsis or i is None:
        raise TypeError(f"tensor parameter {name!r}: index {k} is {i!r}; only integer expressions can index, one per dim")
    if isinstance(i, TensorSym):
        return _index_node(name, k, lift(i))
    n = lift(i, f"index {k} of tensor parameter {name!r}")
    if n.dtype != "i":
        raise TypeError(
            f"index {k} of tensor parameter {name!r} is {what(n)}; indices must be integers: index arguments, int "
            "constants, integer arithmetic (+ - * // % & ...), other integer gathers, or sm.floor(x) / sm.ceil(x) "
            "of a float"
        )
    return n


class TensorSym:
    """A tensor parameter during tracing; index it with integer expressions (one per dim)."""

    def __init__(self, name: str, kind: str = "float"):
        self.name, self.kind = name, kind

    def __getitem__(self, idx: Any) -> Sym:
        idx = idx if isinstance(idx, tuple) else (idx,)
        if not idx:
            raise TypeError(f"tensor parameter {self.name!r} needs at least one index")
        nodes = tuple(_index_node(self.name, k, i) for k, i in enumerate(idx))
        return Sym(Node("gather", nodes, attr=self.name, dtype=_KIND_DTYPE[self.kind]))

    def __bool__(self):
        raise TypeError(f"tensor parameter {self.name!r} cannot be used as a Python condition")

    def __iter__(self):
        raise TypeError(f"tensor parameter {self.name!r} cannot be iterated; index it, e.g. {self.name}[h]")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(
            f"torch.{getattr(func, '__name__', func)} cannot be applied to a score_mod tensor parameter; index it, "
            "e.g. bias[b, h, q_idx, kv_idx], and use the score_mods namespace on the result"
        )

    def __float__(self):
        raise TypeError(f"tensor parameter {self.name!r} cannot be converted to a number")
