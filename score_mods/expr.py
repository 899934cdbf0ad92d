"""The score_mod expression language: symbolic values traced into a hash-consed DAG.

A traced function receives `Sym` objects for (score, b, h, q_idx, kv_idx) and float params,
and `TensorSym` objects for tensor params. Operators and the math namespace below build
`Node`s. Nodes compare and hash by structure, so the same subexpression is one node (the
lowering memoizes by node) and the DAG serializes into a structural cache key.

Node ops (dtype "f" float, "b" boolean):
    leaves  score, grad (d loss / d out, backward only), index(axis), length(q_len|kv_len),
            const(value), param(name), tparam((name, axes))
    float   add sub mul div neg tanh exp log abs sqrt sigmoid minimum maximum where(c, x, y)
            tanh_bwd(g, x) sigmoid_bwd(g, x)   (autodiff only)
    bool    lt le gt ge eq ne and or not
"""

from __future__ import annotations

import math
import threading
from typing import Any, Hashable, Tuple, Union

import torch

INDEX_AXES = ("b", "h", "q_idx", "kv_idx")
LENGTHS = ("q_len", "kv_len")
CMP_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
BOOL_OPS = CMP_OPS + ("and", "or", "not")


class Node:
    """One immutable DAG node; equality and hash are structural."""

    __slots__ = ("op", "args", "attr", "dtype", "_hash", "_key")

    def __init__(self, op: str, args: Tuple["Node", ...] = (), attr: Hashable = None, dtype: str = "f"):
        self.op, self.args, self.attr, self.dtype = op, tuple(args), attr, dtype
        self._key = (op, attr, dtype, tuple(a._key for a in self.args))
        self._hash = hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and (self is other or (self._hash == other._hash and self._key == other._key))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        if not self.args:
            return f"{self.op}({self.attr!r})" if self.attr is not None else self.op
        return f"{self.op}({', '.join(map(repr, self.args))})"


def const(value: float) -> Node:
    value = float(value)
    if math.isnan(value):
        raise ValueError("score_mod constants must not be NaN")
    return Node("const", attr=value)


