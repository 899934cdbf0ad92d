"""Keys that no query attends: a dense call with a causal or windowed band skips them.

Query i of a dense call with band (left, right, alignment) attends keys j with
-left <= j - (i + shift) <= right (shift = Skv - Sq bottom-right, 0 top-left), so the keys some
query attends are [shift - left, Sq - 1 + shift + right], clipped to [0, Skv). E.g. top-left
causal with Sq = 3, Skv = 6 attends keys [0, 3); keys 3..5 are never read:

    q\\k 0 1 2 3 4 5
    0   x . . . . .
    1   x x . . . .
    2   x x x . . .

The kernels load whole tiles, so a NaN or Inf in such a key or value (padding is often
uninitialised memory) would reach rows that never attend it; running the call on the attended
keys alone (views, no copy) keeps them out and saves their work. The cut keeps the band's
alignment: top-left bands only lose keys at the end, bottom-right ones only at the start.
Gradients of the skipped keys are 0 (autograd's view backward).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .problem import Band

__all__ = ["attended_key_range", "trim_unattended_keys"]

_SEQ_AXIS = {"bshd": 1, "sbhd": 0, "bhsd": 2}


def attended_key_range(band: Band, seqlen_q: int, seqlen_kv: int) -> Tuple[int, int]:
    """[lo, hi): the keys at least one of `seqlen_q` queries attends under `band`."""
    shift = seqlen_kv - seqlen_q if band.bottom_right else 0
    lo = 0 if band.left is None else shift - band.left
    hi = seqlen_kv if band.right is None else seqlen_q + shift + band.right
    return max(0, min(lo, seqlen_kv)), max(0, min(hi, seqlen_kv))


def trim_unattended_keys(qkv_format: str, band: Optional[Band], query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(key, value) narrowed to the attended keys of a dense call (the same tensors if all are)."""
    axis = _SEQ_AXIS[qkv_format]
    sq, skv = query.shape[axis], key.shape[axis]
    lo, hi = attended_key_range(band, sq, skv)
    if (lo, hi) == (0, skv) or hi <= lo:  # all attended, or none (empty rows are served as such)
        return key, value
    return key.narrow(axis, lo, hi - lo), value.narrow(axis, lo, hi - lo)
