"""DTensor inputs for the entry points: batch / head sharding with no communication.

    from fused_attn import distributed as fd
    q, k, v = (distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v))   # bshd, heads split
    out = fd.dot_product_attention(q, k, v, attn_mask_type="causal")          # DTensor, Shard(2)

`dot_product_attention`, `varlen_attn` (heads) and `module_forward(DotProductAttention, ...)` run
the custom ops ``fused_attn::attn_fwd`` / ``attn_bwd`` on the DTensors, so DTensor dispatch applies
the sharding rules of `fused_attn.distributed.sharding` (forward and backward: gradients come
back as DTensors placed like their inputs). `doc_packed_attn` (batch and heads) runs the local
computation on each shard (its op sees global packed offsets, see the module notes in
`__init__`). Plain tensors go straight to the core entry points.

Placements accepted, per mesh dimension, identical for query, key and value: Replicate(),
Shard(batch dim) (dense formats) or Shard(head dim). Errors (ValueError / NotImplementedError)
name what was passed: inputs on different meshes, a mix of DTensors and plain tensors,
different placements, a sharded sequence / token dim (that is context parallelism:
`context_parallel_attention` with a process group), a sharded head_dim, Partial inputs, GQA head
counts the mesh cannot split, a score_mod reading b / h arithmetically under that sharding, and
score_mod tensors / sinks / cu_seqlens placed inconsistently.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .. import functional as F
from .. import ops as _ops
from ..plan import NO_VARLEN, Varlen
from . import sharding as S

__all__ = ["dot_product_attention", "varlen_attn", "doc_packed_attn", "module_forward", "is_dtensor",
           "input_kinds", "run_ops"]


def is_dtensor(t: Any) -> bool:
    return isinstance(t, DTensor)


def _kind_of(p: Any, fmt: str, name: str, t: DTensor) -> str:
    """The kind a placement of q/k/v stands for (ValueError naming the tensor otherwise)."""
    b, h, s = S.format_dims(fmt)
    if isinstance(p, Replicate):
        return "replicate"
    if isinstance(p, Partial):
        raise ValueError(f"{name} is a Partial DTensor ({p}); attention needs its full values: redistribute it "
                         "to Replicate() or Shard() first")
    if isinstance(p, Shard):
        d = p.dim if p.dim >= 0 else p.dim + t.ndim
        if d == b:
            return "batch"
        if d == h:
            return "heads"
        if d == s:
            what = "token" if fmt == "thd" else "sequence"
            raise ValueError(
                f"{name} is sharded along its {what} dim (placement {p}, qkv_format={fmt!r}, global shape "
                f"{tuple(t.shape)}) with no context-parallel group: attention needs every key for each query. "
                "Use fused_attn.distributed.context_parallel_attention(q, k, v, cp_group=..., cp_comm='ring' | "
                "'all_gather') on the local shards, or shard the batch / heads instead")
        raise ValueError(f"{name} is sharded along its head_dim (placement {p}, shape {tuple(t.shape)}); only the "
                         "batch and head dims can be sharded")
    raise ValueError(f"{name} has an unsupported placement {p!r}")


def input_kinds(query: Any, key: Any, value: Any, fmt: str) -> Tuple[Any, tuple]:
    """(mesh, kind per mesh dim) of DTensor q/k/v; ValueError on mixed / mismatched inputs."""
    _check_meshes(query, key, value)
    mesh = query.device_mesh
    tensors = (("query", query), ("key", key), ("value", value))
    kinds = []
    for dim in range(mesh.ndim):
        got = [(_kind_of(t.placements[dim], fmt, n, t), n, t.placements[dim]) for n, t in tensors]
        if len({k for k, _, _ in got}) != 1:
            desc = ", ".join(f"{n} {p}" for _, n, p in got)
            raise ValueError(f"query, key and value must share their placement on mesh dim {dim} (qkv_format="
                             f"{fmt!r}), got {desc}")
        kinds.append(got[0][0])
    return mesh, tuple(kinds)


def _check_kinds(spec: Any, mesh: Any, kinds: tuple, heads: int, kv_heads: int) -> None:
    n_heads = 1
    for kind, size in zip(kinds, mesh.shape):
        if kind == "heads":
            n_heads *= size
    reasons = S.allowed_kinds(spec, heads, kv_heads, n_heads)
    for kind in set(kinds):
        why = reasons[kind]
        if why is not None:
            raise NotImplementedError(f"attention with its {kind} sharded ({spec.describe()}): {why}")


def _replicated(t: Optional[torch.Tensor], mesh: Any, name: str) -> Optional[DTensor]:
    """A plain tensor every rank holds whole (cu_seqlens, float values) as a Replicate DTensor,
    on its own device: the score_mod's float values stay a CPU tensor (pass-by-value scalars;
    `DTensor.from_local` would move them to the mesh's device and the op would read them back).
    Under torch.compile, from_local (traceable) is used."""
    if t is None:
        return None
    if is_dtensor(t):
        if t.device_mesh != mesh or any(not isinstance(p, Replicate) for p in t.placements):
            raise ValueError(f"{name} must be replicated on the inputs' mesh, got placements {t.placements} on "
                             f"{t.device_mesh}")
        return t
    placements = (Replicate(),) * mesh.ndim
    if torch.compiler.is_compiling():
        return DTensor.from_local(t, mesh, placements, run_check=False)
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))
    return DTensor(t, spec, requires_grad=False)


def _placed(t: torch.Tensor, mesh: Any, want: Sequence[Any], name: str) -> DTensor:
    """A score_mod tensor / sinks as a DTensor with the placements the sharding needs."""
    want = tuple(want)
    if is_dtensor(t):
        if t.device_mesh != mesh:
            raise ValueError(f"{name} is on another device mesh ({t.device_mesh}) than the inputs ({mesh})")
        if tuple(t.placements) != want:
            raise ValueError(f"{name} has placements {tuple(t.placements)} but the inputs' sharding needs {want} "
                             f"(global shape {tuple(t.shape)}): shard it like the inputs' batch / heads")
        return t
    if any(not isinstance(p, Replicate) for p in want):
        raise ValueError(f"{name} is a plain tensor of shape {tuple(t.shape)}, but the inputs are sharded along an "
                         f"axis it is indexed by: pass it as a DTensor with placements {want} (e.g. "
                         "distribute_tensor(t, mesh, placements)), or with size 1 on that axis")
    return DTensor.from_local(t, mesh, list(want), run_check=False)


@torch.compiler.assume_constant_result
def _param_axes(op_key: str) -> tuple:
    """((tensor parameter name, its index axes), ...) of a registered spec's score_mod (a
    constant under torch.compile)."""
    axes = S.tensor_axes(_ops.lookup_spec(op_key).score_mod) or {}
    return tuple(axes.items())


def _mod_tensors(op_key: str, mod: Any, mesh: Any, kinds: tuple) -> list:
    axes = dict(_param_axes(op_key))
    out = []
    for name, t in mod.tensors().items():
        want = [S._param_placement(k, axes.get(name), tuple(t.shape)) for k in kinds]
        out.append(_placed(t, mesh, want, f"score_mod tensor parameter {name!r}"))
    return out


def run_ops(op_key: str, mod: Any, query: DTensor, key: DTensor, value: DTensor, varlen: Varlen,
            sinks: Optional[torch.Tensor], kinds: tuple):
    """attn_fwd on DTensors, every auxiliary tensor made a DTensor of the placement the sharding
    needs: the DTensor twin of `ops.attention_by_key` (traceable: the hook for the compiled path).
    mod: the call's ScoreMod, or None / a plain function (the registered template's values)."""
    from score_mods.base import ScoreMod

    mesh = query.device_mesh
    if isinstance(mod, ScoreMod):
        scalars, tensors = _ops._scalars(mod), _mod_tensors(op_key, mod, mesh, kinds)
    else:
        scalars, tensors = torch.tensor(_ops._template_scalars(op_key), dtype=torch.float64), []
    cu_q = _replicated(varlen.cu_seqlens_q, mesh, "cu_seqlens_q")
    cu_kv = cu_q if varlen.cu_seqlens_kv is varlen.cu_seqlens_q else _replicated(varlen.cu_seqlens_kv, mesh,
                                                                                    "cu_seqlens_kv")
    cu_qp = _replicated(varlen.cu_seqlens_q_padded, mesh, "cu_seqlens_q_padded")
    cu_kvp = _replicated(varlen.cu_seqlens_kv_padded, mesh, "cu_seqlens_kv_padded")
    d_sinks = None if sinks is None else _placed(
        sinks, mesh, [Shard(0) if k == "heads" else Replicate() for k in kinds], "sinks")
    if _ops._dropout_p(op_key):
        raise NotImplementedError("dropout_p > 0 with DTensor inputs: every shard would draw the same dropout mask "
                                  "from one seed; run dropout-free attention or use plain tensors per rank")
    out, lse, _saved = _ops.attn_fwd(query, key, value, cu_q, cu_kv, cu_qp, cu_kvp, varlen.max_seqlen_q,
                                     varlen.max_seqlen_kv, d_sinks, _replicated(scalars, mesh, "score_mod values"),
                                     tensors, None, op_key)
    return out if not _ops._returns_lse(op_key) else (out, lse)


@torch.compiler.assume_constant_result
def _checked_kinds(op_key: str, placements: tuple, mesh_shape: tuple, shapes: tuple) -> tuple:
    """The kind of each mesh dim, validated against the registered spec (a constant under
    torch.compile; eager calls validate the same way)."""
    spec = _ops.lookup_spec(op_key)
    fmt = spec.qkv_format
    kinds = []
    for dim in range(len(mesh_shape)):
        got = [(_kind_of(pl[dim], fmt, n, _Shape(sh)), n, pl[dim])
               for n, pl, sh in zip(("query", "key", "value"), placements, shapes)]
        if len({k for k, _, _ in got}) != 1:
            desc = ", ".join(f"{n} {p}" for _, n, p in got)
            raise ValueError(f"query, key and value must share their placement on mesh dim {dim} (qkv_format="
                             f"{fmt!r}), got {desc}")
        kinds.append(got[0][0])
    _, hd, _ = S.format_dims(fmt)
    _check_kinds(spec, _MeshShape(mesh_shape), tuple(kinds), shapes[0][hd], shapes[1][hd])
    return tuple(kinds)


class _Shape:
    """What `_kind_of` reads of a tensor (its shape and rank), from a shape tuple."""

    def __init__(self, shape: tuple) -> None:
        self.shape, self.ndim = shape, len(shape)


class _MeshShape:
    def __init__(self, shape: tuple) -> None:
        self.shape = shape


def _check_meshes(query: Any, key: Any, value: Any) -> None:
    tensors = (("query", query), ("key", key), ("value", value))
    plain = [n for n, t in tensors if not is_dtensor(t)]
    if plain:
        dts = [n for n, t in tensors if is_dtensor(t)]
        what = "is a plain torch.Tensor" if len(plain) == 1 else "are plain tensors"
        others = "is a DTensor" if len(dts) == 1 else "are DTensors"
        raise TypeError(f"{' and '.join(plain)} {what} but {' and '.join(dts)} {others}: pass all three as DTensors "
                        "on one mesh (or all as plain tensors)")
    for name, t in tensors[1:]:
        if t.device_mesh != query.device_mesh:
            raise ValueError(f"query and {name} are on different device meshes ({query.device_mesh} vs "
                             f"{t.device_mesh}); attention needs one mesh")


def dtensor_call(resolver: Any, config: tuple, score_mod: Any, query: DTensor, key: DTensor, value: DTensor,
                 varlen: Varlen, sinks: Optional[torch.Tensor]):
    """The DTensor twin of `functional.run_call` (eager and under torch.compile): the hook the
    core entry points can call when they receive DTensors."""
    _check_meshes(query, key, value)
    op_key = _ops.call_key(resolver, config, score_mod, query, value)
    kinds = _checked_kinds(op_key, tuple(tuple(t.placements) for t in (query, key, value)),
                           tuple(query.device_mesh.size(i) for i in range(query.device_mesh.ndim)),
                           tuple(tuple(t.shape) for t in (query, key, value)))
    if varlen.cu_seqlens_q is not None and (varlen.max_seqlen_q is None or varlen.max_seqlen_kv is None):
        raise ValueError("DTensor thd calls need max_seqlen_q and max_seqlen_kv (deriving them reads cu_seqlens on "
                         "the host)")
    mod = score_mod if torch.compiler.is_compiling() else resolver(config, score_mod)[1]
    return run_ops(op_key, mod, query, key, value, varlen, sinks, kinds)


def dot_product_attention(query: Any, key: Any, value: Any, *, qkv_format: str = "bshd",
                          attn_mask_type: str = "no_mask", window_size: Optional[Tuple[int, int]] = None,
                          softmax_scale: Optional[float] = None, score_mod: Any = None,
                          score_mod_tensors: Optional[dict] = None, score_mod_bprop: Any = None,
                          score_mod_bprop_tensors: Optional[dict] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
                          cu_seqlens_kv: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                          max_seqlen_kv: Optional[int] = None, cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                          cu_seqlens_kv_padded: Optional[torch.Tensor] = None, return_lse: bool = False,
                          backend: str = "auto", deterministic: bool = False, softmax_type: str = "vanilla",
                          sinks: Optional[torch.Tensor] = None, dropout_p: float = 0.0):
    """`fused_attn.dot_product_attention` accepting DTensors sharded by batch and / or heads
    (same arguments).

    Returns a DTensor placed like the query (lse with return_lse=True: (B, H, Sq) sharded on
    dim 0 / 1, or (H, T) on dim 0 for thd). Differentiable; the backward runs ``attn_bwd`` on
    the shards. Works eagerly and under torch.compile(fullgraph=True). Plain tensors: the core."""
    config = (qkv_format, attn_mask_type, window_size, softmax_scale, score_mod_tensors, score_mod_bprop,
              score_mod_bprop_tensors, return_lse, backend, deterministic, softmax_type, dropout_p)
    varlen = Varlen(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q,
                    max_seqlen_kv)
    if not any(is_dtensor(t) for t in (query, key, value)):
        return F.run_call(F._resolve_call, config, score_mod, query, key, value,
                          NO_VARLEN if varlen == NO_VARLEN else varlen, sinks)
    return dtensor_call(F._resolve_call, config, score_mod, query, key, value, varlen, sinks)


def varlen_attn(query: Any, key: Any, value: Any, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: int,
                max_k: int, *, return_aux: Any = None, scale: Optional[float] = None,
                window_size: Tuple[int, int] = (-1, -1), enable_gqa: bool = False, score_mod: Any = None):
    """`fused_attn.varlen_attn` accepting (T, H, D) DTensors sharded by heads (Shard(1));
    cu_seq_q / cu_seq_k plain (every rank holds the whole table) or Replicate DTensors."""
    from .. import varlen as VL

    if not any(is_dtensor(t) for t in (query, key, value)):
        return VL.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux,
                              scale=scale, window_size=window_size, enable_gqa=enable_gqa, score_mod=score_mod)
    VL._check_heads(query, key, value, enable_gqa)
    max_q, max_k = VL._check_max("max_q", max_q), VL._check_max("max_k", max_k)
    left, right = VL._check_window(window_size)
    want_lse = bool(return_aux is not None and return_aux.lse)
    config = (left, right, cu_seq_q is cu_seq_k, scale, want_lse)
    varlen = Varlen(cu_seq_q, cu_seq_k, None, None, max_q, max_k)
    return dtensor_call(VL._resolve, config, score_mod, query, key, value, varlen, None)


def module_forward(module: Any, query: Any, key: Any, value: Any, **overrides: Any):
    """``module(query, key, value, **overrides)`` for a `DotProductAttention`, accepting DTensors."""
    if not any(is_dtensor(t) for t in (query, key, value)):
        return module(query, key, value, **overrides)
    from ..module import _CALL_KWARGS, _CONFIG_ORDER, _SPEC_KWARGS, _VARLEN

    unknown = sorted(set(overrides) - _CALL_KWARGS)
    if unknown:
        raise TypeError(f"DotProductAttention.forward got unexpected keyword(s) {unknown}")
    eval_spec, train_spec, mod = module._specs
    spec = train_spec if module.training else eval_spec
    varlen = Varlen(*(overrides.get(n) for n in _VARLEN)) if any(n in overrides for n in _VARLEN) else NO_VARLEN
    cfg = dict(qkv_format=module.qkv_format, attn_mask_type=module.attn_mask_type, window_size=module.window_size,
               softmax_scale=module.softmax_scale, score_mod_tensors=None, score_mod_bprop=None,
               score_mod_bprop_tensors=None, return_lse=False, backend=module.backend,
               deterministic=module.deterministic, softmax_type=module.softmax_type, dropout_p=spec.dropout_p)
    cfg.update((n, overrides[n]) for n in _SPEC_KWARGS if n in overrides and n != "score_mod")
    module._check_config(query, key, value, cfg["qkv_format"])
    score_mod = overrides.get("score_mod", module._call_mod)
    return dtensor_call(F._resolve_call, tuple(cfg[n] for n in _CONFIG_ORDER), score_mod, query, key, value, varlen,
                        module.sinks)


# ----------------------------------------------------------------------------- doc_packed (local)


def doc_packed_attn(query: Any, key: Any, value: Any, cu_seq: Any, **kwargs: Any):
    """`fused_attn.doc_packed_attn` accepting (B, S, H, D) DTensors sharded by batch (Shard(0))
    and / or heads (Shard(2)). cu_seq: the global (B, MAX_DOCS+1) table as a plain tensor every
    rank holds (each rank takes its rows, no communication) or a DTensor (Shard(0) where the
    batch is sharded). Each rank runs doc_packed_attn on its shard (autograd flows through
    DTensor.to_local / from_local); the result is a DTensor placed like the query."""
    from .. import doc_packed as DP

    if not any(is_dtensor(t) for t in (query, key, value)):
        return DP.doc_packed_attn(query, key, value, cu_seq, **kwargs)
    mesh, kinds = input_kinds(query, key, value, "bshd")
    probe = _ProbeSpec(kwargs.get("score_mod"))
    _check_kinds(probe, mesh, kinds, query.shape[2], key.shape[2])
    row_placements = [Shard(0) if k == "batch" else Replicate() for k in kinds]
    if is_dtensor(cu_seq):
        if cu_seq.device_mesh != mesh or tuple(cu_seq.placements) != tuple(row_placements):
            raise ValueError(f"cu_seq is a DTensor with placements {tuple(cu_seq.placements)}; with the inputs' "
                             f"sharding it must be {tuple(row_placements)} on the inputs' mesh")
        local_cu = cu_seq.to_local()
    elif isinstance(cu_seq, torch.Tensor):
        if cu_seq.dim() != 2 or cu_seq.shape[0] != query.shape[0]:
            raise ValueError(f"cu_seq must be the global (B, MAX_DOCS+1) table with B={query.shape[0]} rows, got "
                             f"shape {tuple(cu_seq.shape)}")
        local_cu = distribute_tensor(cu_seq, mesh, row_placements, src_data_rank=None).to_local()
    else:
        raise TypeError(f"cu_seq must be a (B, MAX_DOCS+1) int32 tensor or DTensor, got {type(cu_seq).__name__}")
    mod = kwargs.get("score_mod")
    if mod is not None and mod.tensors():
        axes = S.tensor_axes(mod) or {}
        local = {}
        for name, t in mod.tensors().items():
            want = [S._param_placement(k, axes.get(name), tuple(t.shape)) for k in kinds]
            local[name] = _placed(t, mesh, want, f"score_mod tensor parameter {name!r}").to_local()
        kwargs = dict(kwargs, score_mod=mod.bind(**local))
    out = DP.doc_packed_attn(query.to_local(), key.to_local(), value.to_local(), local_cu, **kwargs)
    shape = tuple(query.shape[:-1]) + (value.shape[-1],)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(out, mesh, query.placements, run_check=False, shape=shape, stride=stride)


class _ProbeSpec:
    """The few spec facts `allowed_kinds` reads, for doc_packed (bshd viewed as thd per row)."""

    qkv_format = "bshd"

    def __init__(self, score_mod: Any) -> None:
        from score_mods import as_score_mod

        self.score_mod = as_score_mod(score_mod)

    def describe(self) -> str:
        return f"doc_packed_attn, score_mod={None if self.score_mod is None else self.score_mod.name!r}"
