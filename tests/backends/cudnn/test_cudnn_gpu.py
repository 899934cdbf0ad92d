"""The cuDNN backend on a GPU (dense layouts, every option), each result against the float64
reference with the project's tolerance rule (`fused_attn.testing`)."""

import functools
import math

import pytest
import torch

from fused_attn.layouts import to_logical
from fused_attn.testing import assert_attention_close
from helpers.attention import band_mask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.bfloat16, torch.float16]
CAUSAL_TYPES = ("causal", "causal_bottom_right", "padding_causal")
PADDING_TYPES = ("padding", "padding_causal")


def make(fmt, b, h, s, d, dtype, requires_grad=True):
    shape = {"bshd": (b, s, h, d), "sbhd": (s, b, h, d), "bhsd": (b, h, s, d)}[fmt]
    return torch.randn(shape, device="cuda", dtype=dtype).requires_grad_(requires_grad)


@functools.lru_cache(maxsize=None)
def band(sq, skv, left, right, bottom_right, q_len, kv_len):
    """`helpers.attention.band_mask`, cached (the masks repeat across cases)."""
    return band_mask(sq, skv, left, right, bottom_right, q_len, kv_len)


def allowed_mask(sq, skv, attn_mask_type="no_mask", window_size=None, cu_seqlens_q=None, cu_seqlens_kv=None,
                 **_):
    """Bool (B or 1, 1, Sq, Skv) mask (True = attend) of a dense call's mask arguments, or None.

    As documented by `dot_product_attention`: -left <= j - (i + shift) <= right, with right = 0
    for the causal types, shift = Skv - Sq for causal_bottom_right, and for the padding types
    the lengths of sequence b from cu_seqlens_q/kv (rows and keys past them masked).
    """
    left, right = window_size or (-1, -1)
    if attn_mask_type in CAUSAL_TYPES:
        right = 0
    lens = [(sq, skv)]
    if attn_mask_type in PADDING_TYPES:
        lens = list(zip(cu_seqlens_q.diff().tolist(), cu_seqlens_kv.diff().tolist()))
    elif left == right == -1:
        return None
    bottom_right = attn_mask_type == "causal_bottom_right"
    return torch.stack([band(sq, skv, left, right, bottom_right, lq, lkv) for lq, lkv in lens])[:, None]


def check(out, q, k, v, scale, mask=None, score_fn=None, lse=None, grads=None, do=None, label=""):
    """`fused_attn.testing.assert_attention_close`: logical (B, H, S, D) out, lse and grads against
    float64 with the tolerance rule."""
    assert_attention_close(out, q, k, v, scale, mask, score_fn, lse=lse, grads=grads, grad_out=do, what=label)


def run(q, k, v, grad, **kw):
    """(out, lse, (dq, dk, dv)) of one cuDNN call for the cotangent `grad`."""
    import fused_attn

    out, lse = fused_attn.dot_product_attention(q, k, v, backend="cudnn", return_lse=True, **kw)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    return out, lse, grads


def compare(fmt, dtype, b=2, h=4, hkv=4, sq=128, skv=128, d=64, dv=64, make_inputs=None, **kw):
    """One cuDNN call (out, lse, gradients) in `fmt` against the float64 reference."""
    q, k, v = make(fmt, b, h, sq, d, dtype), make(fmt, b, hkv, skv, d, dtype), make(fmt, b, hkv, skv, dv, dtype)
    if make_inputs is not None:
        q, k, v = make_inputs(q, k, v)
    grad = torch.randn(*q.shape[:-1], dv, device="cuda", dtype=dtype)
    out, lse, grads = run(q, k, v, grad, qkv_format=fmt, **kw)
    assert out.dtype == dtype
    for g, t in zip(grads, (q, k, v)):
        assert g.shape == t.shape
    out_l, q_l, k_l, v_l, do_l = (to_logical(t, fmt) for t in (out, q, k, v, grad))
    scale = kw.get("softmax_scale") or 1 / math.sqrt(q_l.shape[-1])
    mask = allowed_mask(q_l.shape[2], k_l.shape[2], **kw)
    check(out_l, q_l, k_l, v_l, scale, mask, lse=lse, grads=[to_logical(g, fmt) for g in grads], do=do_l)
    return out, grads


MASKS = [
    dict(),
    dict(attn_mask_type="causal"),
    dict(attn_mask_type="causal_bottom_right"),
    dict(window_size=(16, 0)),
    dict(window_size=(8, 8)),
    dict(window_size=(-1, 4)),
    dict(attn_mask_type="causal_bottom_right", window_size=(16, 0)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()) or "none")
