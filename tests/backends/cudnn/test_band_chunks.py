"""Banded score_mod calls served as rectangles of the band (fused_attn.backends.cudnn.band_chunks): the
rectangles' geometry against the brute-force mask, which specs qualify, and exactness against the
unchunked call in float64 (the reference backend on CPU; the GPU test runs cuDNN against float64)."""

import random

import pytest
import torch

import score_mods as sm
from fused_attn.backends.cudnn import band_chunks as C
from fused_attn.backends.cudnn import band_pieces as BP
from fused_attn.functional import _run_plan
from fused_attn.plan import NO_VARLEN, CallPlan
from fused_attn.problem import Band
from fused_attn.spec import resolve_spec
from fused_attn.testing import agreement_bound, assert_close


@pytest.fixture
def small_thresholds(monkeypatch):
    """Cut calls of any size that saves any work (the shipped cost model is for H200 kernels)."""
    _no_host_cost(monkeypatch)
    monkeypatch.setattr(BP, "WINDOW_CHUNK", 128)
    C.clear_memos()
    yield
    C.clear_memos()


def test_bounds_cover_the_rows_on_tile_multiples():
    assert BP.bounds(4096, 4) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]
    for n, chunks in ((2048, 4), (2100, 4), (2111, 3), (5000, 8), (300, 4), (128, 4)):
        b = BP.bounds(n, chunks)
        assert b[0][0] == 0 and b[-1][1] == n and all(x[1] == y[0] for x, y in zip(b, b[1:]))
        assert all(e % 128 == 0 for _, e in b[:-1]) and all(e > s for s, e in b)


def _allowed(band, sq, skv):
    """The global mask of `band` by brute force: (Sq, Skv) bool."""
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(skv).view(1, -1)
    d = j - i - ((skv - sq) if band.bottom_right else 0)
    ok = d <= band.right
    if band.left is not None:
        ok &= d >= -band.left
    return ok


def _check_rectangles(band, sq, skv):
    pieces = BP.plan_pieces(band, sq, skv)
    full = _allowed(band, sq, skv)
    if pieces is None:  # refused only when a row has no key (or a bound would be negative)
        return full.any(dim=1).all().item() is False or None
    for kind, parts in (("forward", pieces.forward), ("backward", pieces.backward)):
        covered = torch.zeros(sq if kind == "forward" else skv, dtype=torch.int64)
        for p in parts:
            if kind == "forward":
                covered[p.q0:p.q1] += 1
            else:
                covered[p.k0:p.k1] += 1
            if p.band is None:  # no query reaches these keys
                assert kind == "backward" and not full[:, p.k0:p.k1].any()
                continue
            assert p.band.left is None or p.band.left >= 0
            assert p.band.right >= 0
            # the rectangle's own band is the global mask restricted to it ...
            mine = _allowed(p.band, p.q1 - p.q0, p.k1 - p.k0)
            assert torch.equal(mine, full[p.q0:p.q1, p.k0:p.k1]), (kind, p)
            # ... and nothing the rectangle owns lies outside it
            if kind == "forward":
                assert full[p.q0:p.q1].sum() == mine.sum(), (kind, p)
            else:
                assert full[:, p.k0:p.k1].sum() == mine.sum(), (kind, p)
            if kind == "backward":  # the backward's key lengths stay off 64 mod 128
                assert (p.k1 - p.k0) % 128 == 0 or p.k1 == skv
        assert torch.equal(covered, torch.ones_like(covered)), kind
    return True


_SLOW = pytest.mark.slow  # ~0.5 s each: the quick set keeps a square causal band and a windowed bottom-right one


@pytest.mark.parametrize("band, sq, skv", [
    (Band(None, 0, False), 1024, 1024), pytest.param(Band(None, 0, True), 640, 1000, marks=_SLOW),
    pytest.param(Band(None, 0, False), 300, 700, marks=_SLOW), pytest.param(Band(255, 0, False), 1024, 1024, marks=_SLOW),
    (Band(100, 0, True), 700, 900), pytest.param(Band(150, 30, False), 900, 900, marks=_SLOW),
    pytest.param(Band(None, 40, False), 800, 600, marks=_SLOW), pytest.param(Band(0, 0, False), 512, 512, marks=_SLOW),
])
def test_rectangles_hold_exactly_the_band(small_thresholds, band, sq, skv):
    assert _check_rectangles(band, sq, skv)


