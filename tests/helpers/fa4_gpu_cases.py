"""Inputs and runs shared by the FA4 GPU test files (the engine alone, and split with cuDNN):
seeded draws on a device, dense q / k / v / dout of a case in each layout, and one backend's
forward and gradients."""

from __future__ import annotations

from typing import Optional

import torch

import fused_attn


def rand(device: torch.device, *shape: int, seed: int) -> torch.Tensor:
    """randn of `shape` from a CPU generator seeded with `seed`, moved to `device`."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device)


def dense_inputs(device: torch.device, case: dict, fmt: str):
    """(q, k, v, dout, the case's remaining keyword arguments) of a dense case: B2 H4 Skv 256,
    D 64, with `sq`, `hkv` and `d` read from (and taken out of) the case, in layout `fmt`."""
    kw = dict(case)
    b, h, skv = 2, 4, 256
    sq, hkv, d = kw.pop("sq", skv), kw.pop("hkv", h), kw.pop("d", 64)
    shape = {"bshd": lambda s, n: (b, s, n, d), "sbhd": lambda s, n: (s, b, n, d),
             "bhsd": lambda s, n: (b, n, s, d)}[fmt]
    q, dout = rand(device, *shape(sq, h), seed=1), rand(device, *shape(sq, h), seed=4)
    k, v = rand(device, *shape(skv, hkv), seed=2), rand(device, *shape(skv, hkv), seed=3)
    return q, k, v, dout, kw


def run(backend: str, dtype: torch.dtype, q, k, v, dout, sinks: Optional[torch.Tensor] = None, **kw):
    """(out, lse or None, [dq, dk, dv(, dsinks)]) of one call on `backend` in `dtype`, the
    backward taken against `dout`."""
    leaves = [t.to(dtype).detach().requires_grad_(True) for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().float().requires_grad_(True)
    if sink_leaf is not None:
        kw["sinks"] = sink_leaf
    got = fused_attn.dot_product_attention(*leaves, backend=backend, **kw)
    out, lse = got if kw.get("return_lse") else (got, None)
    out.backward(dout.to(dtype))
    grads = [t.grad for t in leaves] + ([sink_leaf.grad] if sink_leaf is not None else [])
    return out, lse, grads
