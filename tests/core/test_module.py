"""DotProductAttention (nn.Module) against the functional API."""

from __future__ import annotations

import pytest
import torch

import fused_attn
from fused_attn.testing import agreement_bound, assert_close
from helpers.attention import cu_seqlens, rand


def test_module_matches_functional(gen):
    q, k, v = rand(gen, 2, 6, 4, 8), rand(gen, 2, 6, 2, 8), rand(gen, 2, 6, 2, 4)
    m = fused_attn.DotProductAttention(4, (8, 4), num_gqa_groups=2, attn_mask_type="causal", window_size=(2, 0),
                                       softmax_scale=0.3, backend="reference")
    want = fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal", window_size=(2, 0), softmax_scale=0.3,
                                            backend="reference")
    assert torch.equal(m(q, k, v), want)


def test_per_call_overrides(gen):
    q, k, v = rand(gen, 2, 6, 2, 8), rand(gen, 2, 6, 2, 8), rand(gen, 2, 6, 2, 8)
    m = fused_attn.DotProductAttention(2, 8, backend="reference")
    lengths = cu_seqlens([6, 3])
    out, lse = m(q, k, v, attn_mask_type="padding_causal", cu_seqlens_q=lengths, cu_seqlens_kv=lengths,
                 return_lse=True)
    want, want_lse = fused_attn.dot_product_attention(q, k, v, attn_mask_type="padding_causal", cu_seqlens_q=lengths,
                                                      cu_seqlens_kv=lengths, return_lse=True, backend="reference")
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert not torch.equal(m(q, k, v), out)  # the override did not stick


def test_per_call_score_mod(gen):
    from helpers.mods import IndexMod

    q, k, v = rand(gen, 2, 5, 2, 8), rand(gen, 2, 5, 2, 8), rand(gen, 2, 5, 2, 8)
    m = fused_attn.DotProductAttention(2, 8, backend="reference")
    want = fused_attn.dot_product_attention(q, k, v, score_mod=IndexMod(), backend="reference")
    assert torch.equal(m(q, k, v, score_mod=IndexMod()), want)


def test_module_thd(gen):
    q, k, v = rand(gen, 7, 4, 8), rand(gen, 7, 4, 8), rand(gen, 7, 4, 8)
    cu = cu_seqlens([3, 4])
    m = fused_attn.DotProductAttention(4, 8, qkv_format="thd", attn_mask_type="causal", backend="reference")
    want = fused_attn.dot_product_attention(q, k, v, qkv_format="thd", attn_mask_type="causal", cu_seqlens_q=cu,
                                            cu_seqlens_kv=cu, backend="reference")
    assert torch.equal(m(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu), want)


def test_gradients_flow(gen):
    q = rand(gen, 1, 4, 2, 8, requires_grad=True)
    k, v = rand(gen, 1, 4, 2, 8, requires_grad=True), rand(gen, 1, 4, 2, 8, requires_grad=True)
    fused_attn.DotProductAttention(2, 8, backend="reference")(q, k, v).square().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


@pytest.mark.parametrize("shapes,match", [
    (((1, 4, 3, 8), (1, 4, 2, 8), (1, 4, 2, 8)), r"query has 3 heads but the module was built with "
                                                  r"num_attention_heads=4"),
    (((1, 4, 4, 8), (1, 4, 1, 8), (1, 4, 1, 8)), r"key has 1 heads but the module was built with num_gqa_groups=2"),
    (((1, 4, 4, 16), (1, 4, 2, 16), (1, 4, 2, 8)), r"query has head dim 16 but the module was built with "
                                                    r"kv_channels=\(8, 8\)"),
    (((1, 4, 4, 8), (1, 4, 2, 8), (1, 4, 2, 4)), r"value has head dim 4 but the module"),
])
def test_forward_checks_config(gen, shapes, match):
    m = fused_attn.DotProductAttention(4, 8, num_gqa_groups=2, backend="reference")
    with pytest.raises(ValueError, match=match):
        m(*(rand(gen, *s) for s in shapes))


def test_unknown_forward_kwarg(gen):
    m = fused_attn.DotProductAttention(2, 8)
    t = rand(gen, 1, 4, 2, 8)
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['mask'\]"):
        m(t, t, t, mask=None)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(num_attention_heads=0, kv_channels=8), ValueError, "num_attention_heads must be a positive int, got 0"),
    (dict(num_attention_heads=2, kv_channels="8"), TypeError, "kv_channels must be a positive int, got '8'"),
    (dict(num_attention_heads=2, kv_channels=(8, 8, 8)), ValueError, r"kv_channels must be an int or a \(qk, v\) pair"),
    (dict(num_attention_heads=4, kv_channels=8, num_gqa_groups=3), ValueError,
     r"num_attention_heads \(4\) must be a multiple of num_gqa_groups \(3\)"),
    (dict(num_attention_heads=2, kv_channels=8, qkv_format="bsh"), ValueError, "qkv_format='bsh' is not supported"),
    (dict(num_attention_heads=2, kv_channels=8, attn_mask_type="causal", window_size=(1, 1)), ValueError,
     "right bound to be 0 or -1"),
    (dict(num_attention_heads=2, kv_channels=8, softmax_scale=-1.0), ValueError, "softmax_scale must be a positive"),
    (dict(num_attention_heads=2, kv_channels=8, backend="xla"), ValueError, "backend='xla' is not supported"),
])
def test_constructor_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        fused_attn.DotProductAttention(**kw)


def test_extra_repr():
    m = fused_attn.DotProductAttention(8, (64, 32), num_gqa_groups=2, attn_mask_type="causal", window_size=(16, 0))
    text = repr(m)
    for part in ("num_attention_heads=8", "kv_channels=(64, 32)", "num_gqa_groups=2", "attn_mask_type='causal'",
                 "window_size=(16, 0)", "backend='auto'"):
        assert part in text


def test_score_mod_changed_before_backward_keeps_the_forwards_function():
    """attn.score_mod = softcap(50.) between a forward with softcap(3.) and its backward: each call
    runs on a private copy of the configuration it started with, so the backward gives the
    gradient of the forward's function (softcap(3.)); the next call uses softcap(50.). A mod
    updated in place behind a call's back still raises (see test_band_chunks)."""
    import score_mods as sm

    q, k, v = (torch.randn(1, 16, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    attn = fused_attn.DotProductAttention(2, 8, score_mod=sm.softcap(3.0))
    for cap in (3.0, 50.0):
        out = attn(q, k, v)
        attn.score_mod = sm.softcap(50.0)
        (g,) = torch.autograd.grad(out.sum(), q)
        want = fused_attn.dot_product_attention(q, k, v, score_mod=sm.softcap(cap))
        (g_want,) = torch.autograd.grad(want.sum(), q)
        assert_close(g, g_want, agreement_bound(g_want), f"cap {cap}")


def test_context_parallel_arguments_are_checked():
    with pytest.raises(ValueError, match="cp_layout='zigzag' is not supported"):
        fused_attn.DotProductAttention(2, 16, cp_group=object(), cp_layout="zigzag")
    with pytest.raises(ValueError, match="cp_comm='tree' is not supported"):
        fused_attn.DotProductAttention(2, 16, cp_group=object(), cp_comm="tree")
    assert fused_attn.DotProductAttention(2, 16).cp_group is None
