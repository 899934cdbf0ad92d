"""The part of the engine contract (`fused_attn.engines`) shared by the engines whose backward
recomputes its forward (the reference and the torch engine): always available, and nothing saved
for the backward."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

__all__ = ["RecomputingEngine"]


class RecomputingEngine:
    """Base of an engine with no install requirement whose backward recomputes what it needs."""

    def unavailable(self) -> Optional[str]:
        return None

    def saved_shape(self, make_problem: Any, query_rows: int) -> Tuple[int, ...]:
        return (0,)  # the backward recomputes its forward

    def op_saved(self, saved: tuple, query: torch.Tensor) -> torch.Tensor:
        """Nothing: an empty fp32 tensor for the compiled op to hand its backward."""
        return query.new_empty((0,), dtype=torch.float32)
