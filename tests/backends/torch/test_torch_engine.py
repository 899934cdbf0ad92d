"""The torch engine (CPU): every configuration it serves against float64 with the tolerance rule,
forward and gradients; the choice `backend="auto"` makes on CPU; its refusals and their reasons."""

from __future__ import annotations

import math

import pytest
import torch

import fused_attn
import fused_attn.functional as F
import score_mods as sm
from fused_attn.layouts import from_logical
from fused_attn.testing import agreement_bound, assert_attention_close, assert_close, reference_attention, tolerance
from helpers.attention import band_mask, cu_seqlens, rand

BAND_CASES = [  # (attn_mask_type, window_size)
    ("no_mask", None), ("causal", None), ("causal_bottom_right", None), ("no_mask", (2, 1)), ("no_mask", (0, -1)),
    ("no_mask", (-1, 2)), ("causal", (3, 0)), ("causal_bottom_right", (1, 0))]


def _mask(mask_type, window, sq, skv):
    left, right = window if window is not None else (-1, -1)
    if mask_type in ("causal", "causal_bottom_right"):
        right = 0
    if left == right == -1:
        return None
    return band_mask(sq, skv, left, right, bottom_right=mask_type == "causal_bottom_right")


def _qkv(gen, b, h, hkv, sq, skv, d, dtype, fmt="bshd", grad=True):
    """Logical (B, H, S, D) float64-drawn tensors cast to dtype, and their `fmt` views (leaves)."""
    logical = [rand(gen, b, n, s, d, dtype=dtype) for n, s in ((h, sq), (hkv, skv), (hkv, skv))]
    views = [from_logical(t, fmt).contiguous().requires_grad_(grad) for t in logical]
    return logical, views


PERM = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}


def _check(views, fmt, kw, mask, scale, score_fn=None, grads=True):
    q, k, v = views
    ql, kl, vl = (t.detach().permute(PERM[fmt]) for t in views)
    assert fused_attn.explain(q, k, v, qkv_format=fmt, **kw).backend == "torch"
    out, lse = fused_attn.dot_product_attention(q, k, v, qkv_format=fmt, return_lse=True, **kw)
    assert out.shape == from_logical(torch.empty(ql.shape[:3] + (vl.shape[3],)), fmt).shape and out.is_contiguous()
    o_log = out.permute(PERM[fmt])
    if not grads:
        exact, _ = reference_attention(ql, kl, vl, scale, mask, score_fn)
        assert_close(o_log, exact, tolerance(ql, kl, vl, scale, ql.dtype, mask, score_fn), "out")
        return
    do = torch.randn(o_log.shape, dtype=torch.float64).to(out.dtype)
    g = torch.autograd.grad(o_log, views, do)
    assert_attention_close(o_log, ql, kl, vl, scale, mask, lse=lse, grads=[t.permute(PERM[fmt]) for t in g], grad_out=do)


@pytest.mark.parametrize("mask_type,window", BAND_CASES)
@pytest.mark.parametrize("sq,skv", [(7, 7), (5, 11), (11, 5), (1, 1), (1, 9)])
def test_bands_gqa_awkward_lengths(gen, mask_type, window, sq, skv):
    """Causal variants, windows and bottom-right alignment with Sq != Skv (rows with no key: out 0,
    lse -inf), GQA 4/2, odd lengths and length 1: out, lse, dq, dk, dv against float64."""
    _, views = _qkv(gen, 2, 4, 2, sq, skv, 16, torch.float32)
    kw = dict(attn_mask_type=mask_type, window_size=window, softmax_scale=0.3)
    _check(views, "bshd", kw, _mask(mask_type, window, sq, skv), 0.3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
@pytest.mark.parametrize("mask_type,window", [("causal", None), ("no_mask", (3, 2))])
def test_dtypes_and_layouts(gen, dtype, fmt, mask_type, window):
    _, views = _qkv(gen, 2, 4, 1, 13, 13, 32, dtype, fmt)
    kw = dict(attn_mask_type=mask_type, window_size=window)
    _check(views, fmt, kw, _mask(mask_type, window, 13, 13), 1 / math.sqrt(32))


def test_fully_masked_rows_out_zero_lse_neg_inf_no_nan(gen):
    """causal_bottom_right with Sq > Skv: the first Sq - Skv rows attend nothing."""
    _, (q, k, v) = _qkv(gen, 1, 2, 2, 9, 4, 16, torch.bfloat16)
    out, lse = fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal_bottom_right", return_lse=True)
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5])) and torch.isneginf(lse[:, :, :5]).all()
    assert torch.isfinite(lse[:, :, 5:]).all()
    out.float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[:, :5], torch.zeros_like(q.grad[:, :5]))


