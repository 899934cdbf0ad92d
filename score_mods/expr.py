"""The score_mod expression language: symbolic values traced into a hash-consed DAG.

A traced function receives `Sym` objects for (score, b, h, q_idx, kv_idx) and its scalar
parameters, and `TensorSym` objects for tensor parameters. Operators and the math namespace
below build `Node`s. Nodes compare and hash by structure (constants by their exact bits, so
-0.0 and +0.0 differ), so the same subexpression is one node and the DAG serializes into a
structural cache key.

Kinds (`Node.dtype`): "f" float, "i" integer, "b" condition. Index arguments, lengths, int
constants and int parameters are integers; `+ - * // % min max abs` keep integers integer,
`/` and the transcendental functions give floats, `floor` / `ceil` give integers.

Node ops (see optable.py for their semantics):
    leaves   score, grad (d loss / d out, backward only), index(axis), length(q_len|kv_len),
             const(value), param(name), gather(*indices; attr=tensor name)
    numbers  add sub mul div floordiv mod pow neg abs minimum maximum floor ceil
             exp log tanh sqrt sigmoid erf  bitand bitor bitxor lshift rshift bitnot
             where(c, x, y)  tanh_bwd(g, x) sigmoid_bwd(g, x)   (the last two: autodiff only)
    bool     lt le gt ge eq ne  and or xor not
"""

from __future__ import annotations

import collections
import functools
import math
import threading
from typing import Any, Callable, Dict, Hashable, Optional, Tuple, Union

import torch

from . import optable
from .optable import BOOL_OPS, CMP_OPS, SYMBOL, fold  # noqa: F401 - re-exported

INDEX_AXES = ("b", "h", "q_idx", "kv_idx")
LENGTHS = ("q_len", "kv_len")
_INT64 = (-(2 ** 63), 2 ** 63 - 1)


def exact(attr: Any) -> Hashable:
    """attr with every float replaced by its exact bits (float.hex), for keys: -0.0 != 0.0."""
    if isinstance(attr, float):
        return ("float", attr.hex())
    if isinstance(attr, tuple):
        return tuple(exact(a) for a in attr)
    return attr


class Node:
    """One immutable DAG node; equality and hash are structural (constants by exact bits)."""

    __slots__ = ("op", "args", "attr", "dtype", "_hash", "_key")

    def __init__(self, op: str, args: Tuple["Node", ...] = (), attr: Hashable = None, dtype: str = "f"):
        self.op, self.args, self.attr, self.dtype = op, tuple(args), attr, dtype
        self._key = (op, exact(attr), dtype, tuple(a._key for a in self.args))
        self._hash = hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and (self is other or (self._hash == other._hash and self._key == other._key))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        if not self.args:
            return f"{self.op}({self.attr!r})" if self.attr is not None else self.op
        return f"{self.op}({', '.join(map(repr, self.args))})"


def const(value: Union[int, float]) -> Node:
    """A literal: Python ints are integer constants (int64 range), floats float constants."""
    if isinstance(value, bool):
        raise TypeError(f"score_mod constants must be numbers, got the Python bool {value!r}")
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise ValueError(f"score_mod integer constant {value} is outside the int64 range")
        return Node("const", attr=value, dtype="i")
    value = float(value)
    if math.isnan(value):
        raise ValueError("score_mod constants must not be NaN")
    return Node("const", attr=value, dtype="f")


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


def substitute(root: Node, replace: Callable[[Node, Tuple[Node, ...]], Optional[Node]]) -> Node:
    """root rebuilt bottom-up: each node becomes replace(node, its rebuilt operands), or, where
    that is None, the same node over the rebuilt operands (leaves stay themselves)."""
    done: Dict[Node, Node] = {}
    for n in topo_order(root):
        args = tuple(done[a] for a in n.args)
        out = replace(n, args)
        if out is None:
            out = Node(n.op, args, n.attr, n.dtype) if n.args else n
        done[n] = out
    return done[root]


Reads = collections.namedtuple("Reads", "params tensors gathers lengths axes")


@functools.lru_cache(maxsize=2048)
def reads(root: Node) -> "Reads":
    """What a DAG reads (memoized per structure): scalar param names, tensor param names,
    gathers as (name, number of indices), whether it reads lengths, the index axes it reads."""
    params, tensors, gathers, axes, lengths = set(), set(), set(), set(), False
    for n in topo_order(root):
        if n.op == "param":
            params.add(n.attr)
        elif n.op == "gather":
            tensors.add(n.attr)
            gathers.add((n.attr, len(n.args)))
        elif n.op == "length":
            lengths = True
        elif n.op == "index":
            axes.add(n.attr)
    return Reads(tuple(sorted(params)), tuple(sorted(tensors)), tuple(sorted(gathers)), lengths,
                 tuple(a for a in INDEX_AXES if a in axes))


_PREFIX = {"neg": "-", "bitnot": "~", "not": "~"}


def show(n: Node, limit: int = 60) -> str:
    """Python-like text of a node, for error messages (cut to `limit` characters)."""

    def go(x: Node) -> str:
        if x.op == "index":
            return x.attr
        if x.op in ("score", "grad"):
            return x.op
        if x.op == "length":
            return f"{x.attr}()"
        if x.op == "const":
            return repr(x.attr)
        if x.op == "param":
            return x.attr
        if x.op == "gather":
            return f"{x.attr}[{', '.join(go(a) for a in x.args)}]"
        if x.op in SYMBOL and len(x.args) == 2:
            return f"({go(x.args[0])} {SYMBOL[x.op]} {go(x.args[1])})"
        if x.op in _PREFIX:
            return f"{_PREFIX[x.op]}{go(x.args[0])}"
        return f"{x.op}({', '.join(go(a) for a in x.args)})"

    text = go(n)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def what(n: Node) -> str:
    """'the integer q_idx', 'the condition (q_idx < 3)', 'the float value score' (for errors)."""
    kind = {"f": "float value", "i": "integer", "b": "condition"}[n.dtype]
    return f"the {kind} {show(n, 40)}"


# --------------------------------------------------------------------------- tracing state

_STATE = threading.local()


def tracing() -> bool:
    return getattr(_STATE, "depth", 0) > 0


class _TraceScope:
    def __enter__(self):
        _STATE.depth = getattr(_STATE, "depth", 0) + 1

    def __exit__(self, *exc):
        _STATE.depth -= 1


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
    def __floor__(self): return floor(self)
    def __ceil__(self): return ceil(self)

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


def clamp(x: Value, min: Optional[Value] = None, max: Optional[Value] = None) -> Value:  # noqa: A002
    """minimum(maximum(x, min), max), as torch.clamp (either bound may be None)."""
    if min is None and max is None:
        raise TypeError("clamp() needs at least one of min / max")
    out = x if min is None else maximum(x, min)
    return out if max is None else minimum(out, max)


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
_KIND_DTYPE = {"float": "f", "int": "i", "bool": "b"}


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


def is_tensor_default(value: Any) -> bool:
    return isinstance(value, (TensorParam, torch.Tensor))


def direct_axes(n: Node) -> Optional[Tuple[str, ...]]:
    """For a gather indexed by bare, distinct index arguments in axis order (bias[b, h, q_idx,
    kv_idx], slopes[h], ids[b, kv_idx]): those axes (the tensor is a broadcast view). Else None."""
    if n.op != "gather" or not all(a.op == "index" for a in n.args):
        return None
    axes = tuple(a.attr for a in n.args)
    order = [INDEX_AXES.index(a) for a in axes]
    return axes if order == sorted(set(order)) else None
