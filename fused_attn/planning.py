"""The planner an engine may use for sub-problems of its own (cuDNN's band rectangles and packed
windows plan their pieces as calls of their own), installed once by `fused_attn.plan` when it is
imported, so that engines reach the planner without importing the layer above them.

    planner().get_plan(spec, mod, q, k, v, varlen, sinks, force_grad=False, sig=None) -> CallPlan
    planner().static_problem(spec, mod, q, k, v, varlen, sinks, force_grad=False) -> StaticProblem
    planner().call_signature(spec, q, k, v, varlen, mod, sinks, force_grad=False) -> tuple | None
    planner().signature_records_grad(sig) -> bool
    planner().is_plan(x) -> bool
    planner().clear_plans() -> None
"""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple, Optional

__all__ = ["Planner", "install", "load_with", "planner", "clear_plans"]


class Planner(NamedTuple):
    get_plan: Callable[..., Any]
    static_problem: Callable[..., Any]
    call_signature: Callable[..., Optional[tuple]]
    signature_records_grad: Callable[[tuple], bool]
    is_plan: Callable[[Any], bool]
    clear_plans: Callable[[], None]


_lock = threading.Lock()
_installed: list = []  # at most one Planner
_loader: list = []  # at most one callable that imports the planner's module (set by the package)


def install(p: Planner) -> None:
    """Install the planner (fused_attn.plan does, once, at import)."""
    with _lock:
        _installed[:] = [p]


def load_with(loader: Callable[[], None]) -> None:
    """How to install the planner when an engine asks before anything imported it (the package
    sets this: its public names load lazily)."""
    with _lock:
        _loader[:] = [loader]


def planner() -> Planner:
    """The installed planner (RuntimeError if none is installed and none can be loaded)."""
    if not _installed and _loader:
        _loader[0]()
    if not _installed:
        raise RuntimeError("fused_attn.planning: no planner installed (import fused_attn.plan first)")
    return _installed[0]


def clear_plans() -> None:
    """Drop every call plan (no-op before a planner is installed)."""
    if _installed:
        _installed[0].clear_plans()