def test_dense_masks(fmt, dtype, mask):
    compare(fmt, dtype, **mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [
    dict(h=8, hkv=2), dict(h=4, hkv=1, dv=128), dict(sq=64, skv=192), dict(sq=200, skv=72, d=128, dv=32),
])
@pytest.mark.parametrize("mask", [dict(), dict(attn_mask_type="causal"), dict(attn_mask_type="causal_bottom_right")])
def test_gqa_and_shapes(shape, dtype, mask):
    if mask.get("attn_mask_type") == "causal_bottom_right" and shape.get("sq", 128) > shape.get("skv", 128):
        pytest.skip("bottom-right with Sq > Skv: covered by test_bottom_right_sq_gt_skv")
    compare("bshd", dtype, **shape, **mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_dense_padding(dtype, mask):
    lens_q = torch.tensor([0, 37, 128], dtype=torch.int32)
    lens_kv = torch.tensor([5, 1, 128], dtype=torch.int32)
    cu = lambda l: torch.cat([torch.zeros(1, dtype=torch.int32), l.cumsum(0).to(torch.int32)]).cuda()
    out, grads = compare("bshd", dtype, b=3, attn_mask_type=mask, cu_seqlens_q=cu(lens_q), cu_seqlens_kv=cu(lens_kv))
    assert out[1, 37:].abs().max() == 0 and out[0].abs().max() == 0


def test_bottom_right_sq_gt_skv():
    # Either right (rows with no key: 0 / -inf) or a NotImplementedError naming the alternative.
    try:
        compare("bshd", torch.bfloat16, sq=128, skv=64, attn_mask_type="causal_bottom_right")
    except NotImplementedError as exc:
        assert "reference" in str(exc)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype):
    def slices(q, k, v):
        # every other head of a wider tensor, and a head-dim slice of a wider value
        qw = torch.randn(2, 128, 8, 64, device="cuda", dtype=dtype)[:, :, ::2].requires_grad_()
        kw = torch.randn(2, 128, 4, 128, device="cuda", dtype=dtype)[..., :64].requires_grad_()
        vw = torch.randn(2, 4, 128, 64, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
        return qw, kw, vw

    compare("bshd", dtype, make_inputs=slices)


def test_grad_out_other_layout_and_grads_in_input_layout():
    import fused_attn

    q, k, v = (make("sbhd", 2, 4, 128, 64, torch.bfloat16) for _ in range(3))
    out = fused_attn.dot_product_attention(q, k, v, qkv_format="sbhd", backend="cudnn")
    assert out.stride() == q.stride()
    g = torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16).permute(2, 0, 1, 3)  # bhsd memory
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    assert dq.stride() == q.stride() and dk.stride() == k.stride()
    dq2, _, _ = torch.autograd.grad(fused_attn.dot_product_attention(q, k, v, qkv_format="sbhd", backend="cudnn"),
                                    (q, k, v), g.contiguous())
    assert torch.equal(dq, dq2)


def test_two_streams():
    import fused_attn

    q, k, v = (make("bshd", 2, 4, 256, 64, torch.bfloat16, False) for _ in range(3))
    expected = fused_attn.dot_product_attention(q, k, v, backend="cudnn", attn_mask_type="causal")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    outs = []
    for s in (s1, s2):
        with torch.cuda.stream(s):
            outs.append(fused_attn.dot_product_attention(q, k, v, backend="cudnn", attn_mask_type="causal"))
    torch.cuda.synchronize()
    for o in outs:
        assert torch.equal(o, expected)


def test_deterministic_backward_bitwise():
    import fused_attn

    q, k, v = (make("bshd", 2, 8, 512, 64, torch.bfloat16) for _ in range(3))
    g = torch.randn_like(q)
    runs = []
    for _ in range(2):
        out = fused_attn.dot_product_attention(q, k, v, backend="cudnn", deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), g))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_cache_hits_and_no_rebuilds():
    import fused_attn
    from fused_attn import graph_cache

    graph_cache.clear()
    q, k, v = (make("bshd", 1, 2, 128, 64, torch.float16) for _ in range(3))
    out = fused_attn.dot_product_attention(q, k, v, backend="cudnn")
    out.sum().backward()
    first = graph_cache.cache_info()
    assert first.builds == 2 and first.size == 2
    for _ in range(20):
        q2, k2, v2 = (make("bshd", 1, 2, 128, 64, torch.float16) for _ in range(3))
        fused_attn.dot_product_attention(q2, k2, v2, backend="cudnn").sum().backward()
    info = graph_cache.cache_info()
    assert info.builds == 2 and info.hits >= 40


