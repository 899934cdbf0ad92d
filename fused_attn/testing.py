"""The one tolerance rule of the project, and the float64 attention it measures against.

Every numerical check (tests, benchmarks, the self-check) compares a result with a float64
reference and accepts an error of at most

    factor * (error of the same computation done naively in the result's dtype) + floor

where the "naive same-dtype computation" is plain torch math with the inputs cast to that dtype
(matmuls in that dtype, softmax in fp32, as torch's math attention does), measured against the
same float64 reference on the same inputs. So a bf16 kernel is held to bf16 accuracy, an fp32
path to fp32 accuracy, and the bound follows the inputs actually drawn (never zeros).

Tensors are logical (B, H, S, D): use `fused_attn.layouts.to_logical` for bshd/sbhd views; packed
(thd) batches have their own reference, `packed_reference_attention`, and `packed_tolerances`.
Two computations of one result that differ only in rounding (another order, a compiled graph, a
float64 path against the float64 reference) are held to the dtype's floor: `agreement_bound`.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

__all__ = ["reference_attention", "same_dtype_error", "tolerance", "grad_tolerances", "bound_from", "assert_close",
           "max_error", "lse_tolerance", "assert_attention_close", "agreement_bound", "mask_band", "packed_reference_attention", "packed_tolerances",
           "DEFAULT_FACTOR", "DEFAULT_FLOOR"]

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


def lse_tolerance(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dtype: torch.dtype,
                  mask: Optional[torch.Tensor] = None, score_fn: Optional[ScoreFn] = None,
                  sinks: Optional[torch.Tensor] = None, factor: float = DEFAULT_FACTOR,
                  floor: Optional[float] = None) -> Tuple[torch.Tensor, float]:
    """(exact lse (B, H, Sq) float64, bound) for a log-sum-exp computed from inputs in `dtype`: the
    rule from the naive same-dtype lse (fp32 softmax) over the rows with an allowed key (the others
    are -inf in both)."""
    _, exact = reference_attention(q, k, v, scale, mask, score_fn, sinks)
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    _, naive = reference_attention(q, k, v, scale, mask, score_fn, sinks, dtype=dtype, softmax_dtype=soft)
    rows = torch.isfinite(exact)
    return exact, bound_from(naive[rows], exact[rows], dtype, factor, floor)


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


def assert_attention_close(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           mask: Optional[torch.Tensor] = None, score_fn: Optional[ScoreFn] = None,
                           lse: Optional[torch.Tensor] = None, grads=None, grad_out: Optional[torch.Tensor] = None,
                           what: str = "") -> None:
    """A call's logical out (B, H, Sq, Dv), and its lse (B, H, Sq) and gradients of (q, k, v) for
    the cotangent grad_out when given, against float64 with the rule for q's dtype (`tolerance`,
    `lse_tolerance`: rows without an allowed key are -inf in both, `grad_tolerances`)."""
    q, k, v = (t.detach() for t in (q, k, v))
    exact, _ = reference_attention(q, k, v, scale, mask, score_fn)
    assert_close(out, exact, tolerance(q, k, v, scale, q.dtype, mask, score_fn), what + "out")
    if lse is not None:
        exact_lse, bound = lse_tolerance(q, k, v, scale, q.dtype, mask, score_fn)
        assert_close(lse, exact_lse, bound, what + "lse")
    if grads is not None:
        want, bounds = grad_tolerances(q, k, v, grad_out.detach(), scale, q.dtype, mask, score_fn)
        for name, got, w, bound in zip(("dq", "dk", "dv"), grads, want, bounds):
            assert_close(got, w, bound, what + name)


def agreement_bound(expected: torch.Tensor, dtype: torch.dtype = torch.float64) -> float:
    """The rule with no same-dtype error: the dtype's floor relative to max(1, max|expected|). For two
    computations of one result in `dtype` that differ only in rounding, and for a float64 result
    against the float64 reference."""
    return bound_from(expected, expected, dtype)


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


# ----------------------------------------------------------------------------- packed (thd) batches

Band = Tuple[int, int, bool]


def mask_band(attn_mask_type: str = "no_mask", window_size: Optional[Tuple[int, int]] = None) -> Band:
    """(left, right, bottom_right) of `dot_product_attention`'s attn_mask_type and window_size:
    the causal types bound right at 0; "causal_bottom_right" aligns the band to the last key."""
    left, right = window_size if window_size is not None else (-1, -1)
    if attn_mask_type.endswith("causal") or attn_mask_type.endswith("causal_bottom_right"):
        right = 0
    return left, right, attn_mask_type.endswith("bottom_right")


def _sequence_mask(sq: int, skv: int, band: Band = (-1, -1, False), device=None) -> Optional[torch.Tensor]:
    """(Sq, Skv) bool, True = attend: -left <= j - (i + shift) <= right (-1 unbounded), shift =
    Skv - Sq when bottom_right else 0; None when the band allows every key."""
    left, right, bottom_right = band
    if left == -1 and right == -1:
        return None
    d = torch.arange(skv, device=device).view(1, -1) - torch.arange(sq, device=device).view(-1, 1)
    d = d - (skv - sq if bottom_right else 0)
    ok = torch.ones(sq, skv, dtype=torch.bool, device=device)
    if left != -1:
        ok &= d >= -left
    if right != -1:
        ok &= d <= right
    return ok


def packed_reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_kv: torch.Tensor, scale: float, band: Band = (-1, -1, False),
                               score_fn: Optional[ScoreFn] = None, sinks: Optional[torch.Tensor] = None,
                               cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                               cu_seqlens_kv_padded: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float64,
                               softmax_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """`reference_attention` of a packed (thd) batch, sequence by sequence.

    q (Tq, H, D), k (Tkv, Hkv, D), v (Tkv, Hkv, Dv); cu_seqlens_q/kv (B+1,) prefix sums of the
    lengths; *_padded: each sequence's first token when there are gaps (default: cu_seqlens).
    band: (left, right, bottom_right) per sequence (`mask_band` converts attn_mask_type and
    window_size; bottom_right shifts by that sequence's Skv - Sq). score_fn(s, b, h, q_idx, kv_idx)
    sees the sequence index b and positions within the sequence. Differentiable in q, k, v, sinks.
    Returns out (Tq, H, Dv) in `dtype` and lse (H, Tq) float64; tokens of no sequence: 0 and -inf.
    """
    lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    lens_kv = (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).tolist()
    starts_q = (cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded).tolist()
    starts_kv = (cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded).tolist()
    heads, dv = q.shape[1], v.shape[2]
    out = torch.zeros(q.shape[0], heads, dv, dtype=dtype, device=q.device)
    lse = torch.full((heads, q.shape[0]), -math.inf, dtype=torch.float64, device=q.device)
    pieces, rows = [], []
    for b, (nq, nk) in enumerate(zip(lens_q, lens_kv)):
        if nq == 0:
            continue
        sq, skv = slice(starts_q[b], starts_q[b] + nq), slice(starts_kv[b], starts_kv[b] + nk)
        qs, ks, vs = (t[s].transpose(0, 1)[None] for t, s in ((q, sq), (k, skv), (v, skv)))
        fn = None if score_fn is None else (lambda s, bb, h, qi, ki, b=b: score_fn(s, bb + b, h, qi, ki))
        o, l = reference_attention(qs, ks, vs, scale, _sequence_mask(nq, nk, band, q.device), fn, sinks, dtype,
                                   softmax_dtype)
        pieces.append(o[0].transpose(0, 1))
        rows.append(torch.arange(sq.start, sq.stop, device=q.device))
        lse[:, sq] = l[0]
    if pieces:  # index_put keeps the graph: gradients reach every sequence's tokens
        out = out.index_put((torch.cat(rows),), torch.cat(pieces))
    return out, lse


def packed_tolerances(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: Optional[torch.Tensor],
                      cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, scale: float, dtype: torch.dtype,
                      factor: float = DEFAULT_FACTOR, floor: Optional[float] = None, **packed):
    """(exact, bounds) for a packed call computed in `dtype`: exact {"out", "lse"[, "dq", "dk",
    "dv"[, "dsinks"]]} in float64 from `packed_reference_attention` (gradients for the cotangent
    grad_out (Tq, H, Dv) when given), bounds: the rule (`bound_from`) from the same computation
    done naively in `dtype`; lse over the rows with an allowed key. packed: its other arguments."""
    sinks = packed.pop("sinks", None)

    def run(dt: torch.dtype, soft: torch.dtype):
        leaves = [t.detach().to(dt).requires_grad_(grad_out is not None) for t in (q, k, v)]
        sink = None if sinks is None else sinks.detach().to(dt).requires_grad_(grad_out is not None)
        o, l = packed_reference_attention(*leaves, cu_seqlens_q, cu_seqlens_kv, scale, sinks=sink, dtype=dt,
                                          softmax_dtype=soft, **packed)
        result = {"out": o.detach(), "lse": l}
        if grad_out is not None:
            wrt = leaves + ([sink] if sink is not None else [])
            grads = torch.autograd.grad(o, wrt, grad_out.to(dt), allow_unused=True)
            names = ("dq", "dk", "dv", "dsinks")
            result.update({n: torch.zeros_like(w) if g is None else g for n, g, w in zip(names, grads, wrt)})
        return result

    exact = run(torch.float64, torch.float64)
    naive = run(dtype, torch.float64 if dtype == torch.float64 else torch.float32)
    rows = torch.isfinite(exact["lse"])
    bounds = {n: bound_from(naive[n][rows] if n == "lse" else naive[n], e[rows] if n == "lse" else e, dtype, factor,
                            floor) for n, e in exact.items()}
    return exact, bounds
