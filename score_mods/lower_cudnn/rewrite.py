"""The lowering form of a DAG (`_Rewriter`): canonical comparisons, nested selects, derived inputs
first, materialized subexpressions (`Materialized`) and views as leaves, table recipes expanded."""

from __future__ import annotations

from typing import Dict, List, Tuple

from .. import expr, optable
from ..expr import Node, const, direct_axes, show
from .facts import AXIS_LETTER, ZERO, is_derived, is_scalar
from .table import IN_GRAPH, RECIPES, _power_product, _small_int_exponent, emittable

_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_NEGATE = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
_HALF = const(0.5)


def _lin(n: Node) -> Tuple[Dict[Node, float], List[Tuple[float, Node]]]:
    """n as sum(coef * atom) + sum(coef * scalar)."""
    if is_scalar(n):
        return {}, [(1.0, n)]
    if n.op in ("add", "sub"):
        ta, ra = _lin(n.args[0])
        tb, rb = _lin(n.args[1])
        s = 1.0 if n.op == "add" else -1.0
        terms = dict(ta)
        for k, v in tb.items():
            terms[k] = terms.get(k, 0.0) + s * v
        return terms, ra + [(s * c, x) for c, x in rb]
    if n.op == "neg":
        t, r = _lin(n.args[0])
        return {k: -v for k, v in t.items()}, [(-c, x) for c, x in r]
    if n.op == "mul":
        for i in (0, 1):
            if n.args[i].op == "const":
                t, r = _lin(n.args[1 - i])
                k = float(n.args[i].attr)
                return {a: k * v for a, v in t.items()}, [(k * c, x) for c, x in r]
    return {n: 1.0}, []


def _scalar_sum(rem: List[Tuple[float, Node]]) -> Node:
    """The scalar node for sum(coef * node), constants combined."""
    total, out = 0.0, None
    for c, x in rem:
        if x.op == "const":
            total += c * float(x.attr)
            continue
        term = x if c == 1.0 else (Node("neg", (x,)) if c == -1.0 else Node("mul", (const(c), x)))
        out = term if out is None else Node("add", (out, term))
    if out is None:
        return const(total)
    return out if total == 0.0 else Node("add", (out, const(total)))


def _canon_cmp(c: Node, rw) -> Node:
    op = c.op
    ta, ra = _lin(c.args[0])
    tb, rb = _lin(c.args[1])
    terms = dict(ta)
    for k, v in tb.items():
        terms[k] = terms.get(k, 0.0) - v
    terms = {k: v for k, v in terms.items() if v != 0.0}
    rem = ra + [(-x, n) for x, n in rb]
    if terms and next(iter(terms.values())) < 0:
        terms = {k: -v for k, v in terms.items()}
        rem = [(-x, n) for x, n in rem]
        op = _FLIP[op]
    rhs = _scalar_sum([(-x, n) for x, n in rem])
    atoms = list(terms.items())
    if not atoms:
        return Node(op, (ZERO, rhs), dtype="b")
    if len(atoms) == 2 and atoms[0][1] == 1.0 and atoms[1][1] == -1.0 and rhs == const(0.0):
        return Node(op, (rw(atoms[0][0]), rw(atoms[1][0])), dtype="b")
    e = None
    for atom, k in atoms:
        a = rw(atom)
        if e is None:
            e = a if k == 1.0 else Node("mul", (a, const(k)))
            continue
        mag = a if abs(k) == 1.0 else Node("mul", (a, const(abs(k))))
        e = Node("add" if k > 0 else "sub", (e, mag))
    return Node(op, (e, rhs), dtype="b")


class Materialized:
    """A score-free subexpression bound as a graph input: `node` evaluated on the (B, H, Sq, Skv)
    grid, broadcast over the axes it does not depend on (`axes` it does), as fp32 (conditions 0/1)."""

    __slots__ = ("name", "node", "axes", "kind")

    def __init__(self, name: str, node: Node, axes: Tuple[str, ...], kind: str):
        self.name, self.node, self.axes, self.kind = name, node, axes, kind

    def shape(self, dims) -> Tuple[int, ...]:
        return tuple(int(d) if a in self.axes else 1 for a, d in zip(expr.INDEX_AXES, dims))

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name} = {show(self.node)}>"


