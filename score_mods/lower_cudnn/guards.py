"""Non-finite guards: rewrites that keep a mod's forward and derived backward finite where cuDNN
evaluates them at masked scores (-inf), where the true value is masked or a zero gradient."""

from __future__ import annotations

from typing import Dict, Optional

from ..autodiff import GRAD
from ..expr import Node, const, topo_order

def _zero_where_no_gradient(g: Node) -> Node:
    """where(dS == 0, 0, g) around a derivative that is not linear in dS.

    cuDNN's backward evaluates the derivative at every position of its tiles, also where the
    score is -inf (past the keys of a partial tile): gelu'(-inf), silu'(-inf) or 2x at -inf are
    NaN or inf, and their product with dS = 0 is NaN, which then spreads through dQ (measured).
    Where dS is 0 the gradient is exactly 0, whatever the derivative."""
    scored: Dict[Node, bool] = {}
    for n in topo_order(g):
        scored[n] = n.op == "score" or any(scored[a] for a in n.args)
    risky_memo: Dict[Node, bool] = {}

    def risky(n: Node) -> bool:
        """Can n be non-finite at a score of -inf while dS is 0?"""
        if n in risky_memo:
            return risky_memo[n]
        if not scored[n]:
            out = False  # dS and score-free inputs: finite
        elif n.op in ("tanh_bwd", "sigmoid_bwd"):
            out = risky(n.args[0])  # the derivative factor is bounded in [0, 1] at any score
        elif n.op == "where":
            out = risky(n.args[1]) or risky(n.args[2])
        elif n.op in ("add", "sub", "neg"):
            out = any(risky(a) for a in n.args)
        elif n.op in ("mul", "div") and not scored[n.args[1]]:
            out = risky(n.args[0])
        elif n.op == "mul" and not scored[n.args[0]]:
            out = risky(n.args[1])
        else:
            out = True
        risky_memo[n] = out
        return out

    if not risky(g):
        return g
    return Node("where", (Node("eq", (GRAD, const(0.0)), dtype="b"), const(0.0), g), dtype="f")


_ALL = frozenset("-+fn")  # the values a float can take at a masked score: -inf, +inf, finite, NaN


def _values_at_masked_score(root: Node) -> frozenset:
    """The values (a subset of "-+fn") the mod can give where the score is -inf, conservatively."""
    vals: Dict[Node, frozenset] = {}

    def pairwise(a: frozenset, b: frozenset, rule) -> frozenset:
        return frozenset().union(*(rule(x, y) for x in a for y in b))

    def negated(vs: frozenset, flip: bool = True) -> frozenset:
        return frozenset({"-": "+", "+": "-"}.get(x, x) for x in vs) if flip else vs

    def const_factor(node: Node) -> Optional[float]:
        """A nonzero constant multiplier / divisor, else None."""
        return node.attr if node.op == "const" and node.attr != 0 else None

    def add(x, y):
        if "n" in (x, y) or {x, y} == {"-", "+"}:
            return "n"
        return x if x != "f" else y

    def mul(x, y):
        if "n" in (x, y):
            return "n"
        if x == "f" and y == "f":
            return "f"
        return "-+n"  # inf times a finite of unknown sign (or 0), or inf times inf

    for n in topo_order(root):
        a = [vals[x] for x in n.args]
        if n.dtype != "f" and n.op != "where":
            out = frozenset("f")  # integers and conditions never hold a score's infinity
        elif n.op == "score":
            out = frozenset("-")
        elif not n.args:
            out = frozenset("f")
        elif n.op == "neg":
            out = negated(a[0])
        elif n.op == "add":
            out = pairwise(a[0], a[1], add)
        elif n.op == "sub":
            out = pairwise(a[0], negated(a[1]), add)
        elif n.op in ("mul", "div") and const_factor(n.args[1]) is not None:
            out = negated(a[0], const_factor(n.args[1]) < 0)
        elif n.op == "mul" and const_factor(n.args[0]) is not None:
            out = negated(a[1], const_factor(n.args[0]) < 0)
        elif n.op == "mul":
            out = pairwise(a[0], a[1], mul)
        elif n.op == "div" and a[1] == frozenset("f"):  # inf / finite: an infinity of either sign
            out = frozenset("".join("-+" if x in "-+" else x for x in a[0]))
        elif n.op in ("tanh", "sigmoid", "erf", "exp"):
            out = frozenset("n" if x == "n" else "f" for x in a[0])
        elif n.op in ("floor", "ceil"):
            out = a[0]
        elif n.op == "abs":
            out = frozenset("+" if x == "-" else x for x in a[0])
        elif n.op in ("minimum", "maximum"):
            out = a[0] | a[1]
        elif n.op == "where":
            out = a[1] | a[2]
        elif all(x == frozenset("f") for x in a):
            out = frozenset("f")
        else:
            out = _ALL
        vals[n] = out
    return vals[root]


def _masked_stays_masked(root: Node) -> Node:
    """where(score == -inf, -inf, root) unless the mod is known to keep a masked score masked or
    finite there.

    cuDNN evaluates the mod at masked positions (score -inf, e.g. past the keys of a partial tile)
    and recomputes it in the backward: s - floor(s), s % c, s * gelu-like factors give NaN there,
    which the backward's probabilities then carry into dQ (measured: all of dQ NaN)."""
    got = _values_at_masked_score(root)
    if got <= frozenset("-f"):
        return root
    score = Node("score")
    return Node("where", (Node("eq", (score, const(float("-inf"))), dtype="b"), const(float("-inf")), root),
                dtype="f")
