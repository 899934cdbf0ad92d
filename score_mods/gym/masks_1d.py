"""1-D masks of attention-gym: causal, sliding windows (plain, dilated, Longformer global), prefix LM."""

from __future__ import annotations

import score_mods as sm

from ..base import ScoreMod
from .common import IntSeq, _int, _ints, _mask

__all__ = ["causal", "sliding_window", "dilated_sliding_window", "global_sliding_window", "prefix_lm"]


def causal() -> ScoreMod:
    """Causal mask (attention-gym ``causal_mask``): query i attends keys j <= i (top-left).

    Mask of ``causal()`` (Sq = 4, Skv = 6):

        x . . . . .
        x x . . . .
        x x x . . .
        x x x x . .

    This is the library's ``score_mods.causal()``, which runs as cuDNN's native causal band.
    """
    return sm.causal()


def sliding_window(window: int) -> ScoreMod:
    """Causal sliding window (``generate_sliding_window``): i - window <= j <= i, so each query
    sees itself and the `window` keys before it. `window` is the runtime scalar `left`
    (``sliding_window(2).bind(left=5)``).

    Mask of ``sliding_window(2)`` (Sq = 6, Skv = 6):

        x . . . . .
        x x . . . .
        x x x . . .
        . x x x . .
        . . x x x .
        . . . x x x

    The library's ``sliding_window(window, 0)``: it runs as cuDNN's native band.
    """
    window = _int("sliding_window", "window", window, 0)
    mod = sm.sliding_window(window, 0)
    out = mod.renamed("sliding_window")
    out._name_fn = lambda v: f"sliding_window_{int(v['left'])}"
    out.native_band = mod.native_band
    return out


def dilated_sliding_window(window: int, dilation: int) -> ScoreMod:
    """Dilated window (``generate_dilated_sliding_window``): |i - j| <= window and |i - j| is a
    multiple of `dilation`. `window` is a runtime int; `dilation` is structure (it is in a %).

    Mask of ``dilated_sliding_window(4, 2)`` (Sq = 7, Skv = 7):

        x . x . x . .
        . x . x . x .
        x . x . x . x
        . x . x . x .
        x . x . x . x
        . x . x . x .
        . . x . x . x
    """
    window = _int("dilated_sliding_window", "window", window, 0)
    dilation = _int("dilated_sliding_window", "dilation", dilation)

    def dilated_sliding_window(b, h, q_idx, kv_idx, window=0):
        dist = (q_idx - kv_idx).abs()
        return (dist <= window) & (dist % dilation == 0)

    return _mask(lambda v: f"dilated_sliding_window_{v['window']}_d{dilation}", dilated_sliding_window, window=window)


def global_sliding_window(window: int, is_global: IntSeq) -> ScoreMod:
    """Longformer (``generate_global_sliding_window``): |i - j| <= window, or either token is
    global. is_global: (S,) bools or 0/1 ints, a bool tensor parameter (Sq = Skv = S); `window` is
    a runtime int.

    Mask of ``global_sliding_window(1, [0, 0, 0, 1, 0, 0])`` (Sq = 6, Skv = 6):

        x x . x . .
        x x x x . .
        . x x x . .
        x x x x x x
        . . . x x x
        . . . x x x
    """
    window = _int("global_sliding_window", "window", window, 0)
    flags = _ints("global_sliding_window", "is_global", is_global)

    def global_sliding_window(b, h, q_idx, kv_idx, window=0, is_global=sm.TensorParam("bool")):
        return ((q_idx - kv_idx).abs() <= window) | is_global[q_idx] | is_global[kv_idx]

    return _mask(lambda v: f"global_sliding_window_{v['window']}", global_sliding_window, window=window,
                 is_global=flags != 0)


def prefix_lm(prefix_length: int) -> ScoreMod:
    """Prefix LM (``generate_prefix_lm_mask``): every query sees the first `prefix_length` keys,
    and keys j <= i (causal). `prefix` is a runtime int.

    Mask of ``prefix_lm(3)`` (Sq = 6, Skv = 6):

        x x x . . .
        x x x . . .
        x x x . . .
        x x x x . .
        x x x x x .
        x x x x x x
    """
    n = _int("prefix_lm", "prefix_length", prefix_length, 0)

    def prefix_lm(b, h, q_idx, kv_idx, prefix=0):
        return (kv_idx < prefix) | (kv_idx <= q_idx)

    return _mask(lambda v: f"prefix_lm_{v['prefix']}", prefix_lm, prefix=n)
