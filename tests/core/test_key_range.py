"""Keys no query attends (causal / windowed dense calls) are never read: range, views, results."""

import math

import pytest
import torch

import fused_attn
from fused_attn.key_range import attended_key_range, trim_unattended_keys
from fused_attn.problem import Band
from fused_attn.testing import assert_close, grad_tolerances, reference_attention, tolerance


@pytest.mark.parametrize("band, sq, skv, want", [
    (Band(None, 0, False), 3, 6, (0, 3)),      # top-left causal: the tail is never attended
    (Band(None, 0, False), 6, 3, (0, 3)),      # more queries than keys: every key
    (Band(4, 0, True), 3, 20, (13, 20)),       # bottom-right window: the head is never attended
    (Band(None, 0, True), 5, 3, (0, 3)),
    (Band(2, 3, False), 10, 30, (0, 13)),      # top-left window with a right side
    (Band(0, 0, True), 1, 8, (7, 8)),          # decoding step with a window of one
])
def test_attended_key_range(band, sq, skv, want):
    assert attended_key_range(band, sq, skv) == want
    # brute force over the band's definition
    shift = skv - sq if band.bottom_right else 0
    seen = [j for j in range(skv) if any((band.left is None or j - (i + shift) >= -band.left)
                                         and (band.right is None or j - (i + shift) <= band.right)
                                         for i in range(sq))]
    assert (seen[0], seen[-1] + 1) == want


def test_trim_returns_views_or_the_same_tensors():
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 6, 4, 8), torch.randn(2, 6, 4, 8)
    tk, tv = trim_unattended_keys("bshd", Band(None, 0, False), q, k, v)
    assert tk.shape == (2, 3, 4, 8) and tk.data_ptr() == k.data_ptr() and tv._base is v
    assert trim_unattended_keys("bshd", Band(None, None, False), q, k, v) == (k, v)


@pytest.mark.slow
@pytest.mark.parametrize("kw, sq, skv", [
    (dict(attn_mask_type="causal"), 5, 9),
    (dict(attn_mask_type="causal_bottom_right", window_size=(2, 0)), 4, 11),
    (dict(window_size=(1, 2)), 4, 12),
])
def test_poisoned_unattended_keys_give_exact_results(kw, sq, skv):
    """NaN / Inf in keys and values no query attends: out and grads equal the clean inputs' (float64
    reference, the project's rule), and those keys get zero gradients."""
    g = torch.Generator().manual_seed(sq * skv)
    q, k, v, do = (torch.randn(2, n, 2, 16, generator=g) for n in (sq, skv, skv, sq))
    i, j = torch.arange(sq).view(-1, 1), torch.arange(skv).view(1, -1)
    band = {"causal": Band(None, 0, False), "causal_bottom_right": Band(2, 0, True)}.get(
        kw.get("attn_mask_type"), Band(1, 2, False))
    shift = skv - sq if band.bottom_right else 0
    mask = ((band.left is None) | (j - (i + shift) >= -(band.left or 0))) & (j - (i + shift) <= band.right)
    mask = mask.view(1, 1, sq, skv)
    unseen = ~mask.any(dim=2).view(skv)
    assert unseen.any()
    kp, vp = k.clone(), v.clone()
    kp[:, unseen], vp[:, unseen] = float("nan"), float("inf")
    leaves = [t.requires_grad_() for t in (q.clone(), kp, vp)]
    out = fused_attn.dot_product_attention(*leaves, **kw)
    grads = torch.autograd.grad(out, leaves, do)
    ql, kl, vl, dol = (t.transpose(1, 2) for t in (q, k, v, do))
    scale = 1 / math.sqrt(16)
    exact, _ = reference_attention(ql, kl, vl, scale, mask)
    assert_close(out.transpose(1, 2), exact, tolerance(ql, kl, vl, scale, torch.float32, mask), "out")
    want, bounds = grad_tolerances(ql, kl, vl, dol, scale, torch.float32, mask)
    for name, got, w, b in zip(("dq", "dk", "dv"), grads, want, bounds):
        assert_close(got.transpose(1, 2), w, b, name)
    assert (grads[1][:, unseen] == 0).all() and (grads[2][:, unseen] == 0).all()
