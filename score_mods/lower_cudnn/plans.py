"""Plans: a mod's rewritten forward and backward DAGs with the names of their graph operands
(`Plan`, memoized by `plan_for` / `scaled_plan_for`), and the host values of its scalar operands."""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..caches import register_lru
from .. import optable
from ..autodiff import grad_dag
from ..expr import Node, const, show, substitute, topo_order, topo_tuple
from .facts import AXIS_LETTER, Facts, is_scalar
from .guards import _masked_stays_masked, _zero_where_no_gradient
from .rewrite import Materialized, _anchored, _Rewriter

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


@register_lru("score_mods.lower_cudnn.scaled_plan_for")
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


@register_lru("score_mods.lower_cudnn.plan_for")
@functools.lru_cache(maxsize=256)
def plan_for(root: Node) -> Plan:
    return Plan(root)


def eval_scalar(n: Node, params: Dict[str, float], lengths: Optional[Dict[str, int]] = None) -> float:
    """Host value of a scalar node (Python semantics; float math never raises, see optable)."""
    vals: Dict[Node, Any] = {}
    for x in topo_tuple(n):
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

