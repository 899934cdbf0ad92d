"""Whether flash-attn-4 can run here: the package (an optional extra), its version, the GPU.

Imported lazily: the library imports FA4 (and the CuTe DSL behind it) only when the FA4 engine
is asked about a CUDA problem. The answer is computed once per process (a one-slot cache under a
lock); the architecture comes from `fused_attn.device_facts` (once per device).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional

import torch

from ... import device_facts

__all__ = ["PINNED_VERSION", "INSTALL_HINT", "module", "unavailable", "version", "arch_refusal", "arch",
           "persist_kernels", "cache_swap_lock"]

#: the flash-attn-4 release this engine is written and tested against (3rdparty/requirements-fa4.txt)
PINNED_VERSION = "4.0.0b36"
INSTALL_HINT = "pip install 'fused_attn[fa4]'"
#: compute capabilities (major) whose FA4 kernels this engine runs: Hopper (sm90), Blackwell (sm100)
SUPPORTED_MAJORS = (9, 10)

_lock = threading.Lock()
_state: Dict[str, Any] = {}
#: held while the library replaces one of FA4's compile caches (`persist_kernels`, `replay.record`)
_swap_lock = threading.Lock()


def _load() -> None:
    with _lock:
        if "done" in _state:
            return
        try:
            from flash_attn.cute import interface  # noqa: F401 - the kernels' entry points
        except Exception as exc:  # ImportError, or the CuTe DSL failing to load its libraries
            _state["why"] = (f"flash-attn-4 is not installed or cannot be imported ({type(exc).__name__}: {exc}); "
                             f"{INSTALL_HINT} adds it")
            _state["module"] = None
        else:
            _state["why"] = None
            _state["module"] = interface
            try:
                from importlib.metadata import version as dist_version

                _state["version"] = dist_version("flash-attn-4")
            except Exception:
                _state["version"] = "unknown"
        _state["done"] = True


def unavailable() -> Optional[str]:
    """Why the FA4 engine cannot run on this machine at all, or None."""
    if not torch.cuda.is_available():
        return "the FA4 engine needs a CUDA GPU (none is available)"
    _load()
    return _state["why"]


def module() -> Any:
    """flash_attn.cute.interface (call only after `unavailable()` returned None)."""
    _load()
    return _state["module"]


def version() -> Optional[str]:
    """The installed flash-attn-4 version, or None when it is not installed."""
    _load()
    return _state.get("version")


def arch(device: torch.device) -> tuple:
    """(major, minor) compute capability of a CUDA device."""
    return device_facts.capability(device)


def arch_refusal(device: torch.device) -> Optional[str]:
    """Why FA4 does not run on this device's architecture, or None."""
    major, minor = arch(device)
    if major not in SUPPORTED_MAJORS:
        return (f"the FA4 engine runs on sm90 (Hopper) and sm100 (Blackwell); {device} is sm{major}{minor}")
    return None


#: FA4's compile caches that a forward / backward call of this engine goes through
_KERNEL_CACHES = (("_flash_attn_fwd", "fwd"), ("_flash_attn_bwd", "bwd"), ("_bwd_preprocess", "bwd_pre"),
                  ("_bwd_postprocess_convert", "bwd_post"), ("_bwd_dsink_reduce", "bwd_dsink"),
                  ("_compute_tile_cumsum", "tile_cumsum"), ("_compute_blocks_to_batch", "blocks_to_batch"),
                  ("_get_scheduler_metadata", "scheduler_metadata"))


def persist_kernels(directory: Optional[Any]) -> None:
    """Keep FA4's compiled kernels in `<directory>/fa4/<FA4 source fingerprint>/` (the library's
    persistent cache directory, `graph_cache.set_persistent_dir`), so a later process loads a
    configuration's kernels instead of compiling them (seconds). Kernels compiled so far stay in
    memory; None leaves FA4's caches as they are. FA4 keys its files on the kernel configuration
    and the score_mod's structural hash (`cute_load`), never on a Python object."""
    if directory is None:
        return
    from pathlib import Path

    from flash_attn.cute import cache_utils

    interface = module()
    root = Path(directory) / "fa4" / cache_utils._compute_source_fingerprint()
    with _swap_lock:
        for attr, name in _KERNEL_CACHES:
            fn = getattr(interface, attr, None)
            current = getattr(fn, "compile_cache", None)
            if current is None:
                continue
            target = root / name
            if getattr(current, "cache_path", None) == target:
                continue
            fresh = cache_utils.JITPersistentCache(target)
            fresh.cache.update(getattr(current, "cache", {}))
            fn.compile_cache = fresh


def cache_swap_lock() -> threading.Lock:
    """The lock held while one of FA4's compile caches is replaced (by `persist_kernels`, or
    watched for one call by `replay.record`): never taken while FA4 is being imported."""
    return _swap_lock
