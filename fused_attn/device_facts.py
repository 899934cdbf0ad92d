"""Facts about a CUDA device that hold for the life of the process, read once per device: its
compute capability, which the engine table (`engine_speed`) and the engines' architecture checks
both need on every call plan."""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple

from .cache_registry import MemoInfo, register_clear

__all__ = ["capability", "arch_name", "clear"]

_MAX_DEVICES = 64
_lock = threading.Lock()
_capability: Dict[int, Tuple[int, int]] = {}


def capability(device: Any) -> Tuple[int, int]:
    """(major, minor) compute capability of a CUDA device (index None: the current device)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    got = _capability.get(index)
    if got is None:
        major, minor = torch.cuda.get_device_capability(index)
        got = (int(major), int(minor))
        with _lock:
            if len(_capability) < _MAX_DEVICES:
                _capability[index] = got
    return got


def arch_name(device: Any) -> Optional[str]:
    """"sm90" for a CUDA device of compute capability 9.0; None for any other device type."""
    if getattr(device, "type", None) != "cuda":
        return None
    major, minor = capability(device)
    return f"sm{major}{minor}"


def clear() -> None:
    """Forget what was read (devices do not change; for tests that fake them)."""
    with _lock:
        _capability.clear()


def _info() -> MemoInfo:
    with _lock:
        return MemoInfo("device_facts.capability", 0, 0, 0, len(_capability), _MAX_DEVICES)


register_clear("device_facts.capability", clear, _info)