class _Rewriter:
    """The lowering form of a DAG: canonical comparisons, selects, derived inputs first,
    materialized subexpressions and views as leaves, table recipes expanded."""

    def __init__(self, plan: "Plan"):
        self.plan, self.facts, self.done = plan, plan.facts, {}

    def leaf_for(self, n: Node, how: str) -> Node:
        plan = self.plan
        if n not in plan._mat_leaf:
            axes = self.facts.axes(n)
            name = f"mat{len(plan.materialized)}@{''.join(AXIS_LETTER[a] for a in axes) or 's'}"
            plan.materialized[name] = Materialized(name, n, axes, how)
            if "L" in self.facts.deps(n):
                plan.length_materialized.append(name)
            plan._mat_leaf[n] = Node("mat", attr=name, dtype=n.dtype)
        return plan._mat_leaf[n]

    def rw(self, n: Node) -> Node:
        if n in self.done:
            return self.done[n]
        how = self.facts.materialize(n)
        if how is not None:
            out = self.leaf_for(n, how)
            if n.dtype == "b":
                out = Node("gt", (out, _HALF), dtype="b")
        elif is_scalar(n) or not n.args:
            out = n
        elif n.op == "gather":
            axes = direct_axes(n)
            if axes is None:  # score-dependent index, or length-dependent and not materialized
                out = self.unsupported(n, "a tensor gather whose index depends on the score")
            else:
                out = self.plan.view_leaf(n, axes)
        elif n.op == "where":
            out = self.sel(n.args[0], self.rw(n.args[1]), self.rw(n.args[2]))
        elif n.op in optable.BOOL_OPS:
            out = self.unsupported(n, "a condition used outside where()")
        elif not emittable(n.op):
            out = self.unsupported(n, f"op {n.op!r} is not emitted in cuDNN graphs (lower_cudnn.IN_GRAPH)")
        elif n.op == "pow" and _small_int_exponent(n.args[1]) is not None:
            out = self.rw(_power_product(n.args[0], _small_int_exponent(n.args[1])))
        elif IN_GRAPH.get(n.op) in RECIPES:
            out = self.rw(RECIPES[IN_GRAPH[n.op]][1](*n.args))
        else:
            a = [self.rw(x) for x in n.args]
            op = n.op
            if op in ("add", "mul", "minimum", "maximum") and not is_derived(a[0]) and is_derived(a[1]):
                a.reverse()
            elif op == "sub" and not is_derived(a[0]) and is_derived(a[1]):
                op, a = "add", [Node("neg", (a[1],)), a[0]]
            elif op == "div" and not is_derived(a[0]) and is_derived(a[1]):
                op, a = "mul", [Node("reciprocal", (a[1],)), a[0]]
            out = Node(op, tuple(a), n.attr, n.dtype)
        self.done[n] = out
        return out

    def unsupported(self, n: Node, why: str) -> Node:
        self.plan.unsupported.append(f"{show(n)}: {why}")
        return Node("unsupported", attr=show(n))

    def sel(self, c: Node, x: Node, y: Node) -> Node:
        if x == y:
            return x
        if self.facts.materialize(c) is not None:
            cc = self.rw(c)
        elif c.op == "and":
            return self.sel(c.args[0], self.sel(c.args[1], x, y), y)
        elif c.op == "or":
            return self.sel(c.args[0], x, self.sel(c.args[1], x, y))
        elif c.op == "not":
            return self.sel(c.args[0], y, x)
        elif c.op == "xor":
            return self.sel(c.args[0], self.sel(c.args[1], y, x), self.sel(c.args[1], x, y))
        elif c.op in optable.CMP_OPS:
            cc = _canon_cmp(c, self.rw)
        else:
            cc = self.rw(c)  # a gather of a bool tensor parameter whose index depends on the score
            if cc.op == "unsupported":
                return cc
        if not is_derived(x) and is_derived(y):
            return Node("select", (y, x, Node(_NEGATE[cc.op], cc.args, dtype="b")))
        return Node("select", (x, y, cc))


# --------------------------------------------------------------------------- plan

def _anchored(top: Node) -> Node:
    """The callback must return a graph tensor: a score-free top (a constant dS, a materialized
    value) is anchored to the index grid."""
    return top if is_derived(top) else Node("add", (ZERO, top))
