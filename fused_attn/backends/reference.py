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
from typing import Any, List, Optional, Tuple

import torch

from ..layouts import from_logical
from ..problem import AttentionProblem, Band

__all__ = ["refusal", "make_runner", "ReferenceRunner", "MAX_BLOCK_ELEMENTS"]

#: Upper bound on the score elements of one query block (B * H * rows * Skv).
MAX_BLOCK_ELEMENTS = 1 << 25


def refusal(problem) -> Optional[str]:
    """None (the reference runs every validated problem) unless the score_mod has no eager form."""
    mod = problem.spec.score_mod
    if mod is not None and not mod.has_reference:
        return (f"score_mod {mod.name!r} has no eager reference (a raw cuDNN callback needs reference=... "
                "to run on the reference backend)")
    return None


def make_runner(problem) -> "ReferenceRunner":
    return ReferenceRunner(problem)


_PERM = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}


class ReferenceRunner:
    """Runs a call plan's problem with PyTorch math. forward -> (out, lse, saved, state);
    backward recomputes the forward with autograd (gradients for q, k, v, the score_mod's
    floating tensor parameters and the sinks)."""

    backend = "reference"

    def __init__(self, problem) -> None:
        self.static = problem
        spec = problem.spec
        self.perm = None if spec.is_packed else _PERM[spec.qkv_format]
        self.off_by_one = spec.softmax_type == "off-by-one"

    def _seed(self, rng: Optional[torch.Tensor]) -> Optional[tuple]:
        """(p, seed) of this call's dropout (seed from `rng`, or drawn from torch's CPU RNG)."""
        p = self.static.spec.dropout_p
        if not p:
            return None
        seed = int(rng[0]) if rng is not None else int(torch.randint(0, 2**62, (1,)).item())
        return (p, seed)

    def _problem(self, q, k, v, varlen, mod, sinks, dropout=None) -> AttentionProblem:
        spec, st = self.static.spec, self.static
        if self.off_by_one:
            sinks = torch.zeros(st.heads, dtype=torch.float32, device=q.device)
        seqlens_q = seqlens_kv = None
        if spec.padding:
            seqlens_q = (varlen.cu_seqlens_q[1:] - varlen.cu_seqlens_q[:-1]).to(torch.int32)
            seqlens_kv = (varlen.cu_seqlens_kv[1:] - varlen.cu_seqlens_kv[:-1]).to(torch.int32)
        if not spec.is_packed:
            q, k, v = (t.permute(self.perm) for t in (q, k, v))
        return AttentionProblem(
            query=q, key=k, value=v, qkv_format=spec.qkv_format, scale=st.scale, band=spec.band,
            seqlens_q=seqlens_q, seqlens_kv=seqlens_kv,
            cu_seqlens_q=varlen.cu_seqlens_q if spec.is_packed else None,
            cu_seqlens_kv=varlen.cu_seqlens_kv if spec.is_packed else None,
            cu_seqlens_q_padded=varlen.cu_seqlens_q_padded, cu_seqlens_kv_padded=varlen.cu_seqlens_kv_padded,
            max_seqlen_q=st.seqlen_q, max_seqlen_kv=st.seqlen_kv, score_mod=mod, return_lse=True,
            deterministic=spec.deterministic, sinks=sinks, dropout=dropout)

    def grad_inputs(self, mod, sinks) -> tuple:
        """The tensors besides q, k, v that the backward differentiates (in its order)."""
        return tuple(t for _, t in _grad_tensors(mod, sinks))

    def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=None, dest=None):
        """(out, lse, saved, state); dest: (out, (B, H, Sq, 1) lse) views to copy the results into
        (the cuDNN runner's caller-owned outputs, see band_chunks)."""
        dropout = self._seed(rng)
        with torch.no_grad():
            out, lse = _compute(self._problem(q, k, v, varlen, mod, sinks, dropout))
            if dest is not None:
                dest[0].copy_(out)
                dest[1].copy_(lse.unsqueeze(-1))
        extras = _grad_tensors(mod, sinks)
        return out, lse, (q, k, v) + tuple(t for _, t in extras), (varlen, mod, sinks, tuple(n for n, _ in extras),
                                                                    dropout)

    def op_grads(self, mod: Any, sinks: Any, grads: tuple) -> list:
        """The extra gradients of `backward_call`, already per op input (see DenseRunner.op_grads)."""
        return list(grads[3:])

    def backward_call(self, q, k, v, out, stats, varlen, mod, sinks, grad_out, rng=None):
        """The backward from the call's arguments (the custom-op path, which keeps no state;
        `rng`: the forward's dropout seed)."""
        extras = _grad_tensors(mod, sinks)
        state = (varlen, mod, sinks, tuple(n for n, _ in extras), self._seed(rng))
        return self.backward(state, (q, k, v) + tuple(t for _, t in extras), grad_out)

    def backward_with_lse(self, q, k, v, out, lse, varlen, mod, sinks, grad_out, dest=None):
        """Gradients of a call whose output `out` and log-sum-exp `lse` (dense (B, H, Sq), thd
        (H, Tq)) may span more keys than k, v hold (one chunk of a larger attention): the
        partial weights exp(score - lse) give dV = P^T dO and dS = P * (dP - rowsum(dO * out)).
        dest: (None, dK, dV) views to copy dK and dV into (returned in their place)."""
        grads = self._backward_with_lse(q, k, v, out, lse, varlen, mod, sinks, grad_out)
        if dest is None:
            return grads
        for d, g in zip(dest[1:], grads[1:3]):
            d.copy_(g)
        return (grads[0],) + tuple(dest[1:]) + grads[3:]

    def _backward_with_lse(self, q, k, v, out, lse, varlen, mod, sinks, grad_out):
        extras = _grad_tensors(mod, sinks)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        extra = [t.detach().requires_grad_(True) for _, t in extras]
        named = dict(zip((n for n, _ in extras), extra))
        sink_leaf = named.pop(_SINKS, sinks)
        if named:
            mod = mod.bind(**named)
        acc = _acc_dtype(out.dtype)
        row_dot = (grad_out.to(acc) * out.to(acc)).sum(-1)  # the query's format without D
        if self.perm is not None:
            row_dot = row_dot.permute(self.perm[:3])  # -> (B, H, Sq)
        else:
            row_dot = row_dot.t()  # (Tq, H) -> (H, Tq)
        with torch.enable_grad(), _autograd_dispatch():  # also when called with grad mode off (a backward)
            problem = dataclasses.replace(self._problem(*leaves, varlen, mod, sink_leaf), fixed_lse=lse.detach())
            partial, weights = _compute(problem)
            loss = (grad_out.to(partial.dtype) * partial).sum() - (row_dot.to(weights.dtype) * weights).sum()
            wrt = leaves + extra
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        return tuple(torch.zeros_like(t) if g is None else _like(g, t) for g, t in zip(grads, wrt))

    def backward(self, state, saved, grad_out):
        varlen, mod, sinks, names, dropout = state
        q, k, v = saved[:3]
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        extra = [t.detach().requires_grad_(True) for t in saved[3:]]
        named = dict(zip(names, extra))
        sink_leaf = named.pop(_SINKS, sinks)
        if named:
            mod = mod.bind(**named)
        with torch.enable_grad(), _autograd_dispatch():
            out, _ = _compute(self._problem(*leaves, varlen, mod, sink_leaf, dropout))
            wrt = leaves + extra
            if not out.requires_grad:  # nothing attends (e.g. Skv = 0): zero gradients
                return tuple(torch.zeros_like(t) for t in wrt)
            grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=True)
        return tuple(torch.zeros_like(t) if g is None else _like(g, t) for g, t in zip(grads, wrt))


