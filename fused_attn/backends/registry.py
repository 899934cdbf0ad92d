"""Backend choice for a call plan: `choose(problem) -> (name, reason, runner)`.

    "reference"  the pure PyTorch backend (any device, any float dtype)
    "cudnn"      cuDNN frontend graphs; NotImplementedError with the reason if it cannot serve
    "torch"      torch's own CPU kernels (SDPA flash, compiled flex for score_mods); NotImplementedError
                 with the reason if it cannot serve the problem exactly
    "auto"       cuDNN for CUDA tensors, the torch engine for CPU tensors, when they can serve; else
                 the reference, with the reason recorded on the plan (and a FallbackWarning for CUDA
                 tensors, see plan.py)

Backend modules expose `refusal(problem, build) -> Optional[str]` (metadata only: why it cannot
serve, or None) and `make_runner(problem) -> runner` (raises `Refusal` when, e.g., the cuDNN
frontend declines the graph). Backends never import each other.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Optional, Tuple

from ..plan import Refusal, StaticProblem
from . import reference, torch_sdpa

__all__ = ["choose", "choose_name", "backend_module", "cudnn_available"]

_CUDNN: list = []


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


def cudnn_available() -> bool:
    """True when the cuDNN backend imports and its frontend and library are usable."""
    mod, _ = _cudnn()
    return mod is not None and mod.version.unavailable_reason() is None


def backend_module(name: str) -> ModuleType:
    """The backend module called `name` ("reference", "torch" or "cudnn")."""
    if name == "reference":
        return reference
    if name == "torch":
        return torch_sdpa
    mod, why = _cudnn()
    if mod is None:
        raise NotImplementedError(why)
    return mod


def _try_cudnn(problem: StaticProblem, build: bool) -> Tuple[Optional[Any], str]:
    """(runner or None, reason)."""
    mod, why = _cudnn()
    if mod is None:
        return None, why
    why = mod.refusal(problem)
    if why is not None:
        return None, why
    if not build:
        return True, "cuDNN can serve it"
    try:
        return mod.make_runner(problem), "cuDNN serves it"
    except Refusal as exc:
        return None, str(exc)


def choose(problem: StaticProblem, build: bool = True) -> Tuple[str, str, Any]:
    """(backend name, reason, runner) for `problem`; NotImplementedError if nothing can run it.

    build=False decides from metadata only and returns no runner (fake tensors, tracing)."""
    requested = problem.spec.backend
    if requested == "reference":
        why = reference.refusal(problem)
        if why is not None:
            raise NotImplementedError(f"backend='reference' cannot run this problem: {why}")
        return "reference", "backend='reference' was requested", reference.make_runner(problem) if build else None
    if requested == "cudnn":
        runner, why = _try_cudnn(problem, build)
        if runner is None:
            raise NotImplementedError(f"backend='cudnn' cannot run this problem: {why}; use backend='reference' "
                                      "(PyTorch math) or backend='auto'")
        return "cudnn", "backend='cudnn' was requested", runner if build else None
    if requested == "torch" or problem.device.type == "cpu":
        why = torch_sdpa.refusal(problem)
        if why is None:
            reason = "backend='torch' was requested" if requested == "torch" else "the torch engine serves it (CPU)"
            return "torch", reason, torch_sdpa.make_runner(problem) if build else None
        if requested == "torch":
            raise NotImplementedError(f"backend='torch' cannot run this problem: {why}; use backend='reference' "
                                      "(PyTorch math) or backend='auto'")
        cudnn_why = f"the torch engine cannot serve it: {why}"
    elif problem.device.type == "cuda":
        runner, why = _try_cudnn(problem, build)
        if runner is not None:
            return "cudnn", why, runner if build else None
        cudnn_why = f"cuDNN cannot serve it: {why}"
    else:
        cudnn_why = f"the inputs are on {problem.device} (cuDNN needs CUDA tensors)"
    ref_why = reference.refusal(problem)
    if ref_why is not None:
        raise NotImplementedError(f"no backend can run this problem: {cudnn_why}; reference: {ref_why}")
    return "reference", cudnn_why, reference.make_runner(problem) if build else None


def choose_name(problem: StaticProblem) -> str:
    """The backend `choose` would pick, from metadata only."""
    return choose(problem, build=False)[0]
