"""The one registry of the library's process-wide caches.

Every `BoundedMemo` joins it as it is made (weakly); every other cache registers here by name
with its clear and info functions (`register_clear`, `register_lru` for functools.lru_cache
functions): the cuDNN graph cache (builds in flight), the custom ops' spec registry, workspaces.
score_mods, below this layer, keeps a registry of its own (`score_mods.caches`) that this one
reads and clears with its own. `cache_infos()` lists every cache (`fused_attn.graph_cache.caches()`),
`clear_all()` empties them (`fused_attn.graph_cache.clear()`, and at interpreter exit), but for
the caches that register clear=None with the reason they keep their entries.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import sys
import threading
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

__all__ = ["MemoInfo", "register_clear", "register_lru", "register_at_exit", "track_memo", "clear_all",
           "cache_infos", "kept_by_clear", "tensor_bytes"]


class MemoInfo(NamedTuple):
    """Statistics of one cache. hits + misses counts every lookup (0 where a cache does not count);
    maxsize -1: not bounded by a count (its docs say what bounds it); nbytes: bytes of the tensors
    it holds (counted by the caches that hold tensors, bounded by max_bytes; else 0 and None)."""

    name: str
    hits: int
    misses: int
    evictions: int
    size: int
    maxsize: int
    nbytes: int = 0
    max_bytes: Optional[int] = None



_ALL: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every BoundedMemo
_CACHES: Dict[str, Tuple[Optional[Callable[[], None]], Optional[Callable[[], MemoInfo]], Optional[str]]] = {}
_AT_EXIT: Dict[str, Callable[[], None]] = {}
_REGISTRY_LOCK = threading.Lock()


def track_memo(memo: Any) -> None:
    """Add a BoundedMemo (held weakly: a memo that is freed leaves the registry)."""
    _ALL.add(memo)


def register_clear(name: str, clear: Optional[Callable[[], None]], info: Optional[Callable[[], MemoInfo]] = None,
                   keeps: Optional[str] = None) -> None:
    """Register a process-wide cache under `name` (re-registering replaces): clear() empties it,
    info() gives its `MemoInfo`. A cache that `clear_all` must keep (compiled code refers to its
    entries by key) passes clear=None and says why in `keeps`."""
    if (clear is None) == (keeps is None):
        raise ValueError(f"register_clear({name!r}): give clear, or clear=None with the reason it keeps its entries")
    with _REGISTRY_LOCK:
        _CACHES[name] = (clear, info, keeps)


def register_lru(name: str) -> Callable[[Any], Any]:
    """Decorator registering a `functools.lru_cache` function under `name` (its cache_info and
    cache_clear): `@register_lru("x.y")` above `@functools.lru_cache(...)`."""

    def wrap(fn: Any) -> Any:
        register_clear(name, fn.cache_clear, lambda: _lru_info(name, fn))
        return fn

    return wrap


def _lru_info(name: str, fn: Callable[..., Any]) -> MemoInfo:
    i = fn.cache_info()
    return MemoInfo(name, i.hits, i.misses, 0, i.currsize, i.maxsize if i.maxsize is not None else -1)


def register_at_exit(name: str, release: Callable[[], None]) -> None:
    """Run `release()` at interpreter exit, after every cache is cleared (per-thread handles)."""
    with _REGISTRY_LOCK:
        _AT_EXIT[name] = release


def _score_mods_caches() -> Any:
    """score_mods' registry, or None in a process that never imported score_mods (nothing cached
    there; a light process must not import it at exit)."""
    return sys.modules.get("score_mods.caches")


def clear_all() -> None:
    """Empty every BoundedMemo and every registered cache but those that keep their entries
    (statistics of the memos kept), and the caches of score_mods."""
    with _REGISTRY_LOCK:
        memos, clearers = list(_ALL), [c for c, _, _ in _CACHES.values() if c is not None]
    for memo in memos:
        memo.clear(reset_stats=False)
    for clear in clearers:
        clear()
    theirs = _score_mods_caches()
    if theirs is not None:
        theirs.clear_all()


def cache_infos() -> List[MemoInfo]:
    """`MemoInfo` of every process-wide cache (BoundedMemos, registered caches with an info
    function, the caches of score_mods), sorted by name."""
    with _REGISTRY_LOCK:
        memos, infos = list(_ALL), [i for _, i, _ in _CACHES.values() if i is not None]
    out = [m.info() for m in memos] + [i() for i in infos]
    theirs = _score_mods_caches()
    out += [MemoInfo(*i) for i in (theirs.infos() if theirs is not None else ())]
    return sorted(out, key=lambda i: i.name)


def kept_by_clear() -> Dict[str, str]:
    """{name: reason} of the registered caches `clear_all` keeps."""
    with _REGISTRY_LOCK:
        return {n: keeps for n, (_, _, keeps) in _CACHES.items() if keeps is not None}


@atexit.register
def _release_at_exit() -> None:
    """Empty every cache before the interpreter tears down its modules, then run the exit
    releases: cuDNN graphs (and the score_mod callbacks holding their tensors) still alive at exit
    make the frontend's bindings print "leaked instances" warnings
    (benchmarks/results/frontend_probe_h100.md)."""
    clear_all()
    with _REGISTRY_LOCK:
        releases = list(_AT_EXIT.values())
    for release in releases:
        release()
    gc.collect()


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in `value` (tensors, and tuples, lists, dicts and dataclasses of
    them, nested); meta and fake tensors hold none."""
    if isinstance(value, torch.Tensor):
        from torch._subclasses.fake_tensor import is_fake

        if value.device.type == "meta" or is_fake(value):
            return 0
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0
