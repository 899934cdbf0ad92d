"""GPU: varlen_attn next to torch's own varlen_attn, doc_packed_attn next to per-document SDPA (bf16), all
against the packed float64 reference (`fused_attn.testing.packed_tolerances`)."""

import inspect

import pytest
import torch

from fused_attn.testing import assert_close, mask_band, packed_tolerances

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _packed(lens, h, hkv, d, grad=True):
    t = sum(lens)
    mk = lambda hh: torch.randn(t, hh, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    return mk(h), mk(hkv), mk(hkv), cu


def _torch_varlen_gqa(torch_varlen, q, k, v, *args, gqa, **kw):
    """torch's varlen_attn with GQA: its own ``enable_gqa`` where it has one (torch >= 2.12),
    otherwise on key/value with each KV head repeated for its query-head group (same answer)."""
    if "enable_gqa" in inspect.signature(torch_varlen).parameters:
        return torch_varlen(q, k, v, *args, enable_gqa=gqa, **kw)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return torch_varlen(q, k, v, *args, **kw)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (128, 0)])
@pytest.mark.parametrize("gqa", [False, True])
def test_matches_torch_varlen(window, gqa):
    from torch.nn.attention.varlen import AuxRequest as TAux
    from torch.nn.attention.varlen import varlen_attn as torch_varlen

    from fused_attn import AuxRequest, varlen_attn

    lens = [0, 1, 37, 256, 200, 511]
    h, hkv = (8, 2) if gqa else (8, 8)
    q, k, v, cu = _packed(lens, h, hkv, 128)
    out, lse = varlen_attn(
        q, k, v, cu, cu, 511, 511, window_size=window, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
    )
    ref, ref_lse = _torch_varlen_gqa(
        torch_varlen, q, k, v, cu, cu, 511, 511, gqa=gqa, window_size=window, return_aux=TAux(lse=True)
    )
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    # both against the packed float64 reference with the project's rule: the same semantics
    exact, bounds = packed_tolerances(q, k, v, g, cu, cu, 128 ** -0.5, torch.bfloat16, band=(*window, True))
    for name, ours, theirs in zip(("out", "dq", "dk", "dv"), (out, *got), (ref, *want)):
        assert_close(ours, exact[name], bounds[name], name)
        assert_close(theirs, exact[name], bounds[name], f"torch's varlen_attn {name}")
    real = torch.isfinite(ref_lse) & (ref_lse.abs() < 1e30)
    assert_close(lse, exact["lse"], bounds["lse"], "lse")
    assert_close(ref_lse[real], exact["lse"][real], bounds["lse"], "torch's varlen_attn lse")


@pytest.mark.parametrize("gqa", [False, True])
def test_bottom_right_causal_with_a_score_mod_runs_on_cudnn(gqa):
    """Chunked prefill / cross-attention: causal (bottom-right per sequence) + softcap with other
    query than key lengths runs on cuDNN (as a padded dense batch with the bounds as its bias),
    against the packed float64 reference with the tolerance rule, gradients included."""
    import math

    import score_mods as sm
    from fused_attn import AuxRequest, explain, varlen_attn

    lens_q, lens_k = [64, 1, 300, 0, 130, 7], [1000, 1, 300, 5, 64, 70]
    (h, hkv), cap = (8, 2) if gqa else (8, 8), 30.0
    q, _, _, cu_q = _packed(lens_q, h, hkv, 64)
    _, k, v, cu_k = _packed(lens_k, h, hkv, 64)
    how = explain(q, k, v, qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=300,
                  max_seqlen_kv=1000, attn_mask_type="causal_bottom_right", score_mod=sm.softcap(cap))
    assert how.backend == "cudnn", how
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, 300, 1000, return_aux=AuxRequest(lse=True), window_size=(-1, 0),
                           enable_gqa=gqa, score_mod=sm.softcap(cap))
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    fn = lambda s, b, hh, i, j: cap * torch.tanh(s / cap)
    exact, bounds = packed_tolerances(q, k, v, do, cu_q, cu_k, 1 / math.sqrt(64), torch.bfloat16,
                                      band=mask_band("causal_bottom_right"), score_fn=fn)
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert_close(got, exact[name], bounds[name], name)