@pytest.mark.slow
def test_rectangles_hold_exactly_random_bands(small_thresholds):
    rng = random.Random(11)
    for _ in range(60):
        sq, skv = rng.randrange(128, 900), rng.randrange(128, 900)
        left = rng.choice([None, rng.randrange(0, 400)])
        band = Band(left, rng.randrange(0, 200), rng.random() < 0.5)
        assert _check_rectangles(band, sq, skv) is not False, (band, sq, skv)


def test_rows_without_keys_are_not_cut(small_thresholds):
    # bottom-right causal with Skv < Sq: the first Sq - Skv rows see no key
    assert BP.plan_pieces(Band(None, 0, True), 800, 600) is None


def test_work_shares():
    C.clear_memos()
    assert BP.plan_pieces(Band(None, 0, False), 4096, 4096).work == pytest.approx(10 / 16)
    window = BP.plan_pieces(Band(1023, 0, False), 4096, 4096)
    assert window.work < 0.45 and len(window.forward) == 4096 // max(BP.WINDOW_CHUNK, 1024)




@pytest.mark.parametrize("kw, ok", [
    (dict(score_mod=sm.softcap(30.0), attn_mask_type="causal"), True),
    (dict(score_mod=sm.softcap(30.0), attn_mask_type="causal_bottom_right"), True),
    (dict(score_mod=sm.softcap(30.0), window_size=(-1, 0)), True),
    (dict(score_mod=sm.softcap(30.0), attn_mask_type="causal", window_size=(64, 0)), True),
    (dict(score_mod=sm.softcap(30.0), window_size=(64, 16)), True),
    (dict(score_mod=sm.softcap(30.0), window_size=(64, -1)), False),  # unbounded on the right
    (dict(score_mod=sm.alibi(torch.ones(4)), attn_mask_type="causal"), False),  # reads positions
    (dict(score_mod=sm.post_scale_bias(torch.ones(1, 1, 8, 8)), attn_mask_type="causal"), False),  # by position
    (dict(score_mod=sm.softcap(30.0)), False),  # no band
    (dict(attn_mask_type="causal"), False),  # cuDNN's own band already skips tiles
    (dict(score_mod=sm.softcap(30.0), attn_mask_type="causal", backend="reference"), False),
    (dict(score_mod=sm.softcap(30.0), attn_mask_type="causal", dropout_p=0.1), False),
    (dict(score_mod=sm.softcap(30.0), attn_mask_type="padding_causal"), False),
])
def test_which_specs_qualify(kw, ok):
    spec, _ = resolve_spec(**kw)
    assert C.eligible(spec) == ok
    assert spec.may_cut_band or not ok  # the entry points' pre-filter never skips a served spec
    if ok:
        sub = C.piece_spec(spec, Band(3, 5, False))
        assert sub.band == Band(3, 5, False) and sub.return_lse and sub.score_mod_key == spec.score_mod_key
        assert C.piece_spec(spec, Band(3, 5, False)) is sub


def test_a_mod_reading_key_positions_does_not_qualify():
    @sm.score_mod
    def key_tilt(score, b, h, q_idx, kv_idx):
        return score + kv_idx * 0.01

    spec, _ = resolve_spec(score_mod=key_tilt, attn_mask_type="causal")
    assert not C.eligible(spec)


def _assert_same(plain, chunked, return_lse):
    """Outputs (and lse) to float64 rounding; gradients to the lse's: the backward rectangles
    read the forward's log-sum-exp, which every backend keeps in fp32 (cuDNN's Stats)."""
    n_out = 2 if return_lse else 1
    for i, (a, b) in enumerate(zip(plain, chunked)):
        assert_close(b, a, agreement_bound(a, torch.float64 if i < n_out else torch.float32), f"result {i}")


CASES = [("causal", None, 600, 600), ("causal", None, 600, 700), ("causal_bottom_right", None, 520, 800),
         ("causal", None, 300, 700), ("no_mask", (200, 0), 700, 700), ("causal_bottom_right", (150, 0), 600, 650),
         ("no_mask", (150, 30), 640, 640)]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
