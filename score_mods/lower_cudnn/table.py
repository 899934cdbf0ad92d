"""The op table: which ops the cuDNN engines run in-graph (`IN_GRAPH`, `BASE_OPS`), the recipes
that expand the others, and the frontend method each rewritten op is emitted with."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

from .. import optable
from ..expr import Node, const

#: How each op beyond the probe-accepted basics (benchmarks/results/frontend_probe_h100.md) is
#: emitted inside the cuDNN graph, when it depends on the score or on both q_idx and kv_idx. A
#: value is a graph method name, a recipe
#: from `RECIPES`, or None: never emitted (score-free uses are materialized densely; a
#: score-dependent use makes the mod unsupported on cuDNN, with a NotImplementedError naming
#: the op). THIS is the table to edit after the GPU probe of floor / ceil / mod / div / erf /
#: pow acceptance (e.g. "floor": None turns every in-graph // and % into materializations).
IN_GRAPH: Dict[str, Optional[str]] = {
    "floordiv": "floor_div",   # floor(a / b); exact for |a| < 2**24
    "mod": "floor_mod",        # a - b * floor(a / b): Python's sign (follows b); not cuDNN's MOD (C fmod)
    "floor": "floor",
    "ceil": "ceil",
    "div": "div",              # by a host scalar it was probe-accepted (softcap); "mul_reciprocal" is the
                               # fallback (a * (1 / b): not exact enough for floor_div: then set floordiv None)
    "erf": "erf",
    "pow": "pow",
    "bitand": None, "bitor": None, "bitxor": None, "lshift": None, "rshift": None, "bitnot": None,
    "gather": None,            # no gather in the pointwise language: views or materializations only
}

#: recipe -> (table entries it needs, builder of the expansion over the op's arguments)
#: (Recipes build ops that go through this table again: "div" inside floor_div follows IN_GRAPH["div"].)
RECIPES: Dict[str, Tuple[Tuple[str, ...], Callable[..., Node]]] = {
    "floor_div": (("floor", "div"), lambda a, b: Node("floor", (Node("div", (a, b)),))),
    "floor_mod": (("floor", "div"), lambda a, b: Node("sub", (a, Node("mul", (b, Node("floor", (Node("div", (a, b)),))))))),
    "mul_reciprocal": ((), lambda a, b: Node("mul", (a, Node("reciprocal", (b,))))),
}

#: Accepted by the engines (probe tables): always emitted in-graph.
BASE_OPS = frozenset(
    ("add", "sub", "mul", "neg", "abs", "exp", "log", "tanh", "sqrt", "sigmoid", "minimum", "maximum",
     "reciprocal", "tanh_bwd", "sigmoid_bwd", "select") + optable.CMP_OPS
)

_GRAPH_OP = {
    "minimum": "min", "maximum": "max", "tanh_bwd": "tanh_backward", "sigmoid_bwd": "sigmoid_backward",
    "select": "binary_select", "lt": "cmp_lt", "le": "cmp_le", "gt": "cmp_gt", "ge": "cmp_ge",
    "eq": "cmp_eq", "ne": "cmp_neq",
}


def emittable(op: str) -> bool:
    """True if `op` can be emitted inside the graph (BASE_OPS, or IN_GRAPH with its recipe's needs)."""
    if op in BASE_OPS:
        return True
    how = IN_GRAPH.get(op)
    if how is None:
        return False
    if how in RECIPES:
        return all(emittable(p) for p in RECIPES[how][0])
    return True


def graph_op(op: str) -> str:
    """The frontend method emitting a (rewritten) node's op."""
    return IN_GRAPH.get(op) or _GRAPH_OP.get(op, op)


def _small_int_exponent(n: Node) -> Optional[int]:
    """The exponent of x ** c for an integer-valued constant 0 <= c <= 8, else None. The engines'
    pow is exp(c log x) (NaN for x < 0, measured), so such powers are emitted as products."""
    if n.op != "const":
        return None
    value = float(n.attr)
    return int(value) if value.is_integer() and 0 <= value <= 8 else None


def _power_product(x: Node, c: int) -> Node:
    if c == 0:
        return Node("add", (Node("mul", (x, const(0.0))), const(1.0)))
    out = x
    for _ in range(c - 1):
        out = Node("mul", (out, x))
    return out
