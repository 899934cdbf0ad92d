"""layouts: format <-> logical (B, H, S, D) views without copies, output allocation."""

from __future__ import annotations

import pytest
import torch

from conftest import rand
from fused_attn import layouts
from fused_attn.functional import build_problem


@pytest.mark.parametrize("fmt,shape", [("bshd", (2, 5, 3, 4)), ("sbhd", (5, 2, 3, 4)), ("bhsd", (2, 3, 5, 4))])
def test_roundtrip_is_a_view(gen, fmt, shape):
    t = rand(gen, *shape)
    logical = layouts.to_logical(t, fmt)
    assert logical.shape == (2, 3, 5, 4) and logical.data_ptr() == t.data_ptr()
    assert layouts.dims(t, fmt) == (2, 3, 5, 4)
    assert layouts.format_shape(fmt, 2, 3, 5, 4) == shape
    back = layouts.from_logical(logical, fmt)
    assert back.shape == shape and back.data_ptr() == t.data_ptr() and torch.equal(back, t)
    # element [b, s, h, d] of bshd equals logical [b, h, s, d]
    assert logical[1, 2, 3, 0] == back[layouts.format_shape(fmt, 1, 2, 3, 0)]


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
def test_empty_like_output_dense(gen, fmt):
    q = layouts.from_logical(rand(gen, 2, 4, 5, 8), fmt).contiguous()
    k = layouts.from_logical(rand(gen, 2, 2, 6, 8), fmt).contiguous()
    v = layouts.from_logical(rand(gen, 2, 2, 6, 3), fmt).contiguous()
    problem, _ = build_problem(q, k, v, qkv_format=fmt)
    out, logical = layouts.empty_like_output(problem, zero=True)
    assert out.shape == layouts.format_shape(fmt, 2, 4, 5, 3) and out.is_contiguous()
    assert logical.shape == (2, 4, 5, 3) and logical.data_ptr() == out.data_ptr()
    assert layouts.lse_shape(problem) == (2, 4, 5)


def test_empty_like_output_thd(gen):
    q, k, v = rand(gen, 7, 4, 8), rand(gen, 9, 2, 8), rand(gen, 9, 2, 16)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    problem, _ = build_problem(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=torch.tensor(
        [0, 4, 9], dtype=torch.int32))
    out, logical = layouts.empty_like_output(problem, zero=True)
    assert out.shape == (7, 4, 16) and logical.shape == (4, 7, 16) and torch.all(out == 0)
    assert layouts.lse_shape(problem) == (4, 7)


def test_in_query_layout(gen):
    o = rand(gen, 2, 3, 5, 4)
    got = layouts.in_query_layout(o, "bshd")
    assert torch.equal(got, o) and layouts.from_logical(got, "bshd").is_contiguous()