@pytest.mark.parametrize("mask, window, sq, skv", CASES)
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("how", ["both", "forward"])
def test_rectangles_equal_the_unchunked_call(small_thresholds, monkeypatch, fmt, mask, window, sq, skv, return_lse,
                                             how):
    """Forward (no grad) and forward + backward (BandChunks: query chunks forward; backward over
    key chunks, or the plain call's backward, from the stitched output and lse) equal the plain
    call in float64 on the reference."""
    monkeypatch.setattr(C, "strategy", lambda *a: how)
    g = torch.Generator().manual_seed(5)
    shape = {"bshd": lambda s, h: (2, s, h, 16), "sbhd": lambda s, h: (s, 2, h, 16),
             "bhsd": lambda s, h: (2, h, s, 16)}[fmt]
    q = torch.randn(*shape(sq, 4), generator=g, dtype=torch.float64)
    k, v = (torch.randn(*shape(skv, 2), generator=g, dtype=torch.float64) for _ in range(2))  # GQA 4/2
    do = torch.randn(*shape(sq, 4), generator=g, dtype=torch.float64)
    kw = dict(qkv_format=fmt, score_mod=sm.softcap(5.0), attn_mask_type=mask, window_size=window,
              return_lse=return_lse)
    spec, mod = resolve_spec(backend="auto", **kw)
    assert C.eligible(spec)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        got = fn(*leaves)
        out = got[0] if return_lse else got
        d = torch.autograd.grad(out, leaves, do)
        return ([out, got[1]] if return_lse else [out]) + list(d)

    plain = grads(lambda a, b, c: _run_plan(spec, mod, a, b, c, NO_VARLEN, None))
    chunked = grads(lambda a, b, c: C.run_in_pieces(spec, mod, a, b, c, None))
    _assert_same(plain, chunked, return_lse)
    calls = [c for c in C._ROUTES._data.values() if not isinstance(c, CallPlan) and c.trains]
    assert calls and all((c.backward_full is not None) == (how == "forward") for c in calls)
    with torch.no_grad():
        fwd = C.run_in_pieces(spec, mod, q, k, v, None)
    for a, b in zip(plain, fwd if return_lse else [fwd]):
        assert_close(b, a, agreement_bound(a), "forward without grad")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["both", "forward"])
def test_rectangles_with_fixed_sinks_equal_the_unchunked_call(small_thresholds, monkeypatch, how):
    monkeypatch.setattr(C, "strategy", lambda *a: how)
    g = torch.Generator().manual_seed(8)
    q, k, v, do = (torch.randn(1, 520, 2, 16, generator=g, dtype=torch.float64) for _ in range(4))
    sinks = torch.randn(2, generator=g, dtype=torch.float64)
    spec, mod = resolve_spec(score_mod=sm.softcap(5.0), window_size=(130, 0), softmax_type="learnable")

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return [out] + list(torch.autograd.grad(out, leaves, do))

    plain = grads(lambda a, b, c: _run_plan(spec, mod, a, b, c, NO_VARLEN, sinks))
    chunked = grads(lambda a, b, c: C.run_in_pieces(spec, mod, a, b, c, sinks))
    assert chunked[0].grad_fn is not None and type(chunked[0].grad_fn).__name__.startswith("BandChunks")
    _assert_same(plain, chunked, False)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["both", "forward"])
def test_backward_refuses_a_score_mod_changed_in_place(small_thresholds, monkeypatch, how):
    monkeypatch.setattr(C, "strategy", lambda *a: how)
    spec, mod = resolve_spec(score_mod=sm.softcap(5.0).private_copy(), attn_mask_type="causal")
    q = torch.randn(1, 512, 2, 16, dtype=torch.float64, requires_grad=True)
    out = C.run_in_pieces(spec, spec.score_mod, q, q.detach(), q.detach(), None)
    assert out.grad_fn is not None and type(out.grad_fn).__name__.startswith("BandChunks")
    assert spec.score_mod.take_values(sm.softcap(7.0))
    with pytest.raises(RuntimeError, match="changed its values between this forward and its backward"):
        out.sum().backward()


