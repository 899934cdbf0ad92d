"""score_mods on the cuDNN backend vs the reference backend (GPU only; skipped without CUDA).

For every library mod and a composition: forward and dq/dk/dv, bf16 and fp16, against the float64
reference with the project's tolerance rule (`fused_attn.testing.bound_from`: twice the error of
the reference backend's own computation in the same dtype, plus the dtype's floor).
"""

import pytest
import torch

import score_mods as sm
from helpers.mods import quirk_applies

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

B, H, S, D = 2, 4, 128, 64


def _mods(dev):
    g = torch.Generator(device="cpu").manual_seed(0)
    bias = torch.randn(1, H, S, S, generator=g).to(dev)
    ids = torch.sort(torch.randint(0, 4, (B, S), generator=g), dim=1).values.to(dev)
    return {
        "causal": sm.causal(),
        "causal_bottom_right": sm.causal_bottom_right(),
        "sliding_window": sm.sliding_window(16, 0),
        "sliding_window_br": sm.sliding_window(16, 4, bottom_right=True),
        "softcap_1": sm.softcap(1.0),
        "softcap_30": sm.softcap(30.0),
        "post_scale_bias": sm.post_scale_bias(bias),
        "alibi": sm.alibi(sm.alibi_slopes(H).to(dev)),
        "document_mask_1d": sm.document_mask(ids[0]),
        "document_mask_2d": sm.document_mask(ids),
        "document_mask_runs_1d": sm.document_mask(ids[0], contiguous=True),  # trains on cuDNN
        "document_mask_runs_2d": sm.document_mask(ids, contiguous=True),
        "compose": sm.compose(sm.softcap(5.0), sm.alibi(sm.alibi_slopes(H).to(dev)), sm.causal()),
    }


def _run(fused_attn, q, k, v, mod, backend, dout):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=mod, backend=backend)
    out.backward(dout)
    return [out, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(_mods("cpu")))
def test_cudnn_matches_reference(name, dtype):
    """cuDNN in `dtype` against the float64 reference, bounded by the project's rule applied to the
    reference backend's own computation in `dtype` (fp32 softmax): out, dq, dk, dv."""
    fused_attn = pytest.importorskip("fused_attn")
    from fused_attn.testing import assert_close, bound_from

    dev = torch.device("cuda")
    mod = _mods(dev)[name]
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v, dout = (torch.randn(B, H, S, D, generator=g).to(dev) for _ in range(4))
    lo = [t.to(dtype) for t in (q, k, v, dout)]
    if mod.irregular_mask and quirk_applies("irregular_mask_backward"):  # document masks: forward only
        with torch.no_grad():
            exact = fused_attn.dot_product_attention(q.double(), k.double(), v.double(), qkv_format="bhsd",
                                                     score_mod=mod, backend="reference")
            same = fused_attn.dot_product_attention(*lo[:3], qkv_format="bhsd", score_mod=mod, backend="reference")
            got = fused_attn.dot_product_attention(*lo[:3], qkv_format="bhsd", score_mod=mod, backend="cudnn")
        assert_close(got, exact, bound_from(same, exact, dtype), f"{name} out {dtype}")
        with pytest.raises(NotImplementedError, match="irregular_mask_backward"):
            _run(fused_attn, *lo[:3], mod, "cudnn", lo[3])
        return
    exact = _run(fused_attn, q.double(), k.double(), v.double(), mod, "reference", dout.double())
    same = _run(fused_attn, *lo[:3], mod, "reference", lo[3])
    got = _run(fused_attn, *lo[:3], mod, "cudnn", lo[3])
    for what, e, s, g in zip(("out", "dq", "dk", "dv"), exact, same, got):
        assert torch.isfinite(g).all(), f"{name} {what}: non-finite values"
        assert_close(g, e, bound_from(s, e, dtype), f"{name} {what} {dtype}")


