"""Causal score_mod calls served as query chunks over key prefixes (fused_attn.causal_chunks):
the chunk bounds, which specs qualify, and exactness against the unchunked call in float64 (the
reference backend on CPU; the GPU test runs the cuDNN path against float64)."""

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn import causal_chunks as C
from fused_attn.functional import _run_plan
from fused_attn.plan import NO_VARLEN
from fused_attn.spec import resolve_spec


def test_bounds_cover_the_queries_on_tile_multiples():
    assert C.bounds(4096) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]
    for sq in (2048, 2100, 2111, 5000, 300):
        b = C.bounds(sq)
        assert b[0][0] == 0 and b[-1][1] == sq and all(x[1] == y[0] for x, y in zip(b, b[1:]))
        assert all(q1 % 128 == 0 for _, q1 in b[:-1]) and all(q1 > q0 for q0, q1 in b)


@pytest.mark.parametrize("kw, chunked", [
    (dict(score_mod=sm.softcap(30.0), attn_mask_type="causal"), True),
    (dict(score_mod=sm.softcap(30.0), attn_mask_type="causal_bottom_right"), True),
    (dict(score_mod=sm.softcap(30.0), window_size=(-1, 0)), True),
    (dict(score_mod=sm.alibi(torch.ones(4)), attn_mask_type="causal"), False),  # reads q_idx
    (dict(score_mod=sm.softcap(30.0)), False),  # no mask
    (dict(score_mod=sm.softcap(30.0), attn_mask_type="causal", window_size=(64, 0)), False),  # a window
    (dict(attn_mask_type="causal"), False),  # cuDNN's own band already skips tiles
    (dict(score_mod=sm.softcap(30.0), attn_mask_type="causal", backend="reference"), False),
    (dict(score_mod=sm.softcap(30.0), attn_mask_type="causal", dropout_p=0.1), False),
])
def test_which_specs_are_chunked(kw, chunked):
    spec, _ = resolve_spec(**kw)
    sub = C.chunk_spec(spec)
    assert (sub is not None) == chunked
    if chunked:
        assert sub.band.bottom_right and sub.band.right == 0 and sub.band.left is None
        assert sub.score_mod_key == spec.score_mod_key and C.chunk_spec(spec) is sub


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
@pytest.mark.parametrize("mask, sq, skv", [("causal", 600, 600), ("causal", 600, 700), ("causal_bottom_right", 520, 800)])
@pytest.mark.parametrize("return_lse", [False, True])
def test_chunks_equal_the_unchunked_call(monkeypatch, fmt, mask, sq, skv, return_lse):
    """Forward (no grad) and forward + backward (ChunkedCausal: dQ per chunk, dK/dV accumulated
    over key prefixes) equal the plain call in float64 on the reference backend."""
    monkeypatch.setattr(C, "MIN_QUERIES", 256)
    monkeypatch.setattr(C, "MIN_QUERIES_TRAINING", 256)
    g = torch.Generator().manual_seed(5)
    shape = {"bshd": lambda s: (2, s, 3, 16), "sbhd": lambda s: (s, 2, 3, 16), "bhsd": lambda s: (2, 3, s, 16)}[fmt]
    q = torch.randn(*shape(sq), generator=g, dtype=torch.float64)
    k, v = (torch.randn(*shape(skv), generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(*shape(sq), generator=g, dtype=torch.float64)
    kw = dict(qkv_format=fmt, score_mod=sm.softcap(5.0), attn_mask_type=mask, return_lse=return_lse)
    spec, mod = resolve_spec(backend="auto", **kw)
    sub = C.chunk_spec(spec)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        got = fn(*leaves)
        out = got[0] if return_lse else got
        d = torch.autograd.grad(out, leaves, do)
        return ([out, got[1]] if return_lse else [out]) + list(d)

    plain = grads(lambda a, b, c: _run_plan(spec, mod, a, b, c, NO_VARLEN, None))
    chunked = grads(lambda a, b, c: C.run_in_chunks(spec, sub, mod, a, b, c, None))
    for a, b in zip(plain, chunked):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        fwd = C.run_in_chunks(spec, sub, mod, q, k, v, None)
    for a, b in zip(plain, fwd if return_lse else [fwd]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_chunked_backward_refuses_a_score_mod_changed_in_place(monkeypatch):
    monkeypatch.setattr(C, "MIN_QUERIES", 256)
    monkeypatch.setattr(C, "MIN_QUERIES_TRAINING", 256)
    spec, mod = resolve_spec(score_mod=sm.softcap(5.0).private_copy(), attn_mask_type="causal")
    q = torch.randn(1, 512, 2, 16, dtype=torch.float64, requires_grad=True)
    out = C.run_in_chunks(spec, C.chunk_spec(spec), spec.score_mod, q, q.detach(), q.detach(), None)
    assert out.grad_fn is not None and type(out.grad_fn).__name__.startswith("ChunkedCausal")
    assert spec.score_mod.take_values(sm.softcap(7.0))
    with pytest.raises(RuntimeError, match="changed its values between this forward and its backward"):
        out.sum().backward()


def test_tables_or_sinks_that_train_are_not_chunked(monkeypatch):
    monkeypatch.setattr(C, "MIN_QUERIES", 256)
    monkeypatch.setattr(C, "MIN_QUERIES_TRAINING", 256)
    q = torch.randn(1, 512, 2, 16, dtype=torch.float64, requires_grad=True)
    spec, _ = resolve_spec(score_mod=sm.softcap(5.0), attn_mask_type="causal", softmax_type="learnable")
    sinks = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    assert C.run_in_chunks(spec, C.chunk_spec(spec), spec.score_mod, q, q, q, sinks) is None


def test_short_or_wider_query_calls_are_not_chunked():
    spec, mod = resolve_spec(score_mod=sm.softcap(5.0), attn_mask_type="causal")
    sub = C.chunk_spec(spec)
    q = torch.randn(1, 128, 2, 16, dtype=torch.float64)
    assert C.run_in_chunks(spec, sub, mod, q, q, q, None) is None  # below MIN_QUERIES
    q = torch.randn(1, C.MIN_QUERIES, 2, 16, dtype=torch.float64)
    k = torch.randn(1, C.MIN_QUERIES - 128, 2, 16, dtype=torch.float64)
    assert C.run_in_chunks(spec, sub, mod, q, k, k, None) is None  # Skv < Sq


def test_only_calls_without_gradients_are_chunked():
    q = torch.randn(1, 8, 2, 16)
    mod = sm.softcap(5.0)
    assert not C.needs_grad(q, q, q, mod, None)
    assert C.needs_grad(q.clone().requires_grad_(), q, q, mod, None)
    with torch.no_grad():
        assert not C.needs_grad(q.clone().requires_grad_(), q, q, mod, None)
    table = torch.zeros(2, requires_grad=True)
    assert C.needs_grad(q, q, q, sm.alibi(table), None)
    assert C.needs_grad(q, q, q, mod, torch.zeros(2, requires_grad=True))


def test_training_calls_are_chunked_only_from_the_training_threshold(monkeypatch):
    monkeypatch.setattr(C, "MIN_QUERIES", 256)
    monkeypatch.setattr(C, "MIN_QUERIES_TRAINING", 1024)
    spec, mod = resolve_spec(score_mod=sm.softcap(5.0), attn_mask_type="causal")
    sub = C.chunk_spec(spec)
    q = torch.randn(1, 512, 2, 16, dtype=torch.float64)
    assert C.run_in_chunks(spec, sub, mod, q, q, q, None) is not None  # no gradient: chunked
    assert C.run_in_chunks(spec, sub, mod, q.requires_grad_(), q, q, None) is None  # training below 1024
