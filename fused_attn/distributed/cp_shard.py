"""Shard / unshard helpers for context parallelism, and its DTensor entry.

    local = shard_sequence(full, group, qkv_format="bshd")          # this rank's chunks (a copy)
    full = unshard_sequence(local, group, qkv_format="bshd")        # all-gather + global order

thd: pass the global cu_seqlens (B+1,) int32; each sequence is split into 2N chunks
(load_balanced) or N chunks (contiguous), so every length must be a multiple of that.
Without a process group (tests, data loaders that shard before the group exists) give
world_size= and rank= to `shard_sequence`.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .cp_layout import LAYOUTS, DenseLayout, ThdLayout, chunks_per_rank
from .sharding import format_dims

__all__ = ["shard_sequence", "unshard_sequence", "context_parallel_dtensor"]


def _group_shape(group: Any, world_size: Optional[int], rank: Optional[int]) -> Tuple[int, int]:
    if world_size is not None or rank is not None:
        if world_size is None or rank is None or not 0 <= rank < world_size:
            raise ValueError(f"give both world_size and rank with 0 <= rank < world_size, got {world_size}, {rank}")
        return world_size, rank
    group = dist.group.WORLD if group is None else group
    return dist.get_world_size(group), dist.get_rank(group)


def _layout(t: torch.Tensor, fmt: str, layout: str, n: int, rank: int, cu_seqlens: Optional[torch.Tensor],
            local_tokens: int):
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; accepted: {LAYOUTS}")
    if fmt == "thd":
        if not isinstance(cu_seqlens, torch.Tensor):
            raise ValueError("qkv_format='thd' needs cu_seqlens: the global (B+1,) int32 offsets")
        cu = cu_seqlens.to(t.device)
        lay = ThdLayout(layout, n, rank, cu, cu, int(cu.diff().max()) if cu.numel() > 1 else 0, 0, local_tokens,
                        local_tokens)
        lay.max["kv"] = lay.max["q"]
        lay.check_values()
        return lay
    if fmt not in ("bshd", "sbhd", "bhsd"):
        raise ValueError(f"qkv_format={fmt!r} is not supported; accepted: 'bshd', 'sbhd', 'bhsd', 'thd'")
    return DenseLayout(fmt, layout, n, rank, local_tokens, local_tokens)


def shard_sequence(t: torch.Tensor, cp_group: Any = None, *, layout: str = "load_balanced", qkv_format: str = "bshd",
                   cu_seqlens: Optional[torch.Tensor] = None, world_size: Optional[int] = None,
                   rank: Optional[int] = None) -> torch.Tensor:
    """This rank's shard of a full tensor (every rank holds `t`; no communication): the chunks
    `layout` assigns to it, concatenated along the sequence (per sequence for thd)."""
    n, r = _group_shape(cp_group, world_size, rank)
    seq = format_dims(qkv_format)[2] if qkv_format in ("bshd", "sbhd", "bhsd", "thd") else 1
    total = t.shape[seq]
    units = chunks_per_rank(layout) * n
    if qkv_format != "thd" and total % units:
        raise ValueError(f"a sequence of {total} tokens does not split into {units} equal chunks ({n} ranks, "
                         f"layout={layout!r}); pad it to a multiple of {units}")
    if total % n:
        raise ValueError(f"{total} tokens do not split over {n} ranks")
    lay = _layout(t, qkv_format, layout, n, r, cu_seqlens, total // n)
    if qkv_format == "thd":
        perm = torch.empty_like(lay._global_src).index_copy_(0, lay._global_src,
                                                             torch.arange(total, device=t.device))
        return t.index_select(0, perm[r * (total // n):(r + 1) * (total // n)])
    c = lay.unit["q"]
    return torch.cat([t.narrow(lay.sd, k * c, c) for k in lay.ids(r)], dim=lay.sd).contiguous()


def unshard_sequence(local: torch.Tensor, cp_group: Any = None, *, layout: str = "load_balanced",
                     qkv_format: str = "bshd", cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The full tensor from every rank's shard (an all-gather over `cp_group`), in global order."""
    group = dist.group.WORLD if cp_group is None else cp_group
    n, r = dist.get_world_size(group), dist.get_rank(group)
    seq = format_dims(qkv_format)[2] if qkv_format in ("bshd", "sbhd", "bhsd", "thd") else 1
    lay = _layout(local, qkv_format, layout, n, r, cu_seqlens, local.shape[seq])
    from .cp_ring import all_gather_stacked

    return lay.to_global(all_gather_stacked(local, group, n))


