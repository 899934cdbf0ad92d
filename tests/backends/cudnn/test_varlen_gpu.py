"""Packed (thd) batches on cuDNN against the packed float64 reference with the project's tolerance
rule (`fused_attn.testing.packed_tolerances`); graph-build counts."""

import math

import pytest
import torch

from fused_attn.testing import assert_close, mask_band, packed_tolerances
from helpers.attention import cu_seqlens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cu(lens, gap=0):
    return cu_seqlens(lens, gap).cuda()


def outside(offsets, lens, total):
    """(total,) bool: the packed rows that belong to no sequence."""
    rest = torch.ones(total, dtype=torch.bool, device="cuda")
    for start, n in zip(offsets, lens):
        rest[start:start + n] = False
    return rest


def run(q, k, v, grad, **kw):
    """(out, lse, (dq, dk, dv)) of one cuDNN call for the cotangent `grad`."""
    import fused_attn

    out, lse = fused_attn.dot_product_attention(q, k, v, qkv_format="thd", backend="cudnn", return_lse=True, **kw)
    return out, lse, torch.autograd.grad(out, (q, k, v), grad)


CASES = [
    dict(lens_q=[0, 1, 37, 128, 200], lens_kv=[0, 1, 37, 128, 200]),
    dict(lens_q=[5, 1, 37, 64, 3], lens_kv=[9, 3, 37, 200, 1], attn_mask_type="causal_bottom_right"),
    dict(lens_q=[17, 0, 99], lens_kv=[17, 0, 99], attn_mask_type="causal"),
    dict(lens_q=[33, 1, 130], lens_kv=[33, 2, 130], window_size=(8, 0)),
    dict(lens_q=[33, 7, 130], lens_kv=[40, 9, 131], attn_mask_type="causal_bottom_right", window_size=(8, 0)),
    dict(lens_q=[3, 77, 11], lens_kv=[3, 77, 11], h=8, hkv=2),
    dict(lens_q=[3, 77, 11], lens_kv=[5, 60, 11], gap=3, attn_mask_type="causal"),
    dict(lens_q=[64, 1], lens_kv=[64, 1], dv=32),
    # score_mods: on the ragged graph under a causal mask over one offsets tensor; every other form
    # (no mask, windows, bottom-right with q != kv, q > kv, empty sides, gaps) as a padded dense batch
    dict(lens_q=[5, 37, 130, 64], lens_kv=None, attn_mask_type="causal", softcap=20.0),
    dict(lens_q=[5, 37, 130, 64], lens_kv=None, softcap=20.0),
    dict(lens_q=[5, 1, 37, 64, 3, 0, 8, 130], lens_kv=[9, 3, 37, 200, 1, 4, 0, 130],
         attn_mask_type="causal_bottom_right", softcap=20.0),
    dict(lens_q=[64, 200, 7], lens_kv=[300, 64, 7], attn_mask_type="causal_bottom_right", softcap=5.0, h=8, hkv=2),
    dict(lens_q=[3, 77, 11], lens_kv=[5, 60, 11], gap=3, attn_mask_type="causal_bottom_right", softcap=20.0),
    dict(lens_q=[33, 7, 130], lens_kv=[40, 9, 131], window_size=(8, 8), softcap=20.0),
    dict(lens_q=[33, 7, 130], lens_kv=[40, 9, 131], attn_mask_type="causal_bottom_right", window_size=(8, 0),
         alibi=True),
]


def softcap_fn(cap):
    return lambda s, b, h, i, j: cap * torch.tanh(s / cap)


def token_sized_backward(monkeypatch):
    """Every packed backward the ragged runner serves runs its token-sized graph (max_total_seq_len,
    normally only for large workspaces); returns the list of token capacities run."""
    from fused_attn.backends.cudnn import common, thd

    monkeypatch.setattr(thd, "TOKEN_SIZED_WORKSPACE_BYTES", 0)
    monkeypatch.setattr(thd, "TOKEN_SIZED_RATIO", 1)
    ran = []
    real = common.Graphs.run_variant

    def spy(self, direction, key, bind):
        ran.append(key.token_capacity)
        return real(self, direction, key, bind)

    monkeypatch.setattr(common.Graphs, "run_variant", spy)
    return ran


