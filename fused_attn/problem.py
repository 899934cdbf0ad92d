"""The vocabulary every layer shares about a problem: the accepted formats and mask types, and the
`Band` of keys each query may attend (validation resolves the user's arguments into it; engines
read it from the spec).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
