"""doc_packed_attn against the packed float64 reference (each document a sequence); boundary helpers and
validation errors."""

import math

import pytest
import torch

from fused_attn import doc_packed_attn
from fused_attn.doc_packed import check_doc_boundaries, doc_cu_seqlens
from fused_attn.testing import agreement_bound, assert_close, max_error, packed_tolerances


def expected(q, k, v, cu_seq, grad_out=None, is_causal=False, window_size=(-1, -1), scale=None, enable_gqa=False):
    """(exact, bounds) of a doc_packed_attn call from the packed float64 reference: the rows'
    documents as one packed batch of B * S tokens (empty documents dropped), in q's dtype, with
    the project's bounds (`fused_attn.testing.packed_tolerances`). Tensors come back (B, S, ...)."""
    b, s = q.shape[:2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    cu = torch.unique((cu_seq.long() + s * torch.arange(b).view(-1, 1)).flatten()).int()
    flat = [None if t is None else t.detach().reshape(b * s, *t.shape[2:]) for t in (q, k, v, grad_out)]
    band = (window_size[0], 0 if is_causal else window_size[1], False)
    want, bounds = packed_tolerances(*flat, cu, cu, scale, q.dtype, band=band)
    return {n: t.reshape(b, s, *t.shape[1:]) for n, t in want.items() if n != "lse"}, bounds


def make(b=3, s=12, h=4, hkv=4, d=16, dtype=torch.float32, grad=False):
    mk = lambda hh: torch.randn(b, s, hh, d, dtype=dtype, requires_grad=grad)
    return mk(h), mk(hkv), mk(hkv)


CU = torch.tensor([[0, 5, 6, 12], [0, 12, 12, 12], [0, 1, 2, 12]], dtype=torch.int32)


def check(q, k, v, cu, **kw):
    out = doc_packed_attn(q, k, v, cu, **kw)
    want, bounds = expected(q, k, v, cu, **kw)
    assert out.shape == q.shape[:3] + (v.shape[-1],) and out.dtype == q.dtype
    assert_close(out, want["out"], bounds["out"], "doc_packed out")
    return out


def test_doc_cu_seqlens_global_offsets_and_sentinels():
    got = doc_cu_seqlens(CU, 12)
    expected = torch.tensor([0, 5, 6, 12, 24, 24, 24, 25, 26, 36], dtype=torch.int32)
    assert got.dtype == torch.int32 and torch.equal(got, expected)
    # sentinel documents are zero-length sequences; total is B*S
    lengths = got[1:] - got[:-1]
    assert lengths.tolist() == [5, 1, 6, 12, 0, 0, 1, 1, 10]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"window_size": (2, 1)}, {"is_causal": True, "window_size": (3, -1)}])
def test_matches_per_document_naive(kw):
    check(*make(), CU, **kw)


@pytest.mark.slow
def test_gqa_and_scale():
    check(*make(h=6, hkv=3), CU, enable_gqa=True, scale=0.2, is_causal=True)


@pytest.mark.slow
def test_documents_do_not_see_each_other():
    q, k, v = make()
    out = doc_packed_attn(q, k, v, CU)
    k2, v2 = k.clone(), v.clone()
    k2[0, 6:] = torch.randn_like(k2[0, 6:])  # change only the third document of row 0
    v2[0, 6:] = torch.randn_like(v2[0, 6:])
    out2 = doc_packed_attn(q, k2, v2, CU)
    assert torch.equal(out[0, :6], out2[0, :6]) and torch.equal(out[1:], out2[1:])
    assert max_error(out[0, 6:], out2[0, 6:]) > agreement_bound(out[0, 6:], torch.float32)


@pytest.mark.slow
def test_grads_match_naive():
    q, k, v = make(b=2, s=9, h=4, hkv=2, grad=True)
    cu = torch.tensor([[0, 4, 9, 9], [0, 1, 3, 9]], dtype=torch.int32)
    out = doc_packed_attn(q, k, v, cu, is_causal=True, enable_gqa=True)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want, bounds = expected(q, k, v, cu, g, is_causal=True)
    for name, a in zip(("dq", "dk", "dv"), got):
        assert_close(a, want[name], bounds[name], name)


