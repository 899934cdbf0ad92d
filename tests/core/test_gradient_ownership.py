"""Autograd takes an engine's gradient as the leaf's .grad only when nothing else holds it;
otherwise it copies it, a device copy of dq, dk and dv on every step (found on an H200: the FA4
engine's recorded backward kept its buffers in a reference cycle, 40-100 us per fwd+bwd). Each
engine present is checked on every step of a short run, replayed / cached steps included:
the .grad of q, k and v is the very tensor the engine's backward returned."""

from __future__ import annotations

import pytest
import torch

from fused_attn import dot_product_attention, engines
from helpers.grad_ownership import note_returned_grads

ENGINES = ["reference", "torch",
           pytest.param("cudnn", marks=pytest.mark.gpu), pytest.param("fa4", marks=pytest.mark.gpu)]


def _device_for(backend: str) -> torch.device:
    return torch.device("cuda" if backend in ("cudnn", "fa4") else "cpu")


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
@pytest.mark.parametrize("backend", ENGINES)
def test_leaf_gradients_are_the_engines_own_tensors(monkeypatch, backend, fmt):
    if not engines.available(backend):
        pytest.skip(f"the {backend} engine is not available here")
    dev = _device_for(backend)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    returned = note_returned_grads(monkeypatch)
    g = torch.Generator().manual_seed(3)
    kw = dict(attn_mask_type="causal", backend=backend, qkv_format=fmt)
    shape = (2, 64, 2, 32)
    if fmt == "thd":
        shape = (96, 2, 32)
        cu = torch.tensor([0, 40, 96], dtype=torch.int32, device=dev)
        kw.update(attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=56, max_seqlen_kv=56)
    for step in range(3):  # the first call builds / records; later ones run cached plans and replays
        q, k, v, dout = (torch.randn(*shape, generator=g).to(dev, dtype) for _ in range(4))
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        try:
            out = dot_product_attention(*leaves, **kw)
        except NotImplementedError as why:  # a configuration this engine refuses, with its reason
            pytest.skip(str(why).splitlines()[0])
        out.backward(dout)
        assert len(returned) == step + 1
        assert [t.grad.data_ptr() for t in leaves] == returned[-1], f"step {step}: autograd copied a gradient"
