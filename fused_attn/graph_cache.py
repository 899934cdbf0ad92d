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

import os
from typing import Any, Dict, Iterable, List, Optional, Union

import torch

from .cache import GRAPH_CACHE, CacheInfo
from .graph_store import GraphStore, StoreInfo
from .cache_registry import MemoInfo, cache_infos, clear_all, kept_by_clear

__all__ = ["cache_info", "caches", "clear", "kept", "set_maxsize", "set_persistent_dir", "persistent_info", "warmup",
           "CacheInfo", "MemoInfo", "StoreInfo"]


def cache_info() -> CacheInfo:
    """Hits, misses, evictions, builds, build_seconds, size, maxsize and thd_builds."""
    return GRAPH_CACHE.info()


def clear() -> None:
    """Release every cached graph and everything else the library caches per process (call
    plans, resolved specs, memos, workspaces, materialized score_mod operands, the torch engine's
    compiled flex functions: every cache `caches()` lists) and reset the graph statistics:
    afterwards no cache holds a tensor or a graph. Kept: the structural templates compiled code
    refers to by key (`kept()`), which hold no tensor data."""
    clear_all()


def caches() -> List[MemoInfo]:
    """Every process-wide cache of the library (and of score_mods): name, hits, misses, evictions,
    size, maxsize, and for those holding tensors nbytes and max_bytes."""
    return cache_infos()


def kept() -> Dict[str, str]:
    """{name: why} of the caches `clear()` keeps (compiled code refers to their entries by key)."""
    from score_mods import caches

    return {**kept_by_clear(), **caches.kept()}


def set_maxsize(maxsize: int) -> None:
    """Bound the number of cached graphs (forward and backward count separately); >= 1."""
    GRAPH_CACHE.set_maxsize(maxsize)


def set_persistent_dir(directory: Optional[Union[str, "os.PathLike[str]"]], max_bytes: Optional[int] = None) -> None:
    """Keep built graphs in `directory` across processes (None: stop using one).

    On a miss the cache first looks in the directory: a graph stored there by an earlier process
    (or another rank) under the same key and environment (cuDNN library and frontend versions,
    torch version, GPU architecture) is loaded instead of built (CacheInfo.loads counts these);
    otherwise the graph is built and written there. Files are written atomically, so ranks of
    one job may share the directory; a corrupt, truncated or mismatched file is skipped with one
    GraphStoreWarning and rebuilt. max_bytes bounds the directory's size (least recently used
    files are removed); None leaves it unbounded. Graphs already in memory are unaffected.
    """
    if directory is None:
        if max_bytes is not None:
            raise ValueError(f"set_persistent_dir: max_bytes={max_bytes!r} given without a directory")
        GRAPH_CACHE.set_store(None)
        return
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"set_persistent_dir: directory must be a str, os.PathLike or None, got "
                        f"{type(directory).__name__}")
    GRAPH_CACHE.set_store(GraphStore(directory, max_bytes=max_bytes))


def persistent_info() -> Optional[StoreInfo]:
    """The persistent directory's counters (loads, load_misses, saves, skipped files, ...), or None
    when no directory is set."""
    store = GRAPH_CACHE.store
    return None if store is None else store.stats()


_REQUIRED = ("batch", "seqlen_q", "num_heads", "head_dim", "dtype")
_KNOWN = set(_REQUIRED) | {
    "seqlen_kv", "num_kv_heads", "head_dim_v", "qkv_format", "attn_mask_type", "window_size",
    "score_mod", "device", "max_seqlen", "softmax_scale", "deterministic",
}


_SIZES = ("batch", "seqlen_q", "seqlen_kv", "num_heads", "num_kv_heads", "head_dim", "head_dim_v", "max_seqlen")
_DTYPES = (torch.bfloat16, torch.float16)
_FORMATS = ("bshd", "sbhd", "bhsd", "thd")


def _check_config(cfg: Any, i: int) -> None:
    """TypeError / ValueError naming config `i`, the key, the value and what is accepted."""
    if not isinstance(cfg, dict):
        raise TypeError(f"warmup configs[{i}] must be a dict, got {type(cfg).__name__}")
    missing = [k for k in _REQUIRED if k not in cfg]
    unknown = sorted(set(cfg) - _KNOWN)
    if missing or unknown:
        raise ValueError(f"warmup configs[{i}]: missing keys {missing}, unknown keys {unknown}; "
                         f"accepted keys: {sorted(_KNOWN)}")
    for name in _SIZES:
        if name in cfg:
            value = cfg[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"warmup configs[{i}][{name!r}] must be an int >= 1, got {value!r}")
    if cfg["dtype"] not in _DTYPES:
        raise ValueError(f"warmup configs[{i}]['dtype'] must be torch.bfloat16 or torch.float16 (the dtypes cuDNN "
                         f"graphs run), got {cfg['dtype']!r}")
    try:
        device = torch.device(cfg.get("device", "cuda"))
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"warmup configs[{i}]['device'] is not a device: {cfg.get('device')!r} ({exc})") from None
    if device.type != "cuda":
        raise ValueError(f"warmup configs[{i}]['device'] must be a CUDA device (graphs are built for cuDNN), "
                         f"got {str(device)!r}")
    fmt = cfg.get("qkv_format", "bshd")
    if fmt not in _FORMATS:
        raise ValueError(f"warmup configs[{i}]['qkv_format'] must be one of {list(_FORMATS)}, got {fmt!r}")


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
    make = shapes[fmt]  # checked by _check_config
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

    if isinstance(configs, (dict, str, bytes)) or not isinstance(configs, Iterable):
        raise TypeError(f"warmup: configs must be a list (or other iterable) of dicts, got {type(configs).__name__}")
    if not isinstance(backward, bool):
        raise TypeError(f"warmup: backward must be a bool, got {backward!r}")
    configs = list(configs)
    for i, cfg in enumerate(configs):  # every config is checked before any graph is built
        _check_config(cfg, i)
    if configs and not torch.cuda.is_available():
        raise RuntimeError(f"warmup: configs[0]['device'] is {str(configs[0].get('device', 'cuda'))!r}"
                           f"{'' if 'device' in configs[0] else ' (the default)'}, but this torch has no usable CUDA "
                           "device (torch.cuda.is_available() is False): cuDNN graphs are built on a GPU; nothing "
                           "was built")
    from .progress import progress

    for cfg in progress(configs, desc="graph warm-up"):
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