def test_set_maxsize_bounds_size():
    import fused_attn
    from fused_attn import graph_cache

    graph_cache.clear()
    old = graph_cache.cache_info().maxsize
    try:
        graph_cache.set_maxsize(2)
        for s in (64, 128, 192, 256):
            q, k, v = (make("bshd", 1, 2, s, 64, torch.float16, False) for _ in range(3))
            fused_attn.dot_product_attention(q, k, v, backend="cudnn")
        info = graph_cache.cache_info()
        assert info.size == 2 and info.evictions == 2
    finally:
        graph_cache.set_maxsize(old)


def test_score_mod_without_backward_raises_at_backward():
    import fused_attn
    from score_mods.base import ScoreMod

    class Fwd(ScoreMod):
        name = "fwd_only_scale"
        cache_key = ("fwd_only_scale",)
        has_backward = False

        def eager(self, score, *args):
            return score * 0.5

        def cudnn_operands(self):
            return {"f": torch.full((1, 1, 1, 1), 0.5)}

        def lower_forward(self, graph, score, operands, memo):
            return graph.mul(a=score, b=operands["f"])

    q, k, v = (make("bshd", 1, 2, 128, 64, torch.bfloat16) for _ in range(3))
    with torch.no_grad():  # forward only: served by cuDNN
        out = fused_attn.dot_product_attention(q, k, v, backend="cudnn", score_mod=Fwd())
    half = lambda s, *_: s * 0.5
    check(to_logical(out, "bshd"), *(to_logical(t, "bshd") for t in (q, k, v)), 1 / math.sqrt(64), score_fn=half)
    # gradients required: refused up front (auto would pick the reference), not after the forward
    with pytest.raises(NotImplementedError, match="fwd_only_scale.*has no cuDNN backward"):
        fused_attn.dot_product_attention(q, k, v, backend="cudnn", score_mod=Fwd())


def test_warmup_builds_then_call_hits():
    import fused_attn
    from fused_attn import graph_cache

    graph_cache.clear()
    cfg = dict(batch=2, seqlen_q=128, seqlen_kv=128, num_heads=4, num_kv_heads=2, head_dim=64,
               dtype=torch.bfloat16, qkv_format="bshd", attn_mask_type="causal")
    info = graph_cache.warmup([cfg])
    assert info.builds == 2
    q = make("bshd", 2, 4, 128, 64, torch.bfloat16)
    k, v = make("bshd", 2, 2, 128, 64, torch.bfloat16), make("bshd", 2, 2, 128, 64, torch.bfloat16)
    fused_attn.dot_product_attention(q, k, v, backend="cudnn", attn_mask_type="causal").sum().backward()
    assert graph_cache.cache_info().builds == 2


@pytest.mark.parametrize("kw", [dict(), dict(attn_mask_type="causal"), dict(attn_mask_type="causal_bottom_right",
                                                                          window_size=(32, 0)),
                                dict(score_mod="softcap"), dict(hkv=1)])
def test_inference_forward_matches_the_training_forward(kw):
    """No gradient and no lse: the Stats go to the stream's scratch buffer. The output is the
    training forward's, bit for bit, on two streams, and matches float64."""
    import fused_attn
    import score_mods as sm

    kw = dict(kw)
    hkv = kw.pop("hkv", 4)
    if kw.get("score_mod") == "softcap":
        kw["score_mod"] = sm.softcap(20.0)
    q = make("bshd", 2, 4, 192, 64, torch.bfloat16, requires_grad=False)
    k, v = (make("bshd", 2, hkv, 256, 64, torch.bfloat16, requires_grad=False) for _ in range(2))
    with torch.no_grad():
        got = fused_attn.dot_product_attention(q, k, v, backend="cudnn", **kw)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got_side = fused_attn.dot_product_attention(q, k, v, backend="cudnn", **kw)
        torch.cuda.current_stream().wait_stream(side)
    trained = fused_attn.dot_product_attention(q.requires_grad_(), k, v, backend="cudnn", **kw)
    assert torch.equal(got, trained.detach()) and torch.equal(got_side, got)
    q_l, k_l, v_l = (to_logical(t.detach(), "bshd") for t in (q, k, v))
    mask = allowed_mask(192, 256, **{n: x for n, x in kw.items() if n != "score_mod"})
    score_fn = (lambda s, *_: 20.0 * torch.tanh(s / 20.0)) if "score_mod" in kw else None
    check(to_logical(got, "bshd"), q_l, k_l, v_l, 1 / 8, mask, score_fn)


