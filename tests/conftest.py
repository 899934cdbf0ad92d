"""Shared test helpers: a seeded generator, the float64 reference and the tolerance rule
(both from `fused_attn.testing`, the one place that defines them).

Other test files may `from conftest import naive_attention, band_mask, rand` or use the fixtures.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable, Optional, Sequence

import pytest
import torch

from fused_attn.testing import assert_close, bound_from, grad_tolerances, reference_attention
from fused_attn.testing import tolerance as _tolerance

CAUSAL_TYPES = ("causal", "causal_bottom_right", "padding_causal")


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, requires_grad: bool = False):
    """Fresh standard-normal CPU tensor from `gen` (never zeros)."""
    t = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    return t.requires_grad_(requires_grad)


def quick_cover(*axes: Sequence) -> list:
    """Every combination of the axes' values as pytest.params, for one parametrize over all their
    names: the few combinations that together take each value of each axis at least once (the
    i-th value of every axis, cycling the shorter axes) stay in the quick set, the others are
    marked `slow`. A tuple value of an axis gives several arguments (wrap a tuple meant as one
    argument in a 1-tuple)."""
    longest = max(len(a) for a in axes)
    quick = {tuple(i % len(a) for a in axes) for i in range(longest)}
    params = []
    for index in itertools.product(*(range(len(a)) for a in axes)):
        values = []
        for a, i in zip(axes, index):
            v = a[i]
            values.extend(v if isinstance(v, tuple) else (v,))
        params.append(pytest.param(*values, marks=() if index in quick else pytest.mark.slow))
    return params


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


@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded CPU generator per test."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def naive() -> Callable:
    return naive_attention


def quirk_applies(name: str) -> bool:
    """Whether the cuDNN quirk `name` applies on the cuDNN this process loaded (GPU tests: a
    refusal is expected exactly where its entry says)."""
    from fused_attn.backends.cudnn import quirks, version

    return quirks.applies(name, version.backend_version())


def axis_bias_mods(w: torch.Tensor):
    """(query_bias, key_bias): `score + w[q_idx]` and `score + w[kv_idx]` bound to the (S,) table w:
    the two sides of cuDNN 9.19's key-axis backward fault (tests of the refusal boundary)."""
    from score_mods import TensorParam, score_mod

    @score_mod(name="query_bias")
    def query_bias(score, b, h, q_idx, kv_idx, w=TensorParam("float")):
        return score + w[q_idx]

    @score_mod(name="key_bias")
    def key_bias(score, b, h, q_idx, kv_idx, w=TensorParam("float")):
        return score + w[kv_idx]

    return query_bias(w=w), key_bias(w=w)


def batch_table_mods(lens: torch.Tensor, w: torch.Tensor):
    """Mods reading per-sequence tables: {name: (mod, reads a (B, 1|H, 1, 1) operand outside an add)}.
    lens (B,) int32 key counts, w (B,) float; `mask_bkv` reads the same bound as a (B, S) table."""
    import math

    from score_mods import TensorParam, score_mod, where

    @score_mod(name="add_b")
    def add_b(score, b, h, q_idx, kv_idx, w=TensorParam("float")):
        return score + w[b]

    @score_mod(name="mul_b")
    def mul_b(score, b, h, q_idx, kv_idx, w=TensorParam("float")):
        return score * w[b]

    @score_mod(name="mask_b")
    def mask_b(score, b, h, q_idx, kv_idx, lens=TensorParam("int")):
        return where(kv_idx < lens[b], score, -math.inf)

    @score_mod(name="mask_bkv")
    def mask_bkv(score, b, h, q_idx, kv_idx, keep=TensorParam("int")):
        return where(keep[b, kv_idx] != 0, score, -math.inf)

    keep = (torch.arange(256, device=lens.device)[None, :] < lens[:, None]).to(torch.int32)
    return {"add_b": (add_b(w=w), False), "mul_b": (mul_b(w=w), True), "mask_b": (mask_b(lens=lens), True),
            "mask_bkv": (mask_bkv(keep=keep), False)}
