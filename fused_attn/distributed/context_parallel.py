"""Context parallelism: Q, K, V sharded along the sequence over a process group.

    from fused_attn.distributed import context_parallel_attention, shard_sequence
    q_local = shard_sequence(q, group)                 # this rank's chunks r and 2N-1-r
    out_local = context_parallel_attention(q_local, k_local, v_local, group, cp_comm="ring",
                                           attn_mask_type="causal")   # + dot_product_attention kwargs
    out_local.sum().backward()                         # the ring backward

Shapes: the local shards of `dot_product_attention`'s inputs: bshd (B, S/N, H, D), sbhd, bhsd,
or thd (T/N, H, D) with the *global* cu_seqlens_q / cu_seqlens_kv (B+1,) and global
max_seqlen_q / max_seqlen_kv (each sequence split into 2N chunks: every length a multiple of
2N, or of N with layout="contiguous"). Returns the local output shard (and the local fp32 lse
with return_lse=True: (B, H, S/N) or (H, T/N)), differentiable with respect to q, k, v and the
score_mod's floating tensor parameters (summed over the group).

cp_comm: "ring" (point-to-point K/V exchange overlapped with the compute) or "all_gather"
(see `cp_ring`). layout: "load_balanced" (default; rank r holds chunks r and 2N-1-r) or
"contiguous" (rank r holds chunk r: DTensor's Shard(seq)). DTensor inputs sharded along the
sequence on one mesh dim (and by batch / heads on others) are accepted: cp_group may then be
None (the mesh dim's group), and the result is a DTensor placed like the query.

Supported: attn_mask_type "no_mask" / "causal" ("causal_bottom_right" when Sq == Skv), GQA,
softmax_scale, deterministic, every backend; score_mods that do not read positions (softcap, ...)
on every backend; position-dependent score_mods (causal / ALiBi / windows / a bias as score_mods)
at global positions: traced ones on every backend for dense layouts (one cuDNN graph for every
block, offsets bound per call), every kind on the reference backend. Refused with
NotImplementedError: windows (window_size), sinks, dropout, padding masks, padded thd offsets,
and position-dependent score_mods of packed (thd) batches on cuDNN (their offsets differ per
sequence, which cuDNN's packed graphs read wrongly).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from score_mods.positions import at_positions
from score_mods.trace import TracedMod

from . import cp_ring
from .cp_layout import LAYOUTS, DenseLayout, ThdLayout
from .cp_mods import reads_positions

__all__ = ["context_parallel_attention", "ContextParallelAttention", "module_context_parallel", "CP_COMMS",
           "cp_config"]

CP_COMMS = ("ring", "all_gather")
_PASS = ("qkv_format", "softmax_scale", "score_mod", "score_mod_tensors", "score_mod_bprop", "score_mod_bprop_tensors",
         "backend", "deterministic")
#: arguments context parallelism refuses unless they have these values
_REFUSED = (("sinks", None), ("softmax_type", "vanilla"), ("dropout_p", 0.0), ("cu_seqlens_q_padded", None),
            ("cu_seqlens_kv_padded", None))


def _positions_refusal(mod: Any, fmt: str) -> Optional[str]:
    """Why a score_mod that reads positions cannot run on cuDNN under context parallelism, or None."""
    head = (f"score_mod {mod.name!r} reads positions (q_idx / kv_idx / lengths), so under context parallelism it "
            "needs global positions")
    if fmt == "thd":
        return (f"{head}, which differ per sequence in a packed (thd) batch; cuDNN reads per-sequence operands of "
                "packed graphs wrongly, so pass backend='reference' (or pad the batch and shard it as bshd)")
    if not isinstance(mod, TracedMod):
        return f"{head}; only traced score_mods get them on cuDNN (pass backend='reference')"
    why = at_positions(mod, 0, 0, 1, 1).cudnn_unsupported
    return None if why is None else f"{head}; {why}"


def _check_choice(arg: str, value: Any, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{arg}={value!r} is not supported; accepted: {', '.join(map(repr, choices))}")


def _causal(kwargs: Dict[str, Any], sq: int, skv: int) -> bool:
    mask = kwargs.pop("attn_mask_type", "no_mask")
    window = kwargs.pop("window_size", None)
    if window is not None and tuple(window) not in ((-1, -1), (-1, 0)):
        raise NotImplementedError(f"context parallelism does not support sliding windows, got window_size={window!r}")
    if window is not None and tuple(window) == (-1, 0) and mask == "no_mask":
        mask = "causal"
    if mask == "no_mask":
        return False
    if mask == "causal" or (mask == "causal_bottom_right" and sq == skv):
        if sq != skv:
            raise NotImplementedError(f"context parallelism with attn_mask_type='causal' needs equal query and key "
                                      f"lengths, got {sq} and {skv} tokens per shard")
        return True
    raise NotImplementedError(f"context parallelism supports attn_mask_type 'no_mask' and 'causal' "
                              f"('causal_bottom_right' with Sq == Skv), got {mask!r}")


def _grad_names(mod: Any) -> Tuple[str, ...]:
    """The mod's floating tensor parameters the reference differentiates (its order); none when
    no tensor requires grad (their gradients would be summed over the group for nothing)."""
    if mod is None:
        return ()
    specs = getattr(mod, "specs", None) or {}
    names = tuple(n for n, t in mod.tensors().items() if t.is_floating_point() and n in specs)
    return names if any(mod.tensors()[n].requires_grad for n in names) else ()


def cp_config(query: torch.Tensor, key: torch.Tensor, group: Any, cp_comm: str, layout: str, overlap: bool,
              kwargs: Dict[str, Any]) -> cp_ring.CPConfig:
    """Validate a context-parallel call and resolve what every block call shares."""
    _check_choice("cp_comm", cp_comm, CP_COMMS)
    _check_choice("layout", layout, LAYOUTS)
    kwargs = dict(kwargs)
    for name, default in _REFUSED:
        value = kwargs.pop(name, default)
        if value is not default and (default is None or value != default):
            shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(f"context parallelism does not support {name}={shown} (only {default!r})")
    fmt = kwargs.get("qkv_format", "bshd")
    _check_choice("qkv_format", fmt, ("bshd", "sbhd", "bhsd", "thd"))
    unknown = sorted(set(kwargs) - set(_PASS) - {"attn_mask_type", "window_size", "cu_seqlens_q", "cu_seqlens_kv",
                                                 "max_seqlen_q", "max_seqlen_kv"})
    if unknown:
        raise TypeError(f"context_parallel_attention got unexpected keyword(s) {unknown}")
    if group is None:
        group = dist.group.WORLD
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of cp_group")
    from score_mods import as_score_mod

    mod = as_score_mod(kwargs.get("score_mod"), tensors=kwargs.get("score_mod_tensors"),
                       bprop=kwargs.get("score_mod_bprop"), bprop_tensors=kwargs.get("score_mod_bprop_tensors"))
    affine = reads_positions(mod)
    backend = kwargs.get("backend", "auto")
    on_cudnn = backend == "cudnn" or (backend == "auto" and query.is_cuda)
    if affine:
        if on_cudnn:
            why = _positions_refusal(mod, fmt)
            if why is not None:
                raise NotImplementedError(why)
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith("score_mod")}
    varlen = {k: kwargs.pop(k, None) for k in ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv")}
    if fmt == "thd":
        lay = _thd_layout(query, key, varlen, layout, n, rank)
        sq, skv = lay.max["q"], lay.max["kv"]
    else:
        if any(v is not None for v in varlen.values()):
            raise ValueError(f"cu_seqlens / max_seqlen are only accepted with qkv_format='thd' under context "
                             f"parallelism, got qkv_format={fmt!r}")
        seq = {"bshd": 1, "sbhd": 0, "bhsd": 2}[fmt]
        lay = DenseLayout(fmt, layout, n, rank, query.shape[seq], key.shape[seq])
        sq, skv = query.shape[seq], key.shape[seq]
    causal = _causal(kwargs, sq, skv)
    names = _grad_names(mod)
    if names and on_cudnn:
        raise NotImplementedError("score_mod tensor parameters that require grad run on the reference backend under "
                                  "context parallelism (pass backend='reference')")
    return cp_ring.CPConfig(group=group, n=n, rank=rank, layout=lay, causal=causal, kwargs=kwargs, mod=mod,
                            affine=affine, overlap=overlap, grad_names=names)


def _thd_layout(query: torch.Tensor, key: torch.Tensor, varlen: Dict[str, Any], layout: str, n: int,
                rank: int) -> ThdLayout:
    cu_q, cu_kv = varlen["cu_seqlens_q"], varlen["cu_seqlens_kv"]
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.numel() < 2:
            raise ValueError(f"qkv_format='thd' under context parallelism needs {name}: the global (B+1,) int32 "
                             f"offsets, got {t if not isinstance(t, torch.Tensor) else tuple(t.shape)}")
        if t.device != query.device:
            raise ValueError(f"{name} must be on the query's device {query.device}, got {t.device}")
    if cu_q.numel() != cu_kv.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_kv must have the same size, got {cu_q.numel()} and "
                         f"{cu_kv.numel()}")
    mq, mk = varlen["max_seqlen_q"], varlen["max_seqlen_kv"]
    if mq is None or mk is None:  # the documented host read
        lens = torch.stack([cu_q, cu_kv]).diff(dim=1).amax(dim=1).tolist()
        mq, mk = (lens[0] if mq is None else mq), (lens[1] if mk is None else mk)
    lay = ThdLayout(layout, n, rank, cu_q, cu_kv, int(mq), int(mk), query.shape[0], key.shape[0])
    lay.check_values()
    return lay


class _ContextParallel(torch.autograd.Function):
    """apply(cp, comm, q, k, v, *mod tensors) -> (out, lse); the backward runs the engine's backward."""

    @staticmethod
    def forward(ctx, cp: cp_ring.CPConfig, comm: str, query, key, value, *extras):
        fwd = cp_ring.ring_forward if comm == "ring" else cp_ring.allgather_forward
        out, lse = fwd(cp, query, key, value)
        ctx.cp, ctx.comm = cp, comm
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mark_non_differentiable(lse)
        # no zero-filled gradient for lse (non-differentiable) per backward; None grad_out below
        ctx.set_materialize_grads(False)
        ctx.n_extras = len(extras)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        if grad_out is None:  # no gradient reached out: nothing to propagate
            return (None,) * (5 + ctx.n_extras)
        query, key, value, out, lse = ctx.saved_tensors
        cp = ctx.cp
        bwd = cp_ring.ring_backward if ctx.comm == "ring" else cp_ring.allgather_backward
        tensors = {n: cp.mod.tensors()[n] for n in cp.grad_names}
        dq, dk, dv, extra = bwd(cp, query, key, value, out, lse, grad_out, tensors)
        # cp, comm, query, key, value, *mod tensors
        return (None, None, dq, dk, dv, *extra)


