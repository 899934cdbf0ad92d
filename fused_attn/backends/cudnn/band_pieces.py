"""Where a band is cut into rectangles and whether cutting pays (`band_chunks` runs the cuts).

In global positions query i sees key j iff lo <= j - i <= hi (lo = shift - left or unbounded,
hi = shift + right, shift = Skv - Sq for a bottom-right band, else 0). A rectangle at (q0, k0)
sees b - a in [lo - k0 + q0, hi - k0 + q0] in its own positions: a top-left band
`Band(k0 - q0 - lo, hi - k0 + q0)`, or the bottom-right one where a bound would be negative
(see `_piece`). Key chunks sit on multiples of cuDNN's 128-row tile, which keeps the backward's
key lengths off 64 mod 128 (cuDNN 9.19's NaN-dQ fault, see `backends/cudnn/dense.py`); the
forward's key ranges start where the band does. `strategy` estimates, per call, the GPU work a
cut saves against the host time it adds.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

from ...memo import BoundedMemo
from ...problem import Band

__all__ = ["Piece", "Pieces", "bounds", "plan_pieces", "strategy", "TILE", "PLAIN_NS_PER_SCORE_DIM",
           "PIECE_NS_PER_QUERY_ELEMENT", "HOST_NS_CALL", "HOST_NS_PER_PIECE", "RAGGED_NS_PER_QUERY_ELEMENT",
           "HOST_NS_RAGGED", "CAUSAL_CHUNKS", "WINDOW_CHUNK", "clear_memo"]

TILE = 128
#: The cost model (`strategy`), fitted to one H200 run of `benchmarks/band_strategies.py`
#: (softcap(50), bf16, D64: B2 H16/4 S4096 and B1 H16/4 S8192, causal and a 1024-token window,
#: each strategy forced; `benchmarks/results/band_strategies_h200.md`). GPU: the plain call's
#: forward and backward per (score x head dim), 0.596 ms and 1.008 ms over 2^29 scores x 64; a
#: rectangle's share in proportion to its area, plus a fixed cost per rectangle in proportion to
#: the query's elements (B * H * Sq * D: the backward's dO . O rows, lse and dQ traffic), ~16 us
#: forward and ~60 us backward at 2^23 elements (rectangles write into the call's out, lse, dK
#: and dV: no copies). Host, enqueued behind busy kernels: the plain call (forward; training call
#: with its backward) and per rectangle (forward without gradients; forward in a training call;
#: backward). A call's time is estimated as host + GPU time: inside a model the host is busy with
#: everything else too (a Gemma-2-style model at S4096 enqueues ~40 ms of host work per ~50 ms
#: step). Measured call by call, back to back, ms (plain -> query rectangles + plain backward ->
#: rectangles both ways): causal S4096 training 1.60 -> 1.42 -> 1.52, forward only 0.58 -> 0.39;
#: window S4096 training 1.89 -> 1.51 -> 1.48; causal S8192 3.05 -> 2.65 -> 2.19; window S8192
#: 3.65 -> 2.59 -> 1.75, forward only 1.49 -> 0.41.
PLAIN_NS_PER_SCORE_DIM = (0.596e6 / (2 ** 29 * 64), 1.008e6 / (2 ** 29 * 64))  # forward, backward
PIECE_NS_PER_QUERY_ELEMENT = (16e3 / 2 ** 23, 60e3 / 2 ** 23)  # forward, backward rectangle
HOST_NS_CALL = (70e3, 450e3)  # indexed by grad
HOST_NS_PER_PIECE = (40e3, 60e3, 150e3)  # forward rectangle without / with gradients; backward
#: The packed-window backward (`band_ragged`), from one H200 run of `benchmarks/band_strategies.py`
#: (window 1024, softcap, D64, 2^23 query elements at B4 S2048, B2 S4096 and B1 S8192): its two
#: graphs take the plain backward's time in proportion to their area plus ~350 us of fixed GPU
#: work per 2^23 query elements (the key gathers and fp32 key-gradient sums, two dO . O passes,
#: zeroed gradients; measured backward 0.68 / 0.78 / 0.82 ms against plain 0.63 / 1.15 / 2.17);
#: host: 425 us per backward against the plain backward's 64 us (two packed backward calls of
#: ~110 us each, the gathers and sums).
RAGGED_NS_PER_QUERY_ELEMENT = 350e3 / 2 ** 23
HOST_NS_RAGGED = 360e3
CAUSAL_CHUNKS = 4  # chunks of an unbounded (causal) band
WINDOW_CHUNK = 1024  # rows per chunk of a window band (at least the window, rounded to the tile)
_PIECES = BoundedMemo(256, "band_chunks.pieces")


class Piece(NamedTuple):
    """One rectangle: queries [q0, q1), keys [k0, k1), its own band in its own positions
    (None: no key of the rectangle is attended; its gradients are zero)."""

    q0: int
    q1: int
    k0: int
    k1: int
    band: Optional[Band]


class Pieces(NamedTuple):
    forward: Tuple[Piece, ...]  # query chunks covering [0, Sq)
    backward: Tuple[Piece, ...]  # key chunks covering [0, Skv)
    work: float  # the forward pieces' area over Sq * Skv
    backward_work: float = 1.0  # the backward pieces' area over Sq * Skv


def bounds(n: int, chunks: int) -> List[Tuple[int, int]]:
    """`chunks` ranges [(a, b), ...] covering [0, n), inner bounds on multiples of the tile."""
    cuts = sorted({min(n, -(-n * c // chunks) // TILE * TILE) for c in range(1, chunks)} - {0, n})
    edges = [0] + cuts + [n]
    return list(zip(edges[:-1], edges[1:]))


def _limits(band: Band, sq: int, skv: int) -> Tuple[Optional[int], int]:
    """(lo, hi): query i sees key j iff lo <= j - i <= hi (lo None: unbounded)."""
    shift = skv - sq if band.bottom_right else 0
    return (None if band.left is None else shift - band.left), shift + band.right


def _piece(q0: int, q1: int, k0: int, k1: int, lo: Optional[int], hi: int) -> Optional[Piece]:
    """The rectangle with its own band (top-left, else bottom-right aligned), or None when
    neither alignment holds it with non-negative bounds."""
    low, high = (None if lo is None else lo - k0 + q0), hi - k0 + q0  # b - a in [low, high]
    for shift in (0, (k1 - k0) - (q1 - q0)):
        left, right = (None if low is None else shift - low), high - shift
        if right >= 0 and (left is None or left >= 0):
            return Piece(q0, q1, k0, k1, Band(left, right, shift != 0))
    return None


def plan_pieces(band: Band, sq: int, skv: int) -> Optional[Pieces]:
    """The forward and backward rectangles of a (Sq, Skv) call with `band`, or None when the
    band leaves a query row without keys or cannot be cut into non-negative bands (memoized)."""
    key = (band, sq, skv)
    hit = _PIECES.get(key)
    if hit is None:
        hit = (_plan(band, sq, skv),)
        _PIECES.put(key, hit)
    return hit[0]


def _plan(band: Band, sq: int, skv: int) -> Optional[Pieces]:
    lo, hi = _limits(band, sq, skv)
    if hi < 0 or (lo is not None and sq - 1 + lo > skv - 1) or sq < TILE or skv < TILE:
        return None  # a row with no key: the plain path defines that output
    if lo is None:
        q_chunks, k_chunks = bounds(sq, CAUSAL_CHUNKS), bounds(skv, CAUSAL_CHUNKS)
    else:
        size = max(WINDOW_CHUNK, -(-(hi - lo + 1) // TILE) * TILE)
        q_chunks, k_chunks = bounds(sq, max(1, -(-sq // size))), bounds(skv, max(1, -(-skv // size)))
    forward, area = [], 0
    for q0, q1 in q_chunks:
        k0 = 0 if lo is None else max(0, q0 + lo)  # exact: a rounded start needs a negative bound
        k1 = min(skv, q1 + hi)
        piece = _piece(q0, q1, k0, k1, lo, hi)
        if piece is None or k1 <= k0:
            return None
        forward.append(piece)
        area += (q1 - q0) * (k1 - k0)
    backward, back_area = [], 0
    for k0, k1 in k_chunks:
        q0 = max(0, k0 - hi)
        q1 = sq if lo is None else min(sq, k1 - lo)
        if q1 <= q0:  # no query reaches these keys
            backward.append(Piece(q0, q0, k0, k1, None))
            continue
        piece = _piece(q0, q1, k0, k1, lo, hi)
        if piece is None:
            return None
        backward.append(piece)
        back_area += (q1 - q0) * (k1 - k0)
    return Pieces(tuple(forward), tuple(backward), area / (sq * skv), back_area / (sq * skv))


def strategy(pieces: Pieces, scores: int, head_dim: int, grad: bool, query_elements: int,
             ragged: Optional[float] = None) -> Optional[str]:
    """How to run a call of `scores` (B * H * Sq * Skv) whose band cuts into `pieces`: None (the
    plain call), "forward" (query rectangles; with gradients, the plain backward from their
    stitched output and lse), "both" (query rectangles forward, key rectangles backward) or
    "ragged" (query rectangles forward, the packed-window backward of `band_ragged`, offered when
    `ragged` gives its area over Sq * Skv). query_elements: B * H * Sq * D. Each is estimated
    as host + GPU time (see PLAIN_NS_PER_SCORE_DIM); ties keep the plain call."""
    work = scores * head_dim
    g_fwd, g_bwd = work * PLAIN_NS_PER_SCORE_DIM[0], (work * PLAIN_NS_PER_SCORE_DIM[1] if grad else 0.0)
    nf, nb = len(pieces.forward), len(pieces.backward)
    cut_fwd = pieces.work * g_fwd + nf * query_elements * PIECE_NS_PER_QUERY_ELEMENT[0]
    host = HOST_NS_CALL[grad] + nf * HOST_NS_PER_PIECE[1 if grad else 0]
    options = {None: HOST_NS_CALL[grad] + g_fwd + g_bwd, "forward": host + cut_fwd + g_bwd}
    if grad:
        cut_bwd = pieces.backward_work * g_bwd + nb * query_elements * PIECE_NS_PER_QUERY_ELEMENT[1]
        options["both"] = host + nb * HOST_NS_PER_PIECE[2] + cut_fwd + cut_bwd
        if ragged is not None:
            options["ragged"] = (host + HOST_NS_RAGGED + cut_fwd + ragged * g_bwd
                                 + query_elements * RAGGED_NS_PER_QUERY_ELEMENT)
    return min(options, key=options.__getitem__)


def clear_memo() -> None:
    """Forget the memoized cuts (after changing a threshold)."""
    _PIECES.clear()
