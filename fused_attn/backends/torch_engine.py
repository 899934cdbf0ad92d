"""The torch engine (torch's own CPU kernels: SDPA's flash attention, compiled flex_attention for
score_mods; `torch_sdpa`) behind the engine contract (`fused_attn.engines`): backend="auto" tries
it for CPU tensors before the reference, and it refuses what it cannot run exactly, with the
reason."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from . import torch_sdpa
from .recomputing import RecomputingEngine

__all__ = ["ENGINE", "TorchEngine"]


class TorchEngine(RecomputingEngine):
    name = "torch"
    auto_devices: Tuple[str, ...] = ("cpu",)

    def refusal(self, problem: Any) -> Optional[str]:
        return torch_sdpa.refusal(problem)

    def make_runner(self, problem: Any) -> Any:
        return torch_sdpa.make_runner(problem)

    def traced_refusal(self, device_type: str, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> Optional[str]:
        # what it can serve depends on the score_mod and the grad mode, unknown from these facts
        return "the torch engine is chosen per call plan, not at trace time (pass backend='torch' to force it)"

    def grad_param_names(self, spec: Any) -> set:
        return set()  # score_mods that need gradients are refused (CPU flex has no backward)


ENGINE = TorchEngine()
