"""Whether a call's tensors are abstract (fake or meta: metadata, no data), for the layers that
must not read or execute them (the cuDNN execute guard, value checks); `fused_attn.abstract`
routes such calls through the custom ops' fake implementations."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_abstract"]

_FAKE = torch._C._TorchDispatchModeKey.FAKE


def is_abstract(*tensors: Any) -> bool:
    """True for a call that must run no kernel and read no value: a fake or meta tensor among
    `tensors` (None and non-tensors are skipped), or an active FakeTensorMode; False while
    torch.compile traces (its tensors stand for real ones: the entry points take the ops' path
    there themselves). Well under a microsecond for plain tensors (the hot path passes the query
    alone: key and value share its device, and a fake key or value implies an active mode)."""
    for t in tensors:
        if type(t) is torch.Tensor:
            if t.is_meta:
                return True
        elif isinstance(t, torch.Tensor) and _is_fake(t):
            return True
    if torch._C._get_dispatch_mode(_FAKE) is None:
        return False
    return not torch.compiler.is_compiling()


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)
