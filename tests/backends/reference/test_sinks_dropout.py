"""Attention sinks and attention dropout on the reference backend (CPU), against float64 math."""

import math

import pytest
import torch

import fused_attn
from fused_attn.testing import (assert_close, grad_tolerances, lse_tolerance, mask_band, packed_tolerances,
                                reference_attention, tolerance)


def qkv(gen, b=2, s=7, h=3, hkv=3, d=8, dtype=torch.float64):
    t = [torch.randn(b, s, n, d, generator=gen, dtype=dtype).requires_grad_() for n in (h, hkv, hkv)]
    return t


def logical(t):
    return t.detach().transpose(1, 2)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
@pytest.mark.parametrize("hkv", [3, 1])
def test_sinks_match_float64(gen, softmax_type, mask, hkv):
    q, k, v = qkv(gen, hkv=hkv, dtype=torch.float32)
    sinks = None
    if softmax_type == "learnable":
        sinks = torch.tensor([0.7, -1.5, 3.0], requires_grad=True)
    out, lse = fused_attn.dot_product_attention(q, k, v, attn_mask_type=mask, softmax_type=softmax_type, sinks=sinks,
                                                return_lse=True)
    do = torch.randn(out.shape, generator=gen)
    wrt = (q, k, v) + ((sinks,) if sinks is not None else ())
    grads = torch.autograd.grad(out, wrt, do)
    m = torch.ones(7, 7, dtype=torch.bool).tril() if mask == "causal" else None
    ref_sinks = sinks.detach() if sinks is not None else torch.zeros(3)
    exact, _ = reference_attention(logical(q), logical(k), logical(v), 8 ** -0.5, m, None, ref_sinks)
    exact_lse, lse_bound = lse_tolerance(logical(q), logical(k), logical(v), 8 ** -0.5, torch.float32, m, None,
                                         ref_sinks)
    assert_close(logical(out), exact, tolerance(logical(q), logical(k), logical(v), 8 ** -0.5, torch.float32, m,
                                                None, ref_sinks), "out")
    assert_close(lse, exact_lse, lse_bound, "lse (sink included)")
    want, bounds = grad_tolerances(logical(q), logical(k), logical(v), logical(do), 8 ** -0.5, torch.float32, m, None,
                                   ref_sinks)
    for name, got, w, bound in zip(("dq", "dk", "dv", "dsinks"), grads, want, bounds):
        assert_close(got if name == "dsinks" else logical(got), w, bound, name)


def test_sinks_thd_match_dense_per_sequence(gen):
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    q, k, v = (torch.randn(8, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.5, -0.25], dtype=torch.float64)
    out = fused_attn.dot_product_attention(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                           softmax_type="learnable", sinks=sinks, attn_mask_type="causal")
    exact, bounds = packed_tolerances(q, k, v, None, cu, cu, 8 ** -0.5, torch.float64, band=mask_band("causal"),
                                      sinks=sinks)
    assert_close(out, exact["out"], bounds["out"], "out")


def test_module_learnable_sinks_are_a_trained_parameter(gen):
    attn = fused_attn.DotProductAttention(3, 8, softmax_type="learnable")
    assert isinstance(attn.sinks, torch.nn.Parameter) and attn.sinks.shape == (3,)
    assert "sinks" in dict(attn.named_parameters())
    q, k, v = qkv(gen, dtype=torch.float32)
    attn(q, k, v).square().sum().backward()
    assert attn.sinks.grad is not None and attn.sinks.grad.abs().sum() > 0


@pytest.mark.parametrize("kw,exc,match", [
    (dict(softmax_type="learnable"), ValueError, "softmax_type='learnable' needs sinks"),
    (dict(softmax_type="vanilla", sinks=torch.zeros(3)), ValueError, "sinks given with softmax_type='vanilla'"),
    (dict(softmax_type="learnable", sinks=torch.zeros(4)), ValueError, r"sinks must have shape \(H,\) = \(3,\)"),
    (dict(softmax_type="learnable", sinks=torch.zeros(3, dtype=torch.int64)), TypeError, "floating dtype"),
    (dict(softmax_type="sigmoid"), ValueError, "softmax_type='sigmoid' is not supported"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be a float in \[0, 1\), got 1.0"),
    (dict(dropout_p=-0.1), ValueError, r"dropout_p must be a float in \[0, 1\)"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
])
def test_sinks_and_dropout_argument_errors(gen, kw, exc, match):
    q, k, v = qkv(gen)
    with pytest.raises(exc, match=match):
        fused_attn.dot_product_attention(q, k, v, **kw)


def test_dropout_zero_is_exact(gen):
    q, k, v = qkv(gen)
    a = fused_attn.dot_product_attention(q, k, v, dropout_p=0.0)
    b = fused_attn.dot_product_attention(q, k, v)
    assert torch.equal(a, b)


@pytest.mark.slow
def test_dropout_statistics(gen):
    """E[out] equals the no-dropout output; the kept fraction of weights is 1 - p."""
    q, k, v = qkv(gen, b=1, s=16, h=2, hkv=2, d=8)
    p, n = 0.3, 400
    plain = fused_attn.dot_product_attention(q, k, v).detach()
    torch.manual_seed(0)
    outs = torch.stack([fused_attn.dot_product_attention(q, k, v, dropout_p=p).detach() for _ in range(n)])
    mean, std = outs.mean(0), outs.std(0)
    # the mean of n draws is within 5 standard errors of the expectation everywhere
    assert ((mean - plain).abs() <= 5 * std / math.sqrt(n) + 1e-9).all()
    # with v = identity rows, out holds the kept, rescaled weights themselves: kept fraction ~ 1 - p
    eye_v = torch.eye(16, dtype=torch.float64).view(1, 16, 1, 16).expand(1, 16, 2, 16).contiguous()
    w = fused_attn.dot_product_attention(q.detach(), k.detach(), eye_v, dropout_p=p)
    kept = (w != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 0.06


@pytest.mark.slow
def test_dropout_backward_uses_the_forward_mask(gen):
    """With the RNG seeded per evaluation the function is deterministic: gradcheck verifies that
    the backward differentiates exactly the forward's dropped attention."""
    q, k, v = qkv(gen, b=1, s=5, h=2, hkv=1, d=4)

    def f(a, b, c):
        torch.manual_seed(123)
        return fused_attn.dot_product_attention(a, b, c, dropout_p=0.4, attn_mask_type="causal")

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_module_dropout_only_in_training(gen):
    attn = fused_attn.DotProductAttention(3, 8, attention_dropout=0.5)
    q, k, v = qkv(gen)
    attn.eval()
    assert torch.equal(attn(q, k, v), fused_attn.dot_product_attention(q, k, v))
    attn.train()
    torch.manual_seed(1)
    a = attn(q, k, v)
    torch.manual_seed(1)
    b = attn(q, k, v)
    assert torch.equal(a, b) and not torch.equal(a, fused_attn.dot_product_attention(q, k, v))
