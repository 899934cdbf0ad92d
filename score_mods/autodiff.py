"""Reverse-mode differentiation of a score_mod DAG with respect to `score`.

`grad_dag(root)` returns a new DAG for d(loss)/d(score) in terms of the leaf `grad`
(= d(loss)/d(root)) and forward nodes, so the cuDNN lowering can reuse forward intermediates
from its memo and the eager evaluator can check it against torch.autograd. Masks become
selects of the incoming gradient: d/dx where(c, x, y) = where(c, g, 0). Piecewise-constant ops
(floor, ceil, //, bit operations, gathers at computed indices) have derivative 0.
"""

from __future__ import annotations

import math
from typing import Dict, List

from . import optable
from .expr import Node, const, topo_order

GRAD = Node("grad")
_ZERO = const(0.0)
_ONE = const(1.0)
_TWO_OVER_SQRT_PI = const(2.0 / math.sqrt(math.pi))


def depends_on_score(root: Node) -> Dict[Node, bool]:
    dep: Dict[Node, bool] = {}
    for n in topo_order(root):
        dep[n] = n.op == "score" or any(dep[a] for a in n.args)
    return dep


def _sel(c: Node, x: Node, y: Node) -> Node:
    return Node("where", (c, x, y))


def _eq0(x: Node) -> Node:
    return Node("eq", (x, _ZERO), dtype="b")


def _pow_grads(n: Node, g: Node) -> List[Node]:
    """d(a ** b): b * a ** (b - 1) and a ** b * log(a), zeroed where torch zeroes them
    (exponent 0; base 0 with a non-negative exponent)."""
    a, b = n.args
    if b.op == "const":
        c = float(b.attr)
        if c == 0.0:
            da = None
        elif c == 1.0:
            da = g
        elif c == 2.0:
            da = Node("mul", (g, Node("mul", (a, const(2.0)))))
        else:
            da = Node("mul", (g, Node("mul", (Node("pow", (a, const(c - 1.0))), const(c)))))
    else:
        raw = Node("mul", (g, Node("mul", (b, Node("pow", (a, Node("sub", (b, _ONE))))))))
        da = _sel(_eq0(b), _ZERO, raw)
    raw_b = Node("mul", (g, Node("mul", (n, Node("log", (a,))))))
    base0 = Node("and", (_eq0(a), Node("ge", (b, _ZERO), dtype="b")), dtype="b")
    return [da, _sel(base0, _ZERO, raw_b)]


def _local_grads(n: Node, g: Node) -> List[Node]:
    """Gradient contribution to each argument of n (None: no contribution)."""
    op, a = n.op, n.args
    if op in optable.PIECEWISE_CONSTANT or op == "gather":
        return [None] * len(a)
    if op == "mod":  # a - b * floor(a / b)
        return [g, Node("neg", (Node("mul", (g, Node("floordiv", a))),))]
    if op == "pow":
        return _pow_grads(n, g)
    if op == "erf":
        x = a[0]
        return [Node("mul", (g, Node("mul", (Node("exp", (Node("neg", (Node("mul", (x, x)),)),)), _TWO_OVER_SQRT_PI))))]
    if op == "add":
        return [g, g]
    if op == "sub":
        return [g, Node("neg", (g,))]
    if op == "neg":
        return [Node("neg", (g,))]
    if op == "mul":
        return [Node("mul", (g, a[1])), Node("mul", (g, a[0]))]
    if op == "div":
        gd = Node("div", (g, a[1]))
        return [gd, Node("neg", (Node("mul", (gd, n)),))]
    if op == "tanh":
        return [Node("tanh_bwd", (g, a[0]))]
    if op == "sigmoid":
        return [Node("sigmoid_bwd", (g, a[0]))]
    if op == "exp":
        return [Node("mul", (g, n))]
    if op == "log":
        return [Node("div", (g, a[0]))]
    if op == "sqrt":
        return [Node("mul", (Node("div", (g, n)), const(0.5)))]
    if op == "abs":
        return [_sel(Node("ge", (a[0], _ZERO), dtype="b"), g, Node("neg", (g,)))]
    if op in ("minimum", "maximum"):
        first = Node("le" if op == "minimum" else "ge", a, dtype="b")
        return [_sel(first, g, _ZERO), _sel(first, _ZERO, g)]
    if op == "where":
        return [None, _sel(a[0], g, _ZERO), _sel(a[0], _ZERO, g)]
    raise NotImplementedError(f"no derivative rule for score_mod op {op!r}")


def _is_neg_inf(n: Node) -> bool:
    return n.op == "const" and n.attr == -math.inf


def _outer_masks(root: Node) -> set:
    """The chain of `where(c, x, -inf)` masks at the top of the DAG (root first).

    The scores they produce go straight into the softmax, so at a masked position the
    incoming gradient is already exactly 0 (softmax weight 0): the mask's derivative is the
    identity there, and the backward needs no select (and no recomputed mask).
    """
    out, n = set(), root
    while n.op == "where" and (_is_neg_inf(n.args[2]) or _is_neg_inf(n.args[1])):
        out.add(n)
        n = n.args[1] if _is_neg_inf(n.args[2]) else n.args[2]
    return out


def grad_dag(root: Node) -> Node:
    """d(loss)/d(score) as a DAG over GRAD and forward nodes (const 0 if score is unused)."""
    dep = depends_on_score(root)
    if not dep[root]:
        return _ZERO
    outer = _outer_masks(root)
    acc: Dict[Node, Node] = {root: GRAD}
    for n in reversed(topo_order(root)):
        if n not in acc or n.op == "score" or not n.args:
            continue
        if n in outer:
            kept = n.args[1] if _is_neg_inf(n.args[2]) else n.args[2]
            if dep[kept]:
                acc[kept] = Node("add", (acc[kept], acc[n])) if kept in acc else acc[n]
            continue
        for arg, ga in zip(n.args, _local_grads(n, acc[n])):
            if ga is None or not dep[arg]:
                continue
            acc[arg] = Node("add", (acc[arg], ga)) if arg in acc else ga
    return acc.get(Node("score"), _ZERO)