def test_tables_or_sinks_that_train_are_not_chunked(small_thresholds):
    q = torch.randn(1, 512, 2, 16, dtype=torch.float64, requires_grad=True)
    spec, _ = resolve_spec(score_mod=sm.softcap(5.0), attn_mask_type="causal", softmax_type="learnable")
    sinks = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    assert C.run_in_pieces(spec, spec.score_mod, q, q, q, sinks) is None


@pytest.mark.parametrize("band, b, h, s, d, grad, expected", [
    # host + GPU time with the constants fitted on H200 (softcap(50)); see band_chunks
    (Band(None, 0, False), 2, 16, 4096, 64, True, None),  # Gemma 2 causal layer: kept whole in a model
    (Band(1023, 0, False), 2, 16, 4096, 64, True, "forward"),  # its window layer: query rectangles
    (Band(None, 0, False), 1, 16, 8192, 64, True, "forward"),  # query rectangles, plain backward
    (Band(None, 0, False), 2, 16, 8192, 64, True, "both"),  # long: key rectangles pay too
    (Band(None, 0, False), 1, 16, 16384, 64, True, "both"),
    (Band(1023, 0, False), 1, 16, 16384, 64, True, "both"),
    (Band(1023, 0, False), 2, 16, 4096, 128, False, "forward"),  # inference over a window
    (Band(None, 0, False), 1, 1, 1024, 64, True, None),  # host-bound: 0.25 -> 0.78 / 1.32 ms if cut
    (Band(None, 0, False), 1, 1, 1024, 64, False, None),  # 0.03 -> 0.16 ms if cut
])
def test_the_cost_model_weighs_saved_gpu_time_against_added_host_time(band, b, h, s, d, grad, expected):
    pieces = BP.plan_pieces(band, s, s)
    assert BP.strategy(pieces, b * h * s * s, d, grad, b * h * s * d) == expected


def _no_host_cost(monkeypatch, per_piece=(0.0, 0.0, 0.0)):
    """No host cost and no fixed GPU cost per rectangle: any saved work pays."""
    monkeypatch.setattr(BP, "HOST_NS_CALL", (0.0, 0.0))
    monkeypatch.setattr(BP, "HOST_NS_PER_PIECE", per_piece)
    monkeypatch.setattr(BP, "PIECE_NS_PER_QUERY_ELEMENT", (0.0, 0.0))
    C.clear_memos()


@pytest.mark.slow
def test_calls_that_do_not_pay_are_not_cut(monkeypatch):
    C.clear_memos()
    spec, mod = resolve_spec(score_mod=sm.softcap(5.0), attn_mask_type="causal")
    q = torch.randn(1, 1024, 2, 16, dtype=torch.float64)
    assert C.run_in_pieces(spec, mod, q, q, q, None) is None  # a small call: the host time wins
    _no_host_cost(monkeypatch)
    assert C.run_in_pieces(spec, mod, q, q, q, None) is not None


def test_the_route_is_decided_once_per_signature(monkeypatch):
    """A repeated banded call is one lookup: the same rectangles, or the very plan the plain
    path would run (nothing re-decided, nothing re-validated); clearing the plans clears routes."""
    from fused_attn import plan as P

    C.clear_memos()
    spec, mod = resolve_spec(score_mod=sm.softcap(5.0), attn_mask_type="causal")
    q = torch.randn(1, 1024, 2, 16, dtype=torch.float64)
    sig = P.call_signature(spec, q, q, q, NO_VARLEN, mod, None)
    plain = C.route(spec, mod, q, q, q, None, sig)  # a small call: not cut
    assert isinstance(plain, P.CallPlan) and plain is P.get_plan(spec, mod, q, q, q, NO_VARLEN)
    made = []
    monkeypatch.setattr(C, "_make_call", lambda *a, **k: made.append(1))
    monkeypatch.setattr(P, "_make_plan", lambda *a, **k: made.append(1))
    assert C.route(spec, mod, q, q, q, None, sig) is plain and not made
    monkeypatch.undo()
    P.clear_plans()
    _no_host_cost(monkeypatch)
    cut = C.route(spec, mod, q, q, q, None, sig)
    assert not isinstance(cut, P.CallPlan) and C.route(spec, mod, q, q, q, None, sig) is cut
    C.clear_memos()


