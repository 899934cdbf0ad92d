"""Inputs, masks and packed-sequence views for tests: plain-torch oracles, written independently of
the library's own arithmetic, and the float64 comparison of one packed sequence.

Tensors are logical (B, H, S, D) unless a docstring says otherwise.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch

from fused_attn.testing import assert_close, bound_from, grad_tolerances, reference_attention
from fused_attn.testing import tolerance as _tolerance

CAUSAL_TYPES = ("causal", "causal_bottom_right", "padding_causal")


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, requires_grad: bool = False):
    """Fresh standard-normal CPU tensor from `gen` (never zeros)."""
    t = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    return t.requires_grad_(requires_grad)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: Optional[torch.Tensor] = None, score_fn: Optional[Callable] = None,
                    dtype: torch.dtype = torch.float64):
    """`fused_attn.testing.reference_attention` (logical (B, H, S, D) tensors, computed in `dtype`)."""
    out, lse = reference_attention(q, k, v, scale, mask, score_fn, dtype=dtype)
    return out, lse.to(dtype)


def band_mask(sq: int, skv: int, left: int = -1, right: int = -1, bottom_right: bool = False,
              q_len: Optional[int] = None, kv_len: Optional[int] = None) -> torch.Tensor:
    """(Sq, Skv) bool: -left <= j - (i + shift) <= right (-1 unbounded), i < q_len, j < kv_len.

    shift = kv_len - q_len when bottom_right. Written with explicit loops on purpose (an oracle
    independent of the library's band arithmetic): each row's allowed keys are one interval, set
    by slicing (`band_mask_by_element` is the element-by-element definition it is tested against).
    """
    q_len = sq if q_len is None else q_len
    kv_len = skv if kv_len is None else kv_len
    shift = kv_len - q_len if bottom_right else 0
    m = torch.zeros(sq, skv, dtype=torch.bool)
    for i in range(q_len):
        lo = 0 if left == -1 else max(0, i + shift - left)
        hi = kv_len - 1 if right == -1 else min(kv_len - 1, i + shift + right)
        if lo <= hi:
            m[i, lo:hi + 1] = True
    return m


def band_mask_by_element(sq: int, skv: int, left: int = -1, right: int = -1, bottom_right: bool = False,
                         q_len: Optional[int] = None, kv_len: Optional[int] = None) -> torch.Tensor:
    """`band_mask`'s definition, one element at a time (slow: small sizes only)."""
    q_len = sq if q_len is None else q_len
    kv_len = skv if kv_len is None else kv_len
    shift = kv_len - q_len if bottom_right else 0
    m = torch.zeros(sq, skv, dtype=torch.bool)
    for i in range(q_len):
        for j in range(kv_len):
            d = j - (i + shift)
            m[i, j] = (right == -1 or d <= right) and (left == -1 or d >= -left)
    return m


def cu_seqlens(lengths: Sequence[int], gap: int = 0) -> torch.Tensor:
    """(B+1,) int32 prefix sums of `lengths`, with `gap` tokens after each sequence (padded offsets)."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n + gap)
    return torch.tensor(out, dtype=torch.int32)


def tolerance(q, k, v, scale, mask=None, score_fn=None, dtype=torch.float32, factor=3.0, floor=1e-6) -> float:
    """The project's tolerance rule (`fused_attn.testing.tolerance`) for a result computed in `dtype`."""
    return _tolerance(q, k, v, scale, dtype, mask, score_fn, factor=factor, floor=floor)


@functools.lru_cache(maxsize=None)
def sequence_mask(lq, lkv, attn_mask_type="no_mask", window_size=None):
    """Bool (Lq, Lkv) mask (True = attend) of one packed sequence, or None for every key.

    As documented by `dot_product_attention`: -left <= j - (i + shift) <= right, with right = 0
    for the causal types and shift = Lkv - Lq (this sequence's lengths) for causal_bottom_right;
    with thd the padding types equal their twins.
    """
    left, right = window_size or (-1, -1)
    if attn_mask_type in CAUSAL_TYPES:
        right = 0
    if left == right == -1:
        return None
    return band_mask(lq, lkv, left, right, attn_mask_type == "causal_bottom_right")


def packed_sequence(t, start, n):
    """Tokens start..start+n of a packed (T, H, D) tensor as a logical (1, H, n, D) view."""
    return t[start:start + n].transpose(0, 1)[None]


def check_packed_sequence(out, lse, grads, q, k, v, do, scale, mask=None, label="", score_fn=None):
    """Logical (B, H, S, D) out, lse (B, H, Sq) and grads of (q, k, v) for cotangent `do` against
    float64 with the tolerance rule; lse rows without an allowed key must be -inf in both, the
    bound comes from the naive same-dtype lse of the rows that have one."""
    q, k, v, do = (t.detach() for t in (q, k, v, do))
    dtype = q.dtype
    exact, exact_lse = reference_attention(q, k, v, scale, mask, score_fn)
    assert_close(out, exact, _tolerance(q, k, v, scale, dtype, mask, score_fn), label + "out")
    _, naive_lse = reference_attention(q, k, v, scale, mask, score_fn, dtype=dtype, softmax_dtype=torch.float32)
    rows = torch.isfinite(exact_lse)
    assert_close(lse, exact_lse, bound_from(naive_lse[rows], exact_lse[rows], dtype), label + "lse")
    want, bounds = grad_tolerances(q, k, v, do, scale, dtype, mask, score_fn)
    for name, got, w, bound in zip(("dq", "dk", "dv"), grads, want, bounds):
        assert_close(got, w, bound, label + name)
