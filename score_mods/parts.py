"""Structural views of a traced mod's DAG: its outer masks, its additive bias, its trainable tables.

`additive_bias(root)` finds the learned/positional bias a backend can hand to cuDNN's own bias
input (which the frontend adds AFTER the score_mod callback and differentiates: dBias):

    mod(s) = masks( f(s) + g )      g score-free, reading tensor parameters or index arithmetic
           = masks( f(s) ) + g      (masks commute with adding a finite g: -inf + g = -inf)

so the score part is the mod without g and the bias part is the mod `score + g`
(`TracedMod.split_additive_bias` makes both mods); materialize the bias part with
`score_mods.materialize(bias_part, dims)` (autograd flows to the tables) and feed the tensor to
cuDNN's bias. Scalar-only terms (+ cap, + 1.0) stay in the score part.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Dict, List, Optional, Tuple

from .expr import Node, const, topo_order

Trainable = collections.namedtuple("Trainable", "floating bias_only")
Trainable.__doc__ = """A tensor parameter's training facts: floating (it may require grad) and bias_only (it
enters the mod only through the additive bias, so cuDNN's dBias gives its gradient)."""


def _is_neg_inf(n: Node) -> bool:
    return n.op == "const" and n.attr == -math.inf


def mask_chain(root: Node) -> Tuple[List[Tuple[Node, bool]], Node]:
    """The where(c, x, -inf) / where(c, -inf, x) masks at the top of the DAG, outermost first:
    [(condition, keep_when_true)], and the expression under them."""
    chain, n = [], root
    while n.op == "where" and (_is_neg_inf(n.args[2]) or _is_neg_inf(n.args[1])) and n.args[1] != n.args[2]:
        keep_first = _is_neg_inf(n.args[2])
        chain.append((n.args[0], keep_first))
        n = n.args[1] if keep_first else n.args[2]
    return chain, n


def rebuild_chain(chain: List[Tuple[Node, bool]], inner: Node) -> Node:
    out = inner
    for cond, keep_first in reversed(chain):
        ninf = const(-math.inf)
        out = Node("where", (cond, out, ninf) if keep_first else (cond, ninf, out), dtype="f")
    return out


def pure_mask_condition(root: Node) -> Optional[Node]:
    """The condition of a pure mask (masks over the bare score, and-ed), else None."""
    chain, inner = mask_chain(root)
    if not chain or inner.op != "score":
        return None
    out = None
    for cond, keep_first in chain:
        c = cond if keep_first else Node("not", (cond,), dtype="b")
        out = c if out is None else Node("and", (out, c), dtype="b")
    return out


def _terms(n: Node, sign: float, out: List[Tuple[float, Node]]) -> None:
    if n.op == "add":
        _terms(n.args[0], sign, out)
        _terms(n.args[1], sign, out)
    elif n.op == "sub":
        _terms(n.args[0], sign, out)
        _terms(n.args[1], -sign, out)
    elif n.op == "neg":
        _terms(n.args[0], -sign, out)
    else:
        out.append((sign, n))


def _sum(terms: List[Tuple[float, Node]]) -> Optional[Node]:
    out = None
    for sign, n in terms:
        if out is None:
            out = n if sign > 0 else Node("neg", (n,), dtype=n.dtype)
        else:
            out = Node("add" if sign > 0 else "sub", (out, n), dtype="f" if "f" in (out.dtype, n.dtype) else out.dtype)
    return out


def _is_bias_term(n: Node) -> bool:
    ops = {x.op for x in topo_order(n)}
    return "score" not in ops and bool(ops & {"index", "gather"})


def additive_bias(root: Node) -> Optional[Tuple[Optional[Node], Node]]:
    """(score root, bias root) with mod(s) == score(s) + g everywhere (g finite), the bias root
    being `score + g`; the score root is None when what remains is the bare score (cuDNN then
    needs no score_mod, only the bias). None when there is no such g."""
    chain, inner = mask_chain(root)
    terms: List[Tuple[float, Node]] = []
    _terms(inner, 1.0, terms)
    bias = [(s, n) for s, n in terms if _is_bias_term(n)]
    if not bias:
        return None
    rest = [(s, n) for s, n in terms if not _is_bias_term(n) and not (n.op == "const" and n.attr == 0)]
    g = _sum(bias)
    if g.dtype != "f":
        g = Node("add", (g, const(0.0)), dtype="f")
    bias_root = Node("add", (Node("score"), g))
    f = _sum(rest) if rest else const(0.0)
    if f.dtype != "f":
        f = Node("add", (f, const(0.0)), dtype="f")
    if not chain and f.op == "score":
        return None, bias_root
    return rebuild_chain(chain, f), bias_root


def trainable_facts(specs: Dict[str, Any], score_root: Optional[Node],
                    bias_root: Optional[Node]) -> Dict[str, Trainable]:
    """For every tensor parameter in `specs`: whether it is floating (may require grad) and whether
    it enters only through the bias root (so cuDNN can train it through dBias), given the roots
    of a mod's score and bias parts (None: no such part). Parameters read anywhere else get
    gradients only from the reference backend."""

    def names(root: Optional[Node]) -> set:
        return set() if root is None else {x.attr for x in topo_order(root) if x.op == "gather"}

    in_score, in_bias = names(score_root), names(bias_root)
    return {
        p: Trainable(floating=s.tkind == "float", bias_only=p in in_bias and p not in in_score)
        for p, s in specs.items() if s.kind == "tensor"
    }


def split_additive_bias(mod: Any) -> Tuple[Optional[Any], Optional[Any]]:
    """`mod.split_additive_bias()` for a TracedMod `mod`: (score_part, bias_part) over `additive_bias`."""
    return mod.split_additive_bias()


def trainable(mod: Any) -> Dict[str, Trainable]:
    """`mod.trainable()` for a TracedMod `mod`: `trainable_facts` of its split."""
    return mod.trainable()
