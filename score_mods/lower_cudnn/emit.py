"""Emission: rewritten plan nodes as cuDNN frontend pointwise ops inside the score_mod callbacks
(`lower_forward` / `lower_backward`); `cudnn` is imported only here, when a graph is built."""

from __future__ import annotations

from typing import Any, Dict

from .. import expr
from ..expr import Node
from .facts import ZERO, is_derived, is_scalar
from .plans import Plan
from .table import graph_op

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
