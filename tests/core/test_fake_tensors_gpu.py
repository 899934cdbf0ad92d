"""GPU: every public entry point on fake "cuda" tensors and on meta tensors, then real calls in the
same process: no CUDA error (a fake tensor's null pointer once reached cuDNN and left the process
with an illegal memory access) and results against the float64 reference."""

import math

import pytest
import torch

import fused_attn
from fused_attn.layouts import to_logical
from fused_attn.testing import assert_close, grad_tolerances, reference_attention, tolerance
from helpers.fake_cases import CASES, run_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _causal_mask(sq, skv):
    return torch.ones(sq, skv, dtype=torch.bool).tril()


def _check(out, q, k, v, grad_out, fmt="bshd"):
    """out and q/k/v grads of a causal call against the float64 reference (logical layout)."""
    lq, lk, lv, lo, lg = (to_logical(t.detach(), fmt).cpu() for t in (q, k, v, out, grad_out))
    mask = _causal_mask(lq.shape[2], lk.shape[2])
    scale = 1 / math.sqrt(lq.shape[-1])
    want, _ = reference_attention(lq, lk, lv, scale, mask)
    assert_close(lo, want, tolerance(lq, lk, lv, scale, q.dtype, mask), "out")
    exact, bounds = grad_tolerances(lq, lk, lv, lg, scale, q.dtype, mask)
    for name, t, e, bd in zip("qkv", (q, k, v), exact, bounds):
        assert_close(to_logical(t.grad, fmt).cpu(), e, bd, f"d{name}")


def test_abstract_then_real_calls_in_one_process():
    for case in sorted(CASES):  # fake "cuda" and meta tensors: no kernel may run
        run_case(case, "cuda")
        run_case(case, "meta")
    torch.cuda.synchronize()
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, s, h, hkv, d = 2, 96, 4, 2, 64

    def leaves():
        return [torch.randn(b, s, n, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
                for n in (h, hkv, hkv)]

    q, k, v = leaves()
    out = fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal")
    g = torch.randn(out.shape, device="cuda", generator=gen, dtype=out.dtype)
    out.backward(g)
    _check(out, q, k, v, g)

    q, k, v = leaves()
    attn = fused_attn.DotProductAttention(h, d, num_gqa_groups=hkv, attn_mask_type="causal")
    out = attn(q, k, v)
    out.backward(g)
    _check(out, q, k, v, g)

    q, k, v = leaves()  # one document per row: doc-packed causal equals dense causal
    table = torch.tensor([[0, s], [0, s]], dtype=torch.int32, device="cuda")
    out = fused_attn.doc_packed_attn(q, k, v, table, is_causal=True, enable_gqa=True)
    out.backward(g)
    _check(out, q, k, v, g)

    q, k, v = leaves()
    cu = torch.arange(b + 1, dtype=torch.int32, device="cuda") * s
    flat = [t.detach().reshape(b * s, t.shape[2], d).requires_grad_() for t in (q, k, v)]
    out = fused_attn.varlen_attn(*flat, cu, cu, s, s, window_size=(-1, 0), enable_gqa=True)
    out.backward(g.reshape(b * s, h, d))
    for t, f in zip((q, k, v), flat):
        t.grad = f.grad.view(t.shape)
    _check(out.view(b, s, h, d), q, k, v, g)
    torch.cuda.synchronize()