@torch._dynamo.disable
def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp_group: Any = None,
                               cp_comm: str = "ring", *, layout: str = "load_balanced", return_lse: bool = False,
                               cp_overlap: bool = True, **kwargs: Any):
    """Attention over a sequence sharded across `cp_group` (see the module docstring).

    cp_overlap=False waits for each ring exchange before computing (to measure how much of the
    communication the overlap hides; results are identical)."""
    from .dtensor import is_dtensor

    if any(is_dtensor(t) for t in (query, key, value)):
        from .cp_shard import context_parallel_dtensor

        return context_parallel_dtensor(context_parallel_attention, query, key, value, cp_group, cp_comm, layout,
                                        return_lse, cp_overlap, kwargs)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    cp = cp_config(query, key, cp_group, cp_comm, layout, cp_overlap, kwargs)
    extras = [cp.mod.tensors()[n] for n in cp.grad_names]
    out, lse = _ContextParallel.apply(cp, cp_comm, query, key, value, *extras)
    return (out, lse) if return_lse else out


class ContextParallelAttention(nn.Module):
    """A `DotProductAttention` run with context parallelism: forward(q, k, v, **overrides) takes
    the local shards and returns the local output (see `context_parallel_attention`).

    The module's configuration (qkv_format, attn_mask_type, window_size, softmax_scale,
    score_mod, backend, deterministic) applies; per-call keywords override it. The logic lives
    in `context_parallel_attention`, so DotProductAttention may take cp_group / cp_comm itself."""

    def __init__(self, attention: nn.Module, cp_group: Any = None, cp_comm: str = "ring",
                 layout: str = "load_balanced") -> None:
        super().__init__()
        _check_choice("cp_comm", cp_comm, CP_COMMS)
        _check_choice("layout", layout, LAYOUTS)
        self.attention, self.cp_group, self.cp_comm, self.layout = attention, cp_group, cp_comm, layout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **overrides: Any):
        return module_context_parallel(self.attention, self.cp_group, self.cp_comm, self.layout, query, key, value,
                                       **overrides)

    def extra_repr(self) -> str:
        return f"cp_comm={self.cp_comm!r}, layout={self.layout!r}"


def module_context_parallel(attn: nn.Module, cp_group: Any, cp_comm: str, layout: str, query: torch.Tensor,
                            key: torch.Tensor, value: torch.Tensor, **overrides: Any):
    """`context_parallel_attention` with a `DotProductAttention`'s configuration (qkv_format,
    attn_mask_type, window_size, softmax_scale, score_mod, backend, deterministic); per-call
    keywords override it. Used by `ContextParallelAttention` and by `DotProductAttention(...,
    cp_group=...)`."""
    if attn.softmax_type != "vanilla":
        raise NotImplementedError(f"context parallelism does not support softmax_type={attn.softmax_type!r}")
    if attn.training and attn.attention_dropout:
        raise NotImplementedError("context parallelism does not support attention dropout")
    kwargs = dict(qkv_format=attn.qkv_format, attn_mask_type=attn.attn_mask_type, window_size=attn.window_size,
                  softmax_scale=attn.softmax_scale, score_mod=attn._call_mod, backend=attn.backend,
                  deterministic=attn.deterministic)
    kwargs.update(overrides)
    attn._check_config(query, key, value, kwargs["qkv_format"])
    return context_parallel_attention(query, key, value, cp_group, cp_comm, layout=layout, **kwargs)
