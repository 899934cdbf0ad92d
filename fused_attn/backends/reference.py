"""The reference backend: pure PyTorch math that defines the semantics of every option.

    out = softmax(mask(score_mod(scale * Q K^T))) V        per (sequence, head)

* Accumulates in fp32 (fp64 inputs stay fp64); out is cast back to the input dtype, lse is fp32.
* Plain differentiable torch ops: autograd (and torch.autograd.gradcheck on fp64) just works.
* Any device. Memory-bounded: queries are processed in row blocks so one block's scores stay
  under `MAX_BLOCK_ELEMENTS` (a 16k x 16k score matrix is never materialised at once).
* GQA without copying key/value: query heads are grouped onto their kv head (h // (H / Hkv)).
* A query row with no allowed key gives out 0 and lse -inf, and no NaN in the gradients.
* thd: a Python loop over sequences (one device->host copy of the offsets per call).
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

import torch

from ..layouts import in_query_layout
from ..problem import AttentionProblem, Band

__all__ = ["can_serve", "forward", "backward", "attention", "MAX_BLOCK_ELEMENTS"]

#: Upper bound on the score elements of one query block (B * H * rows * Skv).
MAX_BLOCK_ELEMENTS = 1 << 25


def can_serve(problem: AttentionProblem) -> Optional[str]:
    """None (the reference runs every validated problem) unless the score_mod has no eager form."""
    mod = problem.score_mod
    if mod is not None and not mod.has_reference:
        return (f"score_mod {mod.name!r} has no eager reference (a raw cuDNN callback needs reference=... "
                "to run on the reference backend)")
    return None


def forward(problem: AttentionProblem) -> Tuple[torch.Tensor, torch.Tensor, None]:
    """(out, lse, None) without autograd; out in the query's layout with value's head dim."""
    with torch.no_grad():
        out, lse = _compute(problem)
    return out, lse, None


def backward(problem: AttentionProblem, out: torch.Tensor, saved: None,
             grad_out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) shaped like problem.query/key/value, by recomputing the forward with autograd."""
    leaves = [t.detach().requires_grad_(True) for t in (problem.query, problem.key, problem.value)]
    sub = dataclasses.replace(problem, query=leaves[0], key=leaves[1], value=leaves[2])
    with torch.enable_grad(), _autograd_dispatch():
        recomputed, _ = _compute(sub)
        if not recomputed.requires_grad:  # nothing attends (e.g. Skv = 0): zero gradients
            return tuple(torch.zeros_like(t) for t in leaves)
        grads = torch.autograd.grad(recomputed, leaves, grad_out, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))


def _autograd_dispatch():
    """Re-include autograd dispatch: torch.library custom-op implementations (`fused_attn.ops`
    calls `backward` from one) run with autograd excluded, which would make the recompute
    record nothing. Scoped to the recompute; a no-op in eager calls."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU) | torch._C.DispatchKeySet(
        torch._C.DispatchKey.AutogradCUDA)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - keys)


def attention(problem: AttentionProblem) -> Tuple[torch.Tensor, torch.Tensor]:
    """Autograd-aware (out, lse); lse (fp32, not differentiable) is always computed."""
    return _compute(problem)


# ----------------------------------------------------------------------------- math


def _compute(problem: AttentionProblem) -> Tuple[torch.Tensor, torch.Tensor]:
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
    out, lse = _core(q, k, v, problem, b_idx, q_len, kv_len, lengths)
    return in_query_layout(out.to(q.dtype), problem.qkv_format), lse


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: AttentionProblem, b_idx: torch.Tensor,
          q_len: torch.Tensor, kv_len: torch.Tensor, lengths: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv) -> out (B, H, Sq, Dv) acc dtype, lse (B, H, Sq) fp32.

    b_idx / q_len / kv_len: (B, 1, 1, 1) int64 (batch index seen by the score_mod, lengths);
    `lengths` masks rows/keys past q_len/kv_len.
    """
    batch, heads, sq, _ = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[3]
    acc, dev = _acc_dtype(q.dtype), q.device
    if sq == 0 or skv == 0:
        out = torch.zeros((batch, heads, sq, dv), dtype=acc, device=dev)
        return out, torch.full((batch, heads, sq), -math.inf, dtype=torch.float32, device=dev)
    group = heads // hkv
    kf, vf = k.to(acc), v.to(acc)
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
        p, lse = _softmax(s)
        o = torch.matmul(p.view(batch, hkv, group * n, skv), vf).view(batch, heads, n, dv)
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


def _softmax(s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row softmax and fp32 log-sum-exp of s (..., Skv); rows of -inf give p = 0, lse = -inf, no NaN."""
    row_max = s.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(s - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (torch.log(denom.detach()) + row_max).squeeze(-1).to(torch.float32)
    return p, lse


def _packed(problem: AttentionProblem) -> Tuple[torch.Tensor, torch.Tensor]:
    """thd: q (Tq, H, D), k (Tkv, Hkv, D), v (Tkv, Hkv, Dv) -> out (Tq, H, Dv), lse (H, Tq)."""
    q, k, v = problem.query, problem.key, problem.value
    dev, acc = q.device, _acc_dtype(q.dtype)
    tq, heads, dv = q.shape[0], q.shape[1], v.shape[2]
    rows = [problem.cu_seqlens_q, problem.cu_seqlens_kv,
            problem.cu_seqlens_q if problem.cu_seqlens_q_padded is None else problem.cu_seqlens_q_padded,
            problem.cu_seqlens_kv if problem.cu_seqlens_kv_padded is None else problem.cu_seqlens_kv_padded]
    cu_q, cu_kv, off_q, off_kv = torch.stack([r.to(torch.int64) for r in rows]).tolist()
    outs: List[torch.Tensor] = []
    lses: List[torch.Tensor] = []
    end = 0
    for b in range(len(cu_q) - 1):
        lq, lkv = cu_q[b + 1] - cu_q[b], cu_kv[b + 1] - cu_kv[b]
        if lq == 0:
            continue
        if off_q[b] > end:
            outs.append(torch.zeros((off_q[b] - end, heads, dv), dtype=acc, device=dev))
            lses.append(torch.full((heads, off_q[b] - end), -math.inf, dtype=torch.float32, device=dev))
        qb = q[off_q[b]:off_q[b] + lq].transpose(0, 1).unsqueeze(0)
        kb = k[off_kv[b]:off_kv[b] + lkv].transpose(0, 1).unsqueeze(0)
        vb = v[off_kv[b]:off_kv[b] + lkv].transpose(0, 1).unsqueeze(0)
        b_idx = torch.full((1, 1, 1, 1), b, dtype=torch.int64, device=dev)
        q_len = torch.full((1, 1, 1, 1), lq, dtype=torch.int64, device=dev)
        kv_len = torch.full((1, 1, 1, 1), lkv, dtype=torch.int64, device=dev)
        o, lse = _core(qb, kb, vb, problem, b_idx, q_len, kv_len, lengths=False)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
        end = off_q[b] + lq
    if end < tq:
        outs.append(torch.zeros((tq - end, heads, dv), dtype=acc, device=dev))
        lses.append(torch.full((heads, tq - end), -math.inf, dtype=torch.float32, device=dev))
    out = torch.cat(outs, dim=0).to(q.dtype) if outs else q.new_zeros((0, heads, dv))
    lse = torch.cat(lses, dim=1) if lses else torch.zeros((heads, 0), dtype=torch.float32, device=dev)
    return out, lse
