"""Evaluate a score_mod DAG with torch: the reference semantics (and the flex_attention twin).

Index tensors are int64 and broadcast against score. Integer nodes stay exact: int64 tensors
with floor division (torch.div(rounding_mode="floor")), Python-sign remainder
(torch.remainder) and bitwise ops; `floor` / `ceil` of a float give integral float tensors
(so an infinity in an unselected where() branch stays harmless), converted to int64 where an
op needs true integers (bit operations, gather indices). Float nodes compute in the score's
dtype (`float_dtype` when there is no score, e.g. materialized operands); Python numbers stay
Python numbers (folded with optable.fold) until they meet a tensor.

Tensor parameters are gathered with their index expressions; a size-1 dim indexed by a bare
`b` or `h` broadcasts (index 0). The same code serves full score matrices, query blocks and
flex_attention's scalar index tensors (under vmap).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from .caches import register_lru
from . import optable, table_gather
from .expr import INDEX_AXES, Node, topo_order


def _is_t(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _as_float(x: Any, dtype: torch.dtype) -> Any:
    """Tensor operands of float nodes in the float dtype; Python numbers stay Python."""
    if _is_t(x) and x.dtype != dtype:
        return x.to(dtype)
    return x


def _as_int(x: Any) -> Any:
    """Integer operands for bit operations and gather indices: int64 tensors or Python ints."""
    if _is_t(x):
        return x if x.dtype in (torch.int64, torch.int32) else x.to(torch.int64)
    return int(x)


def _tensor(x: Any, ref: Any, dtype: torch.dtype) -> torch.Tensor:
    """x as a tensor on the device of `ref` (a tensor, a list holding one, or None)."""
    if _is_t(x):
        return x
    if isinstance(ref, (list, tuple)):
        ref = _first_t(ref)
    device = ref.device if _is_t(ref) else None
    # torch.full, not torch.tensor: a factory op traces under flex_attention's compiled mask
    # (torch.tensor of a Python number is a lifted constant that its fake-tensor vmap rejects)
    if isinstance(x, bool):
        return torch.full((), x, dtype=torch.bool, device=device)
    if isinstance(x, int):
        return torch.full((), x, dtype=torch.int64, device=device)
    return torch.full((), x, dtype=dtype, device=device)


def gather(t: torch.Tensor, n: Node, idx: list, clamp_b: bool = False) -> torch.Tensor:
    """t[idx...]; a size-1 dim indexed by a bare b / h index argument broadcasts (index 0).
    clamp_b (materialization on bucketed dims): a bare b beyond the dim repeats its last row
    (the extra sequences of a bucketed batch are empty: their values are never read)."""
    if len(idx) != t.dim():
        raise ValueError(
            f"tensor parameter {n.attr!r} is indexed with {len(idx)} indices but has {t.dim()} dims "
            f"(shape {tuple(t.shape)})"
        )
    out = []
    for dim, (arg, i) in enumerate(zip(n.args, idx)):
        if t.shape[dim] == 1 and arg.op == "index" and arg.attr in ("b", "h"):
            i = torch.zeros_like(i) if _is_t(i) else 0
        elif clamp_b and arg.op == "index" and arg.attr == "b" and _is_t(i):
            i = i.clamp(max=t.shape[dim] - 1)
        out.append(_as_int(i))
    if not any(_is_t(i) for i in out):
        return t[tuple(out)]
    device = t.device
    like = next(i for i in out if _is_t(i))
    # Python ints become index tensors too: mixed int / tensor indexing is data-dependent under
    # dynamo (flex_attention traces the mod) once sizes are dynamic
    return table_gather.gather(t, [i.to(device) if _is_t(i) else torch.full_like(like, i, device=device) for i in out])


def evaluate(root: Node, env: Dict[str, Any], params: Mapping[str, Any], extra: Mapping[Node, Any] = None,
             float_dtype: Optional[torch.dtype] = None) -> Any:
    """Value of `root`.

    env: "score" (float tensor; optional for score-free DAGs), "b", "h", "q_idx", "kv_idx"
    (int64 tensors broadcastable to score, or ints), "q_len", "kv_len" (ints or int64
    tensors), optionally "grad" (for gradient DAGs). params: scalar parameter values and
    tensor parameters by name. extra: precomputed nodes. The result is a tensor broadcast to
    score when there is a score; otherwise a tensor or Python number of the root's own shape.
    """
    prog = program(root)
    seeds = {i: extra[n] for i, (n, _) in enumerate(prog) if n in extra} if extra else None
    return run(prog, env, params, float_dtype, seeds)


Program = Tuple[Tuple[Node, Tuple[int, ...]], ...]


@register_lru("score_mods.eager.program")
@functools.lru_cache(maxsize=1024)
def program(root: Node) -> Program:
    """root's nodes in evaluation order, each with its operands' positions in that order: what
    `run` evaluates without hashing a node (torch.compile's tracer, which runs flex_attention's
    score_mods, cannot hash them in every torch version)."""
    order = topo_order(root)
    slot = {n: i for i, n in enumerate(order)}
    return tuple((n, tuple(slot[a] for a in n.args)) for n in order)


def run(prog: Program, env: Dict[str, Any], params: Mapping[str, Any], float_dtype: Optional[torch.dtype] = None,
        seeds: Optional[Mapping[int, Any]] = None) -> Any:
    """`evaluate` of the DAG `prog` was made from (see `program`); seeds: precomputed values by
    position in `prog`."""
    like, fdt = _float_dtype(env, float_dtype)
    vals: List[Any] = []
    for i, (n, slots) in enumerate(prog):
        if seeds is not None and i in seeds:
            vals.append(seeds[i])
        else:
            vals.append(_node_value(n, [vals[j] for j in slots], env, params, like, fdt))
    return _finish(vals[-1], like, fdt)


def _float_dtype(env: Dict[str, Any], float_dtype: Optional[torch.dtype]) -> Tuple[Any, torch.dtype]:
    like = env.get("score")
    fdt = like.dtype if like is not None and like.is_floating_point() else (float_dtype or torch.float32)
    return like, fdt


def _finish(out: Any, like: Any, fdt: torch.dtype) -> Any:
    if like is None:
        return out
    if not _is_t(out):
        out = _tensor(out, like, fdt)
    if out.dtype != fdt and out.dtype != torch.bool:
        out = out.to(fdt)
    shape = torch.broadcast_shapes(out.shape, like.shape)
    # no expand when the shape is already right: inductor's CPU flex_attention lowering rejects a
    # no-op expand of a value computed from a captured 0-d tensor (a float parameter as an input)
    return out if out.shape == shape else out.expand(shape)


def _node_value(n: Node, a: list, env: Dict[str, Any], params: Mapping[str, Any], like, fdt) -> Any:
    op = n.op
    if op in ("score", "grad"):
        return env[op]
    if op in ("index", "length"):
        return env[n.attr]
    if op == "const":
        return n.attr
    if op == "param":
        return params[n.attr]
    if op == "gather":
        v = gather(params[n.attr], n, a, clamp_b=env.get("clamp_b", False))
        if n.dtype == "i":
            v = v.to(torch.int64)
        elif n.dtype == "b":
            v = v.to(torch.bool)
        return v
    if not any(_is_t(x) for x in a):  # every operand a Python number / bool: fold
        return optable.fold(op, *a)
    if op == "where":
        x, y = a[1], a[2]
        if n.dtype == "f":
            x, y = _as_float(x, fdt), _as_float(y, fdt)
        return torch.where(_tensor(a[0], a, fdt), _tensor(x, a, fdt), _tensor(y, a, fdt))
    if op == "tanh_bwd":
        return a[0] * (1 - torch.tanh(_as_float(a[1], fdt)) ** 2)
    if op == "sigmoid_bwd":
        s = torch.sigmoid(_as_float(a[1], fdt))
        return a[0] * s * (1 - s)
    fn = optable.TORCH[op]
    if op in optable.BITWISE or op == "bitnot":
        a = [_as_int(x) for x in a]
        if not _is_t(a[0]):
            a[0] = _tensor(a[0], a[1], fdt)
        return fn(*a)
    if op in optable.LOGIC:
        return fn(*(_tensor(x, a, fdt) for x in a))
    if n.dtype == "f" or op in optable.UNARY_FLOAT or op == "div":
        a = [_as_float(x, fdt) for x in a]
    elif op in optable.CMP_OPS and any(_is_t(x) and x.is_floating_point() for x in a):
        a = [_as_float(x, fdt) if _is_t(x) else x for x in a]
    if op in ("floor", "ceil") and _is_t(a[0]) and not a[0].is_floating_point():
        return a[0]
    if op == "pow" and not _is_t(a[0]):
        a[0] = _tensor(a[0], a[1], fdt if n.dtype == "f" else torch.int64)
    if len(a) == 2 and not _is_t(a[0]) and op in ("floordiv", "mod", "minimum", "maximum"):
        a[0] = _tensor(a[0], a[1], fdt if n.dtype == "f" else torch.int64)
    if len(a) == 2 and not _is_t(a[1]) and op in ("minimum", "maximum"):
        a[1] = _tensor(a[1], a[0], fdt if n.dtype == "f" else torch.int64)
    return fn(*a)


def _first_t(a: list) -> Optional[torch.Tensor]:
    return next((x for x in a if _is_t(x)), None)


def index_env(score: torch.Tensor, b, h, q_idx, kv_idx, q_len, kv_len) -> Dict[str, Any]:
    return dict(zip(("score",) + INDEX_AXES + ("q_len", "kv_len"), (score, b, h, q_idx, kv_idx, q_len, kv_len)))


def grid_env(dims, device=None) -> Dict[str, Any]:
    """Index tensors for a (B, H, Sq, Skv) grid: b (B,1,1,1), h (1,H,1,1), q (1,1,Sq,1), kv (1,1,1,Skv)."""
    env: Dict[str, Any] = {}
    for axis, (name, size) in enumerate(zip(INDEX_AXES, dims)):
        shape = [1, 1, 1, 1]
        shape[axis] = int(size)
        env[name] = torch.arange(int(size), device=device).view(shape)
    env["q_len"], env["kv_len"] = int(dims[2]), int(dims[3])
    env["clamp_b"] = True
    return env
