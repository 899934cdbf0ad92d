"""The reference engine (pure PyTorch math, any device, any float dtype) behind the engine
contract (`fused_attn.engines`): it runs every validated problem whose score_mod has an eager
form, and is what backend="auto" falls back to, with the reason recorded."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from . import reference
from .recomputing import RecomputingEngine

__all__ = ["ENGINE", "ReferenceEngine"]


class ReferenceEngine(RecomputingEngine):
    name = "reference"
    auto_devices: Tuple[str, ...] = ("cpu", "cuda", "meta", "mps", "xpu", "hpu", "privateuseone")

    def refusal(self, problem: Any) -> Optional[str]:
        return reference.refusal(problem)

    def make_runner(self, problem: Any) -> Any:
        return reference.make_runner(problem)

    def traced_refusal(self, device_type: str, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> Optional[str]:
        return None

    def grad_param_names(self, spec: Any) -> set:
        """Every floating tensor parameter the mod declares (autograd differentiates them all)."""
        template = spec.score_mod
        specs = template.specs
        return {n for n, t in template.tensors().items() if t.is_floating_point() and n in specs}


ENGINE = ReferenceEngine()
