"""DTensor sharding rules for the custom ops ``fused_attn::attn_fwd`` and ``fused_attn::attn_bwd``.

Attention is independent per batch element and per head, so on every mesh dimension an op call
may be (the *kinds*):

    "replicate"  every tensor Replicate()
    "batch"      q, k, v, out, grads: Shard(batch dim of the format); lse (B, H, Sq): Shard(0)
                 (dense formats only: thd tokens cannot be split without per-sequence offsets)
    "heads"      q, k, v, out, grads: Shard(head dim); lse: Shard(1) dense / Shard(0) thd (H, T)

with no communication, forward and backward. The other arguments follow the kind:
cu_seqlens and the score_mod's float values are Replicate; a score_mod tensor parameter is
sharded on its b / h axis when that axis is the sharded one and has size > 1 (a bias
(B|1, H|1, Sq, Skv) follows the batch / head sharding; size 1 broadcasts: Replicate); sinks (H,)
follow the heads. In the backward, the gradient of an input that was Replicate while the
kind splits the batch or heads (a broadcast bias, the sinks under batch sharding) is a per-shard
sum: Partial("sum").

A kind is not offered when the math cannot serve it: "batch" for thd; "heads" with GQA when
the mesh size does not divide both head counts; "batch" / "heads" when the score_mod reads the
index b / h arithmetically (each shard would see local indices) or is not a traced mod (its
index use is unknown).

The rules are registered with `DTensor._op_dispatcher.sharding_propagator.register_op_strategy`
— the op-strategy table DTensor dispatch and AutoParallel read (AutoParallel enumerates the
OpSpecs with their redistribute costs). `register()` is idempotent and runs when
`fused_attn.distributed` is imported. It also registers a strategy for
``aten._assert_async.msg`` (doc_packed_attn's asynchronous cu_seq check has none upstream): the
check runs on each shard's local value, no communication.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo, TupleStrategy
from torch.distributed.tensor._ops.utils import generate_redistribute_costs

from .. import ops as _ops
from ..mod_axes import index_uses, tensor_axes

__all__ = ["register", "KINDS", "format_dims", "allowed_kinds", "index_uses", "tensor_axes"]

KINDS = ("replicate", "batch", "heads")

#: (batch dim, head dim, sequence dim) of q/k/v/out in each format.
_DIMS = {"bshd": (0, 2, 1), "sbhd": (1, 2, 0), "bhsd": (0, 1, 2), "thd": (None, 1, 0)}


def format_dims(qkv_format: str) -> Tuple[Optional[int], int, int]:
    """(batch dim or None, head dim, sequence/token dim) of a q/k/v tensor in `qkv_format`."""
    return _DIMS[qkv_format]


def allowed_kinds(spec: Any, heads: int, kv_heads: int, n_shards: int = 1) -> Dict[str, Optional[str]]:
    """{kind: None if it can serve, else why not} for a spec (mesh-size independent reasons,
    plus GQA divisibility when `n_shards` > 1 shards split the heads)."""
    mod = spec.score_mod
    uses = index_uses(mod)
    axes = tensor_axes(mod)
    out: Dict[str, Optional[str]] = {"replicate": None, "batch": None, "heads": None}
    if spec.qkv_format == "thd":
        out["batch"] = ("packed thd tokens cannot be split by batch (cu_seqlens hold global offsets); shard the "
                        "heads, or split sequences with fused_attn.distributed.context_parallel_attention")
    for kind, index in (("batch", "b"), ("heads", "h")):
        if out[kind] is not None or mod is None:
            continue
        name = mod.name
        if uses is None or axes is None:
            out[kind] = (f"score_mod {name!r} is not a traced mod, so its use of the {index!r} index is unknown; "
                         "each shard would see local indices")
        elif index in uses:
            out[kind] = (f"score_mod {name!r} reads the index {index!r} arithmetically; each shard would see local "
                         f"indices (pass {index}-dependent values as a tensor parameter indexed by {index}, which is "
                         "sharded with the inputs)")
    if kv_heads != heads and n_shards > 1 and out["heads"] is None:
        if heads % n_shards or kv_heads % n_shards:
            out["heads"] = (f"GQA with {heads} query heads and {kv_heads} key/value heads cannot be split evenly "
                            f"over {n_shards} shards (both head counts must be multiples of it)")
    return out


# ----------------------------------------------------------------------------- placements


def _qkv_placement(kind: str, fmt: str):
    b, h, _ = format_dims(fmt)
    if kind == "batch":
        return Shard(b)
    if kind == "heads":
        return Shard(h)
    return Replicate()


def _lse_placement(kind: str, fmt: str, numel: int):
    if numel == 0 or kind == "replicate":
        return Replicate()
    if fmt == "thd":
        return Shard(0)  # (H, T); heads only
    return Shard(0) if kind == "batch" else Shard(1)  # (B, H, Sq)


def _saved_placement(kind: str, fmt: str, ndim: int):
    if ndim != 4 or kind == "replicate":  # the reference's empty tensor
        return Replicate()
    if fmt == "thd":
        return Shard(1)  # (B_bucket, H, S, 1); heads only
    return Shard(0) if kind == "batch" else Shard(1)  # cuDNN Stats (B, H, Sq, 1)


def _param_placement(kind: str, axes: Optional[tuple], shape: Sequence[int]):
    """A score_mod tensor parameter indexed by `axes`: Shard on the sharded axis when it has size > 1."""
    if kind == "replicate" or axes is None:
        return Replicate()
    index = "b" if kind == "batch" else "h"
    if index in axes:
        d = axes.index(index)
        if shape[d] > 1:
            return Shard(d)
    return Replicate()


# ----------------------------------------------------------------------------- strategies


def _shape(strategy: OpStrategy) -> Tuple[int, ...]:
    return tuple(strategy.strategies[0].output_spec.tensor_meta.shape)


def _meta(strategy: OpStrategy):
    return strategy.strategies[0].output_spec.tensor_meta


def _mesh_kinds(spec: Any, mesh: Any, q_shape: tuple, k_shape: tuple) -> List[tuple]:
    """Every assignment of a kind to each mesh dimension the math can serve."""
    fmt = spec.qkv_format
    _, hd, _ = format_dims(fmt)
    heads, kv_heads = q_shape[hd], k_shape[hd]
    reasons = allowed_kinds(spec, heads, kv_heads)
    kinds = [k for k in KINDS if reasons[k] is None]
    combos = []
    for combo in itertools.product(kinds, repeat=mesh.ndim):
        n_heads = 1
        for kind, size in zip(combo, mesh.shape):
            if kind == "heads":
                n_heads *= size
        if n_heads > 1 and kv_heads != heads and (heads % n_heads or kv_heads % n_heads):
            continue
        combos.append(combo)
    return combos


class _Role:
    """What a tensor argument is, to place it per kind (and its gradient)."""

    __slots__ = ("name", "strategy", "axes")

    def __init__(self, name: str, strategy: Any, axes: Optional[tuple] = None) -> None:
        self.name, self.strategy, self.axes = name, strategy, axes


def _place(role: _Role, kind: str, fmt: str):
    shape = _shape(role.strategy)
    if role.name in ("query", "key", "value", "out", "grad_out"):
        return _qkv_placement(kind, fmt)
    if role.name == "saved":
        return _saved_placement(kind, fmt, len(shape))
    if role.name == "sinks":
        return Shard(0) if kind == "heads" else Replicate()
    if role.name.startswith("mod:"):
        return _param_placement(kind, role.axes, shape)
    return Replicate()  # cu_seqlens, the score_mod's float values


def _grad_of(role: _Role, kind: str, fmt: str):
    placement = _place(role, kind, fmt)
    if kind != "replicate" and isinstance(placement, Replicate) and role.name not in ("query", "key", "value"):
        return Partial("sum")
    return placement


def _tensor_list(arg: Any) -> list:
    """The score_mod tensors argument as a list (DTensor wraps a list of DTensors in a TupleStrategy)."""
    if isinstance(arg, TupleStrategy):
        return list(arg.children)
    return list(arg or ())


def _roles(spec: Any, names: Sequence[str], args: Sequence[Any]) -> List[_Role]:
    """Roles of the DTensor arguments, in DTensor's flattened argument order."""
    axes = tensor_axes(spec.score_mod) or {}
    mod_names = list(spec.score_mod.tensors()) if spec.score_mod is not None else []
    roles = []
    for name, arg in zip(names, args):
        if isinstance(arg, OpStrategy):
            roles.append(_Role(name, arg))
        elif name == "score_mod_tensors":
            for i, t in enumerate(_tensor_list(arg)):
                if isinstance(t, OpStrategy):
                    pname = mod_names[i] if i < len(mod_names) else f"#{i}"
                    roles.append(_Role("mod:" + pname, t, axes.get(pname)))
    return roles