@pytest.mark.slow
def test_bf16():
    check(*make(dtype=torch.bfloat16), CU, is_causal=True)


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cu, exc, match",
    [
        (CU.long(), TypeError, "cu_seq must have dtype torch.int32, got torch.int64"),
        (CU[0], ValueError, r"cu_seq must have shape \(B, MAX_DOCS\+1\) \(2 dims\), got shape \(4,\)"),
        (CU[:2], ValueError, "expected 3 rows, got 2"),
        (CU[:, :1], ValueError, "at least 2 columns"),
        ([[0, 12]] * 3, TypeError, "cu_seq must be a .* torch.Tensor, got list"),
        (torch.tensor([[0, 13, 12]] * 3, dtype=torch.int32), ValueError, r"row 0 has values outside \[0, S=12\]"),
        (torch.tensor([[0, 12], [1, 12], [0, 12]], dtype=torch.int32), ValueError, "row 1 does not start at 0"),
        (torch.tensor([[0, 12], [0, 12], [0, 11]], dtype=torch.int32), ValueError, "row 2 does not end at S=12"),
        (torch.tensor([[0, 6, 5, 12]] * 3, dtype=torch.int32), ValueError, "row 0 is decreasing"),
    ],
)
def test_cu_seq_errors(cu, exc, match):
    q, k, v = make()
    with pytest.raises(exc, match=match):
        doc_packed_attn(q, k, v, cu)


def test_cu_seq_device_checked():
    with pytest.raises(ValueError, match="cu_seq must be on the query's device cpu or on the CPU, got meta"):
        check_doc_boundaries(CU.to("meta"), 3, 12, torch.device("cpu"))
    # a host table serves queries on any device: it is read on the host, giving the longest document
    assert check_doc_boundaries(CU, 3, 12, torch.device("meta")) == 12


@pytest.mark.slow
@pytest.mark.parametrize("max_doc_len", [None, 11])
def test_a_host_table_sizes_the_graph_by_its_longest_document(monkeypatch, max_doc_len):
    """max_doc_len defaults to the longest document of a host table (read there for free), so
    many short documents do not run a graph sized for S; a given max_doc_len is kept."""
    from fused_attn import doc_packed as dp

    seen = []
    real = dp.run_spec
    monkeypatch.setattr(dp, "run_spec", lambda *a: (seen.append(a[-1]), real(*a))[1])
    q, k, v = make(b=3, s=12)
    cu = torch.tensor([[0, 5, 6, 12], [0, 6, 12, 12], [0, 1, 2, 12]], dtype=torch.int32)  # longest: 10
    out = doc_packed_attn(q, k, v, cu, is_causal=True, max_doc_len=max_doc_len)
    varlen = seen[0]
    assert varlen.max_seqlen_q == varlen.max_seqlen_kv == (10 if max_doc_len is None else 11)
    want, bounds = expected(q, k, v, cu, is_causal=True)
    assert_close(out, want["out"], bounds["out"], "out")
    with pytest.raises(ValueError, match="document of length 10 > max_doc_len=9"):
        doc_packed_attn(q, k, v, cu, max_doc_len=9)


