"""Inputs and masks for tests: plain-torch oracles, written independently of the library's own
arithmetic. The float64 references and the tolerance rule are `fused_attn.testing`'s.

Tensors are logical (B, H, S, D) unless a docstring says otherwise.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, requires_grad: bool = False):
    """Fresh standard-normal CPU tensor from `gen` (never zeros)."""
    t = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    return t.requires_grad_(requires_grad)


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