def topo_order(root: Node) -> list:
    """Nodes reachable from root, each once, children before parents."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((a, False) for a in reversed(node.args) if a not in seen)
    return order


def leaves(root: Node, op: str) -> list:
    return [n for n in topo_order(root) if n.op == op]


# --------------------------------------------------------------------------- tracing state

_STATE = threading.local()


def tracing() -> bool:
    return getattr(_STATE, "depth", 0) > 0


class _TraceScope:
    def __enter__(self):
        _STATE.depth = getattr(_STATE, "depth", 0) + 1

    def __exit__(self, *exc):
        _STATE.depth -= 1


_HOW = "score_mods.{name}(...)"


class Sym:
    """A symbolic value inside a traced score_mod (float or boolean)."""

    __slots__ = ("node",)

    def __init__(self, node: Node):
        self.node = node

    # arithmetic ------------------------------------------------------------
    def __add__(self, o): return _bin("add", self, o)
    def __radd__(self, o): return _bin("add", o, self)
    def __sub__(self, o): return _bin("sub", self, o)
    def __rsub__(self, o): return _bin("sub", o, self)
    def __mul__(self, o): return _bin("mul", self, o)
    def __rmul__(self, o): return _bin("mul", o, self)
    def __truediv__(self, o): return _bin("div", self, o)
    def __rtruediv__(self, o): return _bin("div", o, self)
    def __neg__(self): return _un("neg", self)
    def __pos__(self): return self
    def __abs__(self): return _un("abs", self)

    # comparisons and logic -------------------------------------------------
    def __lt__(self, o): return _cmp("lt", self, o)
    def __le__(self, o): return _cmp("le", self, o)
    def __gt__(self, o): return _cmp("gt", self, o)
    def __ge__(self, o): return _cmp("ge", self, o)
    def __eq__(self, o): return _cmp("eq", self, o)  # type: ignore[override]
    def __ne__(self, o): return _cmp("ne", self, o)  # type: ignore[override]
    def __and__(self, o): return logical_and(self, o)
    def __rand__(self, o): return logical_and(o, self)
    def __or__(self, o): return logical_or(self, o)
    def __ror__(self, o): return logical_or(o, self)
    def __invert__(self): return logical_not(self)
    __hash__ = None  # type: ignore[assignment]

    # unsupported Python -----------------------------------------------------
    def __bool__(self):
        raise TypeError(
            "a score_mod cannot branch on a symbolic value (Python `if`, `and`, `or`, `not`, bool() or a "
            "chained comparison like a < b < c); use score_mods.where(cond, x, y) and &, |, ~ instead"
        )

    def __float__(self):
        raise TypeError(
            "a score_mod cannot turn a symbolic value into a Python number (math.* functions, float(), int()); "
            "use the score_mods math namespace instead: score_mods.tanh, exp, log, abs, sqrt, sigmoid, ..."
        )

    __int__ = __index__ = __float__

    def __pow__(self, o):
        raise TypeError("`**` is not supported in a score_mod; write x * x or use score_mods.sqrt / exp / log")

    __rpow__ = __pow__

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        raise TypeError(
            f"torch.{name} was called on a symbolic score_mod value; a traced score_mod may only use operators and "
            "the score_mods math namespace (score_mods.tanh, exp, log, abs, sqrt, sigmoid, where, minimum, maximum, ...)"
        )

    def __repr__(self) -> str:
        return f"Sym({self.node!r})"


Value = Union[Sym, float, int]


def lift(x: Any, what: str = "operand") -> Node:
    """Node for a Sym or a Python number; TypeError for anything else."""
    if isinstance(x, Sym):
        return x.node
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        if isinstance(x, TensorSym):
            raise TypeError(
                f"tensor parameter {x.name!r} must be indexed by the index arguments before use, "
                f"e.g. {x.name}[h] or {x.name}[b, h, q_idx, kv_idx]"
            )
        raise TypeError(f"score_mod {what} must be a symbolic value or a Python float/int, got {type(x).__name__} ({x!r})")
    return const(x)


def _float_node(x: Any, op: str) -> Node:
    n = lift(x)
    if n.dtype != "f":
        raise TypeError(f"{op}() needs a float operand, got a boolean condition; use where(cond, x, y) to turn it into a value")
    return n


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_PY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b,
    "minimum": min, "maximum": max,
}


def _bin(op: str, a: Any, b: Any) -> Any:
    if _num(a) and _num(b):
        return _PY[op](a, b)
    return Sym(Node(op, (_float_node(a, op), _float_node(b, op))))


_UNARY_PY = {
    "neg": lambda x: -x, "abs": abs, "tanh": math.tanh, "exp": math.exp, "log": math.log, "sqrt": math.sqrt,
    "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)),
}


def _un(op: str, a: Any) -> Any:
    if _num(a):
        return _UNARY_PY[op](a)
    return Sym(Node(op, (_float_node(a, op),)))


def _cmp(op: str, a: Any, b: Any) -> Any:
    if isinstance(a, TensorSym) or isinstance(b, TensorSym):
        lift(a if isinstance(a, TensorSym) else b)
    if not isinstance(a, Sym) and not isinstance(b, Sym):
        return NotImplemented
    return Sym(Node(op, (_float_node(a, op), _float_node(b, op)), dtype="b"))


def _bool_node(x: Any, op: str) -> Node:
    if isinstance(x, bool):
        raise TypeError(f"{op}() got the Python bool {x!r}; conditions must be symbolic comparisons")
    n = lift(x)
    if n.dtype != "b":
        raise TypeError(f"{op}() needs a boolean condition (a comparison), got a float value")
    return n


# --------------------------------------------------------------------------- math namespace

def tanh(x: Value) -> Value:
    """Hyperbolic tangent."""
    return _un("tanh", x)


def exp(x: Value) -> Value:
    """Exponential."""
    return _un("exp", x)


def log(x: Value) -> Value:
    """Natural logarithm."""
    return _un("log", x)


def abs(x: Value) -> Value:  # noqa: A001 - mirrors torch.abs
    """Absolute value."""
    return _un("abs", x)


def sqrt(x: Value) -> Value:
    """Square root."""
    return _un("sqrt", x)


def sigmoid(x: Value) -> Value:
    """Logistic sigmoid 1 / (1 + exp(-x))."""
    return _un("sigmoid", x)


def minimum(x: Value, y: Value) -> Value:
    """Element-wise minimum."""
    return _bin("minimum", x, y)


def maximum(x: Value, y: Value) -> Value:
    """Element-wise maximum."""
    return _bin("maximum", x, y)


def where(cond: Sym, x: Value, y: Value) -> Sym:
    """x where cond holds, else y (cond: a comparison or a logical combination of comparisons)."""
    c = _bool_node(cond, "where")
    return Sym(Node("where", (c, _float_node(x, "where"), _float_node(y, "where"))))


def logical_and(a: Sym, b: Sym) -> Sym:
    return Sym(Node("and", (_bool_node(a, "logical_and"), _bool_node(b, "logical_and")), dtype="b"))


def logical_or(a: Sym, b: Sym) -> Sym:
    return Sym(Node("or", (_bool_node(a, "logical_or"), _bool_node(b, "logical_or")), dtype="b"))


def logical_not(a: Sym) -> Sym:
    return Sym(Node("not", (_bool_node(a, "logical_not"),), dtype="b"))


def q_len() -> Sym:
    """Length of the current query sequence (inside a traced score_mod only).

    Dense problems: Sq. With flex_attention (`to_flex`): the full Sq given to `to_flex`.
    """
    return _length("q_len")


def kv_len() -> Sym:
    """Length of the current key/value sequence (inside a traced score_mod only); see q_len."""
    return _length("kv_len")


def _length(name: str) -> Sym:
    if not tracing():
        raise RuntimeError(f"score_mods.{name}() can only be called inside a function traced by @score_mod")
    return Sym(Node("length", attr=name))


# --------------------------------------------------------------------------- tensor parameters

TENSOR_KINDS = ("float", "int")


class TensorParam:
    """Declares a tensor parameter: `def f(score, b, h, q_idx, kv_idx, bias=TensorParam()): ...`.

    kind "float" (bias, slopes: any floating dtype) or "int" (ids: int32/int64). The tensor is
    bound per call (`f(bias=t)`) and indexed in the body by index arguments in axis order.
    """

    def __init__(self, kind: str = "float"):
        if kind not in TENSOR_KINDS:
            raise ValueError(f"TensorParam kind must be one of {TENSOR_KINDS}, got {kind!r}")
        self.kind = kind

    def __repr__(self) -> str:
        return f"TensorParam({self.kind!r})"


class TensorSym:
    """A tensor parameter during tracing; index it with the index arguments."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, idx: Any) -> Sym:
        idx = idx if isinstance(idx, tuple) else (idx,)
        axes = []
        for i in idx:
            node = i.node if isinstance(i, Sym) else None
            if node is None or node.op != "index":
                raise TypeError(
                    f"tensor parameter {self.name!r} can only be indexed by the index arguments b, h, q_idx, kv_idx "
                    f"(in that order, each at most once), got {i!r}"
                )
            axes.append(node.attr)
        order = [INDEX_AXES.index(a) for a in axes]
        if not axes or order != sorted(set(order)):
            raise ValueError(
                f"tensor parameter {self.name!r} indexed by {tuple(axes)}: indices must be distinct and in the "
                f"axis order {INDEX_AXES}"
            )
        return Sym(Node("tparam", attr=(self.name, tuple(axes))))

    def __bool__(self):
        raise TypeError(f"tensor parameter {self.name!r} cannot be used as a Python condition")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError("torch functions cannot be applied to a score_mod tensor parameter; index it, e.g. bias[b, h, q_idx, kv_idx]")

    def __float__(self):
        raise TypeError(f"tensor parameter {self.name!r} cannot be converted to a number")


def is_tensor_default(value: Any) -> bool:
    return isinstance(value, (TensorParam, torch.Tensor))