@pytest.mark.parametrize("mask, window, sq, skv", [
    ("causal", None, 4096, 4096), ("causal_bottom_right", None, 4096, 4608), ("causal", None, 4224, 4352),
    ("causal", (1023, 0), 4096, 4096), ("causal_bottom_right", (700, 0), 4096, 4300),
    ("no_mask", (511, 64), 4096, 4096)])
@pytest.mark.parametrize("how", ["both", "forward"])
def test_banded_score_mod_in_rectangles_matches_float64(mask, window, sq, skv, how, monkeypatch):
    """softcap with a causal or windowed band runs as rectangles of the band on cuDNN (its band
    is declined next to a score_mod): query chunks forward; backward over key chunks ("both") or
    the plain call's backward ("forward"), from the stitched output and lse (BandChunks, forced
    here whatever the cost model says). out, lse and dq / dk / dv against float64 with the
    tolerance rule; the forward without gradients equal to the training forward."""
    import fused_attn
    import score_mods as sm
    from fused_attn.backends.cudnn import band_chunks

    monkeypatch.setattr(band_chunks, "strategy", lambda *a: how)
    band_chunks.clear_memos()
    q, k, v = (make("bshd", 1, h, n, 64, torch.bfloat16) for n, h in ((sq, 4), (skv, 2), (skv, 2)))
    grad = torch.randn_like(q)
    kw = dict(qkv_format="bshd", attn_mask_type=mask, window_size=window, score_mod=sm.softcap(20.0))
    out, lse, grads = run(q, k, v, grad, **kw)
    assert type(out.grad_fn).__name__.startswith("BandChunks")
    with torch.no_grad():
        inferred = fused_attn.dot_product_attention(q, k, v, backend="cudnn", **kw)
    assert torch.equal(inferred, out.detach())
    out_l, q_l, k_l, v_l, do_l = (to_logical(t, "bshd") for t in (out, q, k, v, grad))
    score_fn = lambda s, *_: 20.0 * torch.tanh(s / 20.0)  # noqa: E731
    check(out_l, q_l, k_l, v_l, 1 / 8, allowed_mask(sq, skv, attn_mask_type=mask, window_size=window), score_fn,
          lse=lse, grads=[to_logical(g, "bshd") for g in grads], do=do_l)


@pytest.mark.parametrize("mask, window, b, s", [("causal", (1023, 0), 2, 4096), ("no_mask", (511, 0), 2, 3000),
                                                ("causal", (200, 0), 3, 1100), ("causal", (575, 0), 1, 2048)])
def test_packed_window_backward_matches_float64(mask, window, b, s, monkeypatch):
    """A windowed softcap call whose backward runs as two packed cuDNN graphs (head rows, and body
    chunks over gathered keys; band_ragged, forced here): out, lse and dq / dk / dv against float64
    with the tolerance rule, GQA 4/2, several batches."""
    import score_mods as sm
    from fused_attn.backends.cudnn import band_chunks
    from fused_attn.plan import CallPlan

    monkeypatch.setattr(band_chunks, "strategy", lambda *a: "ragged")
    band_chunks.clear_memos()
    q, k, v = (make("bshd", b, h, s, 64, torch.bfloat16) for h in (4, 2, 2))
    grad = torch.randn_like(q)
    kw = dict(qkv_format="bshd", attn_mask_type=mask, window_size=window, score_mod=sm.softcap(20.0))
    out, lse, grads = run(q, k, v, grad, **kw)
    calls = [c for c in band_chunks._ROUTES._data.values() if not isinstance(c, CallPlan) and c.trains]
    assert calls and all(c.backward_ragged is not None for c in calls)
    out_l, q_l, k_l, v_l, do_l = (to_logical(t, "bshd") for t in (out, q, k, v, grad))
    score_fn = lambda x, *_: 20.0 * torch.tanh(x / 20.0)  # noqa: E731
    check(out_l, q_l, k_l, v_l, 1 / 8, allowed_mask(s, s, attn_mask_type=mask, window_size=window), score_fn,
          lse=lse, grads=[to_logical(g, "bshd") for g in grads], do=do_l)
    band_chunks.clear_memos()
