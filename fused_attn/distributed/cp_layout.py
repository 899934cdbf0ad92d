"""Context-parallel layouts: which chunks of the sequence each rank holds, and views of them.

The global sequence (each sequence, for thd) is cut into U = m * N equal chunks for N ranks:

    "load_balanced" (m = 2, Transformer Engine's layout): rank r holds chunks r and 2N-1-r, so
                    with a causal mask every rank does the same work. N = 2, U = 4:
                        rank 0: chunks 0, 3      rank 1: chunks 1, 2
    "contiguous"    (m = 1): rank r holds chunk r (DTensor's Shard(seq) layout); causal work is
                    unbalanced (rank N-1 does N times the work of rank 0).

`plan_regions` cuts the (query chunks x key chunks) product of one step into the fewest
attention calls: each call is a contiguous block of local chunks whose chunk pairs are all
"full" (no mask), or form a causal square (a causal mask on the block), skipping blocks that
are entirely masked. Load-balanced causal gives one call per ring step:
same rank -> causal; src < r -> all queries x the first key chunk; src > r -> the second query
chunk x all keys (as in Transformer Engine).

`DenseLayout` (bshd, sbhd, bhsd: narrow views along the sequence dim, no copies) and
`ThdLayout` (packed: index gathers computed on the device without a host sync; each sequence's
length must be a multiple of U) give the tensors, lse rows and cu_seqlens of a block.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Tuple

import torch

from ..cache_registry import register_lru

__all__ = ["chunk_ids", "plan_regions", "Region", "DenseLayout", "ThdLayout", "LAYOUTS"]

LAYOUTS = ("load_balanced", "contiguous")


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "load_balanced" else 1


def chunk_ids(layout: str, n: int, rank: int) -> Tuple[int, ...]:
    """Global chunk ids rank `rank` of `n` holds, in local order."""
    return (rank, 2 * n - 1 - rank) if layout == "load_balanced" else (rank,)


def owner(layout: str, n: int, k: int) -> Tuple[int, int]:
    """(rank, local slot) holding global chunk k."""
    if layout == "load_balanced":
        return (k, 0) if k < n else (2 * n - 1 - k, 1)
    return k, 0


# ----------------------------------------------------------------------------- regions


class Region(tuple):
    """(i0, i1, j0, j1, mask): local query chunks [i0, i1) x local key chunks [j0, j1), mask
    "no_mask" or "causal" (top-left on the block)."""

    __slots__ = ()

    def __new__(cls, i0: int, i1: int, j0: int, j1: int, mask: str) -> "Region":
        return super().__new__(cls, (i0, i1, j0, j1, mask))

    i0 = property(lambda self: self[0])
    i1 = property(lambda self: self[1])
    j0 = property(lambda self: self[2])
    j1 = property(lambda self: self[3])
    mask = property(lambda self: self[4])


def _pair(a: int, b: int, causal: bool) -> str:
    if not causal or a > b:
        return "full"
    return "diag" if a == b else "skip"


def _consecutive(ids: Tuple[int, ...]) -> bool:
    return all(y == x + 1 for x, y in zip(ids, ids[1:]))


def _servable(q: Tuple[int, ...], kv: Tuple[int, ...], causal: bool, affine: bool) -> Optional[str]:
    """The mask serving the block q x kv ("skip" when nothing attends), or None."""
    types = [[_pair(a, b, causal) for b in kv] for a in q]
    flat = [t for row in types for t in row]
    if all(t == "skip" for t in flat):
        return "skip"
    if affine and not (_consecutive(q) and _consecutive(kv)):
        return None  # a position-dependent mod needs global positions affine in the local ones
    if all(t == "full" for t in flat):
        return "no_mask"
    if len(q) == len(kv) and all(types[i][j] == ("diag" if i == j else "full" if i > j else "skip")
                                 for i in range(len(q)) for j in range(len(kv))):
        return "causal"
    return None


@register_lru("distributed.plan_regions")
@functools.lru_cache(maxsize=256)
def plan_regions(q_ids: Tuple[int, ...], kv_ids: Tuple[int, ...], causal: bool, affine: bool) -> Tuple[Region, ...]:
    """The fewest blocks covering the attended pairs (see the module docstring). affine: every
    block's chunk ids must be consecutive (position-dependent score_mods)."""
    m, k = len(q_ids), len(kv_ids)
    whole = [(0, m, 0, k)]
    rows = [(i, i + 1, 0, k) for i in range(m)]
    cols = [(0, m, j, j + 1) for j in range(k)]
    pairs = [(i, i + 1, j, j + 1) for i in range(m) for j in range(k)]
    best = None
    for blocks in (whole, rows, cols, pairs):
        masks = [_servable(q_ids[i0:i1], kv_ids[j0:j1], causal, affine) for i0, i1, j0, j1 in blocks]
        if any(mk is None for mk in masks):
            continue
        regions = tuple(Region(*b, mk) for b, mk in zip(blocks, masks) if mk != "skip")
        if best is None or len(regions) < len(best):
            best = regions
        if len(best) <= 1:
            break
    return best


