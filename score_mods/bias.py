"""`materialize(part, dims)`: a score-free part of a traced mod as a tensor, e.g. the additive
bias of `TracedMod.split_additive_bias` for cuDNN's bias input (memoized by materialization.py)."""

from __future__ import annotations

from typing import Any

import torch

from .expr import Node, const, leaves, reads, substitute
from .materialization import check_dims, default_device, evaluate_cached
from .trace import TracedMod


def materialize(part: Any, dims: Any, *, device: Any = None, dtype: torch.dtype = torch.float32,
                dense: bool = True) -> torch.Tensor:
    """The value of a score-free TracedMod part as a tensor: g for a part `score + g` (the
    bias part of `split_additive_bias`), else the part at score = 0 (a mask gives 0 / -inf).

    Shape (B|1, H|1, Sq, Skv) when dense (what cuDNN's bias input takes), else the broadcast
    shape of the axes the value depends on. Computed with autograd when a tensor parameter
    requires grad (feed cuDNN's dBias back with `value.backward(dbias)`), memoized otherwise.
    """
    if not isinstance(part, TracedMod):
        raise TypeError(f"materialize() takes a TracedMod part, got {type(part).__name__}")
    dims = check_dims(dims, f"materialize({part.name!r})")
    root = part.root
    node = root.args[1] if root.op == "add" and root.args[0].op == "score" else root
    if leaves(node, "score"):
        node = _at_zero_score(node)
    params = dict(part.scalars_typed())
    tensors = part.tensors()
    params.update(tensors)
    axes = reads(node).axes
    return evaluate_cached(node, dims, default_device(tensors, device), dtype, params, axes, dense)


def _at_zero_score(node: Node) -> Node:
    return substitute(node, lambda n, args: const(0.0) if n.op == "score" else None)
