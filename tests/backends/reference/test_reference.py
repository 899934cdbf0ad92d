"""The reference backend against a float64 naive attention, for every option and combination."""

from __future__ import annotations

import math

import pytest
import torch

import fused_attn
from fused_attn.backends import reference_math
from helpers.quick import quick_cover
from fused_attn.layouts import from_logical
from fused_attn.testing import (agreement_bound, assert_close, lse_tolerance, mask_band, packed_tolerances,
                                reference_attention, tolerance)
from helpers.attention import band_mask, band_mask_by_element, cu_seqlens, rand
from helpers.mods import IndexMod
from score_mods.base import ScoreMod


class Softcap(ScoreMod):
    name = "test_softcap"
    cache_key = ("test_softcap",)

    def __init__(self, cap: float = 2.0):
        self.cap = cap

    def eager(self, score, b, h, q_idx, kv_idx, q_len, kv_len):
        return self.cap * torch.tanh(score / self.cap)

    def lower_forward(self, graph, score, operands, memo):
        raise NotImplementedError


def index_fn(s, b, h, qi, ki):
    return s * 0.9 + 0.1 * h - 0.05 * (qi - ki).abs() + 0.2 * b


def test_band_mask_oracle_rows_equal_its_element_definition():
    """The test oracle's row-interval form equals its element-by-element definition (random bands,
    lengths below the padded sizes, both alignments, unbounded sides, empty rows)."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        sq, skv = rng.randrange(1, 24), rng.randrange(1, 24)
        kw = dict(left=rng.choice([-1, 0, 1, 3, 30]), right=rng.choice([-1, 0, 2, 30]),
                  bottom_right=rng.random() < 0.5, q_len=rng.randrange(0, sq + 1), kv_len=rng.randrange(0, skv + 1))
        assert torch.equal(band_mask(sq, skv, **kw), band_mask_by_element(sq, skv, **kw)), (sq, skv, kw)


def _mask_for(mask_type, window, sq, skv):
    left, right = window if window is not None else (-1, -1)
    if mask_type in ("causal", "causal_bottom_right"):
        right = 0
    return band_mask(sq, skv, left, right, bottom_right=mask_type == "causal_bottom_right")


def _dense(gen, b, h, hkv, sq, skv, d, dv, dtype=torch.float32, requires_grad=False):
    return (rand(gen, b, h, sq, d, dtype=dtype, requires_grad=requires_grad),
            rand(gen, b, hkv, skv, d, dtype=dtype, requires_grad=requires_grad),
            rand(gen, b, hkv, skv, dv, dtype=dtype, requires_grad=requires_grad))


WINDOWS = [None, (2, 0), (1, 3), (-1, 2), (0, -1)]


# causal types refuse a window whose right bound is not 0 / -1 (tested in test_validation)
MASK_WINDOWS = [(m, w) for m in ("no_mask", "causal", "causal_bottom_right") for w in WINDOWS
                if m == "no_mask" or w is None or w[1] in (0, -1)]


@pytest.mark.parametrize("mask_type,window,hkv,sq,skv", quick_cover(MASK_WINDOWS, [4, 2, 1], [(6, 6), (3, 8), (8, 3)]))
def test_masks_windows_gqa(gen, mask_type, window, hkv, sq, skv):
    q, k, v = _dense(gen, 2, 4, hkv, sq, skv, 8, 6)
    mask = _mask_for(mask_type, window, sq, skv)
    want, _ = reference_attention(q, k, v, 0.3, mask)
    want_lse, lse_bound = lse_tolerance(q, k, v, 0.3, torch.float32, mask)
    out, lse = fused_attn.dot_product_attention(
        from_logical(q, "bshd"), from_logical(k, "bshd"), from_logical(v, "bshd"), attn_mask_type=mask_type,
        window_size=window, softmax_scale=0.3, return_lse=True, backend="reference")
    assert out.shape == (2, sq, 4, 6) and lse.dtype == torch.float32 and lse.shape == (2, 4, sq)
    assert_close(out.transpose(1, 2), want, tolerance(q, k, v, 0.3, torch.float32, mask), "out")
    assert_close(lse, want_lse, lse_bound, "lse")


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
def test_layouts_keep_query_format(gen, fmt):
    q, k, v = _dense(gen, 2, 4, 2, 5, 7, 8, 4)
    mask = band_mask(5, 7, right=0)
    want, _ = reference_attention(q, k, v, 1 / math.sqrt(8), mask)
    out = fused_attn.dot_product_attention(*(from_logical(t, fmt) for t in (q, k, v)), qkv_format=fmt,
                                           attn_mask_type="causal", backend="reference")
    assert out.shape == from_logical(want, fmt).shape
    assert_close(out, from_logical(want, fmt), tolerance(q, k, v, 1 / math.sqrt(8), torch.float32, mask), fmt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes(gen, dtype):
    q, k, v = _dense(gen, 2, 4, 2, 9, 9, 16, 16)
    mask = band_mask(9, 9, right=0)
    want, _ = reference_attention(q, k, v, 0.25, mask)
    out = fused_attn.dot_product_attention(*(from_logical(t.to(dtype), "bshd") for t in (q, k, v)),
                                           attn_mask_type="causal", softmax_scale=0.25, backend="reference")
    assert out.dtype == dtype
    assert_close(out.transpose(1, 2), want, tolerance(q, k, v, 0.25, dtype, mask), str(dtype))


def test_score_mod_uses_every_index(gen):
    q, k, v = _dense(gen, 2, 4, 2, 5, 7, 8, 8)
    mask = band_mask(5, 7, right=0, bottom_right=True)
    want, _ = reference_attention(q, k, v, 0.5, mask, index_fn)
    out = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", softmax_scale=0.5, score_mod=IndexMod(),
                                           attn_mask_type="causal_bottom_right", backend="reference")
    assert_close(out, want, tolerance(q, k, v, 0.5, torch.float32, mask, index_fn), "out")


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_dense_padding(gen, mask_type):
    lq, lkv = [5, 0, 2], [7, 3, 1]
    q, k, v = _dense(gen, 3, 2, 2, 5, 7, 8, 8, requires_grad=True)
    out, lse = fused_attn.dot_product_attention(
        q, k, v, qkv_format="bhsd", attn_mask_type=mask_type, cu_seqlens_q=cu_seqlens(lq),
        cu_seqlens_kv=cu_seqlens(lkv), return_lse=True, backend="reference")
    for b in range(3):
        m = band_mask(5, 7, right=0 if mask_type == "padding_causal" else -1, q_len=lq[b], kv_len=lkv[b])
        qb, kb, vb = (t[b:b + 1].detach() for t in (q, k, v))
        want, _ = reference_attention(qb, kb, vb, 1 / math.sqrt(8), m)
        want_lse, lse_bound = lse_tolerance(qb, kb, vb, 1 / math.sqrt(8), torch.float32, m)
        assert_close(out[b:b + 1], want, tolerance(qb, kb, vb, 1 / math.sqrt(8), torch.float32, m), f"out {b}")
        assert_close(lse[b:b + 1], want_lse, lse_bound, f"lse {b}")
        assert torch.all(out[b, :, lq[b]:] == 0) and torch.all(lse[b, :, lq[b]:] == -math.inf)
    out.sum().backward()
    for b in range(3):  # positions past a length receive no gradient
        assert torch.all(q.grad[b, :, lq[b]:] == 0)
        assert torch.all(k.grad[b, :, lkv[b]:] == 0) and torch.all(v.grad[b, :, lkv[b]:] == 0)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("mask_type,window", [("no_mask", None), ("causal", None), ("padding_causal", (2, 0)),
                                              ("causal_bottom_right", None), ("padding", (1, 1))])
@pytest.mark.parametrize("with_mod", [False, True])
def test_thd(gen, mask_type, window, with_mod):
    lq, lkv = [3, 0, 1, 6, 2], [4, 2, 1, 6, 0]
    q, k, v = rand(gen, sum(lq), 4, 8), rand(gen, sum(lkv), 2, 8), rand(gen, sum(lkv), 2, 4)
    cq, ckv = cu_seqlens(lq), cu_seqlens(lkv)
    want, bounds = packed_tolerances(q, k, v, None, cq, ckv, 0.4, torch.float32, band=mask_band(mask_type, window),
                                     score_fn=index_fn if with_mod else None)
    out, lse = fused_attn.dot_product_attention(
        q, k, v, qkv_format="thd", attn_mask_type=mask_type, window_size=window, softmax_scale=0.4,
        score_mod=IndexMod() if with_mod else None, cu_seqlens_q=cq, cu_seqlens_kv=ckv, return_lse=True,
        backend="reference")
    assert out.shape == (sum(lq), 4, 4) and lse.shape == (4, sum(lq))
    assert_close(out, want["out"], bounds["out"], "out")
    assert_close(lse, want["lse"], bounds["lse"], "lse")


def test_thd_padded_offsets(gen):
    lq, lkv = [2, 0, 3], [3, 1, 3]
    pq, pkv = [0, 4, 5, 9], [0, 3, 6, 10]
    q, k, v = rand(gen, 9, 2, 8), rand(gen, 10, 2, 8), rand(gen, 10, 2, 8)
    padded = dict(cu_seqlens_q_padded=torch.tensor(pq, dtype=torch.int32),
                  cu_seqlens_kv_padded=torch.tensor(pkv, dtype=torch.int32))
    want, bounds = packed_tolerances(q, k, v, None, cu_seqlens(lq), cu_seqlens(lkv), 0.35, torch.float32,
                                     band=mask_band("causal"), **padded)
    out, lse = fused_attn.dot_product_attention(
        q, k, v, qkv_format="thd", attn_mask_type="causal", softmax_scale=0.35, cu_seqlens_q=cu_seqlens(lq),
        cu_seqlens_kv=cu_seqlens(lkv), return_lse=True, backend="reference", **padded)
    assert_close(out, want["out"], bounds["out"], "out")
    assert_close(lse, want["lse"], bounds["lse"], "lse")
    assert torch.all(out[2:4] == 0) and torch.all(out[8] == 0)  # the gaps stay zero


def test_fully_masked_rows_no_nan(gen):
    # causal_bottom_right with Sq > Skv: the first Sq - Skv rows see no key.
    q, k, v = _dense(gen, 1, 2, 2, 6, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    out, lse = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal_bottom_right",
                                                return_lse=True, backend="reference")
    assert torch.all(out[:, :, :3] == 0) and torch.all(lse[:, :, :3] == -math.inf)
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 3:]).all()
    (out * rand(torch.Generator().manual_seed(1), *out.shape, dtype=torch.float64)).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(q.grad[:, :, :3] == 0)


@pytest.mark.slow
def test_query_blocks_match_single_block(gen, monkeypatch):
    q, k, v = _dense(gen, 2, 4, 2, 33, 20, 8, 8)
    kw = dict(qkv_format="bhsd", attn_mask_type="causal_bottom_right", window_size=(4, 0), score_mod=IndexMod(),
              return_lse=True, backend="reference")
    out1, lse1 = fused_attn.dot_product_attention(q, k, v, **kw)
    monkeypatch.setattr(reference_math, "MAX_BLOCK_ELEMENTS", 4 * 2 * 20 * 5)  # 5 rows per block, 7 blocks
    out2, lse2 = fused_attn.dot_product_attention(q, k, v, **kw)
    assert_close(out1, out2, agreement_bound(out2, torch.float32), "out")
    assert_close(lse1, lse2, agreement_bound(lse2, torch.float32), "lse")


def test_runner_forward_backward_match_autograd(gen):
    from fused_attn.plan import NO_VARLEN, get_plan
    from fused_attn.spec import resolve_spec

    q, k, v = _dense(gen, 2, 4, 2, 5, 6, 8, 8, dtype=torch.float64, requires_grad=True)
    spec, mod = resolve_spec(qkv_format="bhsd", attn_mask_type="causal", backend="reference")
    plan = get_plan(spec, mod, q, k, v, NO_VARLEN)
    assert plan.backend == "reference" and plan.reason == "backend='reference' was requested"
    out, lse, saved, state = plan.runner.forward(q, k, v, NO_VARLEN, mod, None)
    assert not out.requires_grad and out.shape == (2, 4, 5, 8)
    grad_out = rand(gen, *out.shape, dtype=torch.float64)
    dq, dk, dv = plan.runner.backward(state, saved, grad_out)
    out2 = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal", backend="reference")
    want = torch.autograd.grad(out2, (q, k, v), grad_out)
    for got, exp in zip((dq, dk, dv), want):
        torch.testing.assert_close(got, exp)


GRAD_CASES = [
    dict(attn_mask_type="causal"),
    dict(attn_mask_type="no_mask", window_size=(1, 2)),
    dict(attn_mask_type="causal_bottom_right", window_size=(2, 0), hkv=1),
    dict(attn_mask_type="no_mask", score_mod=Softcap(1.5), hkv=1),
    dict(attn_mask_type="padding_causal", lengths=([3, 1], [4, 2])),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: "-".join(f"{k}" for k in c))
def test_gradcheck_dense(gen, case):
    case = dict(case)
    hkv, lengths = case.pop("hkv", 2), case.pop("lengths", None)
    q, k, v = _dense(gen, 2, 2, hkv, 3, 4, 4, 3, dtype=torch.float64, requires_grad=True)
    if lengths:
        case.update(cu_seqlens_q=cu_seqlens(lengths[0]), cu_seqlens_kv=cu_seqlens(lengths[1]))
    fn = lambda q, k, v: fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", backend="reference", **case)
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.slow
def test_gradcheck_thd_with_score_mod(gen):
    lq, lkv = [2, 0, 3], [3, 1, 2]
    q = rand(gen, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    k = rand(gen, 6, 1, 4, dtype=torch.float64, requires_grad=True)
    v = rand(gen, 6, 1, 4, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v: fused_attn.dot_product_attention(
        q, k, v, qkv_format="thd", attn_mask_type="causal_bottom_right", score_mod=IndexMod(),
        cu_seqlens_q=cu_seqlens(lq), cu_seqlens_kv=cu_seqlens(lkv), backend="reference")
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_library_score_mod_composes_with_masks(gen):
    score_mods = pytest.importorskip("score_mods")
    q, k, v = _dense(gen, 2, 2, 2, 6, 6, 8, 8)
    mask = band_mask(6, 6, 2, 0)
    fn = lambda s, b, h, qi, ki: 5.0 * torch.tanh(s / 5.0)
    want, _ = reference_attention(q, k, v, 0.5, mask, fn)
    out = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal", window_size=(2, 0),
                                           softmax_scale=0.5, score_mod=score_mods.softcap(5.0), backend="reference")
    assert_close(out, want, tolerance(q, k, v, 0.5, torch.float32, mask, fn), "out")


def test_cudnn_backend_on_cpu_raises(gen):
    q, k, v = _dense(gen, 1, 2, 2, 4, 4, 8, 8, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="backend='cudnn' cannot run this problem: .*CUDA"):
        fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", backend="cudnn")


def test_auto_uses_reference_on_cpu_when_torch_cannot(gen):
    q, k, v = _dense(gen, 1, 2, 2, 4, 4, 8, 8)
    got = fused_attn.explain(q, k, v, qkv_format="bhsd", softmax_type="off-by-one")
    assert got.backend == "reference" and "torch cannot serve it" in got.reason and "sink" in got.reason


def test_reference_refuses_mod_without_eager(gen):
    class NoRef(IndexMod):
        name = "no_ref"

        @property
        def has_reference(self):
            return False

    q, k, v = _dense(gen, 1, 2, 2, 4, 4, 8, 8)
    with pytest.raises(NotImplementedError, match="no_ref.*no eager reference"):
        fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=NoRef(), backend="reference")


@pytest.mark.slow
def test_attention_backward_with_grad_mode_off_equals_autograd(gen):
    """attention_backward is called inside autograd backward passes (grad mode off): it must
    still differentiate, not return zeros."""
    q, k, v, do = (rand(gen, 1, 12, 2, 16, dtype=torch.float64) for _ in range(4))
    out, lse = fused_attn.functional.attention_forward(q, k, v, attn_mask_type="causal", backend="reference")
    with torch.enable_grad():
        grads_on = fused_attn.functional.attention_backward(q, k, v, out, lse, do, attn_mask_type="causal", backend="reference")
    with torch.no_grad():
        grads_off = fused_attn.functional.attention_backward(q, k, v, out, lse, do, attn_mask_type="causal", backend="reference")
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(fused_attn.dot_product_attention(*leaves, attn_mask_type="causal", backend="reference"),
                               leaves, do)
    for on, off, w in zip(grads_on, grads_off, want):  # the lse crosses as fp32: fp32 agreement
        assert w.abs().max() > 0.1
        assert_close(off, w, agreement_bound(w, torch.float32), "grad mode off")
        assert_close(on, w, agreement_bound(w, torch.float32), "grad mode on")
