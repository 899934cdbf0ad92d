"""Graph keys and the bounded, thread-safe LRU cache of built cuDNN graphs.

`GraphKey` names everything that changes a graph's *structure* (never tensor values, never
`id()`); `GraphCache` maps keys to built graphs. The process-wide instance is `GRAPH_CACHE`
(entries of every device live in it: the device index is part of the key). Builds run outside
the cache lock; two threads asking for the same missing key build it once (the second waits).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, NamedTuple, Optional, Tuple

from .cache_registry import MemoInfo, register_clear

__all__ = ["GraphKey", "CacheInfo", "GraphCache", "GRAPH_CACHE", "DEFAULT_MAXSIZE", "intern_key"]

DEFAULT_MAXSIZE = 128

Dims = Tuple[int, int, int, int]


@dataclass(frozen=True, eq=False)
class GraphKey:
    """Everything that changes an SDPA graph's structure.

    direction: "fwd" or "bwd"; dtype: io dtype name ("bfloat16" / "float16").
    q_dims (B, H, Sq, D), k_dims (B, Hkv, Skv, D), v_dims (B, Hkv, Skv, Dv): logical graph dims
    (for thd: (B_bucket, H, S_bucket, D)); *_strides: element strides of those views
    (o_strides: the output's, which dO / the output buffer share). GQA is H != Hkv in the dims.
    scale: softmax scale baked in the graph, or None when it is a pass-by-value input (a new
    value then never rebuilds). bias: (dims, strides, dtype name, with dBias) of cuDNN's own bias
    input or None. sinks: a (1, H, 1, 1) fp32 sink-logit input (and dSink in the backward).
    dropout: the attention dropout probability (seed and offset are per-call inputs). band: (left_bound, right_bound, bottom_right) in
    cuDNN's convention, or None. padding: use_padding_mask with seq_len tensors.
    ragged: thd (ragged offsets); the bucket sizes are in the dims.
    score_mod / operands: the mod's structural key and `describe_operands` of its graph inputs.
    stats_strides / grad_strides: Stats' strides and dQ, dK, dV's when the caller owns those
    buffers as views of larger tensors (a band's rectangles, `band_chunks`); None: dense.
    token_capacity: (query, key) token counts a ragged backward is sized for (its workspace then
    follows the tokens, not B_bucket x S_bucket); None: sized by the dims.
    """

    direction: str
    dtype: str
    q_dims: Dims
    k_dims: Dims
    v_dims: Dims
    q_strides: Dims
    k_strides: Dims
    v_strides: Dims
    o_strides: Dims
    scale: Optional[float]
    band: Optional[Tuple[Optional[int], Optional[int], bool]] = None
    padding: bool = False
    ragged: bool = False
    score_mod: Hashable = None
    operands: tuple = ()
    deterministic: bool = False
    device_index: int = 0
    backend_version: int = 0
    bias: Optional[tuple] = None
    sinks: bool = False
    dropout: float = 0.0
    stats_strides: Optional[Dims] = None
    grad_strides: Optional[Tuple[Dims, Dims, Dims]] = None
    token_capacity: Optional[Tuple[int, int]] = None
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    _key: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.direction not in ("fwd", "bwd"):
            raise ValueError(f"GraphKey.direction must be 'fwd' or 'bwd', got {self.direction!r}")
        # Keys are hashed and compared on every cache lookup (a hit compares the plan's key with
        # the stored one twice: get and move_to_end): build the field tuple and its hash once.
        fields = self._fields()
        object.__setattr__(self, "_key", fields)
        object.__setattr__(self, "_hash", hash(fields))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not GraphKey:
            return NotImplemented
        return self._hash == other._hash and self._key == other._key

    def _fields(self) -> tuple:
        return (
            self.direction, self.dtype, self.q_dims, self.k_dims, self.v_dims, self.q_strides,
            self.k_strides, self.v_strides, self.o_strides, self.scale, self.band, self.padding,
            self.ragged, self.score_mod, self.operands, self.deterministic, self.device_index,
            self.backend_version, self.bias, self.sinks, self.dropout, self.stats_strides, self.grad_strides,
            self.token_capacity,
        )

    def __hash__(self) -> int:
        return self._hash

    def describe(self) -> str:
        """Short human-readable description for errors and reports."""
        parts = [
            f"{self.direction} {self.dtype}", f"q{list(self.q_dims)}", f"k{list(self.k_dims)}",
            f"v{list(self.v_dims)}", f"q_strides{list(self.q_strides)}",
        ]
        if self.band is not None:
            parts.append(f"band(left_bound={self.band[0]}, right_bound={self.band[1]}, "
                         f"{'bottom_right' if self.band[2] else 'top_left'})")
        if self.padding:
            parts.append("padding mask")
        if self.ragged:
            parts.append("thd (ragged)")
        if self.score_mod is not None:
            parts.append(f"score_mod {self.score_mod!r}")
        if self.bias is not None:
            parts.append(f"bias{list(self.bias[0])} {self.bias[2]}{' + dBias' if self.bias[3] else ''}")
        if self.sinks:
            parts.append("sinks")
        if self.dropout:
            parts.append(f"dropout {self.dropout}")
        if self.deterministic:
            parts.append("deterministic")
        if self.token_capacity is not None:
            parts.append(f"token capacity {self.token_capacity[0]} / {self.token_capacity[1]}")
        return ", ".join(parts)


_interned: "weakref.WeakValueDictionary[tuple, GraphKey]" = weakref.WeakValueDictionary()
_intern_lock = threading.Lock()


def intern_key(key: GraphKey) -> GraphKey:
    """The one live GraphKey object equal to `key` (this one if none is alive). Plans of different
    signatures often share a graph; with one key object, every cache hit is an identity match
    (weakly held: a key no plan or cache entry uses any more is dropped)."""
    with _intern_lock:
        return _interned.setdefault(key._key, key)  # keyed by the field tuple: the key object stays weak


class CacheInfo(NamedTuple):
    """Cache statistics (`build_seconds`: total wall time spent building graphs)."""

    hits: int
    misses: int
    evictions: int
    builds: int
    build_seconds: float
    size: int
    maxsize: int
    thd_builds: int
    loads: int = 0


class Loaded(NamedTuple):
    """What a builder returns for a value it loaded (from the persistent store) instead of building:
    counted in CacheInfo.loads, not builds."""

    value: Any


class GraphCache:
    """Bounded LRU of built graphs, safe to use from many threads.

    `get_or_build(key, builder)` returns the cached value or calls `builder()` (outside the
    lock) once per missing key; concurrent callers of the same key wait for that build.
    An exception from the builder propagates to every waiter and caches nothing.
    """

    def __init__(self, maxsize: int = DEFAULT_MAXSIZE) -> None:
        self._check_maxsize(maxsize)
        self._maxsize = maxsize
        self._entries: "OrderedDict[Hashable, Any]" = OrderedDict()
        self._inflight: Dict[Hashable, Future] = {}
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._builds = self._thd_builds = self._loads = 0
        self._build_seconds = 0.0
        self._store: Any = None

    @property
    def store(self) -> Any:
        """The persistent GraphStore consulted on a miss, or None."""
        return self._store

    def set_store(self, store: Any) -> None:
        """Consult `store` (a GraphStore, or None for none) on later misses."""
        with self._lock:
            self._store = store

    @staticmethod
    def _check_maxsize(maxsize: int) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"maxsize must be an int >= 1, got {maxsize!r}")

    def get_or_build(self, key: Hashable, builder: Callable[[], Any]) -> Any:
        """The value for `key`, built with `builder()` on a miss."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return value
            self._misses += 1
            future = self._inflight.get(key)
            owner = future is None
            if owner:
                future = Future()
                self._inflight[key] = future
        if not owner:
            return future.result()
        start = time.perf_counter()
        try:
            value = builder()
        except BaseException as exc:
            with self._lock:
                del self._inflight[key]
            future.set_exception(exc)
            raise
        elapsed = time.perf_counter() - start
        loaded = isinstance(value, Loaded)
        if loaded:
            value = value.value
        evicted = []
        with self._lock:
            del self._inflight[key]
            if loaded:
                self._loads += 1
            else:
                self._builds += 1
                self._build_seconds += elapsed
                if getattr(key, "ragged", False):
                    self._thd_builds += 1
            self._entries[key] = value
            evicted = self._shrink_locked()
        future.set_result(value)
        del evicted  # released outside the lock
        return value

    def _shrink_locked(self) -> list:
        evicted = []
        while len(self._entries) > self._maxsize:
            evicted.append(self._entries.popitem(last=False)[1])
            self._evictions += 1
        return evicted

    def peek(self, key: Hashable) -> Optional[Any]:
        """The cached value for `key` or None; changes neither stats nor LRU order."""
        with self._lock:
            return self._entries.get(key)

    def keys(self) -> list:
        """Cached keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, self._evictions, self._builds,
                             self._build_seconds, len(self._entries), self._maxsize, self._thd_builds, self._loads)

    def set_maxsize(self, maxsize: int) -> None:
        """Change the bound; shrinking evicts the least recently used entries now."""
        self._check_maxsize(maxsize)
        with self._lock:
            self._maxsize = maxsize
            evicted = self._shrink_locked()
        if evicted:
            del evicted
            gc.collect()

    def clear(self, reset_stats: bool = True) -> None:
        """Drop every cached graph (really released) and, by default, reset the statistics."""
        with self._lock:
            entries = self._entries
            self._entries = OrderedDict()
            if reset_stats:
                self._hits = self._misses = self._evictions = self._builds = self._thd_builds = self._loads = 0
                self._build_seconds = 0.0
        entries.clear()
        del entries
        gc.collect()

    def __len__(self) -> int:
        return len(self._entries)


#: The process-wide cache used by the cuDNN backend.
GRAPH_CACHE = GraphCache()


def _info() -> MemoInfo:
    i = GRAPH_CACHE.info()
    return MemoInfo("cache.graphs", i.hits, i.misses, i.evictions, i.size, i.maxsize)


register_clear("cache.graphs", GRAPH_CACHE.clear, _info)
