"""fused_attn.testing: the packed (thd) float64 reference against a per-sequence oracle built from the
dense one, the attn_mask_type -> band conversion, and the bounds the one rule gives."""

from __future__ import annotations

import math
import os

import pytest
import torch

from fused_attn.testing import (DEFAULT_FLOOR, agreement_bound, mask_band, max_error, packed_reference_attention,
                                packed_tolerances, reference_attention)
from helpers.attention import band_mask, rand


def _per_sequence(q, k, v, lens_q, lens_kv, starts_q, starts_kv, scale, band, score_fn=None):
    """The oracle: each sequence as a (1, H, n, D) dense call of `reference_attention` with the
    element-checked band of `helpers.attention`, written back at its offsets."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64)
    for b, (nq, nk, a, c) in enumerate(zip(lens_q, lens_kv, starts_q, starts_kv)):
        view = lambda t, s, n: t[s:s + n].transpose(0, 1)[None]  # noqa: E731
        mask = band_mask(nq, nk, band[0], band[1], band[2])
        fn = None if score_fn is None else (lambda s, bb, h, i, j, b=b: score_fn(s, bb + b, h, i, j))
        o, l = reference_attention(view(q, a, nq), view(k, c, nk), view(v, c, nk), scale, mask, fn)
        out[a:a + nq] = o[0].transpose(0, 1)
        lse[:, a:a + nq] = l[0]
    return out, lse


@pytest.mark.parametrize("band", [(-1, -1, False), (-1, 0, False), (-1, 0, True), (2, 1, True), (0, -1, False)])
def test_packed_reference_equals_the_dense_reference_per_sequence(gen, band):
    """Lengths 0 and 1, Sq != Skv, gaps between sequences (padded offsets), GQA, and a score_fn
    that reads the sequence index and the positions within the sequence."""
    lens_q, lens_kv = [3, 0, 1, 6, 2], [4, 2, 1, 6, 0]
    starts_q, starts_kv = [0, 5, 5, 8, 16], [1, 6, 9, 12, 20]
    q, k, v = rand(gen, 19, 4, 8, dtype=torch.float64), rand(gen, 21, 2, 8, dtype=torch.float64), \
        rand(gen, 21, 2, 5, dtype=torch.float64)
    fn = lambda s, b, h, i, j: s * 0.9 + 0.3 * b - 0.05 * (i - j).abs() + 0.1 * h  # noqa: E731
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    padded = lambda starts: torch.tensor(starts + [starts[-1]], dtype=torch.int32)  # noqa: E731
    out, lse = packed_reference_attention(q, k, v, cu(lens_q), cu(lens_kv), 0.4, band, fn,
                                          cu_seqlens_q_padded=padded(starts_q), cu_seqlens_kv_padded=padded(starts_kv))
    want, want_lse = _per_sequence(q, k, v, lens_q, lens_kv, starts_q, starts_kv, 0.4, band, fn)
    assert out.shape == (19, 4, 5) and lse.shape == (4, 19)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert (out[[3, 4, 7, 14, 15, 18]] == 0).all()  # tokens of no sequence


@pytest.mark.slow
def test_packed_reference_is_differentiable_in_every_input(gen):
    q, k, v = (rand(gen, 7, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: packed_reference_attention(q, k, v, cu, cu, 0.5, (-1, 0, False), sinks=s)[0],
        (q, k, v, sinks), fast_mode=True)


@pytest.mark.parametrize("mask_type, window, band", [
    ("no_mask", None, (-1, -1, False)), ("padding", (3, 2), (3, 2, False)), ("causal", None, (-1, 0, False)),
    ("padding_causal", (4, 0), (4, 0, False)), ("causal_bottom_right", None, (-1, 0, True)),
    ("padding_causal_bottom_right", (2, -1), (2, 0, True))])
def test_mask_band_follows_dot_product_attention(mask_type, window, band):
    assert mask_band(mask_type, window) == band


@pytest.mark.slow
def test_packed_tolerances_are_the_rule_over_the_whole_batch(gen):
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    q, k, v, do = (rand(gen, 12, 2, 8) for _ in range(4))
    exact, bounds = packed_tolerances(q, k, v, do, cu, cu, 0.3, torch.bfloat16, band=mask_band("causal"),
                                      sinks=torch.tensor([0.2, -0.4]))
    assert set(exact) == set(bounds) == {"out", "lse", "dq", "dk", "dv", "dsinks"}
    assert all(t.dtype == torch.float64 for t in exact.values())
    naive, _ = packed_reference_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, cu, 0.3, (-1, 0, False),
                                          sinks=torch.tensor([0.2, -0.4]).bfloat16(), dtype=torch.bfloat16,
                                          softmax_dtype=torch.float32)
    floor = DEFAULT_FLOOR[torch.bfloat16] * max(1.0, float(exact["out"].abs().max()))
    assert bounds["out"] == pytest.approx(2 * max_error(naive, exact["out"]) + floor)
    assert 0 < bounds["out"] < 0.1


def test_agreement_bound_is_the_floor_of_the_dtype():
    x = torch.tensor([[-3.0, 0.5]], dtype=torch.float64)
    assert agreement_bound(x) == DEFAULT_FLOOR[torch.float64] * 3.0
    assert agreement_bound(x[:, 1:], torch.float32) == DEFAULT_FLOOR[torch.float32]


def test_gpu_spread_gives_each_xdist_worker_one_gpu(monkeypatch):
    """tests/helpers/gpu_spread.py: worker gwI sees the I-th mod N of the visible GPUs; the
    controller, a single GPU and a run without workers are left alone."""
    from types import SimpleNamespace

    from helpers import gpu_spread

    def visible(worker, gpus, before=None):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker) if worker else monkeypatch.delenv("PYTEST_XDIST_WORKER",
                                                                                             raising=False)
        if before is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", before)
        gpu_spread.pytest_configure(SimpleNamespace(getoption=lambda name: gpus))
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    assert [visible(f"gw{i}", 4) for i in range(6)] == ["0", "1", "2", "3", "0", "1"]
    assert visible("gw5", 2, before="2,3") == "3"  # indexes the GPUs already visible
    assert visible("gw3", 1) is None and visible("", 4) is None
