"""Dense attention benchmark: fused_attn module vs a raw cuDNN graph vs torch SDPA (cuDNN, flash).

bf16, BSHD, B*S = 16k tokens, forward and forward + backward, causal and not, H=16 with
D in {64, 128} plus a GQA set (32 query / 8 key-value heads, D=128).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

from .common import Impl, attn_flops, naive_attention, reference_and_bounds
from .runner import SuiteResult, run_config

TOKENS = 16 * 1024
FULL_SEQS = (512, 1024, 2048, 4096, 8192)
QUICK_SEQS = (1024, 4096)
#: The check covers a (batch 0, some heads) slice of at most this many scores (at least one kv
#: head's group); the reference computes it in row blocks (`common.REF_BLOCK_SCORES`).
REF_SCORES = 1 << 28


def configs(quick: bool) -> List[Tuple[int, int, int, int, int, bool]]:
    """(B, S, H, Hkv, D, causal) grid; quick: S in {1024, 4096}, D=128."""
    seqs = QUICK_SEQS if quick else FULL_SEQS
    dims = (128,) if quick else (64, 128)
    grid = [(TOKENS // s, s, 16, 16, d, c) for d in dims for s in seqs for c in (False, True)]
    grid += [(TOKENS // s, s, 32, 8, 128, c) for s in seqs for c in (False, True)]
    return grid


def _inputs(b, s, h, hkv, d, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    mk = lambda heads: torch.randn(b, s, heads, d, device=device, dtype=torch.bfloat16, generator=gen)
    q, k, v, do = mk(h), mk(hkv), mk(hkv), mk(h)
    return [t.requires_grad_() for t in (q, k, v)] + [do]


def _reference(q, k, v, do, causal, hq_s, hkv_s, dtype) -> Dict[str, torch.Tensor]:
    """Naive out, dq, dk, dv in `dtype` on the slice batch 0, q heads [0, hq_s), kv heads [0, hkv_s), in BSHD."""
    sl = [t.detach()[:1, :, :n].transpose(1, 2) for t, n in ((q, hq_s), (k, hkv_s), (v, hkv_s), (do, hq_s))]
    s = q.shape[1]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril() if causal else None
    res = naive_attention(*sl[:3], scale=1 / math.sqrt(q.shape[-1]), dtype=dtype, mask=mask, grad_out=sl[3])
    return {key: t.transpose(1, 2) for key, t in res.items()}


def _autograd_impl(name: str, fn: Callable, q, k, v, do, required: bool, note: str = "") -> Impl:
    def outputs():
        out = fn(q, k, v)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}

    return Impl(name, lambda: fn(q, k, v), lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do),
                outputs, required=required, note=note)


def _sdpa(backend, causal: bool, gqa: bool) -> Callable:
    from torch.nn.attention import sdpa_kernel

    def fn(q, k, v):
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=causal, enable_gqa=gqa)
        return o.transpose(1, 2)

    return fn


def _fused_module(h, hkv, d, causal, backend):
    import fused_attn

    module = fused_attn.DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format="bshd",
                                            attn_mask_type="causal" if causal else "no_mask", backend=backend)

    def fn(q, k, v):
        out = module(q, k, v)
        return out.view(q.shape) if out.dim() == 3 else out  # (B, S, H*D) -> (B, S, H, D)

    return fn


def _raw_impl(q, k, v, do, causal) -> Impl:
    from .raw_cudnn import RawSdpa

    state = {}

    def raw() -> "RawSdpa":  # built on first use so a build failure is reported per impl
        if "g" not in state:
            state["g"] = RawSdpa(q.detach(), k.detach(), v.detach(), causal=causal)
            state["g"].do.copy_(do)
        return state["g"]

    def outputs():
        out, dq, dk, dv = raw().fwd_bwd(raw().do)
        return {"out": out.clone(), "dq": dq.clone(), "dk": dk.clone(), "dv": dv.clone()}

    return Impl("raw_cudnn", lambda: raw().fwd(), lambda: raw().fwd_bwd(raw().do), outputs, required=True,
                note="prebuilt graph, preallocated outputs")


def impls_for(q, k, v, do, causal: bool, device: torch.device) -> List[Impl]:
    """The compared implementations on these inputs (CPU: reference backend and torch math)."""
    from torch.nn.attention import SDPBackend

    h, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    gqa = h != hkv
    if device.type != "cuda":
        return [_autograd_impl("fused_attn", _fused_module(h, hkv, d, causal, "reference"), q, k, v, do, True),
                _autograd_impl("torch_sdpa_math", _sdpa(SDPBackend.MATH, causal, gqa), q, k, v, do, True)]
    return [
        _autograd_impl("fused_attn", _fused_module(h, hkv, d, causal, "cudnn"), q, k, v, do, True),
        _raw_impl(q, k, v, do, causal),
        _autograd_impl("torch_sdpa_cudnn", _sdpa(SDPBackend.CUDNN_ATTENTION, causal, gqa), q, k, v, do, False),
        _autograd_impl("torch_sdpa_flash", _sdpa(SDPBackend.FLASH_ATTENTION, causal, gqa), q, k, v, do, False),
    ]


def run_one(b: int, s: int, h: int, hkv: int, d: int, causal: bool, device: torch.device,
            seed: int = 0, rep_ms: float = 60.0) -> SuiteResult:
    """Check and time one dense configuration; returns its rows and failures."""
    q, k, v, do = _inputs(b, s, h, hkv, d, device, seed)
    group = h // hkv
    hkv_s = max(1, min(hkv, (REF_SCORES // (s * s)) // group))
    hq_s = hkv_s * group
    expected, bounds = reference_and_bounds(functools.partial(_reference, q, k, v, do, causal, hq_s, hkv_s), q.dtype)
    select = lambda key, t: t[:1, :, : (hq_s if key in ("out", "dq") else hkv_s)]
    config = f"B{b} S{s} H{h}/{hkv} D{d}" + (" causal" if causal else "")
    flops = {m: attn_flops(b, h, s, s, d, causal=causal, mode=m) for m in ("fwd", "fwd_bwd")}
    result = run_config("dense", config, impls_for(q, k, v, do, causal, device), expected, bounds, select, flops,
                        device, rep_ms=rep_ms)
    del q, k, v, do, expected
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run(quick: bool, device: torch.device) -> SuiteResult:
    """The dense grid (`configs(quick)`) on `device`."""
    result = SuiteResult(notes=["fused_attn: DotProductAttention(backend='cudnn'), qkv_format bshd; "
                                "raw_cudnn: the same cuDNN SDPA graphs built directly, outputs preallocated",
                                "checked against the float64 reference on batch 0 and a slice of heads"])
    for i, (b, s, h, hkv, d, causal) in enumerate(configs(quick)):
        result.extend(run_one(b, s, h, hkv, d, causal, device, seed=i, rep_ms=40.0 if quick else 60.0))
    return result