def test_qkv_errors():
    q, k, v = make()
    with pytest.raises(ValueError, match=r"key must have shape \(B, S, H, D\) \(4 dims\)"):
        doc_packed_attn(q, k[0], v, CU)
    with pytest.raises(ValueError, match="must share"):
        doc_packed_attn(q, k[:, :6], v[:, :6], CU)
    with pytest.raises(ValueError, match="same head dim, got 16 and 8"):
        doc_packed_attn(q, k[..., :8], v, CU)
    with pytest.raises(ValueError, match="same number of heads, got H=4 and H_kv=2"):
        doc_packed_attn(q, k[:, :, :2], v[:, :, :2], CU)
    with pytest.raises(ValueError, match="query heads must be a multiple of kv heads, got H=4 and H_kv=3"):
        doc_packed_attn(q, k[:, :, :3], v[:, :, :3], CU, enable_gqa=True)
    with pytest.raises(ValueError, match="is_causal=True allows window_size right of -1 or 0"):
        doc_packed_attn(q, k, v, CU, is_causal=True, window_size=(2, 2))
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        doc_packed_attn(q, k, v, CU, is_causal=1)


@pytest.mark.slow
def test_boundary_table_is_checked_once_per_table_and_version(monkeypatch):
    """Layers sharing one table check and derive its offsets once; an in-place edit is seen."""
    from fused_attn import doc_packed as dp

    calls = []
    real = dp.check_doc_boundaries
    monkeypatch.setattr(dp, "check_doc_boundaries", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    q, k, v = make(b=2, s=8)
    cu_seq = torch.tensor([[0, 3, 8], [0, 8, 8]], dtype=torch.int32)
    first = doc_packed_attn(q, k, v, cu_seq)
    again = doc_packed_attn(q, k, v, cu_seq)
    assert len(calls) == 1 and torch.equal(first, again)
    cu_seq[0, 1] = 9  # in place: a new version, checked again (and refused)
    with pytest.raises(ValueError, match="outside"):
        doc_packed_attn(q, k, v, cu_seq)
    cu_seq[0, 1] = 5
    want, bounds = expected(q, k, v, cu_seq)
    assert_close(doc_packed_attn(q, k, v, cu_seq), want["out"], bounds["out"], "out after the edit")
    assert len(calls) == 3


@pytest.mark.slow
def test_argument_checks_run_once_per_call_configuration(monkeypatch):
    """A model's layers repeat one call: its argument checks run once per (table, shapes,
    arguments); a value equal to a cached one but of another type is still refused."""
    from fused_attn import doc_packed as dp

    calls = []
    real = dp._check_qkv
    monkeypatch.setattr(dp, "_check_qkv", lambda *a: (calls.append(1), real(*a))[1])
    q, k, v = make(b=2, s=8)
    cu_seq = torch.tensor([[0, 3, 8], [0, 8, 8]], dtype=torch.int32)
    first = doc_packed_attn(q, k, v, cu_seq, is_causal=True, window_size=(1, 0), max_doc_len=8)
    again = doc_packed_attn(q, k, v, cu_seq, is_causal=True, window_size=(1, 0), max_doc_len=8)
    assert len(calls) == 1 and torch.equal(first, again)
    want, bounds = expected(q, k, v, cu_seq, is_causal=True, window_size=(1, 0))
    assert_close(first, want["out"], bounds["out"], "out")
    q2, k2, v2 = make(b=2, s=8, h=2, hkv=2)  # other shapes: checked again
    doc_packed_attn(q2, k2, v2, cu_seq, is_causal=True, window_size=(1, 0), max_doc_len=8)
    assert len(calls) == 2
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        doc_packed_attn(q, k, v, cu_seq, is_causal=1, window_size=(1, 0), max_doc_len=8)
    with pytest.raises(TypeError, match="window_size left must be an int"):
        doc_packed_attn(q, k, v, cu_seq, is_causal=True, window_size=(True, 0), max_doc_len=8)
    with pytest.raises(ValueError, match="max_doc_len must be None or an int"):
        doc_packed_attn(q, k, v, cu_seq, is_causal=True, window_size=(1, 0), max_doc_len=8.0)
    doc_packed_attn(q, k, v, cu_seq)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        doc_packed_attn(q, k, v, cu_seq, enable_gqa=0)
    with pytest.raises(ValueError, match="is_causal=True allows window_size right of -1 or 0"):
        doc_packed_attn(q, k, v, cu_seq, is_causal=True, window_size=[2, 2])  # a list: checked every call
