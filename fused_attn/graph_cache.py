"""Public controls of the cuDNN graph cache: statistics, clearing, resizing, warm-up.

    >>> import fused_attn
    >>> fused_attn.graph_cache.set_maxsize(64)
    >>> fused_attn.graph_cache.warmup([dict(batch=2, seqlen_q=4096, seqlen_kv=4096, num_heads=16,
    ...     num_kv_heads=16, head_dim=128, dtype=torch.bfloat16, qkv_format="bshd",
    ...     attn_mask_type="causal")])
    >>> fused_attn.graph_cache.cache_info()
    CacheInfo(hits=0, misses=2, evictions=0, builds=2, build_seconds=0.9, size=2, maxsize=64, thd_builds=0)

The cache is per process; entries of every device share it (the device index is in the key).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

import torch

from .cache import GRAPH_CACHE, CacheInfo

__all__ = ["cache_info", "clear", "set_maxsize", "warmup", "CacheInfo"]


def cache_info() -> CacheInfo:
    """Hits, misses, evictions, builds, build_seconds, size, maxsize and thd_builds."""
    return GRAPH_CACHE.info()


def clear() -> None:
    """Release every cached graph and reset the statistics."""
    GRAPH_CACHE.clear()


def set_maxsize(maxsize: int) -> None:
    """Bound the number of cached graphs (forward and backward count separately); >= 1."""
    GRAPH_CACHE.set_maxsize(maxsize)


_REQUIRED = ("batch", "seqlen_q", "num_heads", "head_dim", "dtype")
_KNOWN = set(_REQUIRED) | {
    "seqlen_kv", "num_kv_heads", "head_dim_v", "qkv_format", "attn_mask_type", "window_size",
    "score_mod", "device", "max_seqlen", "softmax_scale", "deterministic",
}


def _inputs(cfg: Dict[str, Any], requires_grad: bool):
    """torch.empty q, k, v (+ cu_seqlens for thd) for one warm-up config."""
    missing = [k for k in _REQUIRED if k not in cfg]
    unknown = sorted(set(cfg) - _KNOWN)
    if missing or unknown:
        raise ValueError(f"warmup config {cfg!r}: missing keys {missing}, unknown keys {unknown}; "
                         f"accepted keys: {sorted(_KNOWN)}")
    b, sq, h, d = cfg["batch"], cfg["seqlen_q"], cfg["num_heads"], cfg["head_dim"]
    skv = cfg.get("seqlen_kv", sq)
    hkv = cfg.get("num_kv_heads", h)
    dv = cfg.get("head_dim_v", d)
    fmt = cfg.get("qkv_format", "bshd")
    device = torch.device(cfg.get("device", "cuda"))
    kw = dict(dtype=cfg["dtype"], device=device, requires_grad=requires_grad)
    extra: Dict[str, Any] = {}
    if fmt == "thd":
        # Every sequence at max_seqlen: the bucket the graph is keyed on depends on it only.
        max_q = cfg.get("max_seqlen", sq)
        q, k, v = (torch.empty(b * max_q, h, d, **kw), torch.empty(b * max_q, hkv, d, **kw),
                   torch.empty(b * max_q, hkv, dv, **kw))
        cu = torch.arange(0, (b + 1) * max_q, max_q, dtype=torch.int32, device=device)
        extra = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_q, max_seqlen_kv=max_q)
        return q, k, v, extra
    shapes = {"bshd": lambda s, n, e: (b, s, n, e), "sbhd": lambda s, n, e: (s, b, n, e),
              "bhsd": lambda s, n, e: (b, n, s, e)}
    if fmt not in shapes:
        raise ValueError(f"warmup config qkv_format={fmt!r}; accepted: bshd, sbhd, bhsd, thd")
    make = shapes[fmt]
    q = torch.empty(make(sq, h, d), **kw)
    k = torch.empty(make(skv, hkv, d), **kw)
    v = torch.empty(make(skv, hkv, dv), **kw)
    if cfg.get("attn_mask_type", "no_mask") in ("padding", "padding_causal"):
        # Dense padding types take per-sequence lengths from cu_seqlens (Transformer Engine style).
        extra = dict(cu_seqlens_q=torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device),
                     cu_seqlens_kv=torch.arange(0, (b + 1) * skv, skv, dtype=torch.int32, device=device))
    return q, k, v, extra


def warmup(configs: Iterable[Dict[str, Any]], backward: bool = True) -> CacheInfo:
    """Build the cuDNN graphs for `configs` now, through the same path as a real call.

    Each config is a dict with keys batch, seqlen_q, num_heads, head_dim, dtype (required) and
    seqlen_kv, num_kv_heads, head_dim_v, qkv_format ("bshd"), attn_mask_type ("no_mask"),
    window_size, score_mod, device ("cuda"), softmax_scale, deterministic, and for thd
    max_seqlen (sequences are bucketed, so one warm-up covers every batch in its bucket).
    Inputs are torch.empty tensors (values do not matter: graphs depend on shapes only).
    backward=True also builds the backward graph. Returns cache_info() afterwards.
    """
    from .functional import dot_product_attention

    for cfg in configs:
        if not isinstance(cfg, dict):
            raise TypeError(f"warmup configs must be dicts, got {type(cfg).__name__}")
        q, k, v, extra = _inputs(cfg, backward)
        kwargs: Dict[str, Any] = dict(qkv_format=cfg.get("qkv_format", "bshd"), backend="cudnn", **extra)
        for name in ("attn_mask_type", "window_size", "score_mod", "softmax_scale", "deterministic"):
            if cfg.get(name) is not None:
                kwargs[name] = cfg[name]
        out = dot_product_attention(q, k, v, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if backward:
            out.backward(torch.empty_like(out))
    return GRAPH_CACHE.info()
