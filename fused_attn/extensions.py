"""Entry points that the layers above the core provide (`fused_attn.distributed`: DTensor inputs
and context parallelism), so that the core never imports them. The top-level package installs
them when it is imported (`fused_attn._wiring`).

    extensions.get("dtensor_call")(resolver, config, score_mod, q, k, v, varlen, sinks)
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict

__all__ = ["NAMES", "provide", "get"]

#: every hook the core may ask for (the registry holds no other name)
NAMES = ("dtensor_call", "dtensor_module_forward", "dtensor_doc_packed", "module_context_parallel", "cp_choices")

_lock = threading.Lock()
_hooks: Dict[str, Callable[..., Any]] = {}


def provide(name: str, fn: Callable[..., Any]) -> None:
    """Install the hook `name` (one of NAMES)."""
    if name not in NAMES:
        raise ValueError(f"extensions.provide: unknown hook {name!r}; known: {NAMES}")
    with _lock:
        _hooks[name] = fn


def get(name: str) -> Callable[..., Any]:
    """The hook `name` (NotImplementedError when nothing provides it)."""
    fn = _hooks.get(name)
    if fn is None:
        raise NotImplementedError(f"fused_attn: nothing provides {name!r} (import fused_attn, which installs "
                                  "fused_attn.distributed's entry points)")
    return fn