@pytest.mark.parametrize("token_sized", [False, True], ids=["dims_sized", "token_sized"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_thd_vs_reference(case, dtype, token_sized, monkeypatch):
    if token_sized:
        token_sized_backward(monkeypatch)
    torch.manual_seed(11)  # the same inputs whatever ran before in this worker
    case = dict(case)
    lens_q, lens_kv = case.pop("lens_q"), case.pop("lens_kv")
    h, hkv, d, dv, gap = case.pop("h", 4), case.pop("hkv", 4), 64, case.pop("dv", 64), case.pop("gap", 0)
    cap, alibi = case.pop("softcap", None), case.pop("alibi", False)
    score_fn = None
    if cap is not None:
        import score_mods as sm

        case["score_mod"], score_fn = sm.softcap(cap), softcap_fn(cap)
    if alibi:  # positions within each sequence, as the reference reads them
        import score_mods as sm

        slopes = sm.alibi_slopes(h).cuda()
        case["score_mod"] = sm.alibi(slopes)
        score_fn = lambda s, b, hh, i, j: s + slopes.double()[hh] * (j - i)
    share = lens_kv is None  # queries and keys in one offsets tensor
    lens_kv = lens_q if share else lens_kv
    cq, ckv = cu(lens_q, gap), cu(lens_kv, gap)
    cu_q = cu(lens_q)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q if share else cu(lens_kv), max_seqlen_q=max(lens_q),
              max_seqlen_kv=max(lens_kv), **case)
    if gap:
        kw.update(cu_seqlens_q_padded=cq, cu_seqlens_kv_padded=ckv)
    tq, tkv = int(cq[-1]), int(ckv[-1])
    q = torch.randn(tq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(tkv, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(tkv, hkv, dv, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn(tq, h, dv, device="cuda", dtype=dtype)
    out, lse, grads = run(q, k, v, grad, **kw)
    assert lse.shape == (h, tq)
    off_q, off_kv = cq.tolist(), ckv.tolist()
    padded = dict(cu_seqlens_q_padded=cq, cu_seqlens_kv_padded=ckv) if gap else {}
    band = mask_band(case.get("attn_mask_type", "no_mask"), case.get("window_size"))
    exact, bounds = packed_tolerances(q, k, v, grad, cu_q, cu(lens_kv), 1 / math.sqrt(d), dtype, band=band,
                                      score_fn=score_fn, **padded)
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert_close(got, exact[name], bounds[name], name)
    if gap:  # nothing written between sequences
        rest_q, rest_kv = outside(off_q, lens_q, tq), outside(off_kv, lens_kv, tkv)
        for name, t, rest in (("out", out, rest_q), ("dq", grads[0], rest_q), ("dk", grads[1], rest_kv),
                              ("dv", grads[2], rest_kv)):
            assert_close(t[rest], torch.zeros_like(t[rest]), 0.0, f"{name} between sequences")
        assert_close(lse[:, rest_q], torch.full_like(lse[:, rest_q], -math.inf), 0.0, "lse between sequences")


def test_token_sized_backward_runs_and_matches(monkeypatch):
    """The token-sized backward graph is the one that runs (capacity: the next power of two of the
    token counts), and its gradients match the packed float64 reference."""
    ran = token_sized_backward(monkeypatch)
    torch.manual_seed(5)
    lens = [300, 17, 700, 1]
    cq = cu(lens)
    t = int(cq[-1])
    q, k, v = (torch.randn(t, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(t, 8, 64, device="cuda", dtype=torch.bfloat16)
    out, lse, grads = run(q, k, v, grad, cu_seqlens_q=cq, cu_seqlens_kv=cq, max_seqlen_q=700, max_seqlen_kv=700,
                          attn_mask_type="causal")
    assert ran == [(1024, 1024)]
    exact, bounds = packed_tolerances(q, k, v, grad, cq, cq, 1 / math.sqrt(64), torch.bfloat16,
                                      band=mask_band("causal"))
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert_close(got, exact[name], bounds[name], name)


def test_graph_builds_bounded_over_random_batches():
    import fused_attn
    from fused_attn import graph_cache

    graph_cache.clear()
    gen = torch.Generator().manual_seed(1234)
    for _ in range(50):
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        lens = torch.randint(0, 1024, (batch,), generator=gen).tolist()
        lens[0] = max(lens[0], 1)
        cq = cu(lens)
        t = int(cq[-1])
        q, k, v = (torch.randn(t, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = fused_attn.dot_product_attention(q, k, v, qkv_format="thd", cu_seqlens_q=cq, cu_seqlens_kv=cq,
                                               max_seqlen_q=max(lens), max_seqlen_kv=max(lens),
                                               attn_mask_type="causal", backend="cudnn")
        out.sum().backward()
        assert not out.isnan().any()
    info = graph_cache.cache_info()
    # batch buckets {1, 2, 4, 8} x seq buckets {64..1024}: a handful, not one per step
    assert info.thd_builds <= 2 * 4 * 5 and info.thd_builds == info.builds
    assert info.builds < 50


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, (24, 24)])
def test_dense_padding_with_a_score_mod(dtype, window):
    """attn_mask_type="padding" + softcap (no causal mask) on a dense (B, S, H, D) batch: through its
    packed form as the padded dense batch with the lengths in the bias; rows past a length stay 0."""
    import fused_attn
    import score_mods as sm

    torch.manual_seed(12)
    b, s, h, hkv, d, cap = 3, 192, 4, 2, 64, 20.0
    lens_q, lens_kv = [37, 192, 100], [5, 192, 77]
    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    out, lse = fused_attn.dot_product_attention(q, k, v, qkv_format="bshd", attn_mask_type="padding",
                                                window_size=window, cu_seqlens_q=cu(lens_q), cu_seqlens_kv=cu(lens_kv),
                                                score_mod=sm.softcap(cap), backend="cudnn", return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    # the batch's rows as one packed batch with gaps: sequence i starts at token i * S
    rows = dict(cu_seqlens_q_padded=cu([s] * b), cu_seqlens_kv_padded=cu([s] * b))
    flat = [t.detach().reshape(b * s, *t.shape[2:]) for t in (q, k, v, grad)]
    exact, bounds = packed_tolerances(*flat, cu(lens_q), cu(lens_kv), 1 / math.sqrt(d), dtype,
                                      band=mask_band("padding", window), score_fn=softcap_fn(cap), **rows)
    real_q = torch.cat([torch.arange(s, device="cuda") < n for n in lens_q])  # lse past a length: unspecified
    assert_close(lse.transpose(0, 1).reshape(h, b * s)[:, real_q], exact["lse"][:, real_q], bounds["lse"], "lse")
    for name, got in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert_close(got.reshape(b * s, *got.shape[2:]), exact[name], bounds[name], name)
    for i, (lq, lkv) in enumerate(zip(lens_q, lens_kv)):
        for name, t, n in (("out", out, lq), ("dq", grads[0], lq), ("dk", grads[1], lkv), ("dv", grads[2], lkv)):
            assert (t[i, n:] == 0).all(), f"{name} past sequence {i}'s length"
