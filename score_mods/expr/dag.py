"""The expression DAG: hash-consed `Node`s and the structural walks over them.

Nodes compare and hash by structure (constants by their exact bits, so -0.0 and +0.0 differ):
the same subexpression is one node, and a DAG serializes into a structural cache key.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any, Callable, Dict, Hashable, Optional, Tuple, Union

from ..caches import register_lru
from ..caches import register_lru
from ..optable import SYMBOL

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


@register_lru("score_mods.expr.topo_tuple")
@functools.lru_cache(maxsize=4096)
def topo_tuple(root: Node) -> Tuple[Node, ...]:
    """`topo_order(root)` as a tuple, memoized per structure (bounded; nodes hold no tensors): for
    the per-call paths (a fresh mod of a known structure, a scalar folded per call)."""
    return tuple(topo_order(root))


@register_lru("score_mods.expr.structure_key")
@functools.lru_cache(maxsize=1024)
def structure_key(root: Node) -> tuple:
    """The DAG as nested tuples of (op, exact attr, kind, operand positions), memoized per structure."""
    order = topo_tuple(root)
    index = {n: i for i, n in enumerate(order)}
    return tuple((n.op, exact(n.attr), n.dtype, tuple(index[a] for a in n.args)) for n in order)


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


@register_lru("score_mods.expr.reads")
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


def direct_axes(n: Node) -> Optional[Tuple[str, ...]]:
    """For a gather indexed by bare, distinct index arguments in axis order (bias[b, h, q_idx,
    kv_idx], slopes[h], ids[b, kv_idx]): those axes (the tensor is a broadcast view). Else None."""
    if n.op != "gather" or not all(a.op == "index" for a in n.args):
        return None
    axes = tuple(a.attr for a in n.args)
    order = [INDEX_AXES.index(a) for a in axes]
    return axes if order == sorted(set(order)) else None