def _op_spec(mesh: Any, combo: tuple, roles: List[_Role], fmt: str, outputs: List[list]) -> OpSpec:
    """One OpSpec: `outputs` holds, per output, its placement on each mesh dim."""
    input_specs, costs = [], []
    for role in roles:
        placements = tuple(_place(role, kind, fmt) for kind in combo)
        dst = DTensorSpec(mesh, placements, tensor_meta=_meta(role.strategy))
        input_specs.append(dst)
        costs.append(generate_redistribute_costs(role.strategy, dst))
    out_specs = tuple(DTensorSpec(mesh, tuple(p)) for p in outputs)
    return OpSpec(output_specs=out_specs, input_specs=input_specs, redistribute_cost=costs)


_FWD_ARGS = ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
             "max_seqlen_q", "max_seqlen_kv", "sinks", "score_mod_scalars", "score_mod_tensors", "dropout_rng",
             "spec_key")
_BWD_ARGS = ("grad_out", "query", "key", "value", "out", "saved", "cu_seqlens_q", "cu_seqlens_kv",
             "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv", "sinks",
             "score_mod_scalars", "score_mod_tensors", "dropout_rng", "spec_key")


def attn_fwd_strategy(op_schema: OpSchema) -> OpStrategy:
    """OpStrategy of ``fused_attn::attn_fwd``: one OpSpec per servable kind assignment."""
    args = dict(zip(_FWD_ARGS, op_schema.args_schema))
    args.update(op_schema.kwargs_schema)
    spec = _ops.lookup_spec(args["spec_key"])
    mesh = op_schema.get_mesh_from_args(validate=False)
    fmt = spec.qkv_format
    roles = _roles(spec, _FWD_ARGS, [args.get(n) for n in _FWD_ARGS])
    q_shape, k_shape = _shape(args["query"]), _shape(args["key"])
    lse_numel = 1 if spec.return_lse else 0
    saved_ndim = 4 if spec.backend == "cudnn" else 1
    strategies = []
    for combo in _mesh_kinds(spec, mesh, q_shape, k_shape):
        outputs = [[_qkv_placement(k, fmt) for k in combo], [_lse_placement(k, fmt, lse_numel) for k in combo],
                   [_saved_placement(k, fmt, saved_ndim) for k in combo]]
        strategies.append(_op_spec(mesh, combo, roles, fmt, outputs))
    return OpStrategy(strategies)


