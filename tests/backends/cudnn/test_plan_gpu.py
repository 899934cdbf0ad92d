"""GPU: call plans on cuDNN — the fast execute path, sinks, the bias input, padding edge cases,
alignment, varlen windows, scale changes, explain/fallback — each against the float64 reference
with the project's tolerance rule (`fused_attn.testing`)."""

import warnings

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn.testing import (assert_close, grad_tolerances, mask_band, packed_tolerances, reference_attention,
                                tolerance)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DT = torch.bfloat16


def bshd(b, s, h, d, dtype=DT, grad=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g).requires_grad_(grad)


def logical(t):
    return t.detach().transpose(1, 2)


def check_dense(out, grads, q, k, v, do, scale, mask=None, score_fn=None, sinks=None, extra=()):
    """out (B, S, H, Dv) and grads of (q, k, v[, sinks]) against float64 with the tolerance rule."""
    ql, kl, vl = logical(q), logical(k), logical(v)
    exact, _ = reference_attention(ql, kl, vl, scale, mask, score_fn, sinks)
    bound = tolerance(ql, kl, vl, scale, q.dtype, mask, score_fn, sinks)
    assert_close(logical(out), exact, bound, "out")
    want, bounds = grad_tolerances(ql, kl, vl, logical(do), scale, q.dtype, mask, score_fn, sinks)
    names = ["dq", "dk", "dv", "dsinks"]
    for name, got, w, b in zip(names, grads, want, bounds):
        got = got if name == "dsinks" else logical(got)
        assert_close(got, w, b, name)


def test_fast_execute_equals_public_execute(monkeypatch):
    """The raw-pointer path and the frontend's public execute run the same plan: equal bits."""
    from fused_attn.cache import GRAPH_CACHE

    q, k, v = bshd(2, 256, 4, 64), bshd(2, 256, 4, 64, seed=1), bshd(2, 256, 4, 64, seed=2)
    do = bshd(2, 256, 4, 64, grad=False, seed=3)
    mod = sm.softcap(20.0)

    def run():
        out = fused_attn.dot_product_attention(q, k, v, score_mod=mod, attn_mask_type="causal", backend="cudnn")
        return [out] + list(torch.autograd.grad(out, (q, k, v), do))

    fast = run()
    compiled = [GRAPH_CACHE.peek(key) for key in GRAPH_CACHE.keys()]
    assert any(c.fast is not None for c in compiled), "the raw-pointer path was not available"
    for c in compiled:
        monkeypatch.setattr(c, "fast", None)
    public = run()
    for a, b in zip(fast, public):
        assert torch.equal(a, b)


def test_softcap_value_change_takes_effect_without_rebuild():
    attn = fused_attn.DotProductAttention(4, 64, attn_mask_type="causal", score_mod=sm.softcap(30.0), backend="cudnn")
    q, k, v = bshd(1, 128, 4, 64, grad=False), bshd(1, 128, 4, 64, grad=False, seed=1), bshd(1, 128, 4, 64, grad=False, seed=2)
    mask = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril()
    outs = []
    for cap in (30.0, 2.0):
        attn.score_mod = sm.softcap(cap)
        before = fused_attn.graph_cache.cache_info().builds
        out = attn(q, k, v)
        if cap == 2.0:
            assert fused_attn.graph_cache.cache_info().builds == before
        fn = lambda s, *_: cap * torch.tanh(s / cap)
        exact, _ = reference_attention(logical(q), logical(k), logical(v), 0.125, mask, fn)
        assert_close(logical(out), exact, tolerance(logical(q), logical(k), logical(v), 0.125, DT, mask, fn), f"cap {cap}")
        outs.append(out)
    assert not torch.equal(outs[0], outs[1])