def _padded(gen, lq, lkv, sq, skv, h, d, garbage):
    q, k, v = (rand(gen, len(lq), s, h, d) for s in (sq, skv, skv))
    for t, lens in ((q, lq), (k, lkv), (v, lkv)):
        for i, n in enumerate(lens):
            t[i, n:] = garbage
    return q, k, v


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_padding_lengths_with_garbage_in_padded_positions(gen, mask_type):
    """Dense padding: rows past a sequence's length give 0 and lse -inf; NaN in padded queries, keys
    and values (uninitialised memory) reaches nothing, forward or backward; equal to the reference
    (gradients compared with finite garbage: the reference's dq takes NaN from padded keys)."""
    lq, lkv = [8, 3, 0], [10, 6, 4]
    kw = dict(attn_mask_type=mask_type, cu_seqlens_q=cu_seqlens(lq), cu_seqlens_kv=cu_seqlens(lkv), return_lse=True)
    for garbage in (math.nan, 1e4):
        q, k, v = _padded(gen, lq, lkv, 8, 10, 2, 16, garbage)
        assert fused_attn.explain(q, k, v, **kw).backend == "torch"
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = fused_attn.dot_product_attention(*leaves, **kw)
        ref, ref_lse = fused_attn.dot_product_attention(*ref_leaves, backend="reference", **kw)
        assert not torch.isnan(out).any()
        assert_close(out, ref, agreement_bound(ref, torch.float32), "out")
        assert_close(lse, ref_lse, agreement_bound(ref_lse, torch.float32), "lse")
        do = torch.randn(out.shape, dtype=torch.float64).float()
        grads = torch.autograd.grad(out, leaves, do)
        ref_grads = torch.autograd.grad(ref, ref_leaves, do)
        for name, g, r, lens in zip("qkv", grads, ref_grads, (lq, lkv, lkv)):
            assert torch.isfinite(g).all(), f"d{name} with garbage {garbage}"
            for i, n in enumerate(lens):  # padded positions get no gradient
                assert torch.equal(g[i, n:], torch.zeros_like(g[i, n:])), f"d{name} past length {n} of sequence {i}"
            if garbage == garbage:
                assert_close(g, r, agreement_bound(r, torch.float32), f"d{name}")


def test_attention_forward_backward_with_lse_of_a_larger_attention(gen):
    """The context-parallel building blocks: gradients of one key chunk given the global out and lse."""
    _, (q, k, v) = _qkv(gen, 1, 4, 2, 6, 10, 16, torch.float32, grad=False)
    out, lse = F.attention_forward(q, k, v, attn_mask_type="causal_bottom_right")
    ref_out, ref_lse = F.attention_forward(q, k, v, attn_mask_type="causal_bottom_right", backend="reference")
    assert_close(out, ref_out, agreement_bound(ref_out, torch.float32), "out")
    assert_close(lse, ref_lse, agreement_bound(ref_lse, torch.float32), "lse")
    do = torch.randn_like(out)
    chunk = dict(attn_mask_type="no_mask")
    got = F.attention_backward(q, k[:, :4], v[:, :4], out, lse, do, **chunk)
    want = F.attention_backward(q, k[:, :4], v[:, :4], out, lse, do, backend="reference", **chunk)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, agreement_bound(w, torch.float32), name)


def test_module_runs_on_torch_engine_and_trains(gen):
    attn = fused_attn.DotProductAttention(num_attention_heads=4, kv_channels=16, num_gqa_groups=2,
                                          attn_mask_type="causal")
    _, (q, k, v) = _qkv(gen, 2, 4, 2, 9, 9, 16, torch.float32)
    out = attn(q, k, v)
    ref = fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal", backend="reference")
    assert_close(out, ref, agreement_bound(ref, torch.float32), "out")
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# ----------------------------------------------------------------------------- the choice, refusals


def _small(gen, dtype=torch.float32, dv=16, grad=False):
    return (rand(gen, 1, 5, 2, 16, dtype=dtype, requires_grad=grad), rand(gen, 1, 5, 2, 16, dtype=dtype, requires_grad=grad),
            rand(gen, 1, 5, 2, dv, dtype=dtype, requires_grad=grad))


def test_auto_picks_torch_on_cpu_and_says_why(gen):
    got = fused_attn.explain(*_small(gen))
    assert got.backend == "torch" and "torch serves it" in got.reason
    forced = fused_attn.explain(*_small(gen), backend="torch")
    assert forced.backend == "torch" and forced.reason == "backend='torch' was requested"


@pytest.mark.parametrize("case,kw,reason", [
    ("sinks", dict(softmax_type="off-by-one"), "sink logit"),
    ("dropout", dict(dropout_p=0.1), "dropout"),
    ("head dims", dict(dv=8), "head_dim_v 8 != head_dim 16"),
    ("mod grad", dict(score_mod=sm.softcap(20.0), grad=True), "no CPU backward"),
    ("mod lse", dict(score_mod=sm.softcap(20.0), return_lse=True), "returns no lse"),
    ("mod fp64", dict(score_mod=sm.softcap(20.0), dtype=torch.float64), "float32, float16 and bfloat16"),
])
def test_refusals_name_the_reason(gen, case, kw, reason):
    kw = dict(kw)
    tensors = _small(gen, kw.pop("dtype", torch.float32), kw.pop("dv", 16), kw.pop("grad", False))
    got = fused_attn.explain(*tensors, **kw)
    assert got.backend == "reference" and reason in got.reason, got.reason
    with pytest.raises(NotImplementedError, match=r"backend='torch' cannot run this problem: .*" + reason):
        fused_attn.explain(*tensors, backend="torch", **kw)