def attn_bwd_strategy(op_schema: OpSchema) -> OpStrategy:
    """OpStrategy of ``fused_attn::attn_bwd``: [dq, dk, dv, *extra grads] placed like their inputs
    (Partial("sum") for a replicated input of a split computation)."""
    args = dict(zip(_BWD_ARGS, op_schema.args_schema))
    args.update(op_schema.kwargs_schema)
    spec = _ops.lookup_spec(args["spec_key"])
    mesh = op_schema.get_mesh_from_args(validate=False)
    fmt = spec.qkv_format
    tensor_list = _tensor_list(args.get("score_mod_tensors"))
    roles = _roles(spec, _BWD_ARGS, [args.get(n) for n in _BWD_ARGS])
    by_strategy = {id(r.strategy): r for r in roles}
    # The extra inputs whose gradients the op returns, in its order (score_mod tensors, sinks).
    extra = _ops._differentiated(spec, tensor_list, args.get("sinks"))
    q_shape, k_shape = _shape(args["query"]), _shape(args["key"])
    strategies = []
    for combo in _mesh_kinds(spec, mesh, q_shape, k_shape):
        outputs = [[_qkv_placement(k, fmt) for k in combo] for _ in range(3)]
        for t in extra:
            role = by_strategy.get(id(t))
            outputs.append([Replicate() if role is None else _grad_of(role, k, fmt) for k in combo])
        strategies.append(_op_spec(mesh, combo, roles, fmt, outputs))
    return OpStrategy(strategies)


def assert_async_strategy(op_schema: OpSchema) -> OpStrategy:
    """``aten._assert_async.msg``: check each shard's local value where that is the global
    check (Replicate, Shard, or a Partial of an and-like reduction); otherwise replicate first."""
    src = op_schema.args_schema[0]
    mesh = src.mesh
    out = []
    for strat in src.strategies:
        placements = strat.output_spec.placements
        if all(not isinstance(p, Partial) or p.reduce_op in ("min", "product") for p in placements):
            dst = DTensorSpec(mesh, placements, tensor_meta=strat.output_spec.tensor_meta)
            out.append(OpSpec(output_specs=None, input_specs=[dst],
                              redistribute_cost=[generate_redistribute_costs(src, dst)]))
    replicate = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=src.strategies[0].output_spec.tensor_meta)
    out.append(OpSpec(output_specs=None, input_specs=[replicate],
                      redistribute_cost=[generate_redistribute_costs(src, replicate)]))
    return OpStrategy(out)


_REGISTERED: List[bool] = []


def register() -> None:
    """Register the strategies (idempotent). max_seqlen_q (argument 7 of attn_fwd, 10 of
    attn_bwd) onwards, the spec key included, are static: the strategy is cached per spec."""
    if _REGISTERED:
        return
    prop = DTensor._op_dispatcher.sharding_propagator
    prop.register_op_strategy(torch.ops.fused_attn.attn_fwd.default, attn_fwd_strategy,
                              RuntimeSchemaInfo(static_argnum=7, needs_pytree=True))
    prop.register_op_strategy(torch.ops.fused_attn.attn_bwd.default, attn_bwd_strategy,
                              RuntimeSchemaInfo(static_argnum=10, needs_pytree=True))
    assert_op = torch.ops.aten._assert_async.msg
    if assert_op not in prop.op_strategy_funcs:
        prop.register_op_strategy(assert_op, assert_async_strategy, RuntimeSchemaInfo(static_argnum=1))
    _REGISTERED.append(True)
