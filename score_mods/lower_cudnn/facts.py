"""Structural facts of DAG nodes: host-foldable scalars (`is_scalar`), engine-acceptable derived
values (`is_derived`), and per-node dependencies and costs (`Facts`), which decide what is
emitted in-graph, bound as a view, or materialized."""

from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

from ..caches import register_lru
from .. import expr, optable
from ..expr import Node, direct_axes, topo_order
from .table import emittable

_SCALAR_LEAVES = ("const", "param", "length")
_DERIVED_LEAVES = ("score", "grad", "index", "zero")
ZERO = Node("zero")
AXIS_LETTER = {"b": "b", "h": "h", "q_idx": "q", "kv_idx": "k"}
_CHEAP = frozenset(("index", "const", "param", "length", "add", "sub", "neg", "mul", "where") + optable.BOOL_OPS)


@register_lru("score_mods.lower_cudnn.is_scalar")
@functools.lru_cache(maxsize=4096)
def is_scalar(n: Node) -> bool:
    """Only constants, scalar params and lengths below: foldable on the host (a gather never is:
    its tensor lives on the device)."""
    if n.op == "gather":
        return False
    return n.op in _SCALAR_LEAVES if not n.args else all(is_scalar(a) for a in n.args)


@register_lru("score_mods.lower_cudnn.is_derived")
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
