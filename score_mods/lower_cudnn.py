"""Lower a score_mod DAG (forward and derived backward) to cuDNN frontend pointwise ops.

Every node of the DAG is classified once, structurally (`Plan`):

  scalar        only constants, scalar parameters and lengths below: folded on the host into
                one pass-by-value fp32 operand (as before);
  in-graph      depends on the score (or dS), or on BOTH q_idx and kv_idx through ops the
                engines accept: emitted as pointwise ops inside the fused kernel;
  materialized  a score-free subexpression that would cost kernel work or that the engines
                cannot do, evaluated eagerly with exact torch semantics and bound as a graph
                input (materialization.py): *single-axis* (depends on at most one of q_idx /
                kv_idx, plus b, h, parameters) -> a broadcast (B|1, H|1, Sq|1, Skv|1)
                tensor, when it contains anything beyond + - * and comparisons (//, %, bit
                tricks, clamps, floor, table gathers: Morton decoding costs O(S) once, nothing
                in the kernel); *dense* (depends on both) -> (B|1, H|1, Sq, Skv), when its op
                cannot be emitted (a gather at q_idx - kv_idx + c, bit ops mixing both axes);
  view          a tensor parameter indexed by bare index arguments in axis order (bias[b, h,
                q_idx, kv_idx], slopes[h], ids[q_idx]): bound as a view, no copy (as before).

Rules the H100 engines imposed (benchmarks/results/frontend_probe_h100.md):
* every emitted op has an input derived from score / dS / gen_index, and a graph input or a
  pass-by-value scalar is never an op's first input: such inputs are anchored by adding a zero
  built as sub(gen_index, gen_index);
* a comparison a OP b is rewritten as E OP c, with E the index-dependent part of a - b (e.g.
  kv_idx - q_idx) and c a host-folded scalar;
* `where` on &, |, ^, ~ becomes nested binary_selects on single comparisons; a materialized
  condition is bound as 0/1 and compared with 0.5;
* every op gets compute type FLOAT and an explicit output type (FLOAT or BOOLEAN).
Integer values are carried in fp32 in the graph: exact below 2**24 (positions are).
`cudnn` is imported only when ops are emitted.

The backend's entry point (`scaled_plan_for`, via `ScoreMod.lower_scaled_forward`) folds a
leading scalar factor out of the mod: when the score enters only as `score * c` or `score / c`
with c a host scalar (softcap's `score / cap`), the callback receives c x score through cuDNN's
attention scale and computes the rest, one pointwise op fewer per score in the forward and in
each backward pass over it (measured on H200, D64: softcap + causal 2-3%, softcap + window 8%
forward+backward). The fold needs c > 0 and finite at run time (the backend refuses other
values) and the same operands as the plain plan.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import expr, optable
from .autodiff import grad_dag
from .expr import Node, const, direct_axes, show, substitute, topo_order

# --------------------------------------------------------------------------- the one table

#: How each op beyond the probe-accepted basics is emitted inside the cuDNN graph, when it
#: depends on the score or on both q_idx and kv_idx. A value is a graph method name, a recipe
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


def _zero_where_no_gradient(g: Node) -> Node:
    """where(dS == 0, 0, g) around a derivative that is not linear in dS.

    cuDNN's backward evaluates the derivative at every position of its tiles, also where the
    score is -inf (past the keys of a partial tile): gelu'(-inf), silu'(-inf) or 2x at -inf are
    NaN or inf, and their product with dS = 0 is NaN, which then spreads through dQ (measured).
    Where dS is 0 the gradient is exactly 0, whatever the derivative."""
    from .autodiff import GRAD

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


# --------------------------------------------------------------------------- structural facts

_SCALAR_LEAVES = ("const", "param", "length")
_DERIVED_LEAVES = ("score", "grad", "index", "zero")
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_NEGATE = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
ZERO = Node("zero")
_HALF = const(0.5)
AXIS_LETTER = {"b": "b", "h": "h", "q_idx": "q", "kv_idx": "k"}
_CHEAP = frozenset(("index", "const", "param", "length", "add", "sub", "neg", "mul", "where") + optable.BOOL_OPS)


@functools.lru_cache(maxsize=4096)
def is_scalar(n: Node) -> bool:
    """Only constants, scalar params and lengths below: foldable on the host (a gather never is:
    its tensor lives on the device)."""
    if n.op == "gather":
        return False
    return n.op in _SCALAR_LEAVES if not n.args else all(is_scalar(a) for a in n.args)


@functools.lru_cache(maxsize=4096)
def is_derived(n: Node) -> bool:
    """Depends on score, dS or an index: an op with such an input is accepted by the engines."""
    return n.op in _DERIVED_LEAVES if not n.args else any(is_derived(a) for a in n.args)


class Facts:
    """Per-node dependencies, computed iteratively (deep DAGs never recurse in Python).

    deps(n): subset of {"S" score/dS, "b", "h", "q", "k", "L" lengths, "T" tensor gathers}.
    costly(n): the subexpression has an op beyond + - * / comparisons / where / views.
    """

    _TAG = {"b": "b", "h": "h", "q_idx": "q", "kv_idx": "k"}

    def __init__(self):
        self._deps: Dict[Node, frozenset] = {}
        self._costly: Dict[Node, bool] = {}

    def _fill(self, root: Node) -> None:
        for n in topo_order(root):
            if n in self._deps:
                continue
            if n.op in ("score", "grad"):
                d = frozenset("S")
            elif n.op == "index":
                d = frozenset(self._TAG[n.attr])
            elif n.op == "length":
                d = frozenset("L")
            else:
                d = frozenset().union(*(self._deps[a] for a in n.args)) if n.args else frozenset()
                if n.op == "gather":
                    d = d | {"T"}
            self._deps[n] = d
            view = n.op == "gather" and direct_axes(n) is not None and n.dtype != "b"
            own = not (n.op in _CHEAP or view)
            self._costly[n] = own or (not view and any(self._costly[a] for a in n.args))

    def deps(self, n: Node) -> frozenset:
        if n not in self._deps:
            self._fill(n)
        return self._deps[n]

    def costly(self, n: Node) -> bool:
        if n not in self._costly:
            self._fill(n)
        return self._costly[n]

    def axes(self, n: Node) -> Tuple[str, ...]:
        d = self.deps(n)
        return tuple(a for a in expr.INDEX_AXES if self._TAG[a] in d)

    def materialize(self, n: Node) -> Optional[str]:
        """"single" / "dense" if n is to be materialized (score-free, not scalar), else None."""
        d = self.deps(n)
        if "S" in d or is_scalar(n) or n.op in ("index", "const", "param", "length"):
            return None
        if "q" in d and "k" in d:
            if n.op == "gather":
                return None if (direct_axes(n) is not None and n.dtype != "b") else "dense"
            # &, |, ^, ~ and where become nested selects
            return None if emittable(n.op) or n.op in optable.LOGIC or n.op == "where" else "dense"
        if n.op == "gather" and direct_axes(n) is not None and n.dtype != "b":
            return None  # a view
        if self.in_graph(n):
            # measured on H100/H200: in-graph index arithmetic (floor, div, ...) recomputes exactly in
            # the backward, while a mask condition reading a graph input does not
            return None
        return "single" if self.costly(n) else None

    def in_graph(self, n: Node) -> bool:
        """True if every op below `n` is emittable in-graph (index arithmetic, no gathers)."""
        memo = self.__dict__.setdefault("_in_graph", {})
        got = memo.get(n)
        if got is None:
            if not n.args:  # lengths stay out: per-sequence graph inputs are read wrongly in ragged graphs
                got = n.op in ("index", "const", "param")
            elif n.op == "gather" or n.op in optable.LOGIC:
                got = False
            else:
                got = (emittable(n.op) or n.op == "where" or n.op in optable.BOOL_OPS or n.op == "pow") and all(
                    self.in_graph(a) for a in n.args)
            memo[n] = got
        return got


# --------------------------------------------------------------------------- rewriting

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


class Plan:
    """Rewritten forward/backward DAGs and the names of their graph operands.

    scalar_names: scalar node -> operand name ("q_len"/"kv_len" for bare lengths, the param
    name for a bare scalar param, "c<k>" for a constant, "f<k>" for a folded subexpression).
    length_folds: names of folds that read q_len/kv_len (bound from dense lengths only).
    tensor_names: view leaf -> operand name, e.g. "slopes@h", "bias@bhqk"; views: that name ->
    (tensor parameter, axes). materialized: operand name ("mat<k>@<axes>") -> Materialized;
    length_materialized: those that read q_len/kv_len (dense problems only).
    mask_reads_inputs: a select's condition reads a view or a materialized operand.
    mask_reads_key_inputs: ... one that varies along kv_idx (cuDNN 9.19's backward recomputes those
    masks wrongly; masks over query-axis inputs, e.g. per-query document bounds, are right).
    kv_broadcast_operands: operands varying along kv_idx but broadcast along q_idx ((.., 1, Skv)):
    cuDNN 9.19's backward reads them wrongly (measured: w[kv_idx] terms, ids[kv_idx] masks; full
    (.., Sq, Skv) operands and (.., Sq, 1) ones are right).
    batch_broadcast_operands: operands varying along b but broadcast along q_idx and kv_idx
    ((B, 1|H, 1, 1): per-sequence scalars such as lens[b]) that an op other than `add` reads:
    cuDNN 9.19 reads them wrongly there (measured on H200: `kv_idx < lens[b]` masks and
    `score * w[b]` off by O(1) in the forward; `score + w[b]`, (1, H, 1, 1) and (B, 1, 1, Skv)
    operands are right).
    unsupported: why the cuDNN lowering cannot run this mod (empty when it can).
    """

    def __init__(self, root: Node, fold_score_scale: bool = False):
        #: with fold_score_scale: the scalar DAG c folded out of the mod (`fold_score_scale_of`), else None
        self.score_scale: Optional[Node] = None
        if fold_score_scale:
            folded = fold_score_scale_of(root)
            if folded is not None:
                root, self.score_scale = folded
        self.facts = Facts()
        self.tensor_names: Dict[Node, str] = {}
        self.views: Dict[str, Tuple[str, Tuple[str, ...]]] = {}
        self.materialized: Dict[str, Materialized] = {}
        self.length_materialized: List[str] = []
        self.unsupported: List[str] = []
        self._mat_leaf: Dict[Node, Node] = {}
        rewriter = _Rewriter(self)
        self.forward = _anchored(rewriter.rw(_masked_stays_masked(root)))
        self.backward = _anchored(rewriter.rw(_zero_where_no_gradient(grad_dag(root))))
        self.scalar_names: Dict[Node, str] = {}
        self.length_folds: List[str] = []
        counts = {"c": 0, "f": 0}
        for top in (self.forward, self.backward):
            for n in topo_order(top):
                if not is_scalar(n) or n in self.scalar_names:
                    continue
                if n.op in ("param", "length"):
                    self.scalar_names[n] = n.attr
                    continue
                kind = "c" if n.op == "const" else "f"
                self.scalar_names[n] = f"{kind}{counts[kind]}"
                counts[kind] += 1
                if kind == "f" and any(x.op == "length" for x in topo_order(n)):
                    self.length_folds.append(self.scalar_names[n])
        # Only maximal scalar subtrees need operands: drop names used solely inside a fold.
        used = set()
        for top in (self.forward, self.backward):
            for n in topo_order(top):
                if not is_scalar(n):
                    used.update(a for a in n.args if is_scalar(a))
            if is_scalar(top):
                used.add(top)
        self.scalar_names = {n: s for n, s in self.scalar_names.items() if n in used}
        self.length_folds = [s for s in self.length_folds if s in self.scalar_names.values()]
        self.mask_reads_inputs = any(
            n.op == "select" and any(x.op in ("tparam", "mat") for x in topo_order(n.args[2]))
            for n in topo_order(self.forward)
        )
        kv_only = {name for name, (_, axes) in self.views.items() if "kv_idx" in axes and "q_idx" not in axes}
        kv_only |= {name for name, m in self.materialized.items() if "kv_idx" in m.axes and "q_idx" not in m.axes}
        self.kv_broadcast_operands = tuple(sorted(kv_only))
        self.batch_broadcast_operands = tuple(sorted(self._batch_broadcast_reads()))
        # a mask whose condition reads an operand varying along the keys (a view or a materialized one)
        self.mask_reads_key_inputs = any(
            n.op == "select" and any(_varies_along_keys(self, x) for x in topo_order(n.args[2]))
            for n in topo_order(self.forward)
        )

    def _batch_broadcast_reads(self) -> set:
        """Names of (B, 1|H, 1, 1) operands read by an op other than `add` (forward or backward)."""
        names = set()
        for top in (self.forward, self.backward):
            for n in topo_order(top):
                if n.op == "add":
                    continue
                for a in n.args:
                    if a.op not in ("tparam", "mat"):
                        continue
                    axes = self.operand_axes(a)
                    if "b" in axes and "q_idx" not in axes and "kv_idx" not in axes:
                        names.add(self.tensor_names[a] if a.op == "tparam" else a.attr)
        return names

    def operand_axes(self, leaf: Node) -> Tuple[str, ...]:
        """The index axes a graph-input leaf ("tparam" view or "mat") varies along."""
        if leaf.op == "tparam":
            return tuple(leaf.attr[1])
        mat = self.materialized.get(leaf.attr)
        return () if mat is None else tuple(mat.axes)

    def view_leaf(self, n: Node, axes: Tuple[str, ...]) -> Node:
        leaf = Node("tparam", attr=(n.attr, axes), dtype=n.dtype)
        if leaf not in self.tensor_names:
            name = f"{n.attr}@{''.join(AXIS_LETTER[a] for a in axes)}"
            self.tensor_names[leaf] = name
            self.views[name] = (n.attr, axes)
        return leaf

    @property
    def needs_host_lengths(self) -> bool:
        return bool(self.length_folds or self.length_materialized)

    def summary(self) -> Dict[str, Any]:
        """What goes where: {"scalar": [...], "views": {...}, "single": {...}, "dense": {...},
        "in_graph": sorted ops emitted by the forward, "unsupported": [...]} (text, for tests/docs)."""
        ops = sorted({n.op for n in topo_order(self.forward) if n.args and not is_scalar(n)})
        return {
            "scalar": sorted(self.scalar_names.values()),
            "views": {k: f"{p}[{', '.join(a)}]" for k, (p, a) in self.views.items()},
            "single": {k: show(m.node) for k, m in self.materialized.items() if m.kind == "single"},
            "dense": {k: show(m.node) for k, m in self.materialized.items() if m.kind == "dense"},
            "in_graph": ops,
            "unsupported": list(self.unsupported),
        }


def fold_score_scale_of(root: Node) -> Optional[Tuple[Node, Node]]:
    """(root', c) with root(score) == root'(c * score), when the score enters the mod only through
    one product or quotient with a host scalar (softcap's `score / cap`: c = 1 / cap), else None.

    c is a scalar DAG over constants and scalar parameters (no lengths). A callback that receives
    c * score (cuDNN multiplies the score by its attention scale before the callback, and dS by it
    after the backward callback) computes the mod with one pointwise op fewer per score in the
    forward and in each of the backward's two passes over it. Nothing is folded when the product
    is the whole mod (the callback would be empty)."""
    score = Node("score")
    parents = {n for n in topo_order(root) if score in n.args}
    if len(parents) != 1:
        return None
    (n,) = parents
    if n == root:
        return None
    if n.op == "mul" and n.args.count(score) == 1:
        other = n.args[1] if n.args[0] == score else n.args[0]
        factor = other
    elif n.op == "div" and n.args[0] == score and n.args[1] != score:
        other = n.args[1]
        factor = Node("div", (const(1.0), other))
    else:
        return None
    if not is_scalar(other) or any(x.op == "length" for x in topo_order(other)):
        return None
    return substitute(root, lambda node, args: score if node == n else None), factor


def _operand_layout(plan: Plan) -> tuple:
    """What a plan binds: scalar, view and materialized operand names with what they hold."""
    return ({name: n for n, name in plan.scalar_names.items()}, dict(plan.views),
            {k: (m.node, m.kind, m.axes) for k, m in plan.materialized.items()}, tuple(plan.length_folds),
            tuple(plan.length_materialized))


@functools.lru_cache(maxsize=256)
def scaled_plan_for(root: Node) -> Plan:
    """The plan of a callback that receives c * score (c = `Plan.score_scale`, bound by the backend
    into cuDNN's attention scale): the fold of `fold_score_scale_of`, or `plan_for(root)` itself
    (score_scale None) when nothing folds or the fold would change the operands the mod binds."""
    plain = plan_for(root)
    folded = Plan(root, fold_score_scale=True)
    if (folded.score_scale is None or plain.unsupported or folded.unsupported
            or _operand_layout(folded) != _operand_layout(plain)):
        return plain
    return folded


def _varies_along_keys(plan: Plan, n: Node) -> bool:
    return n.op in ("tparam", "mat") and "kv_idx" in plan.operand_axes(n)


@functools.lru_cache(maxsize=256)
def plan_for(root: Node) -> Plan:
    return Plan(root)


def eval_scalar(n: Node, params: Dict[str, float], lengths: Optional[Dict[str, int]] = None) -> float:
    """Host value of a scalar node (Python semantics; float math never raises, see optable)."""
    vals: Dict[Node, Any] = {}
    for x in topo_order(n):
        a = [vals[y] for y in x.args]
        if x.op == "const":
            v = x.attr
        elif x.op == "param":
            v = params[x.attr]
            v = int(v) if x.dtype == "i" else float(v)
        elif x.op == "length":
            v = int(lengths[x.attr])
        else:
            v = optable.fold(x.op, *a)
        vals[x] = v
    return vals[n]


def scalar_tensor(value: float) -> torch.Tensor:
    """A CPU fp32 (1, 1, 1, 1) pass-by-value operand."""
    return torch.full((1, 1, 1, 1), float(value), dtype=torch.float32)


def scalar_operands(plan: Plan, params: Dict[str, float], lengths: Optional[Dict[str, int]] = None) -> Dict[str, torch.Tensor]:
    """Values of the plan's scalar operands: without lengths, all but the length folds; with, only those."""
    out = {}
    for n, name in plan.scalar_names.items():
        if n.op == "length":
            continue
        if (name in plan.length_folds) == (lengths is not None):
            out[name] = scalar_tensor(eval_scalar(n, params, lengths))
    return out


# --------------------------------------------------------------------------- emission

class Emitter:
    """Emit rewritten nodes into `graph`, memoized in `memo` (keyed by node)."""

    def __init__(self, graph: Any, plan: Plan, operands: Dict[str, Any], memo: Dict[Any, Any], mod_name: str):
        import cudnn  # lazy: only when a graph is built

        self.g, self.plan, self.operands, self.memo, self.mod_name = graph, plan, operands, memo, mod_name
        self.FLOAT, self.BOOL = cudnn.data_type.FLOAT, cudnn.data_type.BOOLEAN

    def op(self, name: str, *inputs: Any, out_type: Any = None, **kw: Any) -> Any:
        t = getattr(self.g, name)(*inputs, compute_data_type=self.FLOAT, **kw)
        t.set_data_type(out_type or self.FLOAT)
        return t

    def operand(self, name: str) -> Any:
        try:
            return self.operands[name]
        except KeyError:
            if name in self.plan.length_folds:
                raise NotImplementedError(
                    f"score_mod {self.mod_name!r} combines q_len/kv_len on the host (e.g. bottom-right alignment); "
                    "that is only possible for dense problems without padding. cuDNN engines compute it wrongly "
                    "per sequence, so packed (thd) or padded batches with this score_mod need backend='reference'"
                ) from None
            if name in self.plan.materialized:
                raise KeyError(
                    f"score_mod {self.mod_name!r}: materialized operand {name!r} was not supplied; the backend must "
                    "bind cudnn_operands(dims=(B, H, Sq, Skv), device=...)"
                ) from None
            raise KeyError(f"score_mod {self.mod_name!r}: graph operand {name!r} was not supplied") from None

    def emit(self, n: Node) -> Any:
        memo = self.memo
        if n in memo:
            return memo[n]
        if n.op in ("score", "grad"):
            t = memo[n.op]
        elif n.op == "index":
            base = memo.get("score", memo.get("grad"))
            t = self.op("gen_index", base, axis=expr.INDEX_AXES.index(n.attr))
        elif n.op == "zero":
            i = self.emit(Node("index", attr="kv_idx", dtype="i"))
            t = self.op("sub", i, i)
        elif n.op == "unsupported":
            raise NotImplementedError(unsupported_message(self.plan, self.mod_name))
        elif is_scalar(n):
            t = self.operand(self.plan.scalar_names[n])
        elif n.op == "tparam":
            t = self.operand(self.plan.tensor_names[n])
        elif n.op == "mat":
            t = self.operand(n.attr)
        else:
            ins = [self.emit(a) for a in n.args]
            if not is_derived(n.args[0]):  # never a graph input or pbv scalar first
                ins[0] = self.op("add", self.emit(ZERO), ins[0])
            out_type = self.BOOL if n.dtype == "b" else self.FLOAT
            t = self.op(graph_op(n.op), *ins, out_type=out_type)
        memo[n] = t
        return t


def unsupported_message(plan: Plan, name: str) -> str:
    return (
        f"score_mod {name!r} cannot run on cuDNN: {'; '.join(plan.unsupported)}. Use backend='reference' (or "
        "flex_attention via mod.to_flex()); score-free parts are materialized, but these depend on the score"
    )


def lower_forward(plan: Plan, graph: Any, score: Any, operands: Dict[str, Any], memo: Dict[Any, Any], name: str) -> Any:
    if plan.unsupported:
        raise NotImplementedError(unsupported_message(plan, name))
    memo["score"] = score
    return Emitter(graph, plan, operands, memo, name).emit(plan.forward)


def lower_backward(plan: Plan, graph: Any, dscore: Any, operands: Dict[str, Any], memo: Dict[Any, Any], name: str) -> Any:
    if plan.unsupported:
        raise NotImplementedError(unsupported_message(plan, name))
    memo["grad"] = dscore
    return Emitter(graph, plan, operands, memo, name).emit(plan.backward)