# ----------------------------------------------------------------------------- dense


_SEQ_DIM = {"bshd": 1, "sbhd": 0, "bhsd": 2}


class DenseLayout:
    """bshd / sbhd / bhsd shards: each local tensor holds m chunks along its sequence dim."""

    packed = False

    def __init__(self, fmt: str, layout: str, n: int, rank: int, local_q: int, local_kv: int) -> None:
        self.fmt, self.layout, self.n, self.rank = fmt, layout, n, rank
        self.m = chunks_per_rank(layout)
        self.total = self.m * n
        self.sd = _SEQ_DIM[fmt]
        for name, length in (("query", local_q), ("key/value", local_kv)):
            if length % self.m:
                raise ValueError(f"the local {name} shard has {length} tokens, not a multiple of the {self.m} chunks "
                                 f"per rank of layout={layout!r} (the global sequence must split into {self.total} "
                                 "equal chunks)")
        self.unit = {"q": local_q // self.m, "kv": local_kv // self.m}
        self.global_len = {"q": self.unit["q"] * self.total, "kv": self.unit["kv"] * self.total}

    def ids(self, rank: int) -> Tuple[int, ...]:
        return chunk_ids(self.layout, self.n, rank)

    def take(self, t: torch.Tensor, side: str, c0: int, c1: int) -> torch.Tensor:
        """Local chunks [c0, c1) of a q/k/v/out tensor (a view)."""
        u = self.unit[side]
        return t.narrow(self.sd, c0 * u, (c1 - c0) * u)

    def take_lse(self, lse: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
        u = self.unit["q"]
        return lse.narrow(2, c0 * u, (c1 - c0) * u)  # (B, H, Sq)

    def put(self, acc: torch.Tensor, side: str, c0: int, c1: int, value: torch.Tensor, add: bool) -> None:
        view = self.take(acc, side, c0, c1)
        view.add_(value) if add else view.copy_(value)

    def put_lse(self, acc: torch.Tensor, c0: int, c1: int, value: torch.Tensor) -> None:
        self.take_lse(acc, c0, c1).copy_(value)

    def lse_like_out(self, lse: torch.Tensor) -> torch.Tensor:
        """(B, H, S) -> broadcastable against the format's output (..., D)."""
        perm = {"bshd": (0, 2, 1), "sbhd": (2, 0, 1), "bhsd": (0, 1, 2)}[self.fmt]
        return lse.permute(perm).unsqueeze(-1)

    def call_kwargs(self, nq: int, nkv: int) -> Dict[str, Any]:
        """Length arguments of a call on nq local query chunks x nkv local key chunks."""
        return {}

    def global_kwargs(self, nq: int) -> Dict[str, Any]:
        """Length arguments of a call on nq local query chunks x every global key."""
        return {}

    def offsets(self, q_chunk: int, kv_chunk: int) -> Tuple[Any, Any, Any, Any, tuple]:
        """(q offset, kv offset, global q length, global kv length, max lengths) for a mod."""
        g = (self.global_len["q"], self.global_len["kv"])
        return q_chunk * self.unit["q"], kv_chunk * self.unit["kv"], g[0], g[1], g

    # all-gather ------------------------------------------------------------
    def to_global(self, gathered: torch.Tensor) -> torch.Tensor:
        """(N, *local) rank-major -> the global sequence order (one copy)."""
        parts = []
        for k in range(self.total):
            r, s = owner(self.layout, self.n, k)
            parts.append(gathered[r].narrow(self.sd, s * self.unit["kv"], self.unit["kv"]))
        return torch.cat(parts, dim=self.sd)

    def to_rank_major(self, g: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_global`: the global order -> (N, *local)."""
        u = self.unit["kv"]
        return torch.stack([torch.cat([g.narrow(self.sd, k * u, u) for k in self.ids(r)], dim=self.sd)
                            for r in range(self.n)])

    def prefix(self, kv_global: torch.Tensor, chunk: int) -> torch.Tensor:
        """Keys of global chunks [0, chunk] (a view)."""
        return kv_global.narrow(self.sd, 0, (chunk + 1) * self.unit["kv"])

    def prefix_kwargs(self, chunk: int) -> Dict[str, Any]:
        return {}

    def put_prefix(self, acc: torch.Tensor, chunk: int, value: torch.Tensor) -> None:
        self.prefix(acc, chunk).add_(value)


# ----------------------------------------------------------------------------- thd


def _seq_of(t: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Sequence index of each token position t given offsets cu (B+1,)."""
    return torch.searchsorted(cu[1:].contiguous(), t, right=True)


class ThdLayout:
    """Packed shards: each sequence b (global length L_b, a multiple of U) is cut into U chunks of
    u_b = L_b / U tokens; rank r holds its m chunks of every sequence, sequence after sequence.
    cu_q / cu_kv: the global (B+1,) int32 offsets; max_q / max_kv: global max lengths (ints)."""

    packed = True

    def __init__(self, layout: str, n: int, rank: int, cu_q: torch.Tensor, cu_kv: torch.Tensor, max_q: int,
                 max_kv: int, tokens_q: int, tokens_kv: int) -> None:
        self.fmt, self.layout, self.n, self.rank = "thd", layout, n, rank
        self.m = chunks_per_rank(layout)
        self.total = self.m * n
        self.cu = {"q": cu_q, "kv": cu_kv}
        self.max = {"q": max_q, "kv": max_kv}
        self.tokens = {"q": tokens_q, "kv": tokens_kv}
        self.same = cu_q is cu_kv
        self.device = cu_q.device
        self.cu64 = {s: c.to(torch.int64) for s, c in self.cu.items()}
        self.lens = {s: c[1:] - c[:-1] for s, c in self.cu64.items()}
        self.unit = {s: l // self.total for s, l in self.lens.items()}  # (B,) int64 chunk lengths
        self.cu_local = {s: c // n for s, c in self.cu64.items()}
        self._index: Dict[tuple, torch.Tensor] = {}
        self._cu: Dict[tuple, torch.Tensor] = {}

    def ids(self, rank: int) -> Tuple[int, ...]:
        return chunk_ids(self.layout, self.n, rank)

    def check_values(self) -> None:
        """Every length a multiple of U and the shards' token counts matching (CPU: ValueError;
        CUDA: an asynchronous device assertion)."""
        for s, name in (("q", "cu_seqlens_q"), ("kv", "cu_seqlens_kv")):
            lens, cu = self.lens[s], self.cu64[s]
            ok_div = (lens % self.total == 0).all()
            ok_tok = cu[-1] == self.tokens[s] * self.n
            ok_max = (lens <= self.max[s]).all()
            if self.device.type == "cpu":
                if not bool(ok_div):
                    raise ValueError(f"{name}: every sequence length must be a multiple of {self.total} (2 x cp size "
                                     f"for load_balanced, cp size for contiguous) to split per sequence, got lengths "
                                     f"{lens.tolist()}")
                if not bool(ok_tok):
                    raise ValueError(f"{name}[-1] = {int(cu[-1])} global tokens, but the local shard holds "
                                     f"{self.tokens[s]} tokens x {self.n} ranks")
                if not bool(ok_max):
                    raise ValueError(f"max_seqlen for {name} is {self.max[s]}, smaller than a sequence length "
                                     f"({int(lens.max())})")
            else:
                torch._assert_async(ok_div & ok_tok & ok_max,
                                    f"fused_attn context parallelism: {name} lengths must be multiples of "
                                    f"{self.total}, within max_seqlen, and total {self.n} x the local tokens")

    def index(self, side: str, c0: int, c1: int) -> torch.Tensor:
        """Local token positions of local chunks [c0, c1) of every sequence (device, no sync)."""
        key = (side, c0, c1)
        got = self._index.get(key)
        if got is None:
            tokens = self.tokens[side]
            t = torch.arange(tokens, device=self.device)
            cu = self.cu_local[side]
            b = _seq_of(t, cu)
            chunk = (t - cu[b]) // self.unit[side][b].clamp(min=1)
            keep = (chunk >= c0) & (chunk < c1)
            got = torch.nonzero_static(keep, size=tokens * (c1 - c0) // self.m).squeeze(1)
            self._index[key] = got
        return got

    def _whole(self, c0: int, c1: int) -> bool:
        return c0 == 0 and c1 == self.m

    def take(self, t: torch.Tensor, side: str, c0: int, c1: int) -> torch.Tensor:
        return t if self._whole(c0, c1) else t.index_select(0, self.index(side, c0, c1))

    def take_lse(self, lse: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
        return lse if self._whole(c0, c1) else lse.index_select(1, self.index("q", c0, c1))  # (H, T)

    def put(self, acc: torch.Tensor, side: str, c0: int, c1: int, value: torch.Tensor, add: bool) -> None:
        if self._whole(c0, c1):
            acc.add_(value) if add else acc.copy_(value)
        else:
            idx = self.index(side, c0, c1)
            acc.index_add_(0, idx, value) if add else acc.index_copy_(0, idx, value)

    def put_lse(self, acc: torch.Tensor, c0: int, c1: int, value: torch.Tensor) -> None:
        if self._whole(c0, c1):
            acc.copy_(value)
        else:
            acc.index_copy_(1, self.index("q", c0, c1), value)

    def lse_like_out(self, lse: torch.Tensor) -> torch.Tensor:
        return lse.t().unsqueeze(-1)  # (H, T) -> (T, H, 1)

    def _scaled_cu(self, side: str, chunks: int) -> torch.Tensor:
        key = (side, chunks)
        got = self._cu.get(key)
        if got is None:
            got = self._cu[key] = (self.cu64[side] * chunks // self.total).to(torch.int32)
        return got

    def call_kwargs(self, nq: int, nkv: int) -> Dict[str, Any]:
        cu_q, cu_kv = self._scaled_cu("q", nq), self._scaled_cu("kv", nkv)
        if self.same and nq == nkv:
            cu_kv = cu_q
        return dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=self.max["q"] * nq // self.total,
                    max_seqlen_kv=self.max["kv"] * nkv // self.total)

    def global_kwargs(self, nq: int) -> Dict[str, Any]:
        return dict(cu_seqlens_q=self._scaled_cu("q", nq), cu_seqlens_kv=self._scaled_cu("kv", self.total),
                    max_seqlen_q=self.max["q"] * nq // self.total, max_seqlen_kv=self.max["kv"])

    def offsets(self, q_chunk: int, kv_chunk: int) -> Tuple[Any, Any, Any, Any, tuple]:
        return (q_chunk * self.unit["q"], kv_chunk * self.unit["kv"], self.lens["q"], self.lens["kv"],
                (self.max["q"], self.max["kv"]))

    # all-gather ------------------------------------------------------------
    @functools.cached_property
    def _global_src(self) -> torch.Tensor:
        """For each global key token, its position in the rank-major gathered buffer."""
        tokens = self.tokens["kv"]
        t = torch.arange(tokens * self.n, device=self.device)
        cu, u = self.cu64["kv"], self.unit["kv"]
        b = _seq_of(t, cu)
        ub = u[b].clamp(min=1)
        p = t - cu[b]
        k = p // ub
        w = p - k * ub
        if self.layout == "load_balanced":
            first = k < self.n
            r = torch.where(first, k, 2 * self.n - 1 - k)
            slot = torch.where(first, torch.zeros_like(k), torch.ones_like(k))
        else:
            r, slot = k, torch.zeros_like(k)
        return r * tokens + self.cu_local["kv"][b] + slot * u[b] + w

    def to_global(self, gathered: torch.Tensor) -> torch.Tensor:
        flat = gathered.reshape((-1,) + tuple(gathered.shape[2:]))
        return flat.index_select(0, self._global_src)

    def to_rank_major(self, g: torch.Tensor) -> torch.Tensor:
        flat = torch.empty_like(g).index_copy_(0, self._global_src, g)
        return flat.view((self.n, self.tokens["kv"]) + tuple(g.shape[1:]))

    def prefix(self, kv_global: torch.Tensor, chunk: int) -> torch.Tensor:
        """Every global key: each sequence is cut to its chunks [0, chunk] by `prefix_kwargs`."""
        return kv_global

    def prefix_kwargs(self, chunk: int) -> Dict[str, Any]:
        """Padded offsets: sequence b's keys start at its global offset, (chunk + 1) u_b long."""
        return dict(cu_seqlens_kv=self._scaled_cu("kv", chunk + 1),
                    cu_seqlens_kv_padded=self._scaled_cu("kv", self.total),
                    max_seqlen_kv=self.max["kv"] * (chunk + 1) // self.total)

    def put_prefix(self, acc: torch.Tensor, chunk: int, value: torch.Tensor) -> None:
        """Add a prefix call's key gradients, keeping only the prefix tokens (a backend may leave the
        gaps between padded sequences unwritten)."""
        key = ("prefix", chunk)
        keep = self._index.get(key)
        if keep is None:
            t = torch.arange(self.tokens["kv"] * self.n, device=self.device)
            cu = self.cu64["kv"]
            b = _seq_of(t, cu)
            keep = self._index[key] = ((t - cu[b]) < (chunk + 1) * self.unit["kv"][b]).view(-1, 1, 1)
        acc.add_(torch.where(keep, value.to(acc.dtype), torch.zeros((), dtype=acc.dtype, device=acc.device)))
