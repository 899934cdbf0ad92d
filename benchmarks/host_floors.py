"""The floors `bench host` and the step profiles compare fused_attn's call path with: Python
autograd.Functions that do only what any Python-level attention must (allocate outputs and
gradients), one of them over the frontend's prebuilt cuDNN graphs and no library code."""

from __future__ import annotations

import torch

__all__ = ["EmptyAutogradFunction", "BareCudnnFunction"]


class EmptyAutogradFunction(torch.autograd.Function):
    """A Python autograd.Function over (q, k, v) that allocates its output and gradients and
    does nothing else: what any Python-level attention pays autograd per fwd+bwd on this host."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class BareCudnnFunction(torch.autograd.Function):
    """apply(raw, q, k, v): a Python autograd.Function over the frontend's prebuilt graphs
    (`RawSdpa`, ordered execute) that allocates what an attention call must (out and its
    statistics; dq, dk, dv) and nothing else: no library code. Its host time is the floor of
    any Python-level attention that runs cuDNN graphs on this host."""

    @staticmethod
    def forward(ctx, raw, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(raw.lse.shape, dtype=torch.float32, device=q.device)
        raw.run_fwd(q, k, v, out, lse)
        ctx.raw = raw
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ctx.raw.run_bwd(q, k, v, out, grad.contiguous(), lse, dq, dk, dv)
        return None, dq, dk, dv
