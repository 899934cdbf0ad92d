"""score_mods on the cuDNN backend vs the reference backend (GPU only; skipped without CUDA).

For every library mod and a composition: forward and dq/dk/dv, bf16 and fp16. Tolerance:
3 x (reference in the same dtype vs reference in fp32) + a small floor.
"""

import pytest
import torch

import score_mods as sm

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
        "compose": sm.compose(sm.softcap(5.0), sm.alibi(sm.alibi_slopes(H).to(dev)), sm.causal()),
    }


def _run(fused_attn, q, k, v, mod, backend, dout):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=mod, backend=backend)
    out.backward(dout)
    return [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(_mods("cpu")))
def test_cudnn_matches_reference(name, dtype):
    fused_attn = pytest.importorskip("fused_attn")
    dev = torch.device("cuda")
    mod = _mods(dev)[name]
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, H, S, D, device=dev) for _ in range(3))
    dout = torch.randn(B, H, S, D, device=dev)
    if not mod.has_backward:  # document masks: cuDNN forward only (its backward measured wrong)
        with torch.no_grad():
            r32 = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=mod, backend="reference")
            rdt = fused_attn.dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), qkv_format="bhsd",
                                                   score_mod=mod, backend="reference").float()
            g = fused_attn.dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), qkv_format="bhsd",
                                                 score_mod=mod, backend="cudnn").float()
        tol = 3 * (rdt - r32).abs().max().item() + 1e-3 * r32.abs().max().item() + 1e-4
        assert (g - r32).abs().max().item() <= tol
        with pytest.raises(NotImplementedError, match="no correct cuDNN backward"):
            _run(fused_attn, q.to(dtype), k.to(dtype), v.to(dtype), mod, "cudnn", dout.to(dtype))
        return
    ref32 = _run(fused_attn, q, k, v, mod, "reference", dout)
    refdt = _run(fused_attn, q.to(dtype), k.to(dtype), v.to(dtype), mod, "reference", dout.to(dtype))
    got = _run(fused_attn, q.to(dtype), k.to(dtype), v.to(dtype), mod, "cudnn", dout.to(dtype))
    for what, r32, rdt, g in zip(("out", "dq", "dk", "dv"), ref32, refdt, got):
        assert torch.isfinite(g).all(), f"{name} {what}: non-finite values"
        tol = 3 * (rdt - r32).abs().max().item() + 1e-3 * r32.abs().max().item() + 1e-4
        err = (g - r32).abs().max().item()
        assert err <= tol, f"{name} {what} {dtype}: max err {err:.3g} > tol {tol:.3g}"


def test_softcap_value_change_reuses_graph():
    fused_attn = pytest.importorskip("fused_attn")
    dev = torch.device("cuda")
    q, k, v = (torch.randn(1, 2, 64, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    a = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=sm.softcap(1.0), backend="cudnn")
    b = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=sm.softcap(50.0), backend="cudnn")
    rb = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=sm.softcap(50.0), backend="reference")
    assert not torch.equal(a, b)
    torch.testing.assert_close(b.float(), rb.float(), atol=2e-2, rtol=2e-2)
