"""Which tensors an engine's backward handed to autograd: `note_returned_grads(monkeypatch)` wraps
the library's autograd Function and returns the list it appends each backward's q, k, v gradient
data pointers to. A leaf's .grad with the same pointer is the engine's own tensor; another
pointer means autograd copied it (something else still held the engine's tensor)."""

from __future__ import annotations

from typing import List, Optional

from fused_attn import autograd as fa_autograd


def note_returned_grads(monkeypatch) -> List[List[Optional[int]]]:
    returned: List[List[Optional[int]]] = []
    original = fa_autograd.PlanAttention.backward

    def noting(ctx, grad_out, grad_lse):
        grads = original(ctx, grad_out, grad_lse)
        returned.append([None if g is None else g.data_ptr() for g in grads[1:4]])
        return grads

    monkeypatch.setattr(fa_autograd.PlanAttention, "backward", staticmethod(noting))
    return returned
