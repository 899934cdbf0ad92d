"""The cuDNN engine behind the engine contract (`fused_attn.engines`): cuDNN frontend SDPA graphs
for CUDA fp16 / bf16 problems, with every cuDNN-only strategy (band rectangles, packed windows,
packed-as-dense, padded-as-packed, token-sized backwards) and the versioned quirks inside this
package."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from .. import cudnn as package  # its functions looked up per call (tests stand in for them)
from . import band_chunks, version

__all__ = ["ENGINE", "CudnnEngine"]

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


class CudnnEngine:
    name = "cudnn"
    auto_devices: Tuple[str, ...] = ("cuda",)
    #: a training call's backward beside another engine's forward (`engines`): every runner's
    #: `backward_with_lse` gives the whole backward from out and lse (its Stats layouts vary by
    #: strategy, so it offers no forward half)
    split_halves: Tuple[str, ...] = ("backward",)

    def unavailable(self) -> Optional[str]:
        return version.unavailable_reason()

    def refusal(self, problem: Any) -> Optional[str]:
        return package.refusal(problem)

    def make_runner(self, problem: Any) -> Any:
        return package.make_runner(problem)

    def saved_shape(self, make_problem: Any, query_rows: int) -> Tuple[int, ...]:
        return package.saved_shape(make_problem(), query_rows)

    def op_saved(self, saved: tuple, query: torch.Tensor) -> torch.Tensor:
        """The tensor the compiled op hands its backward: a copy of the forward's fp32 Stats."""
        return saved[4].clone()

    def traced_refusal(self, device_type: str, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> Optional[str]:
        if device_type != "cuda":
            return f"the cuDNN engine needs CUDA tensors, got {device_type}"
        if dtype not in _DTYPES:
            return f"the cuDNN engine takes float16 or bfloat16, got {dtype}"
        if any(d % 8 or d > _MAX_HEAD_DIM for d in (head_dim, head_dim_v)):
            return f"the cuDNN engine needs head dims that are multiples of 8 and <= {_MAX_HEAD_DIM}"
        return None

    def grad_param_names(self, spec: Any) -> set:
        """The tensor parameters of the mod's additive bias term (cuDNN's dBias)."""
        from .lowering import split

        _, bias_part = split(spec.score_mod)
        return set() if bias_part is None else set(bias_part.tensors())

    def route(self, spec: Any, mod: Any, query: Any, key: Any, value: Any, sinks: Optional[torch.Tensor],
              sig: tuple) -> Any:
        """Rectangles of a band (`band_chunks`) as run(spec, mod, q, k, v, sinks), or the plain plan."""
        if not spec.may_cut_band:
            return None
        how = band_chunks.route(spec, mod, query, key, value, sinks, sig)
        if isinstance(how, band_chunks.Call):
            return lambda s, m, q, k, v, sk: band_chunks.run_call(how, s, m, q, k, v, sk)
        return how

    def clear_memos(self) -> None:
        band_chunks.clear_memos()


ENGINE = CudnnEngine()
