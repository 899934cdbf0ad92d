"""The flash-attn-4 engine behind the engine contract (`fused_attn.engines`): FA4's CuTe DSL
kernels for CUDA fp16 / bf16 problems on sm90 / sm100, an optional extra
(`pip install 'fused_attn[fa4]'`). Without the package every call runs as before and `explain`
says why FA4 was not used."""

from __future__ import annotations

import threading
from typing import Any, Optional, Tuple

import torch

from ...static import Refusal
from . import install, support

__all__ = ["ENGINE", "Fa4Engine"]


class Fa4Engine:
    name = "fa4"
    auto_devices: Tuple[str, ...] = ("cuda",)
    #: a training call's forward or backward beside another engine (`engines`: the runner has
    #: `forward_lse` and a whole backward from out and lse)
    split_halves: Tuple[str, ...] = ("forward", "backward")

    def __init__(self) -> None:
        # the last (problem, decision) of this thread: `make_runner` follows `refusal` for the same
        # problem when a plan is built, and the decision (it writes the score_mod's CuTe source)
        # is made once; one slot per thread, so no lock and no growth
        self._last = threading.local()

    def _decide(self, problem: Any) -> Any:
        last = getattr(self._last, "pair", None)
        if last is not None and last[0] is problem:
            return last[1]
        got = support.decide(problem, install.arch(problem.device)[0])
        self._last.pair = (problem, got)
        return got

    def unavailable(self) -> Optional[str]:
        return install.unavailable()

    def refusal(self, problem: Any) -> Optional[str]:
        if problem.device.type != "cuda":
            return f"the FA4 engine needs CUDA tensors, got {problem.device.type}"
        if not torch.cuda.is_available():
            return "the FA4 engine needs a CUDA GPU (none is available)"
        why = install.arch_refusal(problem.device)
        if why:
            return why
        got = self._decide(problem)
        return got if isinstance(got, str) else None

    def make_runner(self, problem: Any) -> Any:
        from .runner import Fa4Runner

        got = self._decide(problem)
        self._last.pair = None  # the runner holds the decision; the slot keeps no problem alive
        if isinstance(got, str):
            raise Refusal(got)
        return Fa4Runner(problem, got)

    def saved_shape(self, make_problem: Any, query_rows: int) -> Tuple[int, ...]:
        """The forward's lse: (B, H, Sq) dense, (H, Tq) thd."""
        problem = make_problem()
        if problem.spec.is_packed:
            return (problem.heads, query_rows)
        return (problem.batch, problem.heads, problem.seqlen_q)

    def op_saved(self, saved: tuple, query: torch.Tensor) -> torch.Tensor:
        return saved[4].clone()

    def traced_refusal(self, device_type: str, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> Optional[str]:
        # what FA4 serves depends on the band, the lengths and the score_mod: unknown from these facts
        return "the FA4 engine is chosen per call plan, not at trace time (pass backend='fa4' to force it)"

    def grad_param_names(self, spec: Any) -> set:
        return set()  # score_mod tensor parameters that need gradients are refused


ENGINE = Fa4Engine()
