"""Head-parallel context parallelism (all-to-all, "Ulysses"): cp_comm="all_to_all".

Each rank holds a sequence shard of every head (the layouts of `cp_layout`). One all-to-all per
tensor turns that into the whole sequence of H/N heads:

    local (.., S/N, H, ..)  --all_to_all-->  (N, .., S/N, H/N, ..) rank-major  --to_global-->
    (.., S, H/N, ..) in global order

then each rank runs one ordinary attention call on its heads (every mask, every score_mod that
reads positions, packed thd batches: the call sees the global sequence, so nothing is offset),
and the output goes back the same way (the inverse all-to-all). The backward is the same
exchange run the other way (the transform's adjoint is its inverse): dO in, dQ / dK / dV out.

Communication per rank and step: q, k, v, out forward and dO, dq, dk, dv backward, each
(N-1)/N of the local tensor — independent of N, not overlapped with compute. Needs the query
heads and the key/value heads to be multiples of N. Score_mod tensor parameters indexed by `h`
(ALiBi slopes, a (B, H, S, S) bias) are cut to the local heads; their gradients (and those of
tensors not indexed by h) are summed over the group. Mods that read `h` arithmetically, or whose
index use is unknown (untraced callbacks), are refused: each rank would see local head indices.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .cp_faults import failure_note
from .cp_layout import DenseLayout, ThdLayout
from .sharding import format_dims, index_uses, tensor_axes

__all__ = ["heads_refusal", "heads_attention"]


def heads_refusal(heads: int, kv_heads: int, n: int, mod: Any) -> Optional[str]:
    """None when cp_comm="all_to_all" can serve these head counts and score_mod over n ranks, else why not."""
    if heads % n or kv_heads % n:
        return (f"cp_comm='all_to_all' splits the heads over the {n} ranks of the group: {heads} query heads and "
                f"{kv_heads} key/value heads must both be multiples of {n}")
    if mod is None:
        return None
    name = mod.name
    uses, axes = index_uses(mod), tensor_axes(mod)
    if uses is None or axes is None:
        return (f"score_mod {name!r} is not a traced mod, so its use of the head index is unknown; under "
                "cp_comm='all_to_all' each rank sees local head indices (use cp_comm='ring' or 'all_gather')")
    if "h" in uses:
        return (f"score_mod {name!r} reads the head index arithmetically; under cp_comm='all_to_all' each rank sees "
                "local head indices (pass head-dependent values as a tensor indexed by h, or use cp_comm='ring')")
    return None


class _SumOverGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group (a parameter every rank uses)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _local_mod(mod: Any, group: Any, rank: int, n: int, heads: int) -> Any:
    """The mod with its h-indexed tensor parameters cut to this rank's heads (gradients summed over the group)."""
    if mod is None:
        return None
    axes = tensor_axes(mod) or {}
    tensors = mod.tensors()
    bound = {}
    for name, t in tensors.items():
        if t.requires_grad:
            t = _SumOverGroup.apply(t, group)
        ax = axes.get(name) or ()
        if "h" in ax and t.shape[ax.index("h")] > 1:
            d = ax.index("h")
            if t.shape[d] != heads:
                raise ValueError(f"score_mod tensor {name!r} has {t.shape[d]} entries along its head axis, expected "
                                 f"{heads} (or 1)")
            t = t.narrow(d, rank * (heads // n), heads // n)
        if t is not tensors[name]:
            bound[name] = t
    return mod.bind(**bound) if bound else mod


class _Exchange:
    """One side's (query or key/value) layout and the all-to-all between sequence and head shards."""

    def __init__(self, lay: Any, group: Any, n: int, head_dim: int) -> None:
        self.lay, self.group, self.n, self.hd = lay, group, n, head_dim

    def to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """Local sequence shard, all heads -> the global sequence of this rank's heads."""
        parts = torch.stack(t.chunk(self.n, dim=self.hd))  # (N, *local with H/N heads), piece j for rank j
        got = torch.empty_like(parts)
        dist.all_to_all_single(got, parts, group=self.group)  # got[j]: rank j's sequence shard of my heads
        return self.lay.to_global(got)

    def to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_heads`: the global sequence of this rank's heads -> local shard, all heads."""
        parts = self.lay.to_rank_major(t).contiguous()  # (N, *local with H/N heads), piece j for rank j
        got = torch.empty_like(parts)
        dist.all_to_all_single(got, parts, group=self.group)  # got[j]: my sequence shard of rank j's heads
        return torch.cat(got.unbind(0), dim=self.hd)


class _Exchanged(torch.autograd.Function):
    """`ex.to_heads(t)` (to_heads=True) or `ex.to_sequence(t)`; the backward runs the other way."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, ex: _Exchange, to_heads: bool) -> torch.Tensor:
        ctx.ex, ctx.to_heads = ex, to_heads
        return ex.to_heads(t) if to_heads else ex.to_sequence(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ex = ctx.ex
        with failure_note("all_to_all", "backward", ex.lay.rank, ex.n):
            g = g.contiguous()
            return (ex.to_sequence(g) if ctx.to_heads else ex.to_heads(g)), None, None


def _exchanges(query: torch.Tensor, key: torch.Tensor, fmt: str, layout: str, group: Any, n: int, rank: int,
               varlen: Dict[str, Any]) -> Tuple[_Exchange, _Exchange]:
    _, hd, sd = format_dims(fmt)
    if fmt == "thd":
        mq, mk = int(varlen["max_seqlen_q"]), int(varlen["max_seqlen_kv"])
        cu_q, cu_kv = varlen["cu_seqlens_q"], varlen["cu_seqlens_kv"]
        lay_q = ThdLayout(layout, n, rank, cu_q, cu_q, mq, mq, query.shape[0], query.shape[0])
        lay_kv = ThdLayout(layout, n, rank, cu_kv, cu_kv, mk, mk, key.shape[0], key.shape[0])
        lay_q.check_values()
        lay_kv.check_values()
    else:
        lay_q = DenseLayout(fmt, layout, n, rank, query.shape[sd], query.shape[sd])
        lay_kv = DenseLayout(fmt, layout, n, rank, key.shape[sd], key.shape[sd])
    return _Exchange(lay_q, group, n, hd), _Exchange(lay_kv, group, n, hd)


def _lse_to_sequence(lse: torch.Tensor, ex: _Exchange, fmt: str) -> torch.Tensor:
    """(B, H/N, S) / (H/N, T) of the local heads -> (B, H, S/N) / (H, T/N) of the local sequence."""
    if fmt == "thd":
        as_tokens = lse.t().unsqueeze(-1).contiguous()  # (T, H/N, 1): a thd tensor
        lay = ex.lay
        return _Exchange(lay, ex.group, ex.n, 1).to_sequence(as_tokens).squeeze(-1).t()
    lay = ex.lay
    seq_lay = DenseLayout("bshd", lay.layout, lay.n, lay.rank, lay.unit["q"] * lay.m, lay.unit["q"] * lay.m)
    as_bshd = lse.transpose(1, 2).unsqueeze(-1).contiguous()  # (B, S, H/N, 1)
    return _Exchange(seq_lay, ex.group, ex.n, 2).to_sequence(as_bshd).squeeze(-1).transpose(1, 2)


def heads_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any, n: int, rank: int,
                    layout: str, mod: Any, kwargs: Dict[str, Any], varlen: Dict[str, Any], return_lse: bool):
    """The local output shard (and the local lse) of head-parallel attention; autograd through the exchanges.

    kwargs: validated dot_product_attention arguments without score_mod / lengths; varlen: the
    global cu_seqlens / max_seqlen (thd) or Nones; mod: the normalized score_mod or None."""
    from .. import functional

    fmt = kwargs.get("qkv_format", "bshd")
    _, hd, _ = format_dims(fmt)
    why = heads_refusal(query.shape[hd], key.shape[hd], n, mod)
    if why is not None:
        raise NotImplementedError(why)
    ex_q, ex_kv = _exchanges(query, key, fmt, layout, group, n, rank, varlen)
    q, k, v = (_Exchanged.apply(t, ex, True) for t, ex in ((query, ex_q), (key, ex_kv), (value, ex_kv)))
    call = dict(kwargs)
    call.update({k_: val for k_, val in varlen.items() if val is not None})
    call["score_mod"] = _local_mod(mod, group, rank, n, query.shape[hd])
    res = functional.dot_product_attention(q, k, v, return_lse=return_lse, **call)
    out, lse = res if return_lse else (res, None)
    out = _Exchanged.apply(out.contiguous(), ex_q, False)
    if not return_lse:
        return out
    return out, _lse_to_sequence(lse.detach().float(), ex_q, fmt)
