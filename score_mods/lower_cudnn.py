"""Lower a score_mod DAG (forward and derived backward) to cuDNN frontend pointwise ops.

Rules the H100 engines imposed (benchmarks/results/frontend_probe_h100.md):
* every emitted op has an input derived from score / dS / gen_index: subexpressions of only
  scalars (constants, float params, lengths) are folded on the host into one pass-by-value
  operand; ops on tensor parameters alone are anchored by adding a zero built as
  sub(gen_index, gen_index);
* a comparison a OP b is rewritten as E OP c, with E the index-dependent part of a - b (e.g.
  kv_idx - q_idx) and c a host-folded scalar; a pbv scalar is never the first input;
* `where` on &, |, ~ becomes nested binary_selects on single comparisons;
* every op gets compute type FLOAT and an explicit output type (FLOAT or BOOLEAN).
`cudnn` is imported only when ops are emitted.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import expr
from .autodiff import grad_dag
from .expr import Node, const, topo_order

_SCALAR_LEAVES = ("const", "param", "length")
_DERIVED_LEAVES = ("score", "grad", "index", "zero")
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_NEGATE = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
_GRAPH_OP = {
    "minimum": "min", "maximum": "max", "tanh_bwd": "tanh_backward", "sigmoid_bwd": "sigmoid_backward",
    "select": "binary_select", "lt": "cmp_lt", "le": "cmp_le", "gt": "cmp_gt", "ge": "cmp_ge",
    "eq": "cmp_eq", "ne": "cmp_neq",
}
ZERO = Node("zero")
AXIS_LETTER = {"b": "b", "h": "h", "q_idx": "q", "kv_idx": "k"}


@functools.lru_cache(maxsize=4096)
def is_scalar(n: Node) -> bool:
    """Only constants, float params and lengths below: foldable on the host."""
    return n.op in _SCALAR_LEAVES if not n.args else all(is_scalar(a) for a in n.args)


@functools.lru_cache(maxsize=4096)
def is_derived(n: Node) -> bool:
    """Depends on score, dS or an index: an op with such an input is accepted by the engines."""
    return n.op in _DERIVED_LEAVES if not n.args else any(is_derived(a) for a in n.args)


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
                k = n.args[i].attr
                return {a: k * v for a, v in t.items()}, [(k * c, x) for c, x in r]
    return {n: 1.0}, []


def _scalar_sum(rem: List[Tuple[float, Node]]) -> Node:
    """The scalar node for sum(coef * node), constants combined."""
    total, out = 0.0, None
    for c, x in rem:
        if x.op == "const":
            total += c * x.attr
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


def rewrite(root: Node) -> Node:
    """The lowering form of root: canonical comparisons, selects, derived inputs first."""
    done: Dict[Node, Node] = {}

    def rw(n: Node) -> Node:
        if n in done:
            return done[n]
        if is_scalar(n) or not n.args:
            out = n
        elif n.op == "where":
            out = sel(n.args[0], rw(n.args[1]), rw(n.args[2]))
        else:
            a = [rw(x) for x in n.args]
            op = n.op
            if op in ("add", "mul", "minimum", "maximum") and not is_derived(a[0]) and is_derived(a[1]):
                a.reverse()
            elif op == "sub" and not is_derived(a[0]) and is_derived(a[1]):
                op, a = "add", [Node("neg", (a[1],)), a[0]]
            elif op == "div" and not is_derived(a[0]) and is_derived(a[1]):
                op, a = "mul", [Node("reciprocal", (a[1],)), a[0]]
            if op in expr.BOOL_OPS:
                raise NotImplementedError(f"boolean op {op!r} outside where() cannot be lowered")
            out = Node(op, tuple(a))
        done[n] = out
        return out

    def sel(c: Node, x: Node, y: Node) -> Node:
        if x == y:
            return x
        if c.op == "and":
            return sel(c.args[0], sel(c.args[1], x, y), y)
        if c.op == "or":
            return sel(c.args[0], x, sel(c.args[1], x, y))
        if c.op == "not":
            return sel(c.args[0], y, x)
        cc = _canon_cmp(c, rw)
        if not is_derived(x) and is_derived(y):
            return Node("select", (y, x, Node(_NEGATE[cc.op], cc.args, dtype="b")))
        return Node("select", (x, y, cc))

    return rw(root)


# --------------------------------------------------------------------------- plan

class Plan:
    """Rewritten forward/backward DAGs and the names of their graph operands.

    scalar_names: scalar node -> operand name ("q_len"/"kv_len" for bare lengths, the param
    name for a bare float param, "c<k>" for a constant, "f<k>" for a folded subexpression).
    length_folds: names of folds that read q_len/kv_len (bound from dense lengths only).
    tensor_names: tparam node -> operand name, e.g. "slopes@h", "bias@bhqk".
    """

    def __init__(self, root: Node):
        self.forward = rewrite(root)
        self.backward = rewrite(grad_dag(root))
        self.scalar_names: Dict[Node, str] = {}
        self.tensor_names: Dict[Node, str] = {}
        self.length_folds: List[str] = []
        counts = {"c": 0, "f": 0}
        for top in (self.forward, self.backward):
            for n in topo_order(top):
                if n.op == "tparam" and n not in self.tensor_names:
                    name, axes = n.attr
                    self.tensor_names[n] = f"{name}@{''.join(AXIS_LETTER[a] for a in axes)}"
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


@functools.lru_cache(maxsize=256)
def plan_for(root: Node) -> Plan:
    return Plan(root)


def eval_scalar(n: Node, params: Dict[str, float], lengths: Optional[Dict[str, int]] = None) -> float:
    """Host value of a scalar node."""
    vals: Dict[Node, float] = {}
    for x in topo_order(n):
        a = [vals[y] for y in x.args]
        if x.op == "const":
            v = x.attr
        elif x.op == "param":
            v = float(params[x.attr])
        elif x.op == "length":
            v = float(lengths[x.attr])
        elif x.op in expr._PY:
            v = expr._PY[x.op](*a)
        else:
            v = expr._UNARY_PY[x.op](*a)
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
            i = self.emit(Node("index", attr="kv_idx"))
            t = self.op("sub", i, i)
        elif is_scalar(n):
            t = self.operand(self.plan.scalar_names[n])
        elif n.op == "tparam":
            t = self.operand(self.plan.tensor_names[n])
        else:
            ins = [self.emit(a) for a in n.args]
            if not any(is_derived(a) for a in n.args):
                ins[0] = self.op("add", self.emit(ZERO), ins[0])
            out_type = self.BOOL if n.dtype == "b" else self.FLOAT
            t = self.op(_GRAPH_OP.get(n.op, n.op), *ins, out_type=out_type)
        memo[n] = t
        return t


def lower_forward(plan: Plan, graph: Any, score: Any, operands: Dict[str, Any], memo: Dict[Any, Any], name: str) -> Any:
    memo["score"] = score
    return Emitter(graph, plan, operands, memo, name).emit(plan.forward)


def lower_backward(plan: Plan, graph: Any, dscore: Any, operands: Dict[str, Any], memo: Dict[Any, Any], name: str) -> Any:
    memo["grad"] = dscore
    return Emitter(graph, plan, operands, memo, name).emit(plan.backward)
