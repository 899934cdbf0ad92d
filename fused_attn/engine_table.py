"""The registered engines' names, in backend="auto"'s order of preference, and where each lives
("module:attribute", imported only when first needed). The lowest layer: argument checks read
the accepted `backend=` values here; `fused_attn.engines` loads and chooses engines."""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

__all__ = ["names", "engine_names", "location", "add", "remove", "BUILTIN", "MAX_ENGINES"]

#: the built-in engines (the reference, which runs everything, last)
BUILTIN: Tuple[Tuple[str, str], ...] = (
    ("cudnn", "fused_attn.backends.cudnn.engine:ENGINE"),
    ("fa4", "fused_attn.backends.fa4.engine:ENGINE"),
    ("torch", "fused_attn.backends.torch_engine:ENGINE"),
    ("reference", "fused_attn.backends.reference_engine:ENGINE"),
)
MAX_ENGINES = 16

_lock = threading.Lock()
_order: List[str] = [name for name, _ in BUILTIN]
_where: Dict[str, str] = dict(BUILTIN)


def engine_names() -> Tuple[str, ...]:
    """The registered engines, in auto's order."""
    return tuple(_order)


def names() -> Tuple[str, ...]:
    """The accepted `backend=` values: "auto" and every registered engine."""
    return ("auto",) + tuple(_order)


def location(name: str) -> Optional[str]:
    """"module:attribute" of a built-in engine, "" for a registered object, None if unknown."""
    return _where.get(name)


def add(name: str, before: str) -> None:
    """Insert `name` before `before` (ValueError naming the problem)."""
    with _lock:
        if name in _order:
            raise ValueError(f"register: an engine named {name!r} is registered already")
        if len(_order) >= MAX_ENGINES:
            raise ValueError(f"register: at most {MAX_ENGINES} engines")
        if before not in _order:
            raise ValueError(f"register: before={before!r} names no engine; registered: {list(_order)}")
        _order.insert(_order.index(before), name)
        _where[name] = ""


def remove(name: str) -> None:
    """Remove a registered (not built-in) engine."""
    with _lock:
        if name in dict(BUILTIN) or name not in _order:
            raise ValueError(f"unregister: {name!r} is not a registered plug-in engine")
        _order.remove(name)
        _where.pop(name, None)
