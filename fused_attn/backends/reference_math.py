"""The reference backend's math: pure PyTorch that defines the semantics of every option, on the
reference's normalized problem (`AttentionProblem`).

    out = softmax(mask(score_mod(scale * Q K^T))) V        per (sequence, head)

* Accumulates in fp32 (fp64 inputs stay fp64); out is cast back to the input dtype, lse is fp32.
* Plain differentiable torch ops: autograd (and torch.autograd.gradcheck on fp64) just works.
* Any device. Memory-bounded: queries are processed in row blocks so one block's scores stay
  under `MAX_BLOCK_ELEMENTS` (a 16k x 16k score matrix is never materialised at once).
* GQA without copying key/value: query heads are grouped onto their kv head (h // (H / Hkv)).
* A query row with no allowed key gives out 0 and lse -inf, and no NaN in the gradients.
* thd: a Python loop over sequences (one device->host copy of the offsets per call).

Shape legend:
    B: batch (number of sequences)      H / Hkv: query / key-value heads (H % Hkv == 0)
    Sq / Skv: (max) query / key length  D / Dv: query-key / value head dim
    Tq / Tkv: total packed tokens (thd)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch

from ..layouts import from_logical
from ..problem import Band
from ..static import NO_VARLEN, Varlen

if TYPE_CHECKING:  # pragma: no cover
    from score_mods.base import ScoreMod

__all__ = ["AttentionProblem", "compute", "acc_dtype", "MAX_BLOCK_ELEMENTS"]

#: Upper bound on the score elements of one query block (B * H * rows * Skv).
MAX_BLOCK_ELEMENTS = 1 << 25


@dataclass
class AttentionProblem:
    """One attention call, normalized, as the reference's runner (`reference.ReferenceRunner`) builds
    it from a call plan's problem. Nothing here copies data: dense tensors are logical views.

    Dense formats (bshd, sbhd, bhsd): query (B, H, Sq, D), key (B, Hkv, Skv, D),
    value (B, Hkv, Skv, Dv), logical views of the caller's tensors (strides keep the layout).
    thd: query (Tq, H, D), key (Tkv, Hkv, D), value (Tkv, Hkv, Dv) plus varlen's cu_seqlens_*.

    Per-sequence lengths:
      * dense + padding mask types: seqlens_q / seqlens_kv (B,) int32 on the query's device;
        positions past a sequence's length produce output 0 and get no gradient.
      * thd: varlen (the call's `Varlen`): cu_seqlens_q / cu_seqlens_kv (B+1,) int32 give the
        lengths; the token offset of sequence b is cu_seqlens_*_padded[b] when given (gaps
        between sequences), else cu_seqlens_*[b]. Dense problems ignore it.

    sinks: (H,) logits of one extra key per head with no value (attention sinks), or None.
    fixed_lse: a given log-sum-exp (B, H, Sq) / (H, Tq) — the reference then computes the
    *partial* attention exp(score - fixed_lse) V and the row sums of those weights (used to
    differentiate one chunk of a larger attention whose normalizer is known, e.g. context
    parallelism), instead of the softmax.
    dropout: (p, seed) — attention weights dropped with probability p and the kept ones scaled
    by 1/(1-p), the mask drawn from a generator seeded with `seed` (so a recompute redraws it).

    Outputs: out has the query's format with Dv (contiguous in that format);
    lse is fp32 (B, H, Sq) for dense and (H, Tq) for thd (sink included), -inf on rows with no
    allowed key and no sink.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    qkv_format: str
    scale: float
    band: Optional[Band] = None
    seqlens_q: Optional[torch.Tensor] = None
    seqlens_kv: Optional[torch.Tensor] = None
    varlen: Varlen = NO_VARLEN
    score_mod: Optional["ScoreMod"] = None
    return_lse: bool = False
    deterministic: bool = False
    sinks: Optional[torch.Tensor] = None
    fixed_lse: Optional[torch.Tensor] = None
    dropout: Optional[tuple] = None

    @property
    def is_packed(self) -> bool:
        return self.qkv_format == "thd"

    @property
    def has_lengths(self) -> bool:
        """True when sequences have their own lengths (thd, or a padding mask type)."""
        return self.is_packed or self.seqlens_q is not None


def compute(problem: AttentionProblem) -> Tuple[torch.Tensor, torch.Tensor]:
    if problem.is_packed:
        return _packed(problem)
    q, k, v = problem.query, problem.key, problem.value
    batch, dev = q.shape[0], q.device
    b_idx = torch.arange(batch, device=dev).view(batch, 1, 1, 1)
    if problem.seqlens_q is not None:
        q_len = problem.seqlens_q.to(device=dev, dtype=torch.int64).view(batch, 1, 1, 1)
        kv_len = problem.seqlens_kv.to(device=dev, dtype=torch.int64).view(batch, 1, 1, 1)
        lengths = True
    else:
        q_len = torch.full((batch, 1, 1, 1), q.shape[2], dtype=torch.int64, device=dev)
        kv_len = torch.full((batch, 1, 1, 1), k.shape[2], dtype=torch.int64, device=dev)
        lengths = False
    out, lse = _core(q, k, v, problem, b_idx, q_len, kv_len, lengths, _generator(problem))
    return from_logical(out.to(q.dtype), problem.qkv_format).contiguous(), lse


def _generator(problem: AttentionProblem) -> Optional[torch.Generator]:
    """The dropout mask generator of a call (seeded, so the backward's recompute redraws the
    forward's mask: the mask is drawn block by block in a fixed order)."""
    if problem.dropout is None:
        return None
    gen = torch.Generator(device=problem.query.device)
    gen.manual_seed(problem.dropout[1] % (2**63))
    return gen


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: AttentionProblem, b_idx: torch.Tensor,
          q_len: torch.Tensor, kv_len: torch.Tensor, lengths: bool,
          gen: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv) -> out (B, H, Sq, Dv) acc dtype, lse (B, H, Sq) fp32.

    b_idx / q_len / kv_len: (B, 1, 1, 1) int64 (batch index seen by the score_mod, lengths);
    `lengths` masks rows/keys past q_len/kv_len.
    """
    batch, heads, sq, _ = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[3]
    acc, dev = acc_dtype(q.dtype), q.device
    if sq == 0 or skv == 0:
        out = torch.zeros((batch, heads, sq, dv), dtype=acc, device=dev)
        if problem.fixed_lse is not None:  # partial mode: no key, no weight
            return out, torch.zeros((batch, heads, sq), dtype=acc, device=dev)
        lse = torch.full((batch, heads, sq), -math.inf, dtype=torch.float32, device=dev)
        if problem.sinks is not None:
            lse = problem.sinks.detach().float().view(1, heads, 1).expand(batch, heads, sq).clone()
        return out, lse
    group = heads // hkv
    if lengths:  # padded rows never matter: masked with where (0 * NaN would stay NaN), forward and backward
        q = torch.where(torch.arange(sq, device=dev).view(1, 1, sq, 1) < q_len, q, 0.0)
        kv_ok = torch.arange(skv, device=dev).view(1, 1, skv, 1) < kv_len
        k, v = torch.where(kv_ok, k, 0.0), torch.where(kv_ok, v, 0.0)
    kf, vf = k.to(acc), v.to(acc)
    finite = torch.isfinite(vf)
    v_finite = torch.where(finite, vf, torch.zeros_like(vf))
    v_bad = (~finite).to(acc)  # (B, Hkv, Skv, Dv) indicator, used without a host sync
    sink = None if problem.sinks is None else problem.sinks.to(acc).view(1, heads, 1, 1)
    h_idx = torch.arange(heads, device=dev).view(1, heads, 1, 1)
    kv_idx = torch.arange(skv, device=dev).view(1, 1, 1, skv)
    rows = max(1, MAX_BLOCK_ELEMENTS // max(1, batch * heads * skv))
    outs: List[torch.Tensor] = []
    lses: List[torch.Tensor] = []
    for start in range(0, sq, rows):
        stop = min(sq, start + rows)
        n = stop - start
        qb = q[:, :, start:stop].to(acc).reshape(batch, hkv, group * n, q.shape[3])
        s = torch.matmul(qb, kf.transpose(-1, -2)).view(batch, heads, n, skv) * problem.scale
        q_idx = torch.arange(start, stop, device=dev).view(1, 1, n, 1)
        if problem.score_mod is not None:
            s = problem.score_mod.eager(s, b_idx, h_idx, q_idx, kv_idx, q_len, kv_len).to(acc)
        allowed = _allowed(problem.band, q_idx, kv_idx, q_len, kv_len, lengths)
        if allowed is not None:
            s = s.masked_fill(~allowed, -math.inf)
        if problem.fixed_lse is None:
            p, lse = _softmax(s, sink)
        else:
            p, lse = _partial_weights(s, problem.fixed_lse[:, :, start:stop], sink)
        if gen is not None:
            prob = problem.dropout[0]
            keep = torch.rand(p.shape, generator=gen, device=dev, dtype=acc) >= prob
            p = p * keep.to(acc) / (1.0 - prob)
        pg = p.view(batch, hkv, group * n, skv)
        o = torch.matmul(pg, v_finite).view(batch, heads, n, dv)
        if v_bad is not None:
            # A non-finite value poisons exactly the rows that attend it (p > 0), as the math
            # says; rows that do not attend it (masked, past a length) stay untouched.
            hits = torch.matmul((pg.detach() > 0).to(acc), v_bad).view(batch, heads, n, dv)
            o = torch.where(hits > 0, torch.full_like(o, math.nan), o)
        if lengths:  # rows past a length: 0, and no gradient from their grad_out (NaN there included)
            o = torch.where(q_idx < q_len, o, 0.0)
        outs.append(o)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out, torch.cat(lses, dim=2)


def _allowed(band: Optional[Band], q_idx: torch.Tensor, kv_idx: torch.Tensor, q_len: torch.Tensor,
             kv_len: torch.Tensor, lengths: bool) -> Optional[torch.Tensor]:
    """Boolean mask broadcastable to (B, H, n, Skv), or None when every key is allowed."""
    allowed = None
    if band is not None:
        d = kv_idx - q_idx
        if band.bottom_right:
            d = d - (kv_len - q_len)
        if band.right is not None:
            allowed = d <= band.right
        if band.left is not None:
            left_ok = d >= -band.left
            allowed = left_ok if allowed is None else allowed & left_ok
    if lengths:
        in_range = (q_idx < q_len) & (kv_idx < kv_len)
        allowed = in_range if allowed is None else allowed & in_range
    return allowed


def _partial_weights(s: torch.Tensor, lse: torch.Tensor,
                     sink: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Weights exp(s - lse) under a given normalizer lse (..., n) and their row sums (the
    sink's weight included when given); rows with lse -inf weigh nothing."""
    lse = lse.to(s.dtype).unsqueeze(-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, math.inf))
    p = torch.exp(s - safe)
    total = p.sum(dim=-1)
    if sink is not None:
        total = total + torch.exp(sink - safe).squeeze(-1)
    return p, total


