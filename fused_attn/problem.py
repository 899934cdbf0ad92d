"""The normalized attention problem: what every backend receives after validation.

`functional.py` validates the user's arguments and turns them into one `AttentionProblem`;
backends (`backends/reference.py`, `backends/cudnn/`) read only this object. Nothing here
copies data: dense tensors are logical (B, H, S, D) *views* of the caller's memory.

Shape legend:
    B: batch (number of sequences)      H / Hkv: query / key-value heads (H % Hkv == 0)
    Sq / Skv: (max) query / key length  D / Dv: query-key / value head dim
    Tq / Tkv: total packed tokens (thd)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from score_mods.base import ScoreMod

QKV_FORMATS = ("bshd", "sbhd", "bhsd", "thd")
MASK_TYPES = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal")


@dataclass(frozen=True)
class Band:
    """The diagonal band of keys each query may attend to.

    Query i (0-based, within its own sequence) may attend key j iff

        -left <= j - (i + shift) <= right

    with shift = 0 for top-left alignment and shift = kv_len - q_len for bottom-right
    alignment (lengths of that sequence). `None` means unbounded on that side.
    causal (top-left) is Band(None, 0, False); a sliding window (left, right) of
    flash-attention is Band(left, right, ...). Example, Sq = Skv = 4, Band(1, 0, False):

        q\\k 0 1 2 3
        0   x . . .
        1   x x . .
        2   . x x .
        3   . . x x
    """

    left: Optional[int]
    right: Optional[int]
    bottom_right: bool = False


@dataclass
class AttentionProblem:
    """One attention call, normalized.

    Dense formats (bshd, sbhd, bhsd): query (B, H, Sq, D), key (B, Hkv, Skv, D),
    value (B, Hkv, Skv, Dv), logical views of the caller's tensors (strides keep the layout).
    thd: query (Tq, H, D), key (Tkv, Hkv, D), value (Tkv, Hkv, Dv) plus cu_seqlens_*.

    Per-sequence lengths:
      * dense + padding mask types: seqlens_q / seqlens_kv (B,) int32 on the query's device;
        positions past a sequence's length produce output 0 and get no gradient.
      * thd: cu_seqlens_q / cu_seqlens_kv (B+1,) int32 give the lengths; the token offset of
        sequence b is cu_seqlens_*_padded[b] when given (gaps between sequences), else
        cu_seqlens_*[b]. max_seqlen_q / max_seqlen_kv are host ints >= every length.

    sinks: (H,) logits of one extra key per head with no value (attention sinks), or None.
    fixed_lse: a given log-sum-exp (B, H, Sq) / (H, Tq) — the reference then computes the
    *partial* attention exp(score - fixed_lse) V and the row sums of those weights (used to
    differentiate one chunk of a larger attention whose normalizer is known, e.g. context
    parallelism), instead of the softmax.
    dropout: (p, seed) — attention weights dropped with probability p and the kept ones scaled
    by 1/(1-p), the mask drawn from a generator seeded with `seed` (so a recompute redraws it).

    Outputs: out has the query's format with Dv (contiguous in that format);
    lse is fp32 (B, H, Sq) for dense and (H, Tq) for thd (sink included), -inf on rows with no
    allowed key and no sink.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    qkv_format: str
    scale: float
    band: Optional[Band] = None
    seqlens_q: Optional[torch.Tensor] = None
    seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    score_mod: Optional["ScoreMod"] = None
    return_lse: bool = False
    deterministic: bool = False
    sinks: Optional[torch.Tensor] = None
    fixed_lse: Optional[torch.Tensor] = None
    dropout: Optional[tuple] = None

    @property
    def is_packed(self) -> bool:
        return self.qkv_format == "thd"

    @property
    def has_lengths(self) -> bool:
        """True when sequences have their own lengths (thd, or a padding mask type)."""
        return self.is_packed or self.seqlens_q is not None
