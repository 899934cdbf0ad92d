"""The one tolerance rule of the project, and the float64 attention it measures against.

Every numerical check (tests, benchmarks, the self-check) compares a result with a float64
reference and accepts an error of at most

    factor * (error of the same computation done naively in the result's dtype) + floor

where the "naive same-dtype computation" is plain torch math with the inputs cast to that dtype
(matmuls in that dtype, softmax in fp32, as torch's math attention does), measured against the
same float64 reference on the same inputs. So a bf16 kernel is held to bf16 accuracy, an fp32
path to fp32 accuracy, and the bound follows the inputs actually drawn (never zeros).

Tensors are logical (B, H, S, D): use `fused_attn.layouts.to_logical` for bshd/sbhd views.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

__all__ = ["reference_attention", "same_dtype_error", "tolerance", "grad_tolerances", "bound_from", "assert_close",
           "max_error", "DEFAULT_FACTOR", "DEFAULT_FLOOR"]

DEFAULT_FACTOR = 2.0
#: Absolute floor added to every bound (covers results that are exact in both computations).
DEFAULT_FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}

ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        mask: Optional[torch.Tensor] = None, score_fn: Optional[ScoreFn] = None,
                        sinks: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float64,
                        softmax_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """softmax(score_fn(scale * q k^T) masked, [sink]) v, computed in `dtype`.

    q (B, H, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv); H % Hkv == 0 (kv heads repeated).
    mask: bool broadcastable to (B, H, Sq, Skv), True = attend. score_fn(s, b, h, q_idx, kv_idx)
    with broadcastable int64 index tensors. sinks: (H,) logits of one extra key per head that
    has no value (attention sinks). softmax_dtype: precision of the softmax (default `dtype`).
    Returns (out (B, H, Sq, Dv) in `dtype`, lse (B, H, Sq) in float64 of the softmax's input,
    sink included). Rows with no allowed key and no sink: out 0, lse -inf, never NaN.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    sm = softmax_dtype or dtype
    s = s.to(sm)
    if score_fn is not None:
        b, h, sq, skv = s.shape
        s = score_fn(s, torch.arange(b, device=s.device).view(-1, 1, 1, 1),
                     torch.arange(h, device=s.device).view(1, -1, 1, 1),
                     torch.arange(sq, device=s.device).view(1, 1, -1, 1),
                     torch.arange(skv, device=s.device).view(1, 1, 1, -1)).to(sm)
    if mask is not None:
        s = s.masked_fill(~mask.to(s.device), -math.inf)
    if sinks is not None:
        sink_col = sinks.to(device=s.device, dtype=sm).view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        s = torch.cat([s, sink_col], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return (p.to(dtype) @ v), lse.double()


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| in float64; positions where both are the same infinity count 0."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    same_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = (a - e).abs().masked_fill(same_inf, 0.0)
    return float(diff.max()) if diff.numel() else 0.0


def same_dtype_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dtype: torch.dtype,
                     mask: Optional[torch.Tensor] = None, score_fn: Optional[ScoreFn] = None,
                     sinks: Optional[torch.Tensor] = None) -> float:
    """Max abs error of the naive computation in `dtype` (fp32 softmax) against float64."""
    exact, _ = reference_attention(q, k, v, scale, mask, score_fn, sinks)
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    approx, _ = reference_attention(q, k, v, scale, mask, score_fn, sinks, dtype=dtype, softmax_dtype=soft)
    return max_error(approx, exact)


def tolerance(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dtype: torch.dtype,
              mask: Optional[torch.Tensor] = None, score_fn: Optional[ScoreFn] = None,
              sinks: Optional[torch.Tensor] = None, factor: float = DEFAULT_FACTOR,
              floor: Optional[float] = None) -> float:
    """The project's bound for an output computed in `dtype` (see the module docstring)."""
    base = same_dtype_error(q, k, v, scale, dtype, mask, score_fn, sinks)
    return factor * base + (DEFAULT_FLOOR.get(dtype, 1e-5) if floor is None else floor)


def grad_tolerances(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, scale: float,
                    dtype: torch.dtype, mask: Optional[torch.Tensor] = None, score_fn: Optional[ScoreFn] = None,
                    sinks: Optional[torch.Tensor] = None, factor: float = DEFAULT_FACTOR,
                    floor: Optional[float] = None):
    """(exact grads, bounds): float64 gradients of q, k, v (and sinks when given) for the
    cotangent grad_out, and the matching bounds from the same-dtype naive computation."""

    def grads(dt: torch.dtype, soft: torch.dtype):
        leaves = [t.detach().to(dt).requires_grad_(True) for t in (q, k, v)]
        sink_leaf = None if sinks is None else sinks.detach().to(dt).requires_grad_(True)
        out, _ = reference_attention(*leaves, scale, mask, score_fn, sink_leaf, dtype=dt, softmax_dtype=soft)
        wrt = leaves + ([sink_leaf] if sink_leaf is not None else [])
        return torch.autograd.grad(out, wrt, grad_out.to(dt), allow_unused=True)

    exact = grads(torch.float64, torch.float64)
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    approx = grads(dtype, soft)
    bounds = [bound_from(a, e, dtype, factor, floor) for a, e in zip(approx, exact)]
    return exact, bounds


def bound_from(same_dtype: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, factor: float = DEFAULT_FACTOR,
               floor: Optional[float] = None) -> float:
    """The rule for any result (gradients, model logits, table gradients): `factor` times the
    error of the same computation done naively in `dtype` (`same_dtype`, against `exact`), plus
    the dtype's floor relative to max(1, max|exact|)."""
    fl = DEFAULT_FLOOR.get(dtype, 1e-5) if floor is None else floor
    scale = max(1.0, float(exact.detach().abs().max())) if exact.numel() else 1.0
    return factor * max_error(same_dtype, exact) + fl * scale


def assert_close(actual: torch.Tensor, expected: torch.Tensor, bound: float, what: str = "result") -> None:
    """Raise AssertionError naming `what` unless max |actual - expected| <= bound (NaN fails)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().double().cpu()
    if torch.isnan(a).any() and not torch.isnan(expected.detach().double().cpu()).any():
        raise AssertionError(f"{what}: {int(torch.isnan(a).sum())} NaN entries")
    err = max_error(actual, expected)
    if not err <= bound:
        raise AssertionError(f"{what}: max error {err:.3e} > bound {bound:.3e}")
