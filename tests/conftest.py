"""Shared test helpers: a seeded generator and a float64 naive attention.

Other test files may `from conftest import naive_attention, band_mask, rand` or use the fixtures.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import pytest
import torch


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, requires_grad: bool = False):
    """Fresh standard-normal CPU tensor from `gen` (never zeros)."""
    t = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    return t.requires_grad_(requires_grad)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: Optional[torch.Tensor] = None, score_fn: Optional[Callable] = None,
                    dtype: torch.dtype = torch.float64):
    """softmax(score_fn(scale * q k^T) masked) v on logical (B, H, S, D) tensors, computed in `dtype`.

    k/v may have fewer heads (GQA: repeated). mask: bool, broadcastable to (B, H, Sq, Skv), True =
    attend. score_fn(s, b, h, q_idx, kv_idx) with broadcastable int64 index tensors.
    Returns (out (B, H, Sq, Dv), lse (B, H, Sq)); rows with no allowed key: out 0, lse -inf.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if score_fn is not None:
        bsz, h, sq, skv = s.shape
        s = score_fn(s, torch.arange(bsz).view(-1, 1, 1, 1), torch.arange(h).view(1, -1, 1, 1),
                     torch.arange(sq).view(1, 1, -1, 1), torch.arange(skv).view(1, 1, 1, -1))
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v, lse


def band_mask(sq: int, skv: int, left: int = -1, right: int = -1, bottom_right: bool = False,
              q_len: Optional[int] = None, kv_len: Optional[int] = None) -> torch.Tensor:
    """(Sq, Skv) bool: -left <= j - (i + shift) <= right (-1 unbounded), i < q_len, j < kv_len.

    shift = kv_len - q_len when bottom_right. Written with explicit loops on purpose.
    """
    q_len = sq if q_len is None else q_len
    kv_len = skv if kv_len is None else kv_len
    shift = kv_len - q_len if bottom_right else 0
    m = torch.zeros(sq, skv, dtype=torch.bool)
    for i in range(q_len):
        for j in range(kv_len):
            d = j - (i + shift)
            m[i, j] = (right == -1 or d <= right) and (left == -1 or d >= -left)
    return m


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    """(B+1,) int32 prefix sums of `lengths`."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def tolerance(q, k, v, scale, mask=None, score_fn=None, dtype=torch.float32, factor=3.0, floor=1e-6) -> float:
    """factor * (max error of naive attention computed in `dtype` vs float64) + floor."""
    exact, _ = naive_attention(q, k, v, scale, mask, score_fn)
    approx, _ = naive_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale, mask, score_fn, dtype=dtype)
    return factor * (approx.double() - exact).abs().max().item() + floor


@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded CPU generator per test."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def naive() -> Callable:
    return naive_attention
