"""Evaluate a score_mod DAG with torch: the reference semantics (and the flex_attention twin).

Index tensors are int64 and broadcast against score; tensor parameters are gathered with the
index tensors (a size-1 dim on the b/h axis broadcasts), so the same code serves full score
matrices, query blocks, and flex_attention's scalar index tensors.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

from .expr import INDEX_AXES, Node, topo_order

_UNARY = {
    "neg": torch.neg, "tanh": torch.tanh, "exp": torch.exp, "log": torch.log, "abs": torch.abs,
    "sqrt": torch.sqrt, "sigmoid": torch.sigmoid, "not": torch.logical_not,
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide,
    "minimum": torch.minimum, "maximum": torch.maximum,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "and": torch.logical_and, "or": torch.logical_or,
}


def _t(x: Any, like: torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.tensor(x, dtype=like.dtype if like.is_floating_point() else torch.float32, device=like.device)


def gather_param(t: torch.Tensor, axes: tuple, index: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """t[index[axes[0]], index[axes[1]], ...] with size-1 dims broadcast (index 0)."""
    idx = []
    for dim, axis in enumerate(axes):
        i = index[axis]
        idx.append(torch.zeros_like(i) if t.shape[dim] == 1 else i)
    return t[tuple(idx)]


def evaluate(root: Node, env: Dict[str, Any], params: Mapping[str, Any], extra: Mapping[Node, Any] = None) -> torch.Tensor:
    """Value of `root`.

    env: "score" (float tensor), "b", "h", "q_idx", "kv_idx" (int64 tensors broadcastable to
    score), "q_len", "kv_len" (ints or int64 tensors), optionally "grad" (for gradient DAGs).
    params: float parameter values and tensor parameters by name. extra: precomputed nodes.
    """
    vals: Dict[Node, Any] = dict(extra or {})
    like = env["score"]
    for n in topo_order(root):
        if n in vals:
            continue
        op, a = n.op, [vals[x] for x in n.args]
        if op in ("score", "grad"):
            v = env[op]
        elif op == "index":
            v = env[n.attr]
        elif op == "length":
            v = env[n.attr]
        elif op == "const":
            v = n.attr
        elif op == "param":
            v = params[n.attr]
        elif op == "tparam":
            name, axes = n.attr
            v = gather_param(params[name], axes, env)
            if not v.is_floating_point():
                v = v.to(torch.int64)
        elif op in _BINARY:
            if not isinstance(a[0], torch.Tensor) and not isinstance(a[1], torch.Tensor):
                v = _py_binary(op, a[0], a[1])
            else:
                v = _BINARY[op](_t(a[0], like), _t(a[1], like))
        elif op in _UNARY:
            x = _t(a[0], like)
            v = _UNARY[op](x if op == "not" or x.is_floating_point() else x.to(like.dtype))
        elif op == "where":
            v = torch.where(a[0], _t(a[1], like), _t(a[2], like))
        elif op == "tanh_bwd":
            v = a[0] * (1 - torch.tanh(_t(a[1], like)) ** 2)
        elif op == "sigmoid_bwd":
            s = torch.sigmoid(_t(a[1], like))
            v = a[0] * s * (1 - s)
        else:  # pragma: no cover - every op is listed above
            raise NotImplementedError(f"eager evaluation of op {op!r}")
        vals[n] = v
    out = vals[root]
    return out if isinstance(out, torch.Tensor) else _t(out, like).expand_as(like)


def _py_binary(op: str, x: Any, y: Any) -> Any:
    tx = torch.as_tensor(x, dtype=torch.float64)
    return _BINARY[op](tx, torch.as_tensor(y, dtype=torch.float64)).item()


def index_env(score: torch.Tensor, b, h, q_idx, kv_idx, q_len, kv_len) -> Dict[str, Any]:
    return dict(zip(("score",) + INDEX_AXES + ("q_len", "kv_len"), (score, b, h, q_idx, kv_idx, q_len, kv_len)))