def test_refuses_packed_thd(gen):
    q, k, v = (rand(gen, 7, 2, 16) for _ in range(3))
    kw = dict(qkv_format="thd", cu_seqlens_q=cu_seqlens([3, 4]), cu_seqlens_kv=cu_seqlens([3, 4]))
    got = fused_attn.explain(q, k, v, **kw)
    assert got.backend == "reference" and "packed thd" in got.reason
    with pytest.raises(NotImplementedError, match="backend='torch' cannot run this problem: packed thd"):
        fused_attn.dot_product_attention(q, k, v, backend="torch", **kw)


def test_score_mod_with_gradients_runs_on_the_reference(gen):
    """Training with a score_mod on CPU: flex has no CPU backward, the reference serves it (and says so)."""
    q, k, v = _small(gen, grad=True)
    mod = sm.softcap(5.0)
    assert "no CPU backward" in fused_attn.explain(q, k, v, score_mod=mod).reason
    out = fused_attn.dot_product_attention(q, k, v, score_mod=mod)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


# ----------------------------------------------------------------------------- score_mods through flex


@pytest.mark.slow
def test_score_mods_are_refused_until_flex_is_right(gen):
    """The case that showed the flex path wrong now runs on the reference, exactly."""
    from fused_attn.testing import assert_close, bound_from

    q, k, v = (torch.randn(2, 8, 4, 16, generator=gen) for _ in range(3))
    kw = dict(score_mod=sm.softcap(3.0), attn_mask_type="causal")
    why = fused_attn.explain(q, k, v, **kw)
    assert why.backend == "reference" and "switched off" in why.reason
    exact = fused_attn.dot_product_attention(q.double(), k.double(), v.double(), backend="reference", **kw)
    same = fused_attn.dot_product_attention(q, k, v, backend="reference", **kw)
    assert_close(fused_attn.dot_product_attention(q, k, v, **kw).double(), exact,
                 bound_from(same.double(), exact, torch.float32), "auto on CPU")


@pytest.mark.xfail(strict=True, reason="score_mods on the torch engine are switched off (torch_sdpa.refusal)")
def test_score_mods_through_compiled_flex(gen):
    """softcap (with causal, GQA, bf16), ALiBi (a tensor parameter) and a user-written mod reading
    positions, inference, against float64; a new float value or tensor reuses the compiled function."""
    from fused_attn.backends import torch_flex

    @sm.score_mod
    def user_mod(score, b, h, q_idx, kv_idx, w=0.5):
        return score - w * sm.abs(q_idx - kv_idx) / (q_idx + 1)

    slopes = sm.alibi_slopes(4)
    cases = [
        (sm.softcap(2.0), dict(attn_mask_type="causal"), lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0), torch.bfloat16),
        (sm.alibi(slopes), dict(), lambda s, b, h, i, j: s + slopes.double()[h] * (j - i), torch.float32),
        (user_mod, dict(window_size=(4, 0)), lambda s, b, h, i, j: s - 0.5 * (i - j).abs() / (i + 1), torch.float32),
    ]
    for mod, kw, fn, dtype in cases:
        _, views = _qkv(gen, 2, 4, 2, 19, 19, 16, dtype, grad=False)
        mask = _mask(kw.get("attn_mask_type", "no_mask"), kw.get("window_size"), 19, 19)
        got = fused_attn.explain(*views, score_mod=mod, **kw)
        assert got.backend == "torch", got.reason
        out = fused_attn.dot_product_attention(*views, score_mod=mod, **kw)
        ql, kl, vl = (t.transpose(1, 2) for t in views)
        exact, _ = reference_attention(ql, kl, vl, 0.25, mask, fn)
        assert_close(out.transpose(1, 2), exact, tolerance(ql, kl, vl, 0.25, dtype, mask, fn), mod.name)
    compiles = torch_flex.FLEX_CACHE.info().misses
    _, views = _qkv(gen, 2, 4, 2, 19, 19, 16, torch.float32, grad=False)
    out = fused_attn.dot_product_attention(*views, score_mod=sm.alibi(slopes * 3))
    ql, kl, vl = (t.transpose(1, 2) for t in views)
    exact, _ = reference_attention(ql, kl, vl, 0.25, None, lambda s, b, h, i, j: s + 3 * slopes.double()[h] * (j - i))
    fn3 = lambda s, b, h, i, j: s + 3 * slopes.double()[h] * (j - i)  # noqa: E731
    assert_close(out.transpose(1, 2), exact, tolerance(ql, kl, vl, 0.25, torch.float32, None, fn3), "alibi x3")
    assert torch_flex.FLEX_CACHE.info().misses == compiles
    fused_attn.graph_cache.clear()
    assert len(torch_flex.FLEX_CACHE) == 0
