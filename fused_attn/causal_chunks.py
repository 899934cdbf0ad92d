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
Skv >= Sq, at least `MIN_QUERIES` queries, and no gradient: measured on H200 (B2 H16 S4096 D128
bf16, softcap(30) + causal), the forward drops from 0.66 to 0.455 ms, but through autograd
(slices in, a cat out) the backward's slice-gradient zero-fills and accumulations cost more than
the skipped tiles save (fwd+bwd 2.29 against 2.24 ms), and at 2048 queries a training step got
slower; a backward writing each chunk's gradients in place is the next step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import torch

from .memo import BoundedMemo
from .problem import Band
from .spec import AttentionSpec

__all__ = ["chunk_spec", "run_in_chunks", "needs_grad", "CHUNKS", "MIN_QUERIES"]

CHUNKS = 4
MIN_QUERIES = 4096
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
    """Whether this call records a backward (then it is not chunked, see the module docstring)."""
    if not torch.is_grad_enabled():
        return False
    if query.requires_grad or key.requires_grad or value.requires_grad or (sinks is not None and sinks.requires_grad):
        return True
    tensors = mod.tensors() if hasattr(mod, "tensors") else {}
    return any(t.requires_grad for t in tensors.values())


def bounds(sq: int, chunks: int = CHUNKS) -> List[Tuple[int, int]]:
    """Query chunk bounds [(q0, q1), ...] covering [0, sq), inner bounds on multiples of 128."""
    cuts = sorted({min(sq, -(-sq * c // chunks) // _TILE * _TILE) for c in range(1, chunks)} - {0, sq})
    edges = [0] + cuts + [sq]
    return list(zip(edges[:-1], edges[1:]))


def run_in_chunks(spec: AttentionSpec, sub: AttentionSpec, run: Callable[..., Any], query: torch.Tensor,
                  key: torch.Tensor, value: torch.Tensor, varlen: Any, sinks: Optional[torch.Tensor]):
    """`run(sub, query chunk, key prefix, value prefix, varlen, sinks)` per chunk, outputs (and
    lse, (B, H, Sq)) concatenated along the sequence; None when the shapes do not qualify."""
    seq = _SEQ_DIM[spec.qkv_format]
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in (query, key, value)):
        return None  # the plain path validates and names the argument
    sq, skv = query.shape[seq], key.shape[seq]
    if sq < MIN_QUERIES or skv < sq or value.shape[seq] != skv:
        return None
    shift = skv - sq if spec.band.bottom_right else 0
    outs, lses = [], []
    for q0, q1 in bounds(sq):
        kend = q1 + shift
        got = run(sub, query.narrow(seq, q0, q1 - q0), key.narrow(seq, 0, kend), value.narrow(seq, 0, kend),
                  varlen, sinks)
        if spec.return_lse:
            outs.append(got[0])
            lses.append(got[1])
        else:
            outs.append(got)
    out = torch.cat(outs, dim=seq)
    return (out, torch.cat(lses, dim=2)) if spec.return_lse else out