# ----------------------------------------------------------------------------- DTensor


def _cp_dims(t: DTensor, seq: int, fmt: str) -> Tuple[int, Dict[int, Any]]:
    """(the mesh dim sharding the sequence, {other mesh dim: placement})."""
    cp_dims = [d for d, p in enumerate(t.placements) if isinstance(p, Shard) and p.dim % t.ndim == seq]
    if len(cp_dims) != 1:
        raise ValueError(f"context parallelism with DTensors needs the sequence dim ({seq} for qkv_format={fmt!r}) "
                         f"sharded on exactly one mesh dim, got placements {t.placements}")
    return cp_dims[0], {d: p for d, p in enumerate(t.placements) if d != cp_dims[0]}


def context_parallel_dtensor(context_parallel_attention: Any, query: Any, key: Any, value: Any, cp_group: Any,
                             cp_comm: str, layout: str, return_lse: bool, overlap: bool, kwargs: Dict[str, Any]):
    """`context_parallel_attention` (passed in: it runs on the local shards) on DTensors: the
    sequence sharded on one mesh dim (whose process group is the CP group), the batch / heads
    possibly on others; returns DTensors."""
    from .dtensor import _kind_of

    fmt = kwargs.get("qkv_format", "bshd")
    b, h, s = format_dims(fmt)
    if not all(isinstance(t, DTensor) for t in (query, key, value)):
        raise TypeError("pass query, key and value all as DTensors (or all as plain local shards)")
    mesh = query.device_mesh
    if key.device_mesh != mesh or value.device_mesh != mesh:
        raise ValueError(f"query, key and value must share one device mesh, got {mesh}, {key.device_mesh}, "
                         f"{value.device_mesh}")
    cp_dim, others = _cp_dims(query, s, fmt)
    for name, t in (("key", key), ("value", value)):
        if tuple(t.placements) != tuple(query.placements):
            raise ValueError(f"query and {name} must have the same placements, got {query.placements} and "
                             f"{t.placements}")
    for d, p in others.items():
        _kind_of(p, fmt, "query", query)  # batch / heads / replicate, or a clear error
    group = mesh.get_group(cp_dim)
    units = chunks_per_rank(layout) * mesh.size(cp_dim) if layout in LAYOUTS else 1
    for name, t in (("query", query), ("key", key)):
        if fmt != "thd" and t.shape[s] % units:
            raise ValueError(f"{name} has a global sequence of {t.shape[s]} tokens, which does not split into {units} "
                             f"equal chunks over {mesh.size(cp_dim)} ranks with layout={layout!r} (DTensor would shard "
                             "it unevenly); pad the sequence to a multiple of that")
    if cp_group is not None and dist.get_world_size(cp_group) != dist.get_world_size(group):
        raise ValueError(f"cp_group has {dist.get_world_size(cp_group)} ranks but the sequence is sharded over mesh "
                         f"dim {cp_dim} of size {mesh.size(cp_dim)}")
    kw = dict(kwargs)
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        if isinstance(kw.get(name), DTensor):
            kw[name] = kw[name].full_tensor()
    res = context_parallel_attention(query.to_local(), key.to_local(), value.to_local(), cp_group or group, cp_comm,
                                     layout=layout, return_lse=True, cp_overlap=overlap, **kw)
    out, lse = res
    shape = tuple(query.shape[:-1]) + (value.shape[-1],)
    stride = torch.empty(shape, device="meta").stride()
    d_out = DTensor.from_local(out, mesh, query.placements, run_check=False, shape=shape, stride=stride)
    if not return_lse:
        return d_out
    lse_dims = {b: 0, h: 1, s: 2} if fmt != "thd" else {h: 0, s: 1}
    lse_pl = [Shard(lse_dims[p.dim % query.ndim]) if isinstance(p, Shard) else Replicate() for p in query.placements]
    gl = (shape[h], shape[s]) if fmt == "thd" else (shape[b], shape[h], shape[s])
    return d_out, DTensor.from_local(lse, mesh, lse_pl, run_check=False, shape=gl,
                                     stride=torch.empty(gl, device="meta").stride())