def test_doc_packed_matches_per_document_sdpa():
    from fused_attn import doc_packed_attn

    b, s, h, d = 2, 512, 8, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([[0, 100, 101, 512, 512], [0, 512, 512, 512, 512]], device="cuda", dtype=torch.int32)
    out = doc_packed_attn(q, k, v, cu, is_causal=True)
    ref = torch.empty_like(out)
    for bi, row in enumerate(cu.tolist()):
        for s0, s1 in zip(row[:-1], row[1:]):
            if s1 > s0:
                sl = lambda x: x[bi, s0:s1].transpose(0, 1)
                sdpa = torch.nn.functional.scaled_dot_product_attention
                ref[bi, s0:s1] = sdpa(sl(q), sl(k), sl(v), is_causal=True).transpose(0, 1)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    # both against the packed float64 reference with the project's rule: the rows' documents as one
    # packed batch of B * S tokens (empty documents dropped)
    cu_all = torch.unique((cu.long() + s * torch.arange(b, device="cuda").view(-1, 1)).flatten()).int()
    flat = [t.detach().reshape(b * s, h, d) for t in (q, k, v, g)]
    exact, bounds = packed_tolerances(*flat, cu_all, cu_all, d ** -0.5, torch.bfloat16, band=mask_band("causal"))
    for name, ours, theirs in zip(("out", "dq", "dk", "dv"), (out, *got), (ref, *want)):
        assert_close(ours.reshape(b * s, h, d), exact[name], bounds[name], name)
        assert_close(theirs.reshape(b * s, h, d), exact[name], bounds[name], f"per-document SDPA {name}")


@pytest.mark.parametrize("causal", [True, False])
def test_doc_packed_with_a_host_table_runs_a_graph_sized_by_the_longest_document(monkeypatch, causal):
    """A CPU boundary table with CUDA queries: read on the host (no sync), the graph sized by its
    longest document, offsets copied asynchronously; out and gradients against float64."""
    import math

    import fused_attn
    from fused_attn import doc_packed as dp
    from fused_attn.testing import assert_close, grad_tolerances, reference_attention, tolerance

    seen = []
    real = dp.run_spec
    monkeypatch.setattr(dp, "run_spec", lambda *a: (seen.append(a[-1]), real(*a))[1])
    b, s, h, d = 2, 1024, 4, 64
    table = torch.tensor([[0, 100, 164, 400, 1024], [0, 300, 600, 900, 1024]], dtype=torch.int32)  # longest 624
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fused_attn.doc_packed_attn(q, k, v, table, is_causal=causal)
    assert seen[-1].max_seqlen_q == 624 and seen[-1].cu_seqlens_q.is_cuda
    grads = torch.autograd.grad(out, (q, k, v), do)
    doc = torch.zeros(b, s, dtype=torch.long)
    for bi, row in enumerate(table.tolist()):
        for i, (s0, s1) in enumerate(zip(row[:-1], row[1:])):
            doc[bi, s0:s1] = i
    mask = (doc[:, :, None] == doc[:, None, :])[:, None].cuda()
    if causal:
        mask = mask & torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
    lq, lk, lv, ldo = (t.detach().transpose(1, 2) for t in (q, k, v, do))
    scale = 1 / math.sqrt(d)
    exact, _ = reference_attention(lq, lk, lv, scale, mask)
    assert_close(out.transpose(1, 2), exact, tolerance(lq, lk, lv, scale, torch.bfloat16, mask), "out")
    want, bounds = grad_tolerances(lq, lk, lv, ldo, scale, torch.bfloat16, mask)
    for name, got, w, bound in zip("qkv", grads, want, bounds):
        assert_close(got.transpose(1, 2), w, bound, f"d{name}")
    # the same call with the table on the device: read once on the host, the same graph size and answer
    again = fused_attn.doc_packed_attn(q, k, v, table.cuda(), is_causal=causal)
    assert seen[-1].max_seqlen_q == 624
    assert_close(again.transpose(1, 2), exact, tolerance(lq, lk, lv, scale, torch.bfloat16, mask), "out (device table)")
    # given max_doc_len, a device table is never read on the host: the graph is sized by it
    sized = fused_attn.doc_packed_attn(q, k, v, table.cuda(), is_causal=causal, max_doc_len=s)
    assert seen[-1].max_seqlen_q == s
    assert_close(sized.transpose(1, 2), exact, tolerance(lq, lk, lv, scale, torch.bfloat16, mask), "out (max_doc_len=S)")


def test_doc_packed_device_table_is_read_once_per_table_and_never_with_max_doc_len():
    """Without max_doc_len a device table is read (and checked) on the host once; the layers that
    reuse it, and any call given max_doc_len, synchronise nothing; a bad device table is a
    ValueError at the call (the host check), not a device assertion."""
    import fused_attn

    b, s, h, d = 2, 512, 2, 64
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor([[0, 100, 512], [0, 256, 512]], dtype=torch.int32, device="cuda")
    other = torch.tensor([[0, 200, 512], [0, 1, 512]], dtype=torch.int32, device="cuda")
    fused_attn.doc_packed_attn(q, q, q, table, is_causal=True)  # the read
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_attn.doc_packed_attn(q, q, q, table, is_causal=True)  # the same table: no read
        fused_attn.doc_packed_attn(q, q, q, other, is_causal=True, max_doc_len=511)
        with pytest.raises(RuntimeError, match="synchroniz"):  # a new table without max_doc_len is read
            fused_attn.doc_packed_attn(q, q, q, other, is_causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    bad = torch.tensor([[0, 300, 200, 512], [0, 1, 2, 512]], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="row 0 is decreasing"):
        fused_attn.doc_packed_attn(q, q, q, bad)