def test_softmax_scale_change_does_not_rebuild():
    q, k, v = bshd(1, 128, 2, 64, grad=False), bshd(1, 128, 2, 64, grad=False, seed=1), bshd(1, 128, 2, 64, grad=False, seed=2)
    fused_attn.dot_product_attention(q, k, v, softmax_scale=0.1, backend="cudnn")
    before = fused_attn.graph_cache.cache_info().builds
    out = fused_attn.dot_product_attention(q, k, v, softmax_scale=0.3, backend="cudnn")
    assert fused_attn.graph_cache.cache_info().builds == before
    exact, _ = reference_attention(logical(q), logical(k), logical(v), 0.3)
    assert_close(logical(out), exact, tolerance(logical(q), logical(k), logical(v), 0.3, DT), "scale 0.3")


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
@pytest.mark.parametrize("hkv", [4, 2])
def test_sinks_dense(softmax_type, mask, hkv):
    q, k, v = bshd(2, 192, 4, 64), bshd(2, 192, hkv, 64, seed=1), bshd(2, 192, hkv, 64, seed=2)
    do = bshd(2, 192, 4, 64, grad=False, seed=3)
    sinks = None
    if softmax_type == "learnable":
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device="cuda", requires_grad=True)
    out = fused_attn.dot_product_attention(q, k, v, attn_mask_type=mask, softmax_type=softmax_type, sinks=sinks,
                                           backend="cudnn")
    wrt = (q, k, v) + ((sinks,) if sinks is not None else ())
    grads = torch.autograd.grad(out, wrt, do)
    m = torch.ones(192, 192, dtype=torch.bool, device="cuda").tril() if mask == "causal" else None
    ref_sinks = sinks.detach() if sinks is not None else torch.zeros(4, device="cuda")
    check_dense(out, grads, q, k, v, do, 0.125, m, None, ref_sinks)


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
@pytest.mark.parametrize("window", [None, (15, 0)])
@pytest.mark.parametrize("hkv", [4, 2])
def test_sinks_thd_forward_and_backward_on_cudnn(softmax_type, window, hkv):
    """Packed sinks on cuDNN, gradients included (below cuDNN 9.26 the backward graph has no sink
    token: dQ/dK/dV come from the sink-aware Stats and dSink from a reduction), against the packed
    float64 reference; a sequence with one token and one longer than a 128-key tile."""
    cu = torch.tensor([0, 5, 135, 136, 200], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(200, 4, 64, device="cuda", dtype=DT, generator=g).requires_grad_()
    k, v = (torch.randn(200, hkv, 64, device="cuda", dtype=DT, generator=g).requires_grad_() for _ in range(2))
    do = torch.randn(200, 4, 64, device="cuda", dtype=DT, generator=g)
    sinks = None
    if softmax_type == "learnable":
        sinks = torch.tensor([0.3, -0.7, 1.5, 0.0], device="cuda", requires_grad=True)
    kw = dict(qkv_format="thd", attn_mask_type="causal", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=130,
              max_seqlen_kv=130, softmax_type=softmax_type, window_size=window, return_lse=True)
    out, lse = fused_attn.dot_product_attention(q, k, v, sinks=sinks, backend="cudnn", **kw)
    wrt = (q, k, v) + (() if sinks is None else (sinks,))
    grads = torch.autograd.grad(out, wrt, do)
    ref_sinks = torch.zeros(4, device="cuda") if sinks is None else sinks.detach()
    exact, bounds = packed_tolerances(q, k, v, do, cu, cu, 0.125, DT, band=mask_band("causal", window), sinks=ref_sinks)
    names = ("out", "lse", "dq", "dk", "dv") + (() if sinks is None else ("dsinks",))
    for name, got in zip(names, (out, lse) + grads):
        assert_close(got, exact[name], bounds[name], name)


@pytest.mark.parametrize("bias_dtype", [torch.float32, DT])
@pytest.mark.parametrize("shape", [(1, 4, 128, 128), (2, 1, 128, 128), (2, 4, 128, 128)])
def test_post_scale_bias_input_and_grad(bias_dtype, shape):
    q, k, v = bshd(2, 128, 4, 64), bshd(2, 128, 4, 64, seed=1), bshd(2, 128, 4, 64, seed=2)
    do = bshd(2, 128, 4, 64, grad=False, seed=3)
    g = torch.Generator(device="cuda").manual_seed(9)
    bias = torch.randn(*shape, device="cuda", generator=g).to(bias_dtype).requires_grad_()
    out = fused_attn.dot_product_attention(q, k, v, score_mod=sm.post_scale_bias(bias), backend="cudnn")
    grads = torch.autograd.grad(out, (q, k, v, bias), do)
    fn = lambda s, b, h, qi, ki: s + bias.detach().double()[b.clamp(max=shape[0] - 1), h.clamp(max=shape[1] - 1), qi, ki]
    check_dense(out, grads[:3], q, k, v, do, 0.125, None, fn)
    b64 = bias.detach().double().requires_grad_()
    ref = fused_attn.dot_product_attention(*(t.detach().double() for t in (q, k, v)), score_mod=sm.post_scale_bias(b64),
                                           backend="reference")
    (want,) = torch.autograd.grad(ref, (b64,), do.double())
    assert grads[3].shape == bias.shape
    err = (grads[3].double() - want).abs().max().item()
    assert err <= 0.02 * want.abs().max().item() + 1e-3, err


def test_softcap_then_bias_uses_bias_input():
    q, k, v = bshd(1, 128, 2, 64), bshd(1, 128, 2, 64, seed=1), bshd(1, 128, 2, 64, seed=2)
    do = bshd(1, 128, 2, 64, grad=False, seed=3)
    bias = torch.randn(1, 2, 128, 128, device="cuda")
    mod = sm.compose(sm.softcap(5.0), sm.post_scale_bias(bias))
    out = fused_attn.dot_product_attention(q, k, v, score_mod=mod, attn_mask_type="causal", backend="cudnn")
    grads = torch.autograd.grad(out, (q, k, v), do)
    m = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril()
    fn = lambda s, b, h, qi, ki: 5.0 * torch.tanh(s / 5.0) + bias.double()[0, h, qi, ki]
    check_dense(out, grads, q, k, v, do, 0.125, m, fn)


def test_huge_window_is_unbounded():
    q, k, v = bshd(1, 128, 2, 64, grad=False), bshd(1, 128, 2, 64, grad=False, seed=1), bshd(1, 128, 2, 64, grad=False, seed=2)
    a = fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal", window_size=(2**31 - 1, 0), backend="cudnn")
    b = fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal", backend="cudnn")
    assert torch.equal(a, b)


def test_padded_rows_without_keys_are_zero():
    q, k, v = bshd(3, 64, 2, 64, grad=False), bshd(3, 64, 2, 64, grad=False, seed=1), bshd(3, 64, 2, 64, grad=False, seed=2)
    cu_q = torch.tensor([0, 10, 40, 104], dtype=torch.int32, device="cuda")
    cu_kv = torch.tensor([0, 0, 30, 94], dtype=torch.int32, device="cuda")  # sequence 0 has no key
    out, lse = fused_attn.dot_product_attention(q, k, v, attn_mask_type="padding", cu_seqlens_q=cu_q,
                                                cu_seqlens_kv=cu_kv, return_lse=True, backend="cudnn")
    assert out[0].abs().max() == 0 and torch.isinf(lse[0, :, :10]).all()
    assert torch.isfinite(out).all()


def test_thd_rows_without_keys_are_zero():
    cu_q = torch.tensor([0, 7, 20], dtype=torch.int32, device="cuda")
    cu_kv = torch.tensor([0, 0, 9], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(20, 2, 64, device="cuda", dtype=DT, generator=g)
    k, v = (torch.randn(9, 2, 64, device="cuda", dtype=DT, generator=g) for _ in range(2))
    out = fused_attn.dot_product_attention(q, k, v, qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                           max_seqlen_q=13, max_seqlen_kv=9, backend="cudnn")
    assert out[:7].abs().max() == 0 and torch.isfinite(out).all()
    exact, bounds = packed_tolerances(q, k, v, None, cu_q, cu_kv, 0.125, DT)
    assert_close(out, exact["out"], bounds["out"], "out")


def test_misaligned_and_odd_stride_inputs_are_served():
    base = torch.randn(2 * 128 * 4 * 64 + 1, device="cuda", dtype=DT)
    q = base[1:].view(2, 128, 4, 64)  # storage offset of one element: not 16-byte aligned
    k, v = bshd(2, 128, 4, 64, grad=False, seed=1), bshd(2, 128, 4, 64, grad=False, seed=2)
    out = fused_attn.dot_product_attention(q, k, v, backend="cudnn")
    exact, _ = reference_attention(logical(q), logical(k), logical(v), 0.125)
    assert_close(logical(out), exact, tolerance(logical(q), logical(k), logical(v), 0.125, DT), "misaligned q")


def test_varlen_causal_score_mod_self_attention_runs_on_cudnn():
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(300, 4, 64, device="cuda", dtype=DT) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fused_attn.FallbackWarning)
        out = fused_attn.varlen_attn(q, k, v, cu, cu, 200, 200, window_size=(-1, 0), score_mod=sm.softcap(30.0))
    exact, bounds = packed_tolerances(q, k, v, None, cu, cu, 64 ** -0.5, DT, band=(-1, 0, True),
                                      score_fn=lambda s, *_: 30.0 * torch.tanh(s / 30.0))
    assert_close(out, exact["out"], bounds["out"], "varlen causal softcap")


def test_varlen_two_sided_window_with_unequal_lengths():
    cu_q = torch.tensor([0, 5, 45], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 9, 90], dtype=torch.int32, device="cuda")
    q = torch.randn(45, 2, 64, device="cuda", dtype=DT)
    k, v = (torch.randn(90, 2, 64, device="cuda", dtype=DT) for _ in range(2))
    out = fused_attn.varlen_attn(q, k, v, cu_q, cu_k, 40, 81, window_size=(6, 3))
    exact, bounds = packed_tolerances(q, k, v, None, cu_q, cu_k, 64 ** -0.5, DT, band=(6, 3, True))
    assert_close(out, exact["out"], bounds["out"], "bottom-right two-sided window")


