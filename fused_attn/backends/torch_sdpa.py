"""The torch engine: torch's own CPU kernels, where they compute the reference's math exactly.

    SDPA path (no score_mod): torch's CPU flash attention kernel
        (aten._scaled_dot_product_flash_attention_for_cpu and its backward, what
        F.scaled_dot_product_attention runs on CPU) — forward, backward and lse.
        causal top-left -> is_causal (tiles above the diagonal skipped); other bands (windows,
        bottom-right alignment with Sq != Skv) and dense padding -> an additive -inf mask of shape
        (B|1, 1, Sq, Skv); GQA native (no repeat). Rows with no allowed key: out 0 and lse -inf
        (the kernel writes lse 0 there: fixed from the mask).
    flex path (traced score_mods, inference only): flex_attention compiled once per mod
        structure (`torch_flex`), bands as block masks, dense padding as per-sequence lengths;
        torch 2.13's CPU flex has no backward and no lse (those calls run on the reference).

Everything else is refused with the reason (`refusal`), so backend="auto" runs the reference:
packed thd, sinks, dropout (torch draws its own mask; the reference's seeded mask is the oracle),
head_dim_v != head_dim, non-CPU tensors, score_mods with gradients / lse / fp64 or on CPUs torch
does not compile flex_attention for.

Limits: non-finite keys or values that some rows attend and others do not poison the others too
(the kernel multiplies masked weights 0 by them); padded positions are zeroed first, and keys no
query attends are trimmed before the call (`key_range`), so only genuinely attended NaN/Inf differ.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch

from ..layouts import from_logical
from ..lse_backward import into_dest, weightless_empty_rows
from ..problem import Band
from . import torch_flex

__all__ = ["refusal", "make_runner", "SdpaRunner", "FlexRunner"]

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_PERM = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_CAUSAL = Band(None, 0, False)


def refusal(problem) -> Optional[str]:
    """None when this engine runs `problem` (a StaticProblem) exactly, else why not (metadata only)."""
    spec = problem.spec
    if problem.device.type != "cpu":
        return f"the torch engine serves CPU tensors (these are on {problem.device})"
    if spec.is_packed:
        return "packed thd: torch has no CPU varlen kernel (the reference runs each sequence)"
    if spec.has_sinks:
        return f"softmax_type={spec.softmax_type!r}: torch's kernels have no sink logit"
    if spec.dropout_p:
        return ("dropout_p > 0: torch's kernels draw their own dropout mask, not the reference's seeded one "
                "(which the oracle and the recomputing backward need)")
    if problem.dtype not in _DTYPES:
        return f"dtype {problem.dtype}: the torch engine takes {', '.join(str(d) for d in _DTYPES)}"
    if problem.head_dim != problem.head_dim_v:
        return (f"head_dim_v {problem.head_dim_v} != head_dim {problem.head_dim}: torch's CPU flash kernel needs "
                "equal head dims")
    mod = spec.score_mod
    if mod is None:
        return None
    return torch_flex.refusal(problem, mod)


def make_runner(problem) -> Any:
    """SdpaRunner (no score_mod) or FlexRunner (a traced score_mod) for a problem `refusal` accepts."""
    return SdpaRunner(problem) if problem.spec.score_mod is None else torch_flex.FlexRunner(problem)


FlexRunner = torch_flex.FlexRunner


def _logical(t: torch.Tensor, perm: tuple) -> torch.Tensor:
    return t.permute(perm)


def _like(g: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """g in t's memory layout (what the custom op's fake implementation promises)."""
    return g if g.stride() == t.stride() else torch.empty_like(t).copy_(g)


class SdpaRunner:
    """Runs a problem without score_mod on torch's CPU flash attention kernel.

    forward -> (out in the query's format, lse fp32 (B, H, Sq), saved (q, k, v, out, raw lse),
    state (varlen,)); backward -> (dq, dk, dv) in the inputs' layouts. The interface is the
    reference runner's (plan.py, autograd.py, ops.py, functional.py call it)."""

    backend = "torch"

    def __init__(self, problem) -> None:
        self.static = problem
        spec = problem.spec
        self.fmt = spec.qkv_format
        self.perm = _PERM[self.fmt]
        band = spec.band
        square = problem.seqlen_q == problem.seqlen_kv
        # bottom-right causal with Sq == Skv is top-left causal
        self.is_causal = not spec.padding and band is not None and band.left is None and band.right == 0 and (
            not band.bottom_right or square)
        self.masked = spec.padding or (band is not None and not self.is_causal)

    # -- the interface shared with the reference runner
    def grad_inputs(self, mod: Any, sinks: Any) -> tuple:
        """No tensors besides q, k, v are differentiated (no score_mod, no sinks)."""
        return ()

    def op_grads(self, mod: Any, sinks: Any, grads: tuple) -> list:
        return list(grads[3:])

    def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=None, dest=None):
        """(out, lse, saved, state); dest: (out, (B, H, Sq, 1) lse) views to copy the results into."""
        with torch.no_grad():
            o, raw, lse = self._forward(q, k, v, varlen)
            out = from_logical(o, self.fmt).contiguous()
            if dest is not None:
                dest[0].copy_(out)
                dest[1].copy_(lse.unsqueeze(-1))
        return out, lse, (q, k, v, out, raw), (varlen,)

    def backward(self, state, saved, grad_out):
        q, k, v, out, raw = saved
        return self._backward(q, k, v, out, raw, state[0], grad_out)

    def backward_call(self, q, k, v, out, stats, varlen, mod, sinks, grad_out, rng=None):
        """The backward from the call's arguments (the custom-op path): recomputes the kernel's lse."""
        with torch.no_grad():
            _, raw, _ = self._forward(q, k, v, varlen)
        return self._backward(q, k, v, out, raw, varlen, grad_out)

    def backward_with_lse(self, q, k, v, out, lse, varlen, mod, sinks, grad_out, dest=None):
        """Gradients of one chunk of a larger attention whose output `out` and fp32 lse (B, H, Sq)
        are given: the kernel's backward takes P = exp(score - lse) and D = rowsum(dO * out) from
        them. Rows with lse -inf (no key anywhere) weigh nothing."""
        # the kernel's own lse dtype: its accumulation type (float64 for float64 inputs, else fp32)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        return into_dest(self._backward(q, k, v, out, weightless_empty_rows(lse).to(acc), varlen, grad_out), dest)

    # -- the math
    def _inputs(self, q, k, v, varlen) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                                                 Optional[torch.Tensor]]:
        """Logical (B, H, S, D) q, k, v (padded positions zeroed), the additive mask or None, and
        the (B|1, 1|H, Sq) rows with no allowed key or None."""
        ql, kl, vl = (_logical(t, self.perm) for t in (q, k, v))
        if not self.masked:
            return ql, kl, vl, None, None
        sq, skv = ql.shape[2], kl.shape[2]
        dev = q.device
        q_idx = torch.arange(sq, device=dev).view(1, 1, sq, 1)
        kv_idx = torch.arange(skv, device=dev).view(1, 1, 1, skv)
        allowed = None
        q_len = kv_len = None
        if self.static.spec.padding:
            q_len = (varlen.cu_seqlens_q[1:] - varlen.cu_seqlens_q[:-1]).to(torch.int64).view(-1, 1, 1, 1)
            kv_len = (varlen.cu_seqlens_kv[1:] - varlen.cu_seqlens_kv[:-1]).to(torch.int64).view(-1, 1, 1, 1)
            q_ok, kv_ok = q_idx < q_len, kv_idx < kv_len  # (B, 1, Sq, 1), (B, 1, 1, Skv)
            allowed = q_ok & kv_ok
            # padded positions may hold anything (uninitialised memory): zero them, so that a NaN there
            # cannot reach a row through a masked weight of 0
            ql = ql.masked_fill(~q_ok, 0)
            kl, vl = kl.masked_fill(~kv_ok.transpose(2, 3), 0), vl.masked_fill(~kv_ok.transpose(2, 3), 0)
        band = self.static.spec.band
        if band is not None:
            d = kv_idx - q_idx
            if band.bottom_right:
                d = d - ((kv_len - q_len) if q_len is not None else (skv - sq))
            if band.right is not None:
                allowed = (d <= band.right) if allowed is None else allowed & (d <= band.right)
            if band.left is not None:
                allowed = (d >= -band.left) if allowed is None else allowed & (d >= -band.left)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=dev).masked_fill_(~allowed, -math.inf)
        return ql, kl, vl, mask, ~allowed.any(dim=-1)

    def _forward(self, q, k, v, varlen) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(out logical (B, H, Sq, D), the kernel's lse, lse with -inf on empty rows (B, H, Sq) fp32)."""
        st = self.static
        ql, kl, vl, mask, empty = self._inputs(q, k, v, varlen)
        b, h, sq = ql.shape[:3]
        if sq == 0 or kl.shape[2] == 0:  # the kernel does not take empty sequences
            o = ql.new_zeros((b, h, sq, vl.shape[3]))
            lse = torch.full((b, h, sq), -math.inf, dtype=torch.float32, device=q.device)
            return o, lse.clone(), lse
        o, raw = _FWD(ql, kl, vl, 0.0, self.is_causal, attn_mask=mask, scale=st.scale)
        lse = raw if empty is None else raw.masked_fill(empty, -math.inf)
        return o, raw, lse.contiguous()

    def _backward(self, q, k, v, out, raw, varlen, grad_out) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ql, kl, vl, mask, _ = self._inputs(q, k, v, varlen)
        if ql.shape[2] == 0 or kl.shape[2] == 0:
            return tuple(torch.zeros_like(t) for t in (q, k, v))
        ol, gl = _logical(out, self.perm), _logical(grad_out, self.perm)
        dq, dk, dv = _BWD(gl, ql, kl, vl, ol, raw, 0.0, self.is_causal, attn_mask=mask, scale=self.static.scale)
        return tuple(_like(from_logical(g, self.fmt), t) for g, t in zip((dq, dk, dv), (q, k, v)))
