"""Shared pieces of the gym ports: argument checks and the `_mask` / `_mod` factories that trace
a body, set its runtime int checks and name it."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence, Tuple, Union

import torch

import score_mods as sm

from ..base import ScoreMod

NEG_INF = -math.inf
Predicate = Callable[[Any, Any, Any, Any], Any]
IntSeq = Union[torch.Tensor, Sequence[int]]


def _int(fn: str, name: str, v: Any, low: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{fn}: {name} must be an int, got {v!r} ({type(v).__name__})")
    if v < low:
        raise ValueError(f"{fn}: {name} must be >= {low}, got {v}")
    return v


def _float(fn: str, name: str, v: Any, low: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise TypeError(f"{fn}: {name} must be a finite number, got {v!r} ({type(v).__name__})")
    if v < low:
        raise ValueError(f"{fn}: {name} must be >= {low:g}, got {v!r}")
    return float(v)


def _ints(fn: str, name: str, v: Any, dims: int = 1) -> torch.Tensor:
    """An int64 tensor from a tensor or nested sequence of ints (bools become 0/1)."""
    t = v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
    if t.dtype == torch.bool:
        t = t.to(torch.int64)
    if t.is_floating_point() or t.is_complex():
        raise TypeError(f"{fn}: {name} must hold integers (or bools), got dtype {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{fn}: {name} must have {dims} dim(s), got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def _offsets(fn: str, offsets: IntSeq) -> torch.Tensor:
    t = _ints(fn, "offsets", offsets)
    if t.numel() < 2 or int(t[0]) != 0 or bool((t.diff() < 0).any()):
        raise ValueError(f"{fn}: offsets must start at 0 and not decrease (documents' cumulative lengths), "
                         f"got {t.tolist()}")
    return t


def _shape(fn: str, name: str, v: Any, rank: int) -> Tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or len(v) != rank:
        raise TypeError(f"{fn}: {name} must be a tuple of {rank} ints, got {v!r}")
    return tuple(_int(fn, f"{name}[{i}]", x) for i, x in enumerate(v))


def _non_negative(fn: str) -> Callable[[str, Any], None]:
    def check(name: str, v: Any) -> None:
        if v < 0:
            raise ValueError(f"{fn}: {name} must be >= 0, got {v!r}")
    return check


def _finish(mod: ScoreMod, name: Union[str, Callable[[dict], str]], **values: Any) -> ScoreMod:
    """Bind `values`; runtime int sizes are checked >= 0 on every bind. `name` is a string, or
    a function of the bound values (the name then follows `bind`)."""
    fn = mod.base_name
    for p, spec in mod.specs.items():
        if spec.kind == "int":
            spec.check = _non_negative(fn)
    if callable(name):
        mod._name_fn = name
    else:
        mod = mod.renamed(name)
    return mod.bind(**values) if values else mod


def _mask(name: Union[str, Callable[[dict], str]], body: Callable, **values: Any) -> ScoreMod:
    """Trace `body(b, h, q_idx, kv_idx, **params) -> condition` as a mask (see _finish)."""
    return _finish(sm.mask_mod(body, name=body.__name__), name, **values)


def _mod(name: Union[str, Callable[[dict], str]], body: Callable, **values: Any) -> ScoreMod:
    return _finish(sm.score_mod(body, name=body.__name__), name, **values)
