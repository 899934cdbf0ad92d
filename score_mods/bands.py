"""Native bands: the causal masks' expressions and `band_of`, which recognizes them in a DAG.

A backend runs a mod that is exactly one of these masks as its own diagonal band (cuDNN then
skips masked tiles instead of computing and masking them). The library's `causal()` and
`causal_bottom_right()` are traced from the functions below.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

from .expr import kv_len, q_len, where
from .tracing import trace

_NEG_INF = -math.inf


def causal(score, b, h, q_idx, kv_idx):
    return where(kv_idx <= q_idx, score, _NEG_INF)


def causal_bottom_right(score, b, h, q_idx, kv_idx):
    return where(kv_idx <= q_idx + kv_len() - q_len(), score, _NEG_INF)


#: (expression, native band (left, right, bottom_right)) of each causal mask
_BANDS = ((trace(causal, {}), (None, 0, False)), (trace(causal_bottom_right, {}), (None, 0, True)))


def band_of(root: Any) -> Optional[Tuple[Optional[int], int, bool]]:
    """The native band (left, right, bottom_right) an expression graph is exactly equal to
    (structurally: the library's causal masks), or None."""
    for expression, band in _BANDS:
        if root == expression:
            return band
    return None