def test_softcap_value_change_reuses_graph():
    fused_attn = pytest.importorskip("fused_attn")
    from fused_attn.testing import assert_close, bound_from

    dev = torch.device("cuda")
    q, k, v = (torch.randn(1, 2, 64, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    a = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=sm.softcap(1.0), backend="cudnn")
    b = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=sm.softcap(50.0), backend="cudnn")
    exact = fused_attn.dot_product_attention(q.double(), k.double(), v.double(), qkv_format="bhsd",
                                             score_mod=sm.softcap(50.0), backend="reference")
    same = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=sm.softcap(50.0), backend="reference")
    assert not torch.equal(a, b)
    assert_close(b, exact, bound_from(same, exact, torch.bfloat16), "softcap 50 after softcap 1")


# --------------------------------------------------------------------------- the new language on cuDNN
# Every construct of the attention-gym zoo (integer ops, bit tricks, clamps, gathers at computed
# indices, erf / pow / % on the score, learned tables) through the public API, forward and
# backward, against the float64 reference with the project's tolerance rule (fused_attn.testing).

from helpers.zoo import H as ZH, S as ZS, zoo  # noqa: E402

ZD = 64


def _zoo_case(name, dtype, seed=3):
    from fused_attn import testing

    dev = torch.device("cuda")
    mod, _ = zoo(device=dev, dtype=torch.float32)[name]
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, dout = (torch.randn(1, ZH, ZS, ZD, generator=g).to(dev) for _ in range(4))
    scale = ZD ** -0.5

    def score_fn(s, b, h, qi, ki):
        return mod.eager(s, b, h, qi, ki, ZS, ZS)

    return testing, mod, (q, k, v, dout), scale, score_fn


def _cudnn(fused_attn, mod, q, k, v, dtype, grad):
    q, k, v = (t.to(dtype).detach().requires_grad_(grad) for t in (q, k, v))
    out = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=mod, backend="cudnn")
    return out, (q, k, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(zoo()))
def test_zoo_on_cudnn_matches_reference(name, dtype):
    fused_attn = pytest.importorskip("fused_attn")
    testing, mod, (q, k, v, dout), scale, score_fn = _zoo_case(name, dtype)
    exact, _ = testing.reference_attention(q, k, v, scale, score_fn=score_fn)
    bound = testing.tolerance(q, k, v, scale, dtype, score_fn=score_fn)
    if mod.irregular_mask and quirk_applies("irregular_mask_backward"):  # cuDNN forward only
        with torch.no_grad():
            out, _ = _cudnn(fused_attn, mod, q, k, v, dtype, grad=False)
        testing.assert_close(out.float(), exact.float(), bound, what=f"{name} out")
        with pytest.raises(NotImplementedError):
            o, _ = _cudnn(fused_attn, mod, q, k, v, dtype, grad=True)
            o.backward(dout.to(dtype))
        return
    out, leaves = _cudnn(fused_attn, mod, q, k, v, dtype, grad=True)
    testing.assert_close(out.float(), exact.float(), bound, what=f"{name} out")
    out.backward(dout.to(dtype))
    grads, bounds = testing.grad_tolerances(q, k, v, dout, scale, dtype, score_fn=score_fn)
    for what, leaf, g_exact, b in zip(("dq", "dk", "dv"), leaves, grads, bounds):
        assert torch.isfinite(leaf.grad).all(), f"{name} {what}: non-finite"
        testing.assert_close(leaf.grad.float(), g_exact.float(), b, what=f"{name} {what}")


