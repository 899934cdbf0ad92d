"""score_mods under context parallelism: which read positions, and global positions for those that do.

Each context-parallel call sees a slice of the sequence, so a score_mod's q_idx / kv_idx are
local. A mod that never reads positions (softcap, a per-head tensor) runs as is, on any backend.
A mod that does (causal or ALiBi written as a score_mod, a bias indexed by q_idx / kv_idx, mods
reading q_len / kv_len) needs the global positions:

    q_idx_global = q_idx + q_offset,  kv_idx_global = kv_idx + kv_offset,
    q_len / kv_len = the global lengths

Dense layouts: one offset per block call, so a traced mod becomes `score_mods.positions.at_positions`
(int parameters bound per call: every backend, one cuDNN graph for all blocks, ranks and steps).
Packed (thd) layouts: the offsets are per sequence (chunk id * that sequence's chunk length),
(B,) tensors; `OffsetMod` serves those (and mods that are not traced) on the reference backend
only: cuDNN engines read per-sequence (B, 1, 1, 1) operands of ragged graphs wrongly (measured on
H100, benchmarks/results/frontend_probe_h100.md).
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, Optional, Union

import torch
from score_mods.base import ScoreMod
from score_mods.positions import at_positions
from score_mods.trace import TracedMod

from .sharding import index_uses, tensor_axes

__all__ = ["reads_positions", "OffsetMod", "offset_mod"]


def reads_positions(mod: Any) -> bool:
    """True when the mod's value depends on q_idx, kv_idx, q_len or kv_len (also through a
    tensor parameter indexed by them). Mods whose index use is unknown count as reading them."""
    if mod is None:
        return False
    uses, axes = index_uses(mod), tensor_axes(mod)
    if uses is None or axes is None:
        return True
    if uses & {"q_idx", "kv_idx", "length"}:
        return True
    return any(a in ("q_idx", "kv_idx") for ax in axes.values() for a in ax)


Offset = Union[int, torch.Tensor]


def _at(offset: Offset, b: torch.Tensor) -> Any:
    """An offset for the batch indices b: an int, or a (B,) tensor of per-sequence values."""
    if isinstance(offset, torch.Tensor):
        return offset.to(b.device)[b]
    return offset


class OffsetMod(ScoreMod):
    """`inner` evaluated at global positions: q_idx + q_offset, kv_idx + kv_offset, lengths q_len /
    kv_len. Offsets and lengths are ints or (B,) int64 tensors indexed by the sequence (thd).
    Reference backend only (no cuDNN lowering: see the module docstring)."""

    def __init__(self, inner: ScoreMod, q_offset: Offset, kv_offset: Offset, q_len: Offset, kv_len: Offset,
                 max_len: tuple) -> None:
        self.inner = inner
        self.q_offset, self.kv_offset, self.q_len, self.kv_len = q_offset, kv_offset, q_len, kv_len
        self.max_len = max_len  # global (max) query / key lengths: what tensor parameters must cover
        self.name = f"{inner.name}@cp"
        self.specs = inner.specs  # the reference binds gradient leaves through these names

    @property
    def cache_key(self) -> Hashable:
        return ("cp_offset", self.inner.cache_key)

    @property
    def has_reference(self) -> bool:
        return self.inner.has_reference

    @property
    def has_backward(self) -> bool:
        return False

    @property
    def uses_lengths(self) -> bool:
        return self.inner.uses_lengths

    def scalars(self) -> Dict[str, float]:
        return self.inner.scalars()

    def tensors(self) -> Dict[str, torch.Tensor]:
        return self.inner.tensors()

    def scalar_tensor(self) -> torch.Tensor:
        return self.inner.scalar_tensor()

    def bind(self, **params: Any) -> "OffsetMod":
        return OffsetMod(self.inner.bind(**params), self.q_offset, self.kv_offset, self.q_len, self.kv_len,
                         self.max_len)

    def rebind(self, scalars: Dict[str, float], tensors: Dict[str, torch.Tensor]) -> "OffsetMod":
        return self.bind(**scalars, **tensors)

    def check(self, *, device: torch.device, batch: int, heads: int, seqlen_q: int, seqlen_kv: int) -> None:
        """Tensor parameters are checked against the global lengths (they are indexed globally)."""
        self.inner.check(device=device, batch=batch, heads=heads, seqlen_q=self.max_len[0],
                         seqlen_kv=self.max_len[1])

    def eager(self, score, b, h, q_idx, kv_idx, q_len, kv_len) -> torch.Tensor:
        qo, ko = _at(self.q_offset, b), _at(self.kv_offset, b)
        gq, gk = _at(self.q_len, b), _at(self.kv_len, b)
        return self.inner.eager(score, b, h, q_idx + qo, kv_idx + ko, gq, gk)

    @property
    def cudnn_unsupported(self) -> Optional[str]:
        return (f"score_mod {self.name!r}: position-dependent score_mods under context parallelism run on the "
                "reference backend only when the offsets are per sequence (thd) or the mod is not traced")

    def lower_forward(self, graph: Any, score: Any, operands: Any, memo: Any) -> Any:
        raise NotImplementedError(self.cudnn_unsupported)

    def __repr__(self) -> str:
        return f"<ScoreMod {self.name} q+{self.q_offset!r} kv+{self.kv_offset!r}>"


def offset_mod(mod: Optional[ScoreMod], q_offset: Offset, kv_offset: Offset, q_len: Offset, kv_len: Offset,
               max_len: tuple) -> Optional[ScoreMod]:
    """`mod` at global positions, or `mod` itself when it does not read positions: a traced mod
    with int offsets becomes a positioned TracedMod (every backend), anything else an OffsetMod."""
    if mod is None or not reads_positions(mod):
        return mod
    if isinstance(mod, TracedMod) and all(isinstance(v, int) for v in (q_offset, kv_offset, q_len, kv_len)):
        return at_positions(mod, q_offset, kv_offset, q_len, kv_len)
    return OffsetMod(mod, q_offset, kv_offset, q_len, kv_len, max_len)
