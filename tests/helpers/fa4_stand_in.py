"""What the CPU stand-ins of flash-attn-4's interface share (`tests/backends/fa4/test_fa4_replay_*`):
its aux-data type and a count of the tensors a recording holds."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class AuxData(NamedTuple):
    """FA4's `utils.AuxData`: the aux tensors and scalars a kernel launch takes."""
    tensors: object = None
    scalars: object = None


def tensors_in(x: Any) -> int:
    """How many tensors `x` holds, through nested tuples (named tuples included): a recording must
    hold none."""
    if isinstance(x, torch.Tensor):
        return 1
    if isinstance(x, tuple):
        return sum(tensors_in(e) for e in x)
    return 0
