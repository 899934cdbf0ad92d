"""The cuDNN backend: every AttentionProblem option through cuDNN frontend SDPA graphs.

Protocol (see fused_attn.backends): can_serve, forward, backward, attention, plus saved_like
for torch.compile. `saved` is the fp32 Stats tensor the forward graph wrote: (B, H, Sq, 1) for
dense problems, (B_bucket, H, S_bucket, 1) for thd; the backward graph reads it as is.

Copies: none on the hot path. Only a dense input whose last dim is not contiguous
(stride != 1), a packed input that is not contiguous (T, H, D), or a grad_out whose strides
differ from the output's is copied, as cuDNN needs those layouts.
The frontend (`cudnn`) is imported only when a graph is built or run.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Tuple

import torch

from ...cache import GRAPH_CACHE, GraphKey
from ...problem import AttentionProblem
from . import runtime, varlen, version
from .graphs import CompiledGraph, build, cudnn_band, dense_strides_like, grad_strides, thd_strides

__all__ = ["can_serve", "forward", "backward", "attention", "saved_like", "lse_from_saved"]

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_MAX_HEAD_DIM = 256
_KEY_MEMO: Dict[tuple, GraphKey] = {}
_KEY_MEMO_LIMIT = 4096
_LEN_SCALARS: Dict[int, torch.Tensor] = {}


def can_serve(problem: AttentionProblem) -> Optional[str]:
    """None if cuDNN can run `problem`, else the reason (a score_mod without a cuDNN backward
    is reported by `backward`, when gradients are actually needed)."""
    q, k, v = problem.query, problem.key, problem.value
    if q.device.type != "cuda" or k.device.type != "cuda" or v.device.type != "cuda":
        return f"the cuDNN backend needs CUDA tensors, got query on {q.device}, key on {k.device}, value on {v.device}"
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"the cuDNN backend takes float16 or bfloat16 query/key/value, got {q.dtype}, {k.dtype}, {v.dtype}"
    for name, dim in (("query/key", q.shape[-1]), ("value", v.shape[-1])):
        if dim % 8 != 0 or dim > _MAX_HEAD_DIM:
            return f"the cuDNN backend needs a {name} head dim that is a multiple of 8 and <= {_MAX_HEAD_DIM}, got {dim}"
    band = problem.band
    if (band is not None and band.bottom_right and not problem.is_packed and problem.seqlens_q is not None
            and q.shape[2] > k.shape[2]):
        return (f"cuDNN's bottom-right band needs Sq <= Skv with padded batches, got Sq={q.shape[2]} > "
                f"Skv={k.shape[2]}")
    mod = problem.score_mod
    if (mod is not None and not mod.has_backward and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return (f"score_mod {mod.name!r} has no correct cuDNN backward and gradients are required "
                "(document masks: use fused_attn.doc_packed_attn or thd, which run them as sequences)")
    if mod is not None and mod.needs_host_lengths and problem.has_lengths:
        return (f"score_mod {mod.name!r} compares positions against per-sequence lengths "
                "(bottom-right alignment), which cuDNN computes wrongly on packed or padded batches")
    return version.unavailable_reason()


def _seq_buckets(problem: AttentionProblem) -> Tuple[int, int]:
    sq = varlen.bucket_seqlen(int(problem.max_seqlen_q))
    skv = varlen.bucket_seqlen(int(problem.max_seqlen_kv))
    if problem.band is not None and problem.band.bottom_right:
        # cuDNN's bottom-right band refuses max_s_q > max_s_kv: give both one bucket.
        sq = skv = max(sq, skv)
    return sq, skv


def saved_like(problem: AttentionProblem) -> torch.Tensor:
    """An empty tensor shaped like `saved` (works on fake tensors)."""
    q = problem.query
    if problem.is_packed:
        sq, _ = _seq_buckets(problem)
        shape = (varlen.bucket_batch(problem.batch_size), q.shape[1], sq, 1)
    else:
        shape = tuple(q.shape[:3]) + (1,)
    return q.new_empty(shape, dtype=torch.float32)


def lse_from_saved(problem: AttentionProblem, saved: torch.Tensor) -> Optional[torch.Tensor]:
    """Dense problems: `forward`'s lse is `saved` (B, H, Sq, 1) squeezed, a view; the custom op
    returns `saved` only and takes this view outside (op outputs may not alias). Packed: None
    (lse is gathered into a tensor of its own). Works on fake tensors."""
    return None if problem.is_packed else saved.squeeze(-1)


# ----------------------------------------------------------------------------- helpers


def _dense_view(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy in the rare case cuDNN cannot take its strides."""
    if t.stride(-1) != 1:
        return t.contiguous()
    return t