def test_auto_fallback_warns_once_and_explains():
    """float32 CUDA tensors: no GPU engine takes them, so auto runs the reference, warns once per
    plan and says why; a document mask in bf16 runs on FA4 where it is installed (its CuTe
    lowering reads the ids), else on the reference with the same warning."""
    q, k, v = (t.float() for t in (bshd(1, 64, 2, 64), bshd(1, 64, 2, 64, seed=1), bshd(1, 64, 2, 64, seed=2)))
    mod = sm.document_mask(torch.arange(64, device="cuda") // 16)
    with pytest.warns(fused_attn.FallbackWarning, match="reference backend"):
        fused_attn.dot_product_attention(q, k, v, score_mod=mod)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fused_attn.FallbackWarning)
        fused_attn.dot_product_attention(q, k, v, score_mod=mod)  # same plan: no second warning
    why = fused_attn.explain(q, k, v, score_mod=mod)
    assert why.backend == "reference" and "float16 or bfloat16" in why.reason
    half = [t.to(torch.bfloat16) for t in (q, k, v)]
    from fused_attn import engines

    expected = "fa4" if engines.available("fa4") else "reference"
    assert fused_attn.explain(*half, score_mod=mod).backend == expected


@pytest.mark.parametrize("batch,docs", [(1, 1), (2, 3), (4, 6)])
@pytest.mark.parametrize("mask", [dict(is_causal=True), dict(), dict(window_size=(32, 0), is_causal=True)])
def test_doc_packed_parity_cases(batch, docs, mask):
    """AutoParallel's parity shapes (S=256, H 8/4 GQA, D=64, bf16): previously a workspace error."""
    g = torch.Generator().manual_seed(batch * 10 + docs)
    rows = []
    for _ in range(batch):
        cuts = sorted(torch.randperm(255, generator=g)[: docs - 1].add(1).tolist())
        rows.append([0] + cuts + [256] * (docs - len(cuts)))
    cu_seq = torch.tensor(rows, dtype=torch.int32, device="cuda")
    q = bshd(batch, 256, 8, 64)
    k, v = bshd(batch, 256, 4, 64, seed=1), bshd(batch, 256, 4, 64, seed=2)
    do = bshd(batch, 256, 8, 64, grad=False, seed=3)
    out = fused_attn.doc_packed_attn(q, k, v, cu_seq, enable_gqa=True, **mask)
    grads = torch.autograd.grad(out, (q, k, v), do)
    # the rows' documents as one packed batch of B * 256 tokens (empty documents dropped)
    cu = torch.unique((cu_seq.long() + 256 * torch.arange(batch, device="cuda").view(-1, 1)).flatten()).int()
    flat = [t.detach().reshape(batch * 256, t.shape[2], 64) for t in (q, k, v, do)]
    band = mask_band("causal" if mask.get("is_causal") else "no_mask", mask.get("window_size"))
    exact, bounds = packed_tolerances(*flat, cu, cu, 64 ** -0.5, DT, band=band)
    for name, got in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert_close(got.reshape(exact[name].shape), exact[name], bounds[name], name)


