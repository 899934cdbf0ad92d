"""The torch engine (torch's own CPU kernels: SDPA's flash attention, compiled flex_attention for
score_mods; `torch_sdpa`) behind the engine contract (`fused_attn.engines`): backend="auto" tries
it for CPU tensors before the reference, and it refuses what it cannot run exactly, with the
reason."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from . import torch_sdpa

__all__ = ["ENGINE", "TorchEngine"]


class TorchEngine:
    name = "torch"
    auto_devices: Tuple[str, ...] = ("cpu",)

    def unavailable(self) -> Optional[str]:
        return None

    def refusal(self, problem: Any) -> Optional[str]:
        return torch_sdpa.refusal(problem)

    def make_runner(self, problem: Any) -> Any:
        return torch_sdpa.make_runner(problem)

    def saved_shape(self, make_problem: Any, query_rows: int) -> Tuple[int, ...]:
        return (0,)  # like the reference: the backward recomputes what it needs

    def op_saved(self, saved: tuple, query: torch.Tensor) -> torch.Tensor:
        return query.new_empty((0,), dtype=torch.float32)

    def traced_refusal(self, device_type: str, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> Optional[str]:
        # what it can serve depends on the score_mod and the grad mode, unknown from these facts
        return "the torch engine is chosen per call plan, not at trace time (pass backend='torch' to force it)"

    def grad_param_names(self, spec: Any) -> set:
        return set()  # score_mods that need gradients are refused (CPU flex has no backward)


ENGINE = TorchEngine()