def _packed_view(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _len_scalar(n: int) -> torch.Tensor:
    t = _LEN_SCALARS.get(n)
    if t is None:
        t = _LEN_SCALARS[n] = torch.full((1, 1, 1, 1), float(n), dtype=torch.float32)
    return t


def _score_mod_operands(problem: AttentionProblem, sq: int, skv: int, lengths_in_graph: bool) -> Dict[str, torch.Tensor]:
    mod = problem.score_mod
    if mod is None:
        return {}
    operands = dict(mod.cudnn_operands())
    if mod.needs_host_lengths and not lengths_in_graph:
        # kv_len - q_len style folds: the engines get that arithmetic wrong in-graph.
        operands.update(mod.length_operands(sq, skv))
    if mod.uses_lengths and not lengths_in_graph:
        operands["q_len"], operands["kv_len"] = _len_scalar(sq), _len_scalar(skv)
    return operands


def _band(problem: AttentionProblem) -> Optional[tuple]:
    band = problem.band
    if band is None or (band.left is None and band.right is None):
        return None
    left, right = cudnn_band(band.left, band.right)
    return (left, right, bool(band.bottom_right))


def _graph_key(direction: str, problem: AttentionProblem, dims: tuple, strides: tuple, o_strides: tuple,
               padding: bool, operands: Dict[str, torch.Tensor], device_index: int) -> GraphKey:
    """The GraphKey, memoized on a cheap tuple of the same fields."""
    mod = problem.score_mod
    mod_key = None if mod is None else mod.cache_key
    if operands:
        from score_mods.base import describe_operands

        described = describe_operands(operands)
    else:
        described = ()
    raw = (direction, problem.query.dtype, dims, strides, o_strides, float(problem.scale), problem.band, padding,
           problem.is_packed, mod_key, described, bool(problem.deterministic), device_index)
    key = _KEY_MEMO.get(raw)
    if key is None:
        if len(_KEY_MEMO) >= _KEY_MEMO_LIMIT:
            _KEY_MEMO.clear()
        key = GraphKey(
            direction=direction, dtype=_DTYPES[problem.query.dtype], q_dims=dims[0], k_dims=dims[1],
            v_dims=dims[2], q_strides=strides[0], k_strides=strides[1], v_strides=strides[2],
            o_strides=o_strides, scale=float(problem.scale), band=_band(problem), padding=padding,
            ragged=problem.is_packed, score_mod=mod_key, operands=described,
            deterministic=bool(problem.deterministic), device_index=device_index,
            backend_version=version.check(),
        )
        _KEY_MEMO[raw] = key
    return key


def _compiled(key: GraphKey, problem: AttentionProblem, operands: Dict[str, torch.Tensor]) -> CompiledGraph:
    def builder() -> CompiledGraph:
        with torch.cuda.device(key.device_index):
            return build(key, problem.score_mod, operands, runtime.handle_for(key.device_index))

    return GRAPH_CACHE.get_or_build(key, builder)


def _run(compiled: CompiledGraph, bind: Dict[str, Any], device_index: int) -> None:
    runtime.execute(compiled, [bind[s] for s in compiled.slots], device_index)


def _ragged_bindings(compiled: CompiledGraph, thd: varlen.ThdBatch, bind: Dict[str, Any]) -> None:
    bind["seq_q"], bind["seq_kv"] = thd.seq_q, thd.seq_kv
    for slot in compiled.slots:
        if slot.startswith("roff_"):
            _, side, mult = slot.split("_")
            bind[slot] = thd.offsets(side, int(mult))


def _bind_dense_extras(bind: Dict[str, Any], problem: AttentionProblem, operands: Dict[str, torch.Tensor],
                       padding: bool) -> None:
    """Add the dense graphs' optional inputs to `bind`: padding lengths and score_mod operands."""
    if padding:
        b = problem.seqlens_q.shape[0]
        bind["seq_q"] = problem.seqlens_q.to(torch.int32).view(b, 1, 1, 1)
        bind["seq_kv"] = problem.seqlens_kv.to(torch.int32).view(b, 1, 1, 1)
    for name, t in operands.items():
        bind[f"sm:{name}"] = t


def _zero_past_lengths(t: torch.Tensor, lengths: torch.Tensor, value: float = 0.0) -> None:
    """In place: t (B, H, S, X) rows s >= lengths[b] set to `value`."""
    past = torch.arange(t.shape[2], device=t.device)[None, :] >= lengths.view(-1, 1)
    t.masked_fill_(past[:, None, :, None], value)


# ----------------------------------------------------------------------------- forward


def forward(problem: AttentionProblem) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """(out, lse, saved) without autograd; out in the query's layout with value's head dim."""
    reason = can_serve(problem)
    if reason is not None:
        raise NotImplementedError(f"backend='cudnn' cannot run this problem: {reason}; use backend='reference'")
    if problem.is_packed:
        return _forward_thd(problem)
    q, k, v = _dense_view(problem.query), _dense_view(problem.key), _dense_view(problem.value)
    dev = q.device.index
    b, h, sq, _ = q.shape
    skv, dv = k.shape[2], v.shape[3]
    o_shape = (b, h, sq, dv)
    o_strides = dense_strides_like(o_shape, q.stride())
    padding = problem.seqlens_q is not None
    operands = _score_mod_operands(problem, sq, skv, lengths_in_graph=padding)
    key = _graph_key("fwd", problem, (tuple(q.shape), tuple(k.shape), tuple(v.shape)),
                     (q.stride(), k.stride(), v.stride()), o_strides, padding, operands, dev)
    compiled = _compiled(key, problem, operands)
    out = torch.empty_strided(o_shape, o_strides, dtype=q.dtype, device=q.device)
    stats = torch.empty((b, h, sq, 1), dtype=torch.float32, device=q.device)
    bind: Dict[str, Any] = {"q": q, "k": k, "v": v, "o": out, "stats": stats}
    _bind_dense_extras(bind, problem, operands, padding)
    _run(compiled, bind, dev)
    if padding and problem.score_mod is not None:
        # Without cuDNN's padding mask (refused with a score_mod) rows past a length are not cleared.
        _zero_past_lengths(out, problem.seqlens_q)
        _zero_past_lengths(stats, problem.seqlens_q, float("-inf"))
    lse = stats.squeeze(-1) if problem.return_lse else None
    return out, lse, stats


def _thd_dims(problem: AttentionProblem, thd: varlen.ThdBatch, sq: int, skv: int) -> tuple:
    q, k, v = problem.query, problem.key, problem.value
    bb = thd.batch_bucket
    return ((bb, q.shape[1], sq, q.shape[2]), (bb, k.shape[1], skv, k.shape[2]), (bb, v.shape[1], skv, v.shape[2]))


def _thd_setup(problem: AttentionProblem, direction: str):
    q, k, v = _packed_view(problem.query), _packed_view(problem.key), _packed_view(problem.value)
    for name, t in (("query", q), ("key", k), ("value", v)):
        varlen.check_offset_range(name, t.shape[0], t.shape[1], t.shape[2])
    thd = varlen.prepare(problem)
    sq, skv = _seq_buckets(problem)
    dims = _thd_dims(problem, thd, sq, skv)
    strides = tuple(thd_strides(d) for d in dims)
    o_strides = thd_strides(dims[0][:3] + (dims[2][3],))
    operands = _score_mod_operands(problem, sq, skv, lengths_in_graph=True)
    key = _graph_key(direction, problem, dims, strides, o_strides, False, operands, q.device.index)
    compiled = _compiled(key, problem, operands)
    bind: Dict[str, Any] = {"q": q, "k": k, "v": v}
    for name, t in operands.items():
        bind[f"sm:{name}"] = t
    _ragged_bindings(compiled, thd, bind)
    return q, k, v, thd, dims, compiled, bind


def _forward_thd(problem: AttentionProblem):
    q, k, v, thd, dims, compiled, bind = _thd_setup(problem, "fwd")
    gaps = problem.cu_seqlens_q_padded is not None
    alloc = torch.zeros if gaps else torch.empty  # tokens between sequences stay 0
    out = alloc((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype, device=q.device)
    stats = torch.empty(dims[0][:3] + (1,), dtype=torch.float32, device=q.device)
    bind["o"], bind["stats"] = out, stats
    _run(compiled, bind, q.device.index)
    lse = varlen.gather_lse(stats, thd, q.shape[0]) if problem.return_lse else None
    return out, lse, stats


# ----------------------------------------------------------------------------- backward


def backward(problem: AttentionProblem, out: torch.Tensor, saved: torch.Tensor,
             grad_out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the saved Stats; no forward recompute. Layouts follow the inputs."""
    mod = problem.score_mod
    if mod is not None and not mod.has_backward:
        raise NotImplementedError(
            f"score_mod {mod.name!r} has no cuDNN backward (give it a bprop) or use backend='reference'")
    reason = can_serve(problem)
    if reason is not None:
        raise NotImplementedError(f"backend='cudnn' cannot run this problem: {reason}; use backend='reference'")
    if saved is None or saved.dtype != torch.float32 or saved.dim() != 4:
        raise ValueError(f"saved must be the fp32 (B, H, S, 1) Stats from cudnn forward, got {saved!r:.80}")
    if problem.is_packed:
        return _backward_thd(problem, out, saved, grad_out)
    q, k, v = _dense_view(problem.query), _dense_view(problem.key), _dense_view(problem.value)
    o = _dense_view(out)
    d_o = grad_out if grad_out.stride() == o.stride() else torch.empty_strided(
        o.shape, o.stride(), dtype=o.dtype, device=o.device).copy_(grad_out)
    dev = q.device.index
    b, _, sq, _ = q.shape
    padding = problem.seqlens_q is not None
    operands = _score_mod_operands(problem, sq, k.shape[2], lengths_in_graph=padding)
    key = _graph_key("bwd", problem, (tuple(q.shape), tuple(k.shape), tuple(v.shape)),
                     (q.stride(), k.stride(), v.stride()), o.stride(), padding, operands, dev)
    compiled = _compiled(key, problem, operands)
    grads = [torch.empty_strided(tuple(t.shape), s, dtype=t.dtype, device=t.device)
             for t, s in zip((q, k, v), grad_strides(key))]
    if padding:  # rows past a length get no gradient, whatever the kernel leaves there
        for g in grads:
            g.zero_()
    bind: Dict[str, Any] = {"q": q, "k": k, "v": v, "o": o, "dO": d_o, "stats": saved,
                            "dQ": grads[0], "dK": grads[1], "dV": grads[2]}
    _bind_dense_extras(bind, problem, operands, padding)
    _run(compiled, bind, dev)
    if padding and mod is not None:
        _zero_past_lengths(grads[0], problem.seqlens_q)
        _zero_past_lengths(grads[1], problem.seqlens_kv)
        _zero_past_lengths(grads[2], problem.seqlens_kv)
    return grads[0], grads[1], grads[2]


def _backward_thd(problem: AttentionProblem, out: torch.Tensor, saved: torch.Tensor, grad_out: torch.Tensor):
    q, k, v, thd, dims, compiled, bind = _thd_setup(problem, "bwd")
    o = _packed_view(out)
    d_o = _packed_view(grad_out)
    gaps = problem.cu_seqlens_q_padded is not None or problem.cu_seqlens_kv_padded is not None
    alloc = torch.zeros if gaps else torch.empty
    grads = [alloc(tuple(t.shape), dtype=t.dtype, device=t.device) for t in (q, k, v)]
    bind.update({"o": o, "dO": d_o, "stats": saved, "dQ": grads[0], "dK": grads[1], "dV": grads[2]})
    _run(compiled, bind, q.device.index)
    return grads[0], grads[1], grads[2]


def attention(problem: AttentionProblem) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Autograd-aware (out, lse): forward here, backward through `backward` with saved Stats."""
    from ...autograd import attention as _autograd_attention

    return _autograd_attention(sys.modules[__name__], problem)
