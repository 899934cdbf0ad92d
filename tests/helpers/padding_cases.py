"""Padded batches whose padding is poisoned: the shared cases of tests/backends/*/test_padding_poison(_gpu).py.

A case is a padded batch (B sequences, S slots each, lengths per sequence for queries and keys,
0 and 1 included) in one of the dense formats with attn_mask_type "padding" / "padding_causal"
and cu_seqlens, or packed thd with one slot of S tokens per sequence (cu_seqlens_*_padded: the
same padding as gaps). Every position no query may see is poisoned with NaN or +-Inf: query rows
past a query length, key and value rows past a key length, and grad_out rows past a query length.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Tuple

import torch
from hypothesis import strategies as st

import fused_attn
from fused_attn.layouts import to_logical

FORMATS = ("bshd", "sbhd", "bhsd", "thd")
MASKS = ("padding", "padding_causal")
POISONS = (math.nan, math.inf, -math.inf)


class Case(NamedTuple):
    fmt: str
    mask: str
    s: int
    lens_q: Tuple[int, ...]
    lens_kv: Tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    poison: float
    seed: int


@st.composite
def cases(draw, dtypes, head_dims) -> Case:
    """A hypothesis strategy of poisoned padded cases (dtypes / head_dims: the choices)."""
    s = draw(st.integers(1, 9))
    b = draw(st.integers(1, 3))
    lens = st.lists(st.integers(0, s), min_size=b, max_size=b).map(tuple)
    kv_heads = draw(st.sampled_from((1, 2)))
    return Case(fmt=draw(st.sampled_from(FORMATS)), mask=draw(st.sampled_from(MASKS)), s=s, lens_q=draw(lens),
                lens_kv=draw(lens), heads=kv_heads * draw(st.sampled_from((1, 2))), kv_heads=kv_heads,
                head_dim=draw(st.sampled_from(head_dims)), dtype=draw(st.sampled_from(dtypes)),
                poison=draw(st.sampled_from(POISONS)), seed=draw(st.integers(0, 2**31 - 1)))


def allowed(case: Case) -> torch.Tensor:
    """(B, 1, S, S) bool: query i of sequence b may see key j (lengths, top-left causal)."""
    i = torch.arange(case.s).view(1, 1, -1, 1)
    j = torch.arange(case.s).view(1, 1, 1, -1)
    lq = torch.tensor(case.lens_q).view(-1, 1, 1, 1)
    lk = torch.tensor(case.lens_kv).view(-1, 1, 1, 1)
    ok = (i < lq) & (j < lk)
    return ok & (j <= i) if case.mask == "padding_causal" else ok


def logical_inputs(case: Case) -> Tuple[torch.Tensor, ...]:
    """Fresh clean float64 (q, k, v, grad_out), logical (B, H, S, D), from the case's seed."""
    gen = torch.Generator().manual_seed(case.seed)
    b, s, d = len(case.lens_q), case.s, case.head_dim
    shapes = ((b, case.heads, s, d), (b, case.kv_heads, s, d), (b, case.kv_heads, s, d), (b, case.heads, s, d))
    return tuple(torch.randn(sh, generator=gen, dtype=torch.float64) for sh in shapes)


def poisoned(case: Case, tensors: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
    """Copies of logical (q, k, v, grad_out) with every row no query sees set to case.poison."""
    q, k, v, g = (t.clone() for t in tensors)
    for b, (lq, lk) in enumerate(zip(case.lens_q, case.lens_kv)):
        q[b, :, lq:] = case.poison
        g[b, :, lq:] = case.poison
        k[b, :, lk:] = case.poison
        v[b, :, lk:] = case.poison
    return q, k, v, g


def _to_format(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """Logical (B, H, S, D) -> the format's layout (thd: (B*S, H, D), S token slots per sequence)."""
    if fmt == "thd":
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).contiguous()
    perm = {"bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3), "bhsd": (0, 1, 2, 3)}[fmt]
    return t.permute(perm).contiguous()


def _to_logical(t: torch.Tensor, case: Case) -> torch.Tensor:
    if case.fmt == "thd":
        return t.view(len(case.lens_q), case.s, t.shape[1], t.shape[2]).transpose(1, 2)
    return to_logical(t, case.fmt)


def _cu(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def run(case: Case, tensors: Tuple[torch.Tensor, ...], device: str, backend: str) -> Tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of the case's call on `tensors` (logical float64 q, k, v, grad_out), logical."""
    q, k, v, g = (_to_format(t, case.fmt).to(device=device, dtype=case.dtype) for t in tensors)
    for t in (q, k, v):
        t.requires_grad_(True)
    b = len(case.lens_q)
    kwargs = dict(qkv_format=case.fmt, attn_mask_type=case.mask, cu_seqlens_q=_cu(case.lens_q, device),
                  cu_seqlens_kv=_cu(case.lens_kv, device), backend=backend)
    if case.fmt == "thd":
        slots = torch.arange(b + 1, dtype=torch.int32, device=device) * case.s
        kwargs.update(cu_seqlens_q_padded=slots, cu_seqlens_kv_padded=slots, max_seqlen_q=case.s,
                      max_seqlen_kv=case.s)
    out = fused_attn.dot_product_attention(q, k, v, **kwargs)
    out.backward(g)
    return tuple(_to_logical(t.detach(), case).cpu() for t in (out, q.grad, k.grad, v.grad))
