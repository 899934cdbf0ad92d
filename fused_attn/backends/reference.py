"""The reference backend's runner: a call plan's problem as the reference's `AttentionProblem`, run
by the math of `reference_math` (the semantics of every option); the backward recomputes the
forward with autograd, or differentiates one key chunk under a given log-sum-exp.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..lse_backward import into_dest
from ..static import NO_VARLEN
from . import reference_math
from .reference_math import AttentionProblem, acc_dtype

__all__ = ["refusal", "make_runner", "ReferenceRunner"]


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
            seqlens_q=seqlens_q, seqlens_kv=seqlens_kv, varlen=varlen if spec.is_packed else NO_VARLEN,
            score_mod=mod, return_lse=True,
            deterministic=spec.deterministic, sinks=sinks, dropout=dropout)

    def grad_inputs(self, mod, sinks) -> tuple:
        """The tensors besides q, k, v that the backward differentiates (in its order)."""
        return tuple(t for _, t in _grad_tensors(mod, sinks))

    def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=None, dest=None):
        """(out, lse, saved, state); dest: (out, (B, H, Sq, 1) lse) views to copy the results into
        (the cuDNN runner's caller-owned outputs, see band_chunks)."""
        dropout = self._seed(rng)
        with torch.no_grad():
            out, lse = reference_math.compute(self._problem(q, k, v, varlen, mod, sinks, dropout))
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
        return into_dest(self._backward_with_lse(q, k, v, out, lse, varlen, mod, sinks, grad_out), dest)

    def _backward_with_lse(self, q, k, v, out, lse, varlen, mod, sinks, grad_out):
        extras = _grad_tensors(mod, sinks)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        extra = [t.detach().requires_grad_(True) for _, t in extras]
        named = dict(zip((n for n, _ in extras), extra))
        sink_leaf = named.pop(_SINKS, sinks)
        if named:
            mod = mod.bind(**named)
        acc = acc_dtype(out.dtype)
        row_dot = (grad_out.to(acc) * out.to(acc)).sum(-1)  # the query's format without D
        if self.perm is not None:
            row_dot = row_dot.permute(self.perm[:3])  # -> (B, H, Sq)
        else:
            row_dot = row_dot.t()  # (Tq, H) -> (H, Tq)
        with torch.enable_grad(), _autograd_dispatch():  # also when called with grad mode off (a backward)
            problem = dataclasses.replace(self._problem(*leaves, varlen, mod, sink_leaf), fixed_lse=lse.detach())
            partial, weights = reference_math.compute(problem)
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
            out, _ = reference_math.compute(self._problem(*leaves, varlen, mod, sink_leaf, dropout))
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
    if mod is not None and mod.has_reference:
        for name, t in mod.tensors().items():
            if t.is_floating_point() and _bindable(mod, name):
                out.append((name, t))
    if sinks is not None:
        out.append((_SINKS, sinks))
    return out


def _bindable(mod, name: str) -> bool:
    """True when the mod takes `name` as a bindable tensor parameter (traced mods)."""
    specs = None if mod is None else mod.specs
    return specs is not None and name in specs


def _autograd_dispatch():
    """Re-include autograd dispatch: torch.library custom-op implementations (`fused_attn.ops`
    runs the runner's backward from one) run with autograd excluded, which would make the recompute
    record nothing. Scoped to the recompute; a no-op in eager calls."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU) | torch._C.DispatchKeySet(
        torch._C.DispatchKey.AutogradCUDA)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - keys)