@pytest.mark.slow
def test_training_calls_weigh_their_backward_rectangles_too(monkeypatch):
    spec, mod = resolve_spec(score_mod=sm.softcap(5.0), attn_mask_type="causal")
    q = torch.randn(1, 512, 2, 16, dtype=torch.float64)
    _no_host_cost(monkeypatch, (0.0, 1e12, 1e12))
    assert C.run_in_pieces(spec, mod, q, q, q, None) is not None  # no gradient: cut
    assert C.run_in_pieces(spec, mod, q.clone().requires_grad_(), q, q, None) is None  # training: does not pay
    _no_host_cost(monkeypatch, (0.0, 0.0, 1e12))  # query rectangles pay, key rectangles do not
    out = C.run_in_pieces(spec, mod, q.clone().requires_grad_(), q, q, None)
    call = next(c for c in C._ROUTES._data.values() if not isinstance(c, CallPlan) and c.trains)
    assert type(out.grad_fn).__name__.startswith("BandChunks") and call.backward_full is not None
    C.clear_memos()

def _ragged_cover(g):
    """How often the packed-window backward's two calls cover each (query, key) pair of one batch
    row (as the band in their own positions allows): (S, S) int."""
    cover = torch.zeros(g.seq, g.seq, dtype=torch.int64)
    n = g.head_rows
    cover[:n, :n] += _allowed(Band(g.left, 0, False), n, n).long()
    for b, q0, q1 in g.body:
        if b:
            continue
        local = _allowed(Band(0, g.left, False), q1 - q0, q1 - q0 + g.left)
        cover[q0:q1, q0 - g.left:q1] += local.long()
    return cover


@pytest.mark.slow
@pytest.mark.parametrize("seq, left", [(700, 200), (640, 150), (1000, 127), (4096, 1023), (3000, 1023), (513, 128),
                                       (900, 1)])
def test_packed_window_calls_hold_exactly_the_band(seq, left):
    """Head rows plus body chunks (keys [q0 - L, q1), band 0 <= b - a <= L in their positions)
    cover every allowed pair once and nothing else; every body chunk's band ends inside its keys."""
    from fused_attn.backends.cudnn.band_ragged import geometry

    g = geometry(2, seq, left)
    assert g is not None and g.chunk % 128 == 0 and g.head_rows >= left
    full = _allowed(Band(left, 0, False), seq, seq).long()
    assert torch.equal(_ragged_cover(g), full)
    assert all(q0 - left >= 0 and (q1 - q0 - 1) + left <= (q1 - q0 + left) - 1 for _, q0, q1 in g.body)
    assert {b for b, _, _ in g.body} == {0, 1}


def test_packed_window_needs_rows_past_its_head():
    from fused_attn.backends.cudnn.band_ragged import geometry

    assert geometry(1, 512, 600) is None and geometry(1, 512, 0) is None


@pytest.mark.slow
@pytest.mark.parametrize("mask, window, seq", [("causal", (200, 0), 700), ("no_mask", (150, 0), 640),
                                               ("causal", (127, 0), 1000), ("causal", (300, 0), 300 + 257)])
@pytest.mark.parametrize("return_lse", [False, True])
def test_packed_window_backward_equals_the_unchunked_call(small_thresholds, monkeypatch, mask, window, seq,
                                                          return_lse):
    """The packed-window backward ("ragged": head rows and gathered body chunks, two packed calls)
    equals the plain call in float64 on the reference, GQA 4/2."""
    monkeypatch.setattr(C, "strategy", lambda *a: "ragged")
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, seq, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, seq, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(2, seq, 4, 16, generator=g, dtype=torch.float64)
    spec, mod = resolve_spec(backend="auto", qkv_format="bshd", score_mod=sm.softcap(5.0), attn_mask_type=mask,
                             window_size=window, return_lse=return_lse)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        got = fn(*leaves)
        out = got[0] if return_lse else got
        return ([out, got[1]] if return_lse else [out]) + list(torch.autograd.grad(out, leaves, do))

    plain = grads(lambda a, b, c: _run_plan(spec, mod, a, b, c, NO_VARLEN, None))
    chunked = grads(lambda a, b, c: C.run_in_pieces(spec, mod, a, b, c, None))
    _assert_same(plain, chunked, return_lse)
    calls = [c for c in C._ROUTES._data.values() if not isinstance(c, CallPlan) and c.trains]
    assert calls and all(c.backward_ragged is not None and c.backward_full is None for c in calls)


