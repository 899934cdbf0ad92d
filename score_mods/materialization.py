"""Materialized operands: score-free subexpressions evaluated eagerly, bound as graph inputs.

`operands(plan, mod, dims, device)` evaluates each `lower_cudnn.Materialized` of a plan on the
(B, H, Sq, Skv) grid with the eager evaluator (exact torch integer semantics), as an fp32
tensor of its broadcast shape (B|1, H|1, Sq|1, Skv|1) (conditions as 0/1). `evaluate_cached`
serves `score_mods.materialize(part, dims)` (bias.py), which does the same for a whole
score-free mod part, e.g. the additive bias of `TracedMod.split_additive_bias`, which the
backend feeds to cuDNN's bias input.

Caching: results are kept in one bounded, thread-safe LRU memo keyed by (subexpression
structure, dims, device, dtype, the exact values of the scalar parameters it reads, and the
identity + `_version` of the tensors it reads; each entry holds weak references to those
tensors and is only reused while they are alive and the same objects), so a repeated call
rebuilds nothing and an in-place update of a table (optimizer step) is seen. When a tensor it
reads requires grad (and grad mode is on), the value is computed with autograd and never
cached, so gradients flow back to the parameter through torch.

Values never enter graph keys: shapes follow only the structure and dims.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from . import caches, eager
from .expr import INDEX_AXES, Node, reads

#: Bounds of the memo: entries, and bytes of tensors held (dense operands can be large).
MAX_ENTRIES = 64
MAX_BYTES = 256 * 2 ** 20

_LOCK = threading.RLock()  # re-entrant: a weakref callback may run under it (GC)
_MEMO: "collections.OrderedDict[Any, Tuple[torch.Tensor, tuple]]" = collections.OrderedDict()
_BYTES = [0]
_STATS = {"hits": 0, "misses": 0, "uncached": 0, "evictions": 0}


def cache_info() -> Dict[str, int]:
    """hits, misses, uncached (autograd) evaluations, entries and bytes of the materialization memo."""
    with _LOCK:
        return dict(_STATS, entries=len(_MEMO), bytes=_BYTES[0], max_entries=MAX_ENTRIES, max_bytes=MAX_BYTES)


def clear_cache() -> None:
    """Drop every memoized materialization (and reset the counters)."""
    with _LOCK:
        _MEMO.clear()
        _BYTES[0] = 0
        _STATS.update(hits=0, misses=0, uncached=0, evictions=0)


def _info() -> caches.Info:
    with _LOCK:
        return ("score_mods.materialization", _STATS["hits"], _STATS["misses"], _STATS["evictions"], len(_MEMO),
                MAX_ENTRIES, _BYTES[0], MAX_BYTES)


caches.register("score_mods.materialization", _info, clear_cache)


def _exact(v: Any) -> Any:
    return v.hex() if isinstance(v, float) else v


def _key_and_refs(node: Node, dims, device, dtype, params: Dict[str, Any], dense: bool):
    r = reads(node)
    scal = tuple((p, _exact(params[p])) for p in r.params)
    ts = [params[p] for p in r.tensors]
    key = (node, tuple(int(d) for d in dims), str(device), dtype, dense, scal,
           tuple((p, id(t), t._version) for p, t in zip(r.tensors, ts)))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in ts)
    return key, [weakref.ref(t) for t in ts], grad


def _lookup(key, refs) -> Optional[torch.Tensor]:
    with _LOCK:
        hit = _MEMO.get(key)
        if hit is not None:
            value, held = hit
            if len(held) == len(refs) and all(h() is not None and h() is r() for h, r in zip(held, refs)):
                _MEMO.move_to_end(key)
                _STATS["hits"] += 1
                return value
            _drop(key)
        _STATS["misses"] += 1
    return None


def _drop(key) -> None:
    value, _ = _MEMO.pop(key)
    _BYTES[0] -= value.numel() * value.element_size()


def _forget(key) -> Any:
    """A weakref callback dropping `key` once one of its source tensors is freed (an entry never
    outlives the tensors it was computed from)."""

    def callback(_ref: Any) -> None:
        with _LOCK:
            if key in _MEMO:
                _drop(key)

    return callback


def _store(key, refs, value: torch.Tensor) -> None:
    size = value.numel() * value.element_size()
    if size > MAX_BYTES:
        return
    live = [r() for r in refs]
    if any(t is None for t in live):
        return
    with _LOCK:
        if key in _MEMO:
            _drop(key)
        _MEMO[key] = (value, tuple(weakref.ref(t, _forget(key)) for t in live))
        _BYTES[0] += size
        while len(_MEMO) > MAX_ENTRIES or _BYTES[0] > MAX_BYTES:
            _drop(next(iter(_MEMO)))
            _STATS["evictions"] += 1


def _evaluate(node: Node, dims, device, dtype, params: Dict[str, Any], axes: Sequence[str], dense: bool) -> torch.Tensor:
    env = eager.grid_env(dims, device)
    value = eager.evaluate(node, env, params, float_dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value, device=device)
    value = value.to(device=device, dtype=dtype)
    if value.dim() < 4:
        value = value.reshape((1,) * (4 - value.dim()) + tuple(value.shape))
    # b / h stay 1 where a size-1 tensor parameter broadcasts them; q / kv follow the axes.
    shape = tuple(
        int(d) if (a in axes and not (a in ("b", "h") and value.shape[i] == 1)) or (dense and a in ("q_idx", "kv_idx"))
        else 1
        for i, (a, d) in enumerate(zip(INDEX_AXES, dims))
    )
    return value.expand(shape).contiguous()


def evaluate_cached(node: Node, dims, device, dtype, params: Dict[str, Any], axes: Sequence[str],
                    dense: bool = False) -> torch.Tensor:
    """`node` on the grid `dims`, broadcast to its axes (and to Sq, Skv when dense), memoized."""
    if any(isinstance(v, torch.Tensor) and v.is_meta for v in params.values()):
        # structure only (a plan's data-free template): the shape, dtype and layout, no data
        return _evaluate(node, dims, torch.device("meta"), dtype, params, axes, dense)
    key, refs, grad = _key_and_refs(node, dims, device, dtype, params, dense)
    if grad:
        with _LOCK:
            _STATS["uncached"] += 1
        return _evaluate(node, dims, device, dtype, params, axes, dense)
    value = _lookup(key, refs)
    if value is None:
        with torch.no_grad():
            value = _evaluate(node, dims, device, dtype, params, axes, dense)
        _store(key, refs, value)
    return value


def check_dims(dims: Any, what: str) -> Tuple[int, int, int, int]:
    if not isinstance(dims, (tuple, list, torch.Size)) or len(dims) != 4:
        raise TypeError(f"{what}: dims must be (B, H, Sq, Skv), got {dims!r}")
    out = []
    for name, d in zip(("B", "H", "Sq", "Skv"), dims):
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"{what}: dims {name} must be a positive int, got {d!r}")
        out.append(d)
    return tuple(out)  # type: ignore[return-value]


def default_device(tensors: Dict[str, torch.Tensor], device: Any) -> torch.device:
    if device is not None:
        return torch.device(device)
    for t in tensors.values():
        return t.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def operands(plan: Any, mod: Any, dims: Any, device: Any = None) -> Dict[str, torch.Tensor]:
    """The plan's materialized operands for `mod`'s current values, on `device`."""
    dims = check_dims(dims, f"score_mod {mod.name!r}")
    params = dict(mod.scalars_typed())
    tensors = mod.tensors()
    params.update(tensors)
    dev = default_device(tensors, device)
    return {name: evaluate_cached(m.node, dims, dev, torch.float32, params, m.axes) for name, m in plan.materialized.items()}
