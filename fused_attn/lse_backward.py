"""What every runner's `backward_with_lse` shares: the backward from a given output and fp32 lse,
for one key chunk of a larger attention (context parallelism) or the backward half of a training
call split across engines (`split_runner`)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["weightless_empty_rows", "into_dest"]


def weightless_empty_rows(lse: torch.Tensor) -> torch.Tensor:
    """`lse` with -inf (rows that attend no key anywhere) as +inf: their weights exp(s - lse)
    are then 0, where -inf would give inf."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)


def into_dest(grads: tuple, dest: Optional[Any]) -> tuple:
    """`grads` (dq, dk, dv, *extras) as they are without `dest`; with dest = (None, dK view,
    dV view), dK and dV copied into those views, which are returned in their place."""
    if dest is None:
        return grads
    for d, g in zip(dest[1:], grads[1:3]):
        d.copy_(g)
    return (grads[0],) + tuple(dest[1:]) + tuple(grads[3:])
