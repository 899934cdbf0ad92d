"""THD (packed) batches: bucketing, ragged offsets, sequence lengths and the LSE gather.

A packed batch of B sequences runs on a graph built for (B_bucket, H, S_bucket, D):
B_bucket = next power of two >= B (extra sequences have length 0 and repeat the last offset),
S_bucket = next power of two >= max_seqlen, at least 64. So a training run with random lengths
builds a handful of graphs (the graph key never holds the token count or the exact max_seqlen).
Everything here is device-side torch ops: no host sync.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Tuple

import torch

__all__ = ["bucket_batch", "bucket_seqlen", "ThdBatch", "prepare", "gather_lse", "MIN_SEQ_BUCKET"]

MIN_SEQ_BUCKET = 64
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
class ThdBatch:
    """Device tensors and bucket sizes of one packed batch.

    seq_q / seq_kv: (B_bucket, 1, 1, 1) int32 lengths (0 for padding sequences);
    tok_q / tok_kv: (B_bucket + 1,) int32 token offsets; batch: the real B.
    """

    batch: int
    batch_bucket: int
    sq_bucket: int
    skv_bucket: int
    seq_q: torch.Tensor
    seq_kv: torch.Tensor
    tok_q: torch.Tensor
    tok_kv: torch.Tensor

    _offsets: Dict[Tuple[str, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def offsets(self, side: str, multiplier: int) -> torch.Tensor:
        """(B_bucket + 1, 1, 1, 1) int32 element offsets: token offset * multiplier (cached)."""
        got = self._offsets.get((side, multiplier))
        if got is None:
            tok = self.tok_q if side == "q" else self.tok_kv
            got = self._offsets[(side, multiplier)] = (tok * multiplier).view(-1, 1, 1, 1)
        return got

    def bindings(self, slot_multipliers: Dict[str, Tuple[str, int]]) -> Dict[str, torch.Tensor]:
        """Buffers for the seq_len and ragged-offset slots of a graph."""
        out = {"seq_q": self.seq_q, "seq_kv": self.seq_kv}
        for slot, (side, mult) in slot_multipliers.items():
            out[slot] = self.offsets(side, mult)
        return out


def _extend(t: torch.Tensor, n: int) -> torch.Tensor:
    """(B+1,) offsets -> (n+1,) by repeating the last offset (zero-length sequences)."""
    if t.numel() == n + 1:
        return t
    return torch.cat([t, t[-1:].expand(n + 1 - t.numel())])


def _lengths(cu: torch.Tensor, n: int) -> torch.Tensor:
    lens = (cu[1:] - cu[:-1]).to(torch.int32)
    if lens.numel() < n:
        lens = torch.cat([lens, lens.new_zeros(n - lens.numel())])
    return lens.view(n, 1, 1, 1)


def check_offset_range(name: str, tokens: int, heads: int, dim: int) -> None:
    """Element offsets are int32: refuse packed tensors too large for them."""
    if tokens * heads * dim > _INT32_MAX:
        raise NotImplementedError(
            f"{name} has {tokens} tokens x {heads} heads x {dim} dims = {tokens * heads * dim} elements; "
            "cuDNN's int32 ragged offsets address at most 2**31 - 1: split the batch or use backend='reference'"
        )


_PREPARED: "OrderedDict[tuple, Tuple[tuple, ThdBatch]]" = OrderedDict()
_PREPARED_MAX = 16


def _identity(t) -> tuple:
    return (None, 0) if t is None else (id(t), t._version)


def prepare(problem) -> ThdBatch:
    """Bucket sizes, lengths and token offsets of a packed (thd) AttentionProblem.

    Memoized on the identity and version counter of the cu_seqlens tensors (the entry holds
    them, so an id cannot be reused while cached; an in-place edit bumps the version): the
    backward of a step and repeated calls on the same batch reuse the device tensors instead of
    relaunching a dozen small kernels.
    """
    sources = (problem.cu_seqlens_q, problem.cu_seqlens_kv, problem.cu_seqlens_q_padded, problem.cu_seqlens_kv_padded)
    key = tuple(_identity(t) for t in sources) + (int(problem.max_seqlen_q), int(problem.max_seqlen_kv))
    hit = _PREPARED.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], sources)):
        _PREPARED.move_to_end(key)
        return hit[1]
    thd = _prepare(problem)
    _PREPARED[key] = (sources, thd)
    if len(_PREPARED) > _PREPARED_MAX:
        _PREPARED.popitem(last=False)
    return thd


def release_prepared() -> None:
    """Drop memoized batches (with the graph cache)."""
    _PREPARED.clear()


def _prepare(problem) -> ThdBatch:
    batch = problem.cu_seqlens_q.numel() - 1
    bb = bucket_batch(batch)
    tok_q = problem.cu_seqlens_q_padded if problem.cu_seqlens_q_padded is not None else problem.cu_seqlens_q
    tok_kv = problem.cu_seqlens_kv_padded if problem.cu_seqlens_kv_padded is not None else problem.cu_seqlens_kv
    return ThdBatch(
        batch=batch, batch_bucket=bb,
        sq_bucket=bucket_seqlen(int(problem.max_seqlen_q)), skv_bucket=bucket_seqlen(int(problem.max_seqlen_kv)),
        seq_q=_lengths(problem.cu_seqlens_q, bb), seq_kv=_lengths(problem.cu_seqlens_kv, bb),
        tok_q=_extend(tok_q.to(torch.int32), bb), tok_kv=_extend(tok_kv.to(torch.int32), bb),
    )


def gather_lse(stats: torch.Tensor, thd: ThdBatch, total_tokens: int) -> torch.Tensor:
    """Packed LSE (H, Tq) fp32 from padded Stats (B_bucket, H, S_bucket, 1); -inf off real tokens."""
    tok = thd.tok_q.to(torch.int64)
    t = torch.arange(total_tokens, device=stats.device)
    b = torch.searchsorted(tok[1:], t, right=True).clamp_(max=thd.batch_bucket - 1)
    i = t - tok[b]
    valid = (i >= 0) & (i < thd.seq_q.view(-1).to(torch.int64)[b])
    i = i.clamp(0, stats.shape[2] - 1)
    lse = stats[b, :, i, 0]  # (Tq, H)
    lse = lse.masked_fill(~valid[:, None], float("-inf"))
    return lse.t().contiguous()
