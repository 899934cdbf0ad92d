"""THD (packed) batches: bucketing, and the per-call device tensors a ragged graph binds.

A packed batch of B sequences runs on a graph built for (B_bucket, H, S_bucket, D):
B_bucket = next power of two >= B (extra sequences have length 0 and repeat the last offset),
S_bucket = next power of two >= max_seqlen, at least 128. So a training run with random lengths
builds a handful of graphs (the graph key never holds the token count or the exact max_seqlen).

Per call (`prepare`), from cu_seqlens and the padded offsets, with no host sync: seq_q / seq_kv
(B_bucket, 1, 1, 1) int32 lengths and the ragged element offsets (B_bucket + 1, 1, 1, 1) int32 =
token offset * (heads * head dim) for each multiplier the graph uses (heads alone for the
per-token Stats rows), plus the value checks as
one asynchronous device assertion. On CUDA without padded offsets one Triton kernel does it all
(`thd_kernel`); otherwise a few torch ops. Memoized per (tensor, version) so a step's backward
reuses its forward's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from ...memo import BoundedMemo
from ...length_checks import within
from . import thd_kernel

__all__ = ["bucket_batch", "bucket_seqlen", "ThdBatch", "ThdLayout", "prepare", "prepare_unchecked",
           "check_offset_range", "check_offset_ranges", "token_positions", "token_rows_of_empty_kv", "MIN_SEQ_BUCKET",
           "INVALID_CU_SEQLENS"]

MIN_SEQ_BUCKET = 128  # cuDNN's key tiles are 128 wide; 64 would be a key length 64 mod 128 (quirks.py: nan_dq_kv_64_mod_128)
_INT32_MAX = 2**31 - 1


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def bucket_batch(batch: int) -> int:
    """Graph batch size for `batch` sequences: the next power of two."""
    return _next_pow2(batch)


def bucket_seqlen(max_seqlen: int) -> int:
    """Graph sequence length for `max_seqlen`: the next power of two, at least MIN_SEQ_BUCKET."""
    return max(MIN_SEQ_BUCKET, _next_pow2(max_seqlen))


@dataclass
class ThdLayout:
    """Per-plan constants of the prep: the real batch, its bucket, the offset multipliers of
    the q side and kv side (heads * head dim of q/o and k/v; the q side also heads, for the
    per-token Stats rows), the gather index extending
    (B+1,) offsets to (B_bucket+1,), and whether q and kv share one cu_seqlens tensor."""

    batch: int
    batch_bucket: int
    q_mults: Tuple[int, ...]
    kv_mults: Tuple[int, ...]
    device: torch.device
    _index: Optional[torch.Tensor] = None
    _mult_tensors: Optional[Dict[str, torch.Tensor]] = None
    _kernel_recipes: Dict[bool, Any] = field(default_factory=dict, repr=False)

    def index(self) -> Optional[torch.Tensor]:
        if self.batch_bucket == self.batch:
            return None
        if self._index is None:
            self._index = torch.arange(self.batch_bucket + 1, device=self.device).clamp_(max=self.batch)
        return self._index

    def mults(self, side: str) -> torch.Tensor:
        if self._mult_tensors is None:
            self._mult_tensors = {
                s: torch.tensor(m, dtype=torch.int32, device=self.device).view(-1, 1)
                for s, m in (("q", self.q_mults), ("kv", self.kv_mults))}
        return self._mult_tensors[side]


@dataclass
class ThdBatch:
    """Device tensors of one packed batch: seq_q / seq_kv (B_bucket, 1, 1, 1) int32 lengths
    (0 for bucket padding), tok_q (B_bucket+1,) int32 token offsets of the queries, and the
    ragged element offsets by (side, multiplier)."""

    seq_q: torch.Tensor
    seq_kv: torch.Tensor
    tok_q: torch.Tensor
    offsets: Dict[Tuple[str, int], torch.Tensor]
    _within: Dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def kv_lengths_within(self, right: int) -> torch.Tensor:
        """min(seq_kv, seq_q + right): the keys a top-left band with right bound `right` can
        reach (computed once per batch and bound)."""
        t = self._within.get(right)
        if t is None:
            t = self._within[right] = torch.minimum(self.seq_kv, self.seq_q + right)
        return t


def check_offset_range(name: str, tokens: int, heads: int, dim: int) -> None:
    """Element offsets are int32: refuse packed tensors too large for them."""
    if tokens * heads * dim > _INT32_MAX:
        raise NotImplementedError(
            f"{name} has {tokens} tokens x {heads} heads x {dim} dims = {tokens * heads * dim} elements; "
            "cuDNN's int32 ragged offsets address at most 2**31 - 1: split the batch or use backend='reference'"
        )


def check_offset_ranges(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """`check_offset_range` of packed (T, H, D) query, key and value: three numel reads per call,
    the named refusal only when one is too large."""
    if q.numel() > _INT32_MAX or k.numel() > _INT32_MAX or v.numel() > _INT32_MAX:
        for name, t in (("query", q), ("key", k), ("value", v)):
            check_offset_range(name, t.shape[0], t.shape[1], t.shape[2])


_PREPARED = BoundedMemo(32, "cudnn.thd_prepare", max_bytes=64 << 20)


def _identity(t: Optional[torch.Tensor]) -> tuple:
    return (None, 0) if t is None else (id(t), t._version)


def prepare(layout: ThdLayout, varlen, tokens: Tuple[int, int], limits: Tuple[int, int]) -> ThdBatch:
    """The bound tensors of a packed call (see the module docstring); checks cu_seqlens values
    with one asynchronous device assertion (start 0, non-decreasing, end at the token count,
    padded slots hold their sequence, lengths <= max_seqlen). Memoized per (tensors, versions)."""
    cu_q, cu_kv, pad_q, pad_kv = sources = varlen[:4]
    if pad_q is None and pad_kv is None:  # the common case, without a generator over four sources
        key = (id(cu_q), cu_q._version, id(cu_kv), cu_kv._version, tokens, limits, layout.batch_bucket,
               layout.q_mults, layout.kv_mults)
    else:
        key = tuple(_identity(t) for t in sources) + (tokens, limits, layout.batch_bucket, layout.q_mults,
                                                      layout.kv_mults)
    thd = _PREPARED.get_identity(key, sources)
    if thd is None:
        thd = _prepare(layout, *sources, tokens, limits)
        _PREPARED.put_identity(key, sources, thd)
    return thd


INVALID_CU_SEQLENS = ("fused_attn: invalid cu_seqlens: each must start at 0, be non-decreasing, end at the token "
                      "count, give lengths <= max_seqlen, and padded offsets must hold each sequence")


def _prepare(layout: ThdLayout, cu_q, cu_kv, pad_q, pad_kv, tokens, limits) -> ThdBatch:
    if pad_q is None and pad_kv is None:  # the one-kernel form asserts in its own launch
        got = thd_kernel.prepare(layout, cu_q, cu_kv, tokens, limits, check=True)
        if got is not None:
            return ThdBatch(*got[:4])
    thd, ok = _prepare_ops(layout, cu_q, cu_kv, pad_q, pad_kv, tokens, limits)
    torch._assert_async(ok, INVALID_CU_SEQLENS)
    return thd


def prepare_unchecked(layout: ThdLayout, cu_q: torch.Tensor, cu_kv: torch.Tensor, pad_q: Optional[torch.Tensor],
                      pad_kv: Optional[torch.Tensor], tokens: Tuple[int, int], limits: Tuple[int, int],
                      one_kernel: bool = True) -> Tuple[ThdBatch, torch.Tensor]:
    """(the batch's bound tensors, ok): ok is a one-element tensor, nonzero iff every value
    check holds (rows start at 0, non-decreasing, end at the token counts, lengths <= limits,
    padded slots hold their sequence). One Triton kernel where it serves (`thd_kernel`), else
    torch ops; one_kernel=False forces the torch ops (the GPU test compares the two)."""
    if one_kernel and pad_q is None and pad_kv is None:
        got = thd_kernel.prepare(layout, cu_q, cu_kv, tokens, limits)
        if got is not None:
            seq_q, seq_kv, tok_q, offsets, ok = got
            return ThdBatch(seq_q, seq_kv, tok_q, offsets), ok
    return _prepare_ops(layout, cu_q, cu_kv, pad_q, pad_kv, tokens, limits)


def _prepare_ops(layout: ThdLayout, cu_q, cu_kv, pad_q, pad_kv, tokens, limits) -> Tuple[ThdBatch, torch.Tensor]:
    # Rows: lengths sources first, token-offset sources after (deduplicated by identity).
    rows = [cu_q] if cu_kv is cu_q else [cu_q, cu_kv]
    tok_rows = []
    for t in (pad_q, pad_kv):
        if t is not None:
            tok_rows.append(t)
    stacked = rows[0].unsqueeze(0) if len(rows) + len(tok_rows) == 1 else torch.stack(rows + tok_rows)
    idx = layout.index()
    ext = stacked if idx is None else stacked.index_select(1, idx)
    n = len(rows)
    shared_row = n == 1 and pad_q is None and pad_kv is None and tokens[0] == tokens[1]
    if shared_row:  # the lengths land in the buffer the value check reads (see _ok_shared)
        checked = torch.empty(ext.shape[1] + 3, dtype=ext.dtype, device=ext.device)
        lens = torch.sub(ext[0, 1:], ext[0, :-1], out=checked[:ext.shape[1] - 1]).unsqueeze(0)
    else:
        lens = ext[:, 1:] - ext[:, :-1]
    seq_q = lens[0].view(-1, 1, 1, 1)
    seq_kv = seq_q if n == 1 else lens[1].view(-1, 1, 1, 1)
    tok_q = ext[n] if pad_q is not None else ext[0]
    tok_kv = ext[n + (pad_q is not None)] if pad_kv is not None else ext[n - 1]
    offsets: Dict[Tuple[str, int], torch.Tensor] = {}
    shared_tokens = n == 1 and pad_q is None and pad_kv is None
    for side, tok, mults in (("q", tok_q, layout.q_mults), ("kv", tok_kv, layout.kv_mults)):
        if side == "kv" and shared_tokens and set(layout.kv_mults) <= set(layout.q_mults):
            offsets.update({("kv", m): offsets[("q", m)] for m in mults})
            continue
        prod = tok.unsqueeze(0) * layout.mults(side)
        for i, m in enumerate(mults):
            offsets[(side, m)] = prod[i].view(-1, 1, 1, 1)
    if shared_row:
        ok = _ok_shared(ext, checked, tokens[0], min(limits))
    else:
        ok = _ok_general(ext, lens, n, pad_q is not None, pad_kv is not None, tokens, limits)
    return ThdBatch(seq_q, seq_kv, tok_q, offsets), ok


_END_PATTERN = BoundedMemo(16, "cudnn.thd_end_pattern", max_bytes=16 << 20)


def _ok_general(ext: torch.Tensor, lens: torch.Tensor, n: int, has_pad_q: bool, has_pad_kv: bool,
                tokens: Tuple[int, int], limits: Tuple[int, int]) -> torch.Tensor:
    """Every value check as one device bool (no host sync, four kernels and a cat): rows start
    at 0, lengths in [0, limit] (padded slots: >= 0 and holding their sequence), the
    token-offset rows end at the token counts."""
    rows, buckets = lens.shape
    lo, hi = [], []
    for r in range(rows):
        if r < n:  # real lengths: q's row first; one shared row serves both limits
            limit = min(limits) if n == 1 else limits[r]
        else:
            limit = _INT32_MAX
        lo += [0] * buckets
        hi += [limit] * buckets
    lo += [0] * rows
    hi += [0] * rows
    end_q = n if has_pad_q else 0
    end_kv = n + has_pad_q if has_pad_kv else n - 1
    lo += [tokens[0], tokens[1]]
    hi += [tokens[0], tokens[1]]
    values = torch.cat([lens.reshape(-1), ext[:, 0], ext[end_q, -1:], ext[end_kv, -1:]])
    also = None
    if has_pad_q or has_pad_kv:
        pads = [n + i for i in range(has_pad_q + has_pad_kv)]
        real = ([0] if has_pad_q else []) + ([n - 1] if has_pad_kv else [])
        # row by row: indexing with a list would copy it host->device (refused inside CUDA graph capture)
        also = torch.stack([lens[p] >= lens[r] for p, r in zip(pads, real)])
    return within(values, lo, hi, also)


def _ok_shared(ext: torch.Tensor, checked: torch.Tensor, tokens: int, limit: int) -> torch.Tensor:
    """`_ok_general` for one offsets row serving queries and keys (self-attention, documents),
    with the host values as kernel scalars: `checked` (L + 4,) holds the L lengths (written by
    the prep) and gets [start, start + limit, end - tokens, end - tokens + limit]; every entry
    in [0, limit] is exactly: lengths in [0, limit], start == 0, end == tokens (int32 cannot
    wrap into the range: tokens and limit are below 2**31). Five small kernels; the general
    form's pinned host->device bounds copy cost a varlen training step ~250 us of host time on
    H200 (one run), an earlier scalar form ~110 us with two kernels more."""
    n = ext.shape[1] - 1
    row = ext[0]
    ends = row.as_strided((2, 2), (n * row.stride(0), 0))  # [[start, start], [end, end]]
    by_tokens, by_limit = _END_PATTERN.get_or_create((ext.device, ext.dtype), lambda: (
        torch.tensor([[0, 0], [1, 1]], dtype=ext.dtype, device=ext.device),
        torch.tensor([[0, -1], [0, -1]], dtype=ext.dtype, device=ext.device)))
    tail = checked[n:].view(2, 2)
    torch.sub(ends, by_tokens, alpha=tokens, out=tail).sub_(by_limit, alpha=limit)
    return checked.clamp(0, limit).eq_(checked).all()


def token_positions(starts: torch.Tensor, lengths: torch.Tensor, total_tokens: int, batch: int):
    """(b, i, valid) (T,) of each packed token: its sequence (of `batch`, from the (N+1,) token
    offsets `starts`), its position in it, and whether it is a real token (not a gap). No sync."""
    tok = starts.to(torch.int64)
    t = torch.arange(total_tokens, device=tok.device)
    b = torch.searchsorted(tok[1:], t, right=True).clamp_(max=batch - 1)
    i = t - tok[b]
    return b, i, (i >= 0) & (i < lengths.to(torch.int64)[b])


def token_rows_of_empty_kv(thd: ThdBatch, total_tokens: int) -> torch.Tensor:
    """(Tq,) bool: query tokens of sequences that have no key (kv length 0), device-side."""
    lens_q = thd.seq_q.view(-1)
    empty = (thd.seq_kv.view(-1) == 0) & (lens_q > 0)
    starts = thd.tok_q[:-1].to(torch.int64)
    t = torch.arange(total_tokens, device=lens_q.device)
    b = torch.searchsorted(thd.tok_q[1:].to(torch.int64), t, right=True).clamp_(max=lens_q.numel() - 1)
    return empty[b] & (t - starts[b] < lens_q[b].to(torch.int64))