@pytest.mark.slow
@pytest.mark.parametrize("fmt, mask, window, sq, skv, deterministic", [
    ("sbhd", "causal", (200, 0), 700, 700, False), ("bshd", "causal", None, 700, 700, False),
    ("bshd", "no_mask", (150, 30), 640, 640, False), ("bshd", "causal_bottom_right", (150, 0), 600, 650, False),
    ("bshd", "causal", (200, 0), 700, 700, True)])
def test_the_packed_window_serves_only_top_left_windows_on_bshd(small_thresholds, monkeypatch, fmt, mask, window,
                                                                sq, skv, deterministic):
    """Other bands and layouts, and deterministic calls (its key gradients are summed with
    index_add), keep the plain backward even when "ragged" is asked for."""
    monkeypatch.setattr(C, "strategy", lambda *a: "ragged")
    shape = {"bshd": lambda s: (1, s, 2, 16), "sbhd": lambda s: (s, 1, 2, 16)}[fmt]
    q = torch.randn(*shape(sq), dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(*shape(skv), dtype=torch.float64, requires_grad=True) for _ in range(2))
    spec, mod = resolve_spec(backend="auto", qkv_format=fmt, score_mod=sm.softcap(5.0), attn_mask_type=mask,
                             window_size=window, deterministic=deterministic)
    C.run_in_pieces(spec, mod, q, k, v, None)
    calls = [c for c in C._ROUTES._data.values() if not isinstance(c, CallPlan) and c.trains]
    assert calls and all(c.backward_ragged is None and c.backward_full is not None for c in calls)


def test_the_cost_model_offers_the_packed_window_where_it_saves_backward_work():
    """At B1 H16 S8192 D64 with a 1024 window the packed backward (0.18 of the square) beats the plain
    backward and its host time; a packed backward over most of the square does not."""
    pieces = BP.plan_pieces(Band(1023, 0, False), 8192, 8192)
    scores, elements = 16 * 8192 * 8192, 16 * 8192 * 64
    assert BP.strategy(pieces, scores, 64, True, elements, 0.18) == "ragged"
    assert BP.strategy(pieces, scores, 64, True, elements, 0.95) != "ragged"
    assert BP.strategy(pieces, scores, 64, False, elements, 0.18) != "ragged"


@pytest.mark.parametrize("batch, seq, left", [(2, 700, 200), (3, 1000, 127), (1, 557, 300)])
def test_packed_window_stats_are_the_packed_lse_per_token(batch, seq, left):
    """The packed-window backward's Stats (one row per flat query row) hold, at every token of
    the head and the body call, the lse of that token: what the packed runner makes of the
    call's packed lse (H, Tq) (its transpose) for its own tokens."""
    from fused_attn.backends.cudnn import band_ragged as R

    heads = 3
    g = R.geometry(batch, seq, left)
    head, body, _, first = R._varlens(g, torch.device("cpu"))
    lse = torch.randn(batch, heads, seq)
    stats = R.token_stats(lse)
    assert stats.shape == (batch * seq, heads, 1) and stats.dtype == torch.float32
    packed = lse.permute(1, 0, 2).reshape(heads, batch * seq)  # (H, Tq) of the flat rows
    for varlen, rows, start in ((head, stats, 0), (body, stats[first:], first)):
        starts = varlen.cu_seqlens_q_padded.tolist()
        lens = (varlen.cu_seqlens_q[1:] - varlen.cu_seqlens_q[:-1]).tolist()
        for s0, n in zip(starts, lens):  # every token of every sequence of the call
            assert torch.equal(rows[s0:s0 + n, :, 0], packed[:, start + s0:start + s0 + n].t())
        assert rows.is_contiguous()