_SINKS = "\0sinks"


def _like(g: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """g in t's memory layout (what the custom op's fake implementation promises)."""
    return g if g.stride() == t.stride() else torch.empty_like(t).copy_(g)


def _grad_tensors(mod, sinks) -> list:
    """(name, tensor) of the floating score_mod tensor parameters and the sinks: the inputs
    besides q, k, v that gradients flow to (in this order; the autograd layer passes them)."""
    out = []
    if mod is not None and getattr(mod, "has_reference", True):
        for name, t in mod.tensors().items():
            if t.is_floating_point() and _bindable(mod, name):
                out.append((name, t))
    if sinks is not None:
        out.append((_SINKS, sinks))
    return out


def _bindable(mod, name: str) -> bool:
    """True when the mod takes `name` as a bindable tensor parameter (traced mods)."""
    specs = getattr(mod, "specs", None)
    return specs is not None and name in specs


def _autograd_dispatch():
    """Re-include autograd dispatch: torch.library custom-op implementations (`fused_attn.ops`
    runs the runner's backward from one) run with autograd excluded, which would make the recompute
    record nothing. Scoped to the recompute; a no-op in eager calls."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU) | torch._C.DispatchKeySet(
        torch._C.DispatchKey.AutogradCUDA)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - keys)


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


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
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
    acc, dev = _acc_dtype(q.dtype), q.device
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
    dev, acc = q.device, _acc_dtype(q.dtype)
    tq, heads, dv = q.shape[0], q.shape[1], v.shape[2]
    rows = [problem.cu_seqlens_q, problem.cu_seqlens_kv,
            problem.cu_seqlens_q if problem.cu_seqlens_q_padded is None else problem.cu_seqlens_q_padded,
            problem.cu_seqlens_kv if problem.cu_seqlens_kv_padded is None else problem.cu_seqlens_kv_padded]
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
