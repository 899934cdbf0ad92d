"""A backend-generic torch.autograd.Function over a backend module's forward / backward.

    out, lse = attention(backend_module, problem)

Forward calls `backend.forward(problem) -> (out, lse, saved)`; backward calls
`backend.backward(problem, out, saved, grad_out) -> (dq, dk, dv)` with the saved query, key,
value, out and `saved` (e.g. cuDNN's Stats): no forward recompute. Gradients flow to
problem.query / key / value (the tensors the problem holds); lse is not differentiable.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Optional, Tuple

import torch

from .problem import AttentionProblem

__all__ = ["attention", "BackendAttention"]


class BackendAttention(torch.autograd.Function):
    """apply(backend, problem, query, key, value) -> (out, lse or None)."""

    @staticmethod
    def forward(ctx, backend: ModuleType, problem: AttentionProblem, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor):
        out, lse, saved = backend.forward(problem)
        ctx.backend = backend
        # The problem minus q/k/v (those go through save_for_backward, which checks in-place edits).
        ctx.problem = dataclasses.replace(problem, query=None, key=None, value=None)
        ctx.save_for_backward(query, key, value, out, saved)
        if lse is not None:
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_lse: Optional[torch.Tensor]):
        query, key, value, out, saved = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None
        problem = dataclasses.replace(ctx.problem, query=query, key=key, value=value)
        dq, dk, dv = ctx.backend.backward(problem, out, saved, grad_out)
        return None, None, dq, dk, dv


def attention(backend: ModuleType, problem: AttentionProblem) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Differentiable (out, lse) of `problem` on `backend` (a module with forward/backward)."""
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (problem.query, problem.key, problem.value))
    if not needs_grad:
        out, lse, _ = backend.forward(problem)
        return out, lse
    return BackendAttention.apply(backend, problem, problem.query, problem.key, problem.value)
