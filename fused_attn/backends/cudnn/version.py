"""Version gate for the cuDNN frontend and library (checked once, on first use)."""

from __future__ import annotations

import threading
import warnings
from typing import Optional

from . import quirks

SUPPORTED_FRONTEND = "1.32"
MIN_BACKEND_VERSION = 91000

class UntestedCudnnWarning(UserWarning):
    """The loaded cuDNN is not one the GPU suite runs on (the quirk table still applies)."""


_lock = threading.Lock()
_result: Optional[tuple] = None  # (error message or None, backend version int)


def _probe() -> tuple:
    try:
        import cudnn
    except Exception as exc:  # noqa: BLE001 - any import failure means "not installed"
        return (f"the cuDNN frontend (nvidia-cudnn-frontend {SUPPORTED_FRONTEND}.x) is not importable: {exc}; "
                "install the cuda extra from the checkout: pip install -c 3rdparty/requirements-cudnn.txt "
                "-e '.[cuda]'", 0)
    frontend = str(getattr(cudnn, "__version__", "unknown"))
    if frontend.split(".")[:2] != SUPPORTED_FRONTEND.split("."):
        return (f"nvidia-cudnn-frontend {frontend} is installed; fused_attn supports {SUPPORTED_FRONTEND}.x", 0)
    try:
        backend = int(cudnn.backend_version())
    except Exception as exc:  # noqa: BLE001 - no libcudnn on this machine
        return (f"the cuDNN library is not available ({exc}); fused_attn needs cuDNN >= 9.10 "
                f"(backend version {MIN_BACKEND_VERSION})", 0)
    if backend < MIN_BACKEND_VERSION:
        return (f"cuDNN backend version {backend} is installed; fused_attn needs >= {MIN_BACKEND_VERSION} "
                "(cuDNN 9.10)", backend)
    return (None, backend)


def _get() -> tuple:
    global _result
    if _result is None:
        with _lock:
            if _result is None:
                _result = _probe()
                notice = quirks.untested_notice(_result[1]) if _result[0] is None else None
                if notice is not None:
                    warnings.warn(notice, UntestedCudnnWarning, stacklevel=3)
    return _result


def unavailable_reason() -> Optional[str]:
    """None when the frontend and cuDNN library are usable, else why not."""
    return _get()[0]


def backend_version() -> int:
    """The cuDNN library version as an int (91900 for 9.19.0), 0 when unavailable."""
    return _get()[1]


def check() -> int:
    """Raise ImportError (installed vs supported) unless usable; return the backend version."""
    reason, backend = _get()
    if reason is not None:
        raise ImportError(reason)
    return backend
