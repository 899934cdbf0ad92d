"""Autograd over a call plan's runner: the backward uses exactly what its forward used.

    out, lse = attention(plan, q, k, v, varlen, mod, sinks)

The runner's forward returns (out, lse, saved tensors, state); the saved tensors go through
`save_for_backward` (so an in-place edit of q, k, v, a score_mod tensor parameter or the sinks
between forward and backward raises torch's usual error instead of giving gradients of another
function) and `state` carries the rest (the score_mod's values as the forward bound them, the
varlen preparation). The backward calls `runner.backward(state, saved, grad_out)` for the
gradients of q, k, v and of `runner.grad_inputs(mod, sinks)` (the floating score_mod tensor
parameters and sinks the backend differentiates): no re-validation, no re-selection, no
re-keying. lse is not differentiable.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from .mod_values import check_mod_unchanged, tensor_versions

__all__ = ["attention", "PlanAttention", "check_mod_unchanged", "tensor_versions"]


class PlanAttention(torch.autograd.Function):
    """apply((runner, varlen, mod, sinks), q, k, v, *extras) -> (out, lse or None).

    The non-tensor arguments travel as one tuple: `Function.apply` costs per argument."""

    @staticmethod
    def forward(ctx, call: Tuple[Any, Any, Any, Optional[torch.Tensor]], query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, *extras: torch.Tensor):
        runner, varlen, mod, sinks = call
        out, lse, saved, state = runner.forward(query, key, value, varlen, mod, sinks, extras=extras)
        ctx.runner, ctx.state, ctx.n_extras = runner, state, len(extras)
        # a module updates its score_mod's values in place (TracedMod.take_values replaces the
        # values dict): the backward checks they are still the forward's
        ctx.mod, ctx.mod_values, ctx.mod_versions = mod, None if mod is None else mod.bound_values, tensor_versions(mod)
        ctx.save_for_backward(*saved)
        if lse is not None:
            ctx.mark_non_differentiable(lse)
        # no zero-filled gradient for lse (non-differentiable) or an unused out: one allocation and
        # one fill kernel fewer per backward; a None grad_out is handled below
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_lse: Optional[torch.Tensor]):
        if grad_out is None:
            return (None,) * (1 + 3 + ctx.n_extras)
        check_mod_unchanged(ctx.mod, ctx.mod_values, ctx.mod_versions)
        grads = ctx.runner.backward(ctx.state, ctx.saved_tensors, grad_out)
        # the call tuple (sinks itself is among the extras), q, k, v, *extras
        return (None,) + tuple(grads)


def attention(runner: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, varlen: Any, mod: Any,
              sinks: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Differentiable (out, lse or None) through `runner` (plain forward when no input needs grad)."""
    extras = runner.grad_inputs(mod, sinks)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                    or any(t.requires_grad for t in extras)):
        return PlanAttention.apply((runner, varlen, mod, sinks), query, key, value, *extras)
    infer = getattr(runner, "infer", None)
    if infer is not None:
        return infer(query, key, value, varlen, mod, sinks)
    out, lse, _, _ = runner.forward(query, key, value, varlen, mod, sinks)
    return out, lse
