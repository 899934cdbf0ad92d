"""Every process-wide cache of score_mods, registered by name with its info and clear functions.

score_mods sits below fused_attn and cannot use its registry (`fused_attn.cache_registry`); that registry
reads and clears these with its own, so `fused_attn.graph_cache.clear()` empties them too. A
cache that must keep its entries (compiled code reaches them by key) registers clear=None and
says why.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["Info", "register", "register_lru", "infos", "clear_all", "kept"]


#: info() of a cache gives (name, hits, misses, evictions, size, maxsize, nbytes, max_bytes): the
#: fields of `fused_attn.cache_registry.MemoInfo` (hits and misses 0 where it does not count them,
#: maxsize -1 where no count bounds it, nbytes 0 and max_bytes None where it holds no tensor).
Info = Tuple[str, int, int, int, int, int, int, Optional[int]]

_LOCK = threading.Lock()
_CACHES: Dict[str, Tuple[Callable[[], Info], Optional[Callable[[], None]], Optional[str]]] = {}


def register(name: str, info: Callable[[], Info], clear: Optional[Callable[[], None]],
             keeps: Optional[str] = None) -> None:
    """Register a cache under `name` (re-registering replaces); clear=None needs `keeps`, the reason."""
    if (clear is None) == (keeps is None):
        raise ValueError(f"score_mods.caches.register({name!r}): give clear, or clear=None with the reason it "
                         "keeps its entries")
    with _LOCK:
        _CACHES[name] = (info, clear, keeps)


def register_lru(name: str) -> Callable[[Any], Any]:
    """Decorator registering a `functools.lru_cache` function (put it above the lru_cache)."""

    def wrap(fn: Any) -> Any:
        def info() -> Info:
            i = fn.cache_info()
            return (name, i.hits, i.misses, 0, i.currsize, i.maxsize if i.maxsize is not None else -1, 0, None)

        register(name, info, fn.cache_clear)
        return fn

    return wrap


def infos() -> List[Info]:
    with _LOCK:
        getters = [info for info, _, _ in _CACHES.values()]
    return [get() for get in getters]


def clear_all() -> None:
    """Empty every registered cache but those that keep their entries."""
    with _LOCK:
        clearers = [clear for _, clear, _ in _CACHES.values() if clear is not None]
    for clear in clearers:
        clear()


def kept() -> Dict[str, str]:
    """{name: reason} of the caches `clear_all` keeps."""
    with _LOCK:
        return {n: keeps for n, (_, _, keeps) in _CACHES.items() if keeps is not None}
