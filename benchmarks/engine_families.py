"""The problem families `bench engines` times (`FAMILIES`), their inputs and fused_attn's arguments
for them. A family's name gives its shape; `fused_attn.engine_speed.family` gives the key the
engine table stores it under."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

import score_mods as sm

DT = torch.bfloat16


@dataclass
class Family:
    name: str
    b: int
    s: int
    h: int
    hkv: int
    d: int
    causal: bool = False
    window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: bool = False
    varlen: bool = False


FAMILIES = [
    Family("dense B2 S4096 H16 D128", 2, 4096, 16, 16, 128),
    Family("causal B2 S4096 H16 D128", 2, 4096, 16, 16, 128, causal=True),
    Family("llama3 B2 S8192 H64/8 D128 causal", 2, 8192, 64, 8, 128, causal=True),
    Family("gemma2 B2 S4096 H16 D128 causal softcap30", 2, 4096, 16, 16, 128, causal=True, softcap=30.0),
    Family("varlen B8 <=2048 H16 D64", 8, 2048, 16, 16, 64, varlen=True),
    Family("varlen causal B8 <=2048 H16 D64", 8, 2048, 16, 16, 64, causal=True, varlen=True),
    Family("gpt-oss B4 S4096 H64/8 D64 window128 sinks", 4, 4096, 64, 8, 64, causal=True, window=128, sinks=True),
    Family("causal B16 S1024 H16 D128", 16, 1024, 16, 16, 128, causal=True),
    Family("causal B8 S1024 H16 D64", 8, 1024, 16, 16, 64, causal=True),
    Family("dense B1 S16384 H16 D128 causal", 1, 16384, 16, 16, 128, causal=True),
    # the attention of `bench models`' Llama / Gemma 2 (16 query / 4 key-value heads of dim 64), dense and packed
    Family("llama model B4 S2048 H16/4 D64 causal", 4, 2048, 16, 4, 64, causal=True),
    Family("gemma2 model B4 S2048 H16/4 D64 causal softcap50", 4, 2048, 16, 4, 64, causal=True, softcap=50.0),
    Family("gemma2 packed B4 <=2048 H16/4 D64 causal softcap50", 4, 2048, 16, 4, 64, causal=True, softcap=50.0,
           varlen=True),
    # Gemma 2's other half: its sliding-window layers (window 1024 in `bench models`)
    Family("gemma2 model B4 S2048 H16/4 D64 window1024 softcap50", 4, 2048, 16, 4, 64, causal=True, window=1024,
           softcap=50.0),
    Family("gemma2 packed B4 <=2048 H16/4 D64 window1024 softcap50", 4, 2048, 16, 4, 64, causal=True, window=1024,
           softcap=50.0, varlen=True),
]


def _lengths(fam: Family, b: int, s: int, seed: int = 7) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(s // 8, s + 1, (b,), generator=g)]


def make_inputs(fam: Family, b: int, s: int, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = torch.device("cuda")
    if fam.varlen:
        lens = _lengths(fam, b, s)
        t = sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
        shape_q, shape_kv, extra = (t, fam.h, fam.d), (t, fam.hkv, fam.d), dict(cu=cu, max_len=max(lens))
    else:
        shape_q, shape_kv, extra = (b, s, fam.h, fam.d), (b, s, fam.hkv, fam.d), {}
    q = torch.randn(*shape_q, generator=g).to(dev, DT)
    k = torch.randn(*shape_kv, generator=g).to(dev, DT)
    v = torch.randn(*shape_kv, generator=g).to(dev, DT)
    dout = torch.randn(*shape_q, generator=g).to(dev, DT)
    sinks = torch.randn(fam.h, generator=g).to(dev) if fam.sinks else None
    return q, k, v, dout, sinks, extra


def ours_kwargs(fam: Family, extra: dict, sinks) -> dict:
    kw: Dict = {}
    if fam.varlen:
        kw.update(qkv_format="thd", cu_seqlens_q=extra["cu"], cu_seqlens_kv=extra["cu"],
                  max_seqlen_q=extra["max_len"], max_seqlen_kv=extra["max_len"],
                  attn_mask_type="padding_causal" if fam.causal else "padding")
    else:
        kw.update(qkv_format="bshd", attn_mask_type="causal" if fam.causal else "no_mask")
    if fam.window is not None:
        kw["window_size"] = (fam.window, 0)
    if fam.softcap is not None:
        kw["score_mod"] = sm.softcap(fam.softcap)
    if fam.sinks:
        kw.update(softmax_type="learnable", sinks=sinks)
    return kw