@pytest.mark.parametrize("name", ["t5_bias", "sandwich", "graphormer", "bias_under_mask"])
def test_learned_tables_train_on_cudnn(name):
    """Tables entering only through the additive bias get their gradient from cuDNN's dBias
    (split_additive_bias + materialize): equal to the reference backend's within the rule. Next
    to a score_mod callback (bias_under_mask: softcap) cuDNN's dBias was measured wrong, so that
    is refused with the reason."""
    fused_attn = pytest.importorskip("fused_attn")
    from fused_attn import testing

    dtype = torch.bfloat16
    _, mod, (q, k, v, dout), _, _ = _zoo_case(name, dtype)
    trained = [n for n, t in mod.trainable().items() if t.floating and t.bias_only]
    assert trained, name
    if name == "bias_under_mask":
        tensors = {n: t.detach().float().requires_grad_(n in trained) if t.is_floating_point() else t
                   for n, t in mod.tensors().items()}
        with pytest.raises(NotImplementedError, match="next to another score_mod term"):
            fused_attn.dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), qkv_format="bhsd",
                                             score_mod=mod.bind(**tensors), backend="cudnn")
        return

    def table_grads(backend, qkv_dtype, table_dtype):
        tensors = {n: t.detach().to(table_dtype if t.is_floating_point() else t.dtype).requires_grad_(n in trained)
                   for n, t in mod.tensors().items()}
        qq, kk, vv = (t.to(qkv_dtype) for t in (q, k, v))
        out = fused_attn.dot_product_attention(qq, kk, vv, qkv_format="bhsd", score_mod=mod.bind(**tensors),
                                               backend=backend)
        return torch.autograd.grad(out, [tensors[n] for n in trained], dout.to(qkv_dtype))

    exact = table_grads("reference", torch.float64, torch.float64)
    same_dtype = table_grads("reference", dtype, torch.float32)
    got = table_grads("cudnn", dtype, torch.float32)
    for n, e, s, g in zip(trained, exact, same_dtype, got):
        bound = testing.bound_from(s, e, dtype)
        testing.assert_close(g.float(), e.float(), bound, what=f"{name} d{n}")


def test_materialized_values_change_without_rebuilding():
    fused_attn = pytest.importorskip("fused_attn")
    from fused_attn import graph_cache, testing

    dev = torch.device("cuda")
    q, k, v = (torch.randn(1, 2, 128, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    mod, _ = zoo()["block_diagonal"]
    fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=mod(block=16), backend="cudnn")
    builds = graph_cache.cache_info().builds
    out = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=mod(block=32), backend="cudnn")
    assert graph_cache.cache_info().builds == builds  # operands are inputs: a new block size rebuilds nothing
    bound = mod(block=32)
    fn = lambda s, b, h, qi, ki: bound.eager(s, b, h, qi, ki, 128, 128)  # noqa: E731
    exact, _ = testing.reference_attention(q, k, v, 64 ** -0.5, score_fn=fn)
    testing.assert_close(out, exact, testing.tolerance(q, k, v, 64 ** -0.5, torch.bfloat16, score_fn=fn), "block 32")