def _softmax(s: torch.Tensor, sink: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row softmax and fp32 log-sum-exp of s (..., Skv), with an optional sink logit per row
    (broadcast (1, H, 1, 1)) that takes probability mass but has no value. Rows of -inf (and no
    sink) give p = 0, lse = -inf, no NaN."""
    row_max = s.detach().amax(dim=-1, keepdim=True)
    if sink is not None:
        row_max = torch.maximum(row_max, sink.detach().expand_as(row_max))
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(s - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    p = e / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (torch.log(denom.detach()) + row_max).squeeze(-1).to(torch.float32)
    return p, lse


def _packed(problem: AttentionProblem) -> Tuple[torch.Tensor, torch.Tensor]:
    """thd: q (Tq, H, D), k (Tkv, Hkv, D), v (Tkv, Hkv, Dv) -> out (Tq, H, Dv), lse (H, Tq)."""
    q, k, v = problem.query, problem.key, problem.value
    dev, acc = q.device, acc_dtype(q.dtype)
    tq, heads, dv = q.shape[0], q.shape[1], v.shape[2]
    lengths = problem.varlen
    rows = [lengths.cu_seqlens_q, lengths.cu_seqlens_kv,
            lengths.cu_seqlens_q if lengths.cu_seqlens_q_padded is None else lengths.cu_seqlens_q_padded,
            lengths.cu_seqlens_kv if lengths.cu_seqlens_kv_padded is None else lengths.cu_seqlens_kv_padded]
    cu_q, cu_kv, off_q, off_kv = torch.stack([r.to(torch.int64) for r in rows]).tolist()
    outs: List[torch.Tensor] = []
    lses: List[torch.Tensor] = []
    gap = -math.inf if problem.fixed_lse is None else 0.0  # rows between sequences: lse -inf, or no weight
    gen = _generator(problem)
    end = 0
    for b in range(len(cu_q) - 1):
        lq, lkv = cu_q[b + 1] - cu_q[b], cu_kv[b + 1] - cu_kv[b]
        if lq == 0:
            continue
        if off_q[b] > end:
            outs.append(torch.zeros((off_q[b] - end, heads, dv), dtype=acc, device=dev))
            lses.append(torch.full((heads, off_q[b] - end), gap, dtype=torch.float32, device=dev))
        qb = q[off_q[b]:off_q[b] + lq].transpose(0, 1).unsqueeze(0)
        kb = k[off_kv[b]:off_kv[b] + lkv].transpose(0, 1).unsqueeze(0)
        vb = v[off_kv[b]:off_kv[b] + lkv].transpose(0, 1).unsqueeze(0)
        b_idx = torch.full((1, 1, 1, 1), b, dtype=torch.int64, device=dev)
        q_len = torch.full((1, 1, 1, 1), lq, dtype=torch.int64, device=dev)
        kv_len = torch.full((1, 1, 1, 1), lkv, dtype=torch.int64, device=dev)
        sub = problem
        if problem.fixed_lse is not None:
            sub = dataclasses.replace(problem, fixed_lse=problem.fixed_lse[:, off_q[b]:off_q[b] + lq].unsqueeze(0))
        o, lse = _core(qb, kb, vb, sub, b_idx, q_len, kv_len, lengths=False, gen=gen)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
        end = off_q[b] + lq
    if end < tq:
        outs.append(torch.zeros((tq - end, heads, dv), dtype=acc, device=dev))
        lses.append(torch.full((heads, tq - end), gap, dtype=torch.float32, device=dev))
    out = torch.cat(outs, dim=0).to(q.dtype) if outs else q.new_zeros((0, heads, dv))
    lse = torch.cat(lses, dim=1) if lses else torch.zeros((heads, 0), dtype=torch.float32, device=dev)
    return out, lse
