"""GPU: values turned into structure follow every call (a window's cuDNN band), and no cache keeps
a caller's tensor alive; results against the float64 reference (`fused_attn.testing`)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn.testing import assert_close, grad_tolerances, reference_attention, tolerance
from helpers.attention import band_mask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DT = torch.bfloat16
S, H, D = 256, 4, 64


def bshd(seed: int, grad: bool = True) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(1, S, H, D, device="cuda", dtype=DT, generator=g).requires_grad_(grad)


def check_window(out, q, k, v, do, left: int) -> None:
    ql, kl, vl = (t.detach().transpose(1, 2) for t in (q, k, v))
    mask = band_mask(S, S, left, 0).cuda()
    scale = D ** -0.5
    exact, _ = reference_attention(ql, kl, vl, scale, mask)
    assert_close(out.detach().transpose(1, 2), exact, tolerance(ql, kl, vl, scale, DT, mask), f"out, window {left}")
    got = torch.autograd.grad(out, (q, k, v), do)
    want, bounds = grad_tolerances(ql, kl, vl, do.transpose(1, 2), scale, DT, mask)
    for name, g, w, b in zip(("dq", "dk", "dv"), got, want, bounds):
        assert_close(g.transpose(1, 2), w, b, f"{name}, window {left}")


@pytest.mark.parametrize("via", ["module", "functional"])
def test_window_change_reaches_the_cudnn_band(via):
    q, k, v, do = bshd(0), bshd(1), bshd(2), bshd(3, grad=False)
    attn = fused_attn.DotProductAttention(H, D, score_mod=sm.sliding_window(2, 0), backend="cudnn")
    for left in (2, 64, 2, 200):
        mod = sm.sliding_window(left, 0)
        if via == "module":
            attn.score_mod = mod
            out = attn(q, k, v)
        else:
            out = fused_attn.dot_product_attention(q, k, v, score_mod=mod, backend="cudnn")
        check_window(out, q, k, v, do, left)


def test_fresh_biases_are_not_kept_alive():
    """1,000 calls with fresh biases hold at most one after the loop, none after clear()."""
    q = bshd(4, grad=False)
    refs = []
    for i in range(1000):
        bias = torch.randn(1, H, S, S, device="cuda")
        refs.append(weakref.ref(bias))
        fused_attn.dot_product_attention(q, q, q, score_mod=sm.post_scale_bias(bias), backend="cudnn")
        del bias
    gc.collect()
    assert sum(r() is not None for r in refs) <= 1
    fused_attn.graph_cache.clear()
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


def test_module_biases_release_their_memory():
    """4 calls with 32 MiB biases leave no bias allocated after score_mod=None and clear()."""
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, 1024, 8, 64, device="cuda", dtype=DT, generator=g)
    attn = fused_attn.DotProductAttention(8, 64, backend="cudnn")

    def reset() -> int:
        attn.score_mod = None
        fused_attn.graph_cache.clear()
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    attn.score_mod = sm.post_scale_bias(torch.randn(1, 8, 1024, 1024, device="cuda", generator=g))
    attn(q, q, q)  # warm: workspaces and scratch buffers the runtime keeps per stream
    base = reset()
    for _ in range(4):
        attn.score_mod = sm.post_scale_bias(torch.randn(1, 8, 1024, 1024, device="cuda", generator=g))
        attn(q, q, q)
    assert reset() - base < 32 * 2 ** 20


def _scale_fprop(graph, score, tensors):
    return graph.mul(a=score, b=tensors["s"])


def _scale_bprop(graph, dscore, tensors):
    return graph.mul(a=dscore, b=tensors["s"])


def test_score_mod_bprop_tensors_are_version_checked_on_cudnn():
    """Transformer Engine's raw-callback arguments on cuDNN: gradients of score * 0.5 against
    float64; an in-place update of a score_mod_bprop_tensors tensor before backward raises."""
    q, k, v, do = bshd(6), bshd(7), bshd(8), bshd(9, grad=False)
    fwd_s, bwd_s = torch.full((1, 1, 1, 1), 0.5), torch.full((1, 1, 1, 1), 0.5)

    def call():
        return fused_attn.dot_product_attention(q, k, v, score_mod=_scale_fprop, score_mod_bprop=_scale_bprop,
                                                score_mod_tensors={"s": fwd_s}, score_mod_bprop_tensors={"s": bwd_s},
                                                backend="cudnn")

    out = call()
    ql, kl, vl = (t.detach().transpose(1, 2) for t in (q, k, v))
    half = lambda s, *_: s * 0.5  # noqa: E731
    exact, _ = reference_attention(ql, kl, vl, D ** -0.5, score_fn=half)
    assert_close(out.detach().transpose(1, 2), exact, tolerance(ql, kl, vl, D ** -0.5, DT, score_fn=half), "out")
    got = torch.autograd.grad(out, (q, k, v), do)
    want, bounds = grad_tolerances(ql, kl, vl, do.transpose(1, 2), D ** -0.5, DT, score_fn=half)
    for name, g, w, b in zip(("dq", "dk", "dv"), got, want, bounds):
        assert_close(g.transpose(1, 2), w, b, name)
    out = call()
    bwd_s.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(do)