def test_score_dependent_gather_is_refused_on_cudnn():
    fused_attn = pytest.importorskip("fused_attn")

    @sm.score_mod
    def score_indexed(score, b, h, q_idx, kv_idx, table=sm.TensorParam()):
        return score + table[sm.floor(score).clamp(0, 3)]

    dev = torch.device("cuda")
    q, k, v = (torch.randn(1, 2, 64, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(NotImplementedError, match="cannot run on cuDNN"):
        fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=score_indexed(table=torch.randn(4, device=dev)),
                                         backend="cudnn")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_query_axis_inputs_train_on_cudnn_and_key_axis_inputs_are_refused(dtype):
    """A document mask written with per-query bounds (kv_idx in [lo[q_idx], hi[q_idx])) and a
    per-query bias train on cuDNN within the rule; a per-key term (w[kv_idx]) is refused with the
    reason under backend="cudnn"; under "auto" it runs on flash-attn-4 where that is installed (its
    answer checked against float64, gradients included), else falls back with a FallbackWarning."""
    fused_attn = pytest.importorskip("fused_attn")
    from helpers.mods import axis_bias_mods
    from fused_attn import testing

    dev, s = torch.device("cuda"), 256
    g = torch.Generator(device="cpu").manual_seed(4)
    ids = torch.sort(torch.randint(0, 5, (s,), generator=g)).values.to(dev)
    w = torch.randn(s, generator=g).to(dev)
    q, k, v, dout = (torch.randn(2, 4, s, 64, generator=g).to(dev) for _ in range(4))
    scale = 64 ** -0.5
    ids64, w64 = ids, w.double()
    query_bias, key_bias = axis_bias_mods(w)
    cases = {"doc_bounds": (sm.document_mask(ids, contiguous=True), lambda sc, b, h, qi, ki: torch.where(
                 ids64[qi] == ids64[ki], sc, float("-inf"))),
             "query_bias": (query_bias, lambda sc, b, h, qi, ki: sc + w64[qi])}
    for name, (mod, fn) in cases.items():
        out, leaves = _cudnn(fused_attn, mod, q, k, v, dtype, grad=True)
        exact, _ = testing.reference_attention(q, k, v, scale, score_fn=fn)
        testing.assert_close(out.float(), exact.float(), testing.tolerance(q, k, v, scale, dtype, score_fn=fn),
                             what=f"{name} out")
        out.backward(dout.to(dtype))
        grads, bounds = testing.grad_tolerances(q, k, v, dout, scale, dtype, score_fn=fn)
        for what, leaf, g_exact, b in zip(("dq", "dk", "dv"), leaves, grads, bounds):
            testing.assert_close(leaf.grad.float(), g_exact.float(), b, what=f"{name} {what}")
    with pytest.raises(NotImplementedError, match="along the keys only"):
        _cudnn(fused_attn, key_bias, q, k, v, dtype, grad=True)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    chosen = fused_attn.explain(*leaves, qkv_format="bhsd", score_mod=key_bias).backend
    assert chosen != "cudnn", "backend='auto' chose cuDNN for a per-key tensor term it refuses"
    if chosen != "fa4":
        with pytest.warns(fused_attn.FallbackWarning, match="along the keys only"):
            fused_attn.dot_product_attention(*leaves, qkv_format="bhsd", score_mod=key_bias)
        return
    # flash-attn-4 is installed and serves the per-key term: no fallback, and its answer is right
    fn = lambda sc, b, h, qi, ki: sc + w64[ki]  # noqa: E731
    out = fused_attn.dot_product_attention(*leaves, qkv_format="bhsd", score_mod=key_bias)
    exact, _ = testing.reference_attention(q, k, v, scale, score_fn=fn)
    testing.assert_close(out.float(), exact.float(), testing.tolerance(q, k, v, scale, dtype, score_fn=fn),
                         what="key_bias out (fa4)")
    out.backward(dout.to(dtype))
    grads, bounds = testing.grad_tolerances(q, k, v, dout, scale, dtype, score_fn=fn)
    for what, leaf, g_exact, b in zip(("dq", "dk", "dv"), leaves, grads, bounds):
        testing.assert_close(leaf.grad.float(), g_exact.float(), b, what=f"key_bias {what} (fa4)")


def test_batch_only_inputs_run_on_cudnn_only_where_read_right():
    """Per-sequence scalars ((B, 1, 1, 1) graph inputs): added to the score, or as a (B, S) table
    read along the keys, they run on cuDNN within the rule; in a mask or a product (read wrongly
    by cuDNN 9.19, measured) the call is refused on backend='cudnn'."""
    fused_attn = pytest.importorskip("fused_attn")
    from helpers.mods import batch_table_mods
    from fused_attn import testing

    dev, s = torch.device("cuda"), 256
    g = torch.Generator(device="cpu").manual_seed(5)
    lens, w = torch.tensor([5, 200, 130, 256], dtype=torch.int32, device=dev), torch.randn(4, generator=g).to(dev)
    q, k, v = (torch.randn(4, 4, s, 64, generator=g).to(dev) for _ in range(3))
    scale = 64 ** -0.5
    kv_ok = torch.arange(s, device=dev)[None, None, None, :] < lens.view(-1, 1, 1, 1)
    fns = {"add_b": lambda sc, b, h, qi, ki: sc + w.double()[b], "mask_bkv": lambda sc, b, h, qi, ki: sc}
    for name, (mod, refused) in batch_table_mods(lens, w).items():
        lo = [t.to(torch.bfloat16) for t in (q, k, v)]
        if refused:
            with pytest.raises(NotImplementedError, match="varies along the batch only"):
                fused_attn.dot_product_attention(*lo, qkv_format="bhsd", score_mod=mod, backend="cudnn")
            continue
        mask = kv_ok if name == "mask_bkv" else None
        with torch.no_grad():
            out = fused_attn.dot_product_attention(*lo, qkv_format="bhsd", score_mod=mod, backend="cudnn")
        exact, _ = testing.reference_attention(q, k, v, scale, mask, fns[name])
        testing.assert_close(out.float(), exact.float(),
                             testing.tolerance(q, k, v, scale, torch.bfloat16, mask, fns[name]), what=name)
