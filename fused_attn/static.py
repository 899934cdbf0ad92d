"""The facts a call plan is made of, shared by the planner and the engines (the lowest layer the
engines import): `Varlen` (per-call length arguments), `StaticProblem` (a call's spec and the
facts of its tensors a plan depends on), `Refusal` (an engine cannot run a problem),
`bucket` (the max_seqlen graph size) and `mod_signature` (a score_mod's tensor parameters'
descriptions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Tuple

import torch

from .spec import AttentionSpec

__all__ = ["Refusal", "Varlen", "NO_VARLEN", "StaticProblem", "bucket", "mod_signature"]


class Refusal(Exception):
    """A backend cannot run a problem; the message is the reason."""


class Varlen(NamedTuple):
    """Per-call length arguments (all None for plain dense calls)."""

    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None


NO_VARLEN = Varlen()


@dataclass(frozen=True)
class StaticProblem:
    """A call's spec and the facts of its tensors that its plan depends on.

    Logical dims: B (sequences), H / Hkv heads, D / Dv head dims. Dense: seqlen_q / seqlen_kv are
    Sq / Skv and q/k/v_strides the logical (B, H, S, D) strides of the caller's tensors. thd:
    seqlen_q / seqlen_kv are the max_seqlen buckets (None when max_seqlen is not given: derived
    per call) and the strides those of the packed (T, H, D) tensors. mod_tensors: (name, shape,
    stride, dtype, device, requires_grad) of the score_mod's tensor parameters. sinks: (H,) fp32
    learnable sink logits given (softmax_type="learnable").
    """

    spec: AttentionSpec
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: Optional[int]
    seqlen_kv: Optional[int]
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    q_strides: Tuple[int, ...]
    k_strides: Tuple[int, ...]
    v_strides: Tuple[int, ...]
    scale: float
    needs_grad: bool
    aligned: bool
    same_lengths: bool
    q_offsets: bool
    kv_offsets: bool
    mod_tensors: tuple
    sinks: bool

    @property
    def is_packed(self) -> bool:
        return self.spec.is_packed

    @property
    def has_lengths(self) -> bool:
        return self.spec.is_packed or self.spec.padding

    def describe(self) -> str:
        shape = (f"B={self.batch} H={self.heads} Hkv={self.kv_heads} Sq={self.seqlen_q} Skv={self.seqlen_kv} "
                 f"D={self.head_dim} Dv={self.head_dim_v}")
        return f"{self.spec.describe()}; {shape} {str(self.dtype).replace('torch.', '')} on {self.device}"


def mod_signature(mod: Any) -> tuple:
    """(name, shape, stride, dtype, device, requires_grad) of each tensor parameter of `mod`."""
    if mod is None:
        return ()
    tensors = mod.tensors()
    if not tensors:
        return ()
    return tuple((name, t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for name, t in tensors.items())


def bucket(n: Optional[int]) -> Optional[int]:
    """The graph size serving max_seqlen n: the next power of two, at least 128 (None stays None)."""
    if n is None:
        return None
    return 128 if n <= 128 else 1 << (n - 1).bit_length()
