"""A base for the stub engines CPU tests plug into `fused_attn.engines` (`register`): the Engine
attributes a stub rarely changes. It is available, serves every problem, saves nothing for a
compiled backward and differentiates no score_mod parameter. A stub sets `name` and
`auto_devices`, defines `make_runner`, and overrides what its test checks."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


class StubEngineBase:
    name = "stub"
    auto_devices: Tuple[str, ...] = ("cpu",)

    def unavailable(self) -> Optional[str]:
        return None

    def refusal(self, problem: Any) -> Optional[str]:
        return None

    def saved_shape(self, make_problem: Any, query_rows: int) -> Tuple[int, ...]:
        return (0,)

    def op_saved(self, saved: tuple, query: torch.Tensor) -> torch.Tensor:
        return query.new_empty((0,), dtype=torch.float32)

    def traced_refusal(self, device_type, dtype, head_dim, head_dim_v) -> Optional[str]:
        return None

    def grad_param_names(self, spec: Any) -> set:
        return set()
