"""Every public entry point as a case runnable on fake tensors (FakeTensorMode, CPU and "cuda"
devices) and on meta tensors, forward and backward, with the output shape each must give
(tests/core/test_fake_tensors.py; the GPU file runs them before real calls in the same process)."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fused_attn
import score_mods as sm
from fused_attn import DotProductAttention, doc_packed_attn, dot_product_attention, varlen_attn, varlen_attn_out
from fused_attn.functional import attention_backward, attention_forward
from fused_attn.integrations import transformers as fa_hf

B, S, H, HKV, D, DV = 2, 8, 4, 2, 16, 8
CU_ROWS = [0, 3, 8]  # dense padding lengths 3 and 5; packed: two sequences of 3 and 5 tokens


def abstract_mode(kind):
    """(context, device): FakeTensorMode for fake CPU / fake "cuda" tensors, nothing for meta."""
    if kind == "meta":
        return contextlib.nullcontext(), "meta"
    return FakeTensorMode(allow_non_fake_inputs=False), kind


def autograd_on(dev) -> bool:
    """A torch without CUDA aborts the process on autograd with (fake) "cuda" tensors: forward only there."""
    return dev != "cuda" or torch.cuda.is_available()


def tensor(dev, *shape, dtype=torch.float16, grad=True):
    return torch.empty(*shape, dtype=dtype, device=dev, requires_grad=grad and autograd_on(dev))


def _cu(dev, rows=CU_ROWS):
    return torch.tensor(rows, dtype=torch.int32, device=dev)


class _HFModule(torch.nn.Module):
    is_causal = True


# Each case: dev -> (output, inputs that must receive gradients). Built inside the mode.
def _dense(dev):
    q, k, v = tensor(dev, B, S, H, D), tensor(dev, B, S, HKV, D), tensor(dev, B, S, HKV, DV)
    return dot_product_attention(q, k, v, attn_mask_type="causal", score_mod=sm.softcap(20.0)), (q, k, v)


def _dense_lse(dev):
    q, k, v = tensor(dev, B, H, S, D), tensor(dev, B, H, S, D), tensor(dev, B, H, S, DV)
    out, lse = dot_product_attention(q, k, v, qkv_format="bhsd", return_lse=True)
    assert lse.shape == (B, H, S) and lse.dtype == torch.float32 and lse.device == q.device
    return out, (q, k, v)


def _padding(dev):
    q, k, v = tensor(dev, B, S, H, D), tensor(dev, B, S, HKV, D), tensor(dev, B, S, HKV, DV)
    cu = _cu(dev)  # (B+1,): lengths 3 and 5
    return dot_product_attention(q, k, v, attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu), (q, k, v)


def _thd_no_max(dev):
    q, k, v = tensor(dev, S, H, D), tensor(dev, S, HKV, D), tensor(dev, S, HKV, DV)
    cu = _cu(dev)
    return dot_product_attention(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu), (q, k, v)


def _sinks(dev):
    q, k, v = tensor(dev, B, S, H, D), tensor(dev, B, S, HKV, D), tensor(dev, B, S, HKV, DV)
    sinks = tensor(dev, H, dtype=torch.float32)
    out = dot_product_attention(q, k, v, softmax_type="learnable", sinks=sinks, attn_mask_type="causal")
    return out, (q, k, v, sinks)


def _module(dev):
    with torch.device(dev):
        attn = DotProductAttention(H, (D, DV), num_gqa_groups=HKV, attn_mask_type="causal", softmax_type="learnable")
    attn.requires_grad_(autograd_on(dev))
    q, k, v = tensor(dev, B, S, H, D), tensor(dev, B, S, HKV, D), tensor(dev, B, S, HKV, DV)
    return attn(q, k, v), (q, k, v, attn.sinks)


def _varlen(dev):
    q, k, v = tensor(dev, S, H, D), tensor(dev, S, HKV, D), tensor(dev, S, HKV, DV)
    cu = _cu(dev)
    return varlen_attn(q, k, v, cu, cu, 5, 5, window_size=(-1, 0), enable_gqa=True), (q, k, v)


def _varlen_out(dev):
    q, k, v = (tensor(dev, S, H, D, grad=False) for _ in range(3))
    out = tensor(dev, S, H, D, grad=False)
    cu = _cu(dev)
    got, lse = varlen_attn_out(out, q, k, v, cu, cu, 5, 5, return_aux=fused_attn.AuxRequest(lse=True))
    assert got is out and lse.shape == (H, S)
    return got, ()


def _doc_packed(dev):
    q, k, v = tensor(dev, B, S, H, D), tensor(dev, B, S, HKV, D), tensor(dev, B, S, HKV, DV)
    table = torch.tensor([[0, 3, 8], [0, 8, 8]], dtype=torch.int32, device=dev)
    return doc_packed_attn(q, k, v, table, is_causal=True, enable_gqa=True), (q, k, v)


def _transformers(dev):
    q, k, v = tensor(dev, B, H, S, D), tensor(dev, B, HKV, S, D), tensor(dev, B, HKV, S, DV)
    mask = torch.ones(B, S, dtype=torch.bool, device=dev)
    out, weights = fa_hf.attention_forward(_HFModule(), q, k, v, mask, scaling=0.25)
    assert weights is None
    return out, (q, k, v)


def _forward_backward_pieces(dev):
    q, k, v = tensor(dev, B, S, H, D, grad=False), tensor(dev, B, S, HKV, D, grad=False), tensor(dev, B, S, HKV, DV, grad=False)
    out, lse = attention_forward(q, k, v, attn_mask_type="causal")
    assert out.shape == (B, S, H, DV) and lse.shape == (B, H, S) and lse.dtype == torch.float32
    grads = attention_backward(q, k, v, out, lse, torch.empty_like(out), attn_mask_type="causal")
    for g, t in zip(grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype and g.device == t.device
    return out, ()


CASES = {f.__name__[1:]: f for f in (_dense, _dense_lse, _padding, _thd_no_max, _sinks, _module, _varlen, _varlen_out,
                                     _doc_packed, _transformers, _forward_backward_pieces)}
EXPECTED = {"dense": (B, S, H, DV), "dense_lse": (B, H, S, DV), "padding": (B, S, H, DV), "thd_no_max": (S, H, DV),
            "sinks": (B, S, H, DV), "module": (B, S, H, DV), "varlen": (S, H, DV), "varlen_out": (S, H, D),
            "doc_packed": (B, S, H, DV), "transformers": (B, S, H, DV), "forward_backward_pieces": (B, S, H, DV)}


def run_case(case, kind):
    """Run CASES[case] on `kind` ("cpu" / "cuda": fake tensors, "meta") and check what it returns
    (forward and, where autograd can run, backward)."""
    ctx, dev = abstract_mode(kind)
    with ctx:
        out, leaves = CASES[case](dev)
        assert tuple(out.shape) == EXPECTED[case]
        assert out.dtype == torch.float16 and out.device.type == kind
        if kind != "meta":
            from torch._subclasses.fake_tensor import is_fake

            assert is_fake(out)
        if leaves and autograd_on(dev):
            assert out.grad_fn is not None
            out.backward(torch.empty_like(out))
            for t in leaves:
                assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype
                assert t.grad.device == t.device
