"""Causal attention with a score_mod, served as query chunks over key prefixes.

cuDNN 9.19 declines its own causal band next to a score_mod callback (measured on H200), so a
causal mask with a score_mod (softcap: Gemma 2) is a select inside the callback and the kernel
computes every (query tile, key tile) pair, twice the work of the causal triangle. Splitting the
queries into N chunks, chunk [q0, q1) attends only the key prefix [0, q1 + shift) under a
bottom-right causal mask (shift = Skv - Sq for bottom-right alignment, 0 for top-left):

    query i of the chunk sees key j  iff  j <= (i - q0) + (q1 + shift) - (q1 - q0) = i + shift,

exactly the global mask, so each chunk is a complete attention (no lse merge) and the work falls
to (N + 1) / (2N) of the full square. Used only where the answer cannot change: dense layouts, no
padding, no dropout, a mod that reads neither q_idx nor the lengths (they would be the chunk's),
Skv >= Sq, no trained score_mod tables or sinks; and only where it was measured faster (H200,
softcap(30) + causal, bf16, one run):

    B H S D            forward plain / chunked     forward+backward plain / chunked
    2 16 4096 128      0.657 / 0.483 ms            2.256 / 2.232 ms
    2 16 4096  64      0.589 / 0.429               1.558 / 1.479
    4 16 2048  64      0.304 / 0.296               0.827 / 1.315
    1 16 8192  64      1.150 / 0.759               3.011 / 2.339

so calls without gradients are chunked from `MIN_QUERIES` queries and calls that record a
backward (`ChunkedCausal`) from `MIN_QUERIES_TRAINING`: the chunks' backward kernels run well
below the plain backward's rate (why is not known yet), which eats the skipped tiles up to 4096.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import torch

from .autograd import attention
from .memo import BoundedMemo
from .problem import Band
from .spec import AttentionSpec

__all__ = ["chunk_spec", "run_in_chunks", "needs_grad", "ChunkedCausal", "CHUNKS", "MIN_QUERIES",
           "MIN_QUERIES_TRAINING"]

CHUNKS = 4
MIN_QUERIES = 4096
MIN_QUERIES_TRAINING = 8192
_TILE = 128  # chunk bounds on multiples of cuDNN's tile keep key lengths off 64 mod 128
_SEQ_DIM = {"bshd": 1, "sbhd": 0, "bhsd": 2}
_SPECS = BoundedMemo(128, "causal_chunks.spec")


def chunk_spec(spec: AttentionSpec) -> Optional[AttentionSpec]:
    """The bottom-right causal spec the chunks of `spec` run with, or None when `spec` is not a
    causal score_mod call that chunking serves exactly (memoized per spec)."""
    hit = _SPECS.get(spec)
    if hit is None:
        hit = (_derive(spec),)
        _SPECS.put(spec, hit)
    return hit[0]


def _derive(spec: AttentionSpec) -> Optional[AttentionSpec]:
    band = spec.band
    if (spec.score_mod is None or band is None or band.left is not None or band.right != 0
            or spec.qkv_format not in _SEQ_DIM or spec.padding or spec.dropout_p or spec.backend == "reference"):
        return None
    from .distributed.sharding import index_uses, tensor_axes

    uses, axes = index_uses(spec.score_mod), tensor_axes(spec.score_mod)
    if uses is None or axes is None or uses & {"q_idx", "length"}:
        return None
    if any(a == "q_idx" or a is None for ax in axes.values() for a in ax):
        return None
    return dataclasses.replace(spec, attn_mask_type="causal_bottom_right", band=Band(None, 0, True))


def needs_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mod: Any,
               sinks: Optional[torch.Tensor]) -> bool:
    """Whether this call records a backward (chunked only from MIN_QUERIES_TRAINING queries)."""
    return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                        or _trains_extras(mod, sinks))


def bounds(sq: int, chunks: int = CHUNKS) -> List[Tuple[int, int]]:
    """Query chunk bounds [(q0, q1), ...] covering [0, sq), inner bounds on multiples of 128."""
    cuts = sorted({min(sq, -(-sq * c // chunks) // _TILE * _TILE) for c in range(1, chunks)} - {0, sq})
    edges = [0] + cuts + [sq]
    return list(zip(edges[:-1], edges[1:]))


def run_in_chunks(spec: AttentionSpec, sub: AttentionSpec, mod: Any, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, sinks: Optional[torch.Tensor]):
    """out (and lse, (B, H, Sq)) of `spec` computed chunk by chunk with `sub`, or None when the
    shapes or the gradients asked for do not qualify (the caller then runs the plain path)."""
    seq = _SEQ_DIM[spec.qkv_format]
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in (query, key, value)):
        return None  # the plain path validates and names the argument
    sq, skv = query.shape[seq], key.shape[seq]
    if sq < MIN_QUERIES or skv < sq or value.shape[seq] != skv:
        return None
    grad = needs_grad(query, key, value, mod, sinks)
    if grad and (sq < MIN_QUERIES_TRAINING or _trains_extras(mod, sinks)):
        return None
    from .plan import NO_VARLEN, get_plan

    shift = skv - sq if spec.band.bottom_right else 0
    parts = []
    for q0, q1 in bounds(sq):
        kend = q1 + shift
        qc, kc, vc = query.narrow(seq, q0, q1 - q0), key.narrow(seq, 0, kend), value.narrow(seq, 0, kend)
        parts.append((q0, q1, kend, get_plan(sub, mod, qc, kc, vc, NO_VARLEN, sinks, force_grad=grad).runner))
    call = (tuple(parts), seq, mod, sinks, spec.return_lse)
    if grad:
        out, lse = ChunkedCausal.apply(call, query, key, value)
    else:
        out, lse, _ = _forward(call, query, key, value, keep=False)
    return (out, lse) if spec.return_lse else out


def _trains_extras(mod: Any, sinks: Optional[torch.Tensor]) -> bool:
    """Gradients other than dq, dk, dv asked for (score_mod tables, sinks): not chunked."""
    if sinks is not None and sinks.requires_grad:
        return True
    tensors = mod.tensors() if hasattr(mod, "tensors") else {}
    return any(t.requires_grad for t in tensors.values())


def _forward(call: tuple, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: bool):
    """(out, lse or None, per chunk (saved, state) when keep) with each chunk written in place."""
    from .plan import NO_VARLEN

    parts, seq, mod, sinks, want_lse = call
    out = torch.empty(tuple(query.shape[:-1]) + (value.shape[-1],), dtype=query.dtype, device=query.device)
    lse = None
    kept = []
    for q0, q1, kend, runner in parts:
        qc, kc, vc = query.narrow(seq, q0, q1 - q0), key.narrow(seq, 0, kend), value.narrow(seq, 0, kend)
        if keep:
            o, l, saved, state = runner.forward(qc, kc, vc, NO_VARLEN, mod, sinks)
            kept.append((saved, state))
        else:  # no gradient: the runner's plain (inference) forward
            o, l = attention(runner, qc, kc, vc, NO_VARLEN, mod, sinks)
        out.narrow(seq, q0, q1 - q0).copy_(o)
        if want_lse:
            if lse is None:
                lse = torch.empty(tuple(l.shape[:2]) + (query.shape[seq],), dtype=torch.float32, device=l.device)
            lse[:, :, q0:q1].copy_(l)
    return out, lse, kept


class ChunkedCausal(torch.autograd.Function):
    """apply((parts, seq dim, mod, sinks, want_lse), q, k, v) -> (out, lse or None): each chunk's
    runner forward, and a backward that writes each chunk's dQ in place and adds its dK / dV into
    fp32 prefix accumulators (no full-size zero-filled slice gradients per chunk)."""

    @staticmethod
    def forward(ctx, call: tuple, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        out, lse, kept = _forward(call, query, key, value, keep=True)
        ctx.parts, ctx.seq, ctx.mod = call[0], call[1], call[2]
        ctx.mod_values = getattr(call[2], "_values", None)
        ctx.states = [state for _, state in kept]
        ctx.counts = [len(saved) for saved, _ in kept]
        ctx.meta = [(t.shape, t.dtype) for t in (query, key, value)]
        ctx.save_for_backward(*[t for saved, _ in kept for t in saved])
        if lse is not None:
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Optional[torch.Tensor], _grad_lse: Optional[torch.Tensor]):
        if grad_out is None:
            return None, None, None, None
        from .autograd import check_mod_unchanged

        check_mod_unchanged(ctx.mod, ctx.mod_values)
        flat = ctx.saved_tensors
        (q_shape, q_dtype), (k_shape, k_dtype), (v_shape, v_dtype) = ctx.meta
        dev, seq = grad_out.device, ctx.seq
        dq = torch.empty(q_shape, dtype=q_dtype, device=dev)
        acc = torch.float64 if k_dtype == torch.float64 else torch.float32
        dk = torch.zeros(k_shape, dtype=acc, device=dev)
        dv = torch.zeros(v_shape, dtype=acc, device=dev)
        start = 0
        for (q0, q1, kend, runner), state, n in zip(ctx.parts, ctx.states, ctx.counts):
            grads = runner.backward(state, flat[start:start + n], grad_out.narrow(seq, q0, q1 - q0))
            start += n
            dq.narrow(seq, q0, q1 - q0).copy_(grads[0])
            dk.narrow(seq, 0, kend).add_(grads[1])
            dv.narrow(seq, 0, kend).add_(grads[2])
        return None, dq, dk.to(k_dtype), dv.to(v_dtype)