@pytest.mark.parametrize("skv", [128, 192, 256, 320])
@pytest.mark.parametrize("sq_equal", [True, False])
@pytest.mark.parametrize("form", ["bias", "bias+softcap"])
def test_no_nan_dq_at_key_lengths_64_mod_128(skv, sq_equal, form):
    """cuDNN 9.19 writes NaN into dQ when Skv = 64 mod 128 and a row's lse < -88.7 (a -200 bias
    on half the query rows): the library pads the keys in the backward and stays exact."""
    sq = skv if sq_equal else 128
    q, k, v = bshd(1, sq, 2, 64), bshd(1, skv, 2, 64, seed=1), bshd(1, skv, 2, 64, seed=2)
    do = bshd(1, sq, 2, 64, grad=False, seed=3)
    bias = torch.zeros(1, 2, sq, skv, device="cuda", dtype=DT)
    bias[:, :, sq // 2:] = -200.0
    mod = sm.post_scale_bias(bias) if form == "bias" else sm.compose(sm.softcap(30.0), sm.post_scale_bias(bias))
    if form != "bias" and skv % 128 == 64:  # refused on cuDNN (see DenseRunner._padded_backward); auto falls back
        with pytest.raises(NotImplementedError, match="64 mod 128"):
            fused_attn.dot_product_attention(q, k, v, score_mod=mod, backend="cudnn")
        return
    out = fused_attn.dot_product_attention(q, k, v, score_mod=mod, backend="cudnn")
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert not any(torch.isnan(g).any() for g in grads)
    b64 = bias.double()
    if form == "bias":
        fn = lambda s, b, h, qi, ki: s + b64[0, h, qi, ki]
    else:
        fn = lambda s, b, h, qi, ki: 30.0 * torch.tanh(s / 30.0) + b64[0, h, qi, ki]
    check_dense(out, grads, q, k, v, do, 0.125, None, fn)


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_dropout_on_cudnn_is_reproducible_and_unbiased(fmt):
    s, h, d, p = 128, 2, 64, 0.25
    if fmt == "thd":  # two sequences of 60 and 64 tokens: a one-hot V row per key of a sequence
        s = 124
        cu = torch.tensor([0, 60, 124], dtype=torch.int32, device="cuda")
        kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=64, max_seqlen_kv=64)
        shape = (s, h, d)
        eye = torch.eye(64, device="cuda", dtype=DT)
        eye_v = torch.cat([eye[:60], eye]).view(s, 1, 64).expand(s, h, 64).contiguous()
    else:
        kw = {}
        shape = (1, s, h, d)
        eye_v = None
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=DT, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(*shape, device="cuda", dtype=DT, generator=g)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        out = fused_attn.dot_product_attention(q, k, v, dropout_p=p, backend="cudnn", **kw)
        runs.append([out] + list(torch.autograd.grad(out, (q, k, v), do)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    plain = fused_attn.dot_product_attention(q, k, v, backend="cudnn", **kw).float()
    assert not torch.equal(runs[0][0].float(), plain)
    mean = torch.stack([fused_attn.dot_product_attention(q, k, v, dropout_p=p, backend="cudnn", **kw).float()
                        for _ in range(300)]).mean(0)
    assert (mean - plain).abs().mean() < 0.1 * plain.abs().mean()
    if eye_v is not None:
        w = fused_attn.dot_product_attention(q.detach(), k.detach(), eye_v, dropout_p=p, backend="cudnn", **kw)
        nonzero = (w != 0).float().sum() / (60 * 60 + 64 * 64) / h
        assert abs(nonzero.item() - (1 - p)) < 0.05


def test_persistent_cache_warm_start_in_a_fresh_process(tmp_path):
    """A process stores its graphs; a second process loads every one (0 builds) and its results
    still match the float64 reference (checked in the child), forward and backward, for a band,
    a score_mod and a packed (thd) configuration."""
    import json
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = os.path.join(tests, "helpers", "persistent_child.py")

    def spawn(mode):
        done = subprocess.run([sys.executable, child, str(tmp_path), mode], capture_output=True, text=True,
                              timeout=300, env=dict(os.environ))
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    stored = spawn("store")
    assert stored["builds"] == 6 and stored["loads"] == 0 and stored["store"]["saves"] == 6
    loaded = spawn("load")
    assert loaded["builds"] == 0 and loaded["loads"] == 6, loaded
    assert loaded["store"]["skipped_corrupt"] == 0 and loaded["store"]["skipped_mismatch"] == 0
    print("persistent cache first call ms (build -> load):",
          {n: (round(stored["first_call_ms"][n], 1), round(ms, 1)) for n, ms in loaded["first_call_ms"].items()})


def test_lse_given_backward_with_strided_views_of_out_and_inputs():
    """attention_backward from an output that is a view into a larger buffer (a context-parallel
    accumulator: batch stride != S*H*D) and from query views along the sequence: the graph reads
    O in the forward's layout, so such views must be laid out first (were read with the wrong
    strides for B > 1)."""
    from fused_attn.functional import attention_backward, attention_forward

    g = torch.Generator(device="cuda").manual_seed(11)
    full = [torch.randn(2, 512, 4, 64, device="cuda", dtype=DT, generator=g) for _ in range(3)]
    q = full[0].narrow(1, 256, 256)
    k, v = full[1].narrow(1, 0, 256), full[2].narrow(1, 0, 256)
    do = torch.randn(2, 256, 4, 64, device="cuda", dtype=DT, generator=g)
    out, lse = attention_forward(q, k, v, attn_mask_type="causal", backend="cudnn")
    big = torch.zeros(2, 512, 4, 64, device="cuda", dtype=DT)
    big.narrow(1, 256, 256).copy_(out)
    grads = attention_backward(q, k, v, big.narrow(1, 256, 256), lse, do, attn_mask_type="causal", backend="cudnn")
    m = torch.ones(256, 256, dtype=torch.bool, device="cuda").tril()
    check_dense(out, grads[:3], q, k, v, do, 0.125, m)


@pytest.mark.parametrize("packed", [False, True])
def test_training_calls_leave_no_reference_cycle_on_cudnn(packed):
    """A call's saved state never references its own output (see the CPU twin in
    test_cudnn_runners_cpu): nothing is left for the garbage collector after fwd + bwd."""
    import gc

    if packed:
        x = torch.randn(384, 4, 64, device="cuda", dtype=DT, requires_grad=True)
        cu = torch.tensor([0, 100, 384], device="cuda", dtype=torch.int32)
        kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=284, max_seqlen_kv=284,
                  attn_mask_type="padding")
    else:
        x = bshd(2, 256, 4, 64)
        kw = dict(attn_mask_type="causal")
    kw["backend"] = "cudnn"  # auto may choose another engine where one is installed
    call = lambda: fused_attn.dot_product_attention(x, x, x, **kw)  # noqa: E731
    call().float().sum().backward()
    gc.collect()
    gc.disable()
    try:
        call().float().sum().backward()
        torch.cuda.synchronize()
        assert gc.collect() == 0
    finally:
        gc.enable()
