"""Backend choice: `run(problem, backend) -> (out, lse)`.

    "reference"  the pure PyTorch backend (any device, any float dtype)
    "cudnn"      the cuDNN graph backend; NotImplementedError with the reason if it cannot serve
    "auto"       cuDNN for CUDA tensors when it can serve, the reference otherwise

An explicit backend never falls back silently. Under torch.compile the call goes through the
`fused_attn.ops` custom ops; eager calls use the backend's own `attention`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional, Tuple

import torch

from ..problem import AttentionProblem
from . import reference

__all__ = ["choose", "run"]


_CUDNN: list = []  # the imported cuDNN backend module, once imported


def _cudnn() -> Tuple[Optional[ModuleType], Optional[str]]:
    """(the cuDNN backend module, None) or (None, why it cannot be imported)."""
    if _CUDNN:
        return _CUDNN[0], None
    try:
        module = importlib.import_module("fused_attn.backends.cudnn")
    except ImportError as exc:
        return None, f"the cuDNN backend cannot be imported ({exc})"
    _CUDNN.append(module)
    return module, None


def choose(problem: AttentionProblem, backend: str = "auto") -> Tuple[str, ModuleType]:
    """(name, module) of the backend that will run `problem`; NotImplementedError if none can."""
    if backend == "reference":
        reason = reference.can_serve(problem)
        if reason is not None:
            raise NotImplementedError(f"backend='reference' cannot run this problem: {reason}")
        return "reference", reference
    if backend == "cudnn":
        mod, reason = _cudnn()
        if mod is not None:
            reason = mod.can_serve(problem)
        if reason is not None:
            raise NotImplementedError(f"backend='cudnn' cannot run this problem: {reason}; "
                                      "use backend='reference' or backend='auto'")
        return "cudnn", mod
    if backend != "auto":
        raise ValueError(f"backend={backend!r} is not supported; accepted: 'auto', 'cudnn', 'reference'")
    cudnn_reason = "the inputs are not CUDA tensors"
    if problem.query.is_cuda:
        mod, cudnn_reason = _cudnn()
        if mod is not None:
            cudnn_reason = mod.can_serve(problem)
            if cudnn_reason is None:
                return "cudnn", mod
    ref_reason = reference.can_serve(problem)
    if ref_reason is not None:
        raise NotImplementedError(f"no backend can run this problem: cudnn: {cudnn_reason}; reference: {ref_reason}")
    return "reference", reference


def run(problem: AttentionProblem, backend: str = "auto") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run `problem` on the chosen backend: (out, lse); out in the backend's layout (see problem.py)."""
    name, mod = choose(problem, backend)
    if torch.compiler.is_compiling():
        from .. import ops

        return ops.attention(problem, name)
    return mod.attention(problem)
