"""A causal or windowed score_mod call served as rectangles of the band, on cuDNN.

cuDNN 9.19 declines its own band (causal, sliding window) next to a score_mod callback
(measured on H200), so the band becomes a select inside the callback and the kernel computes
every (query tile, key tile) pair: twice the causal triangle, S / W times a window W. Here the
band is cut into rectangles, each a complete sub-attention with a band of its own:

* forward: query chunks [q0, q1), each over the keys [k0, k1) its rows can reach;
* backward: key chunks [k0, k1), each with the queries [q0, q1) that reach them, from the
  forward's output and log-sum-exp (cuDNN's backward reads exactly O and Stats, so a key
  subset with the full rows' lse gives that subset's exact dK, dV and its share of dQ).

In global positions query i sees key j iff lo <= j - i <= hi (lo = shift - left or unbounded,
hi = shift + right, shift = Skv - Sq for a bottom-right band, else 0). A rectangle at (q0, k0)
sees b - a in [lo - k0 + q0, hi - k0 + q0] in its own positions: a top-left band
`Band(k0 - q0 - lo, hi - k0 + q0)`, or the bottom-right one where a bound would be negative
(see `_piece`). Key chunks sit on multiples of cuDNN's 128-row tile, which keeps the backward's
key lengths off 64 mod 128 (cuDNN 9.19's NaN-dQ fault, see `backends/cudnn/dense.py`); the
forward's key ranges start where the band does.

Exact only when the score_mod reads no position and no length (they would be the
rectangle's) and indexes no tensor by position; dense layouts without padding or dropout;
no trained score_mod tables or sinks (their gradients are not split). Whether it pays is
estimated per call signature from the work it saves and the host time it adds (`pays`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from .autograd import attention, check_mod_unchanged
from .memo import BoundedMemo
from .plan import NO_VARLEN, call_signature, get_plan, signature_records_grad
from .problem import Band
from .spec import AttentionSpec

__all__ = ["Piece", "Pieces", "eligible", "bounds", "plan_pieces", "run_in_pieces", "BandChunks",
           "pays", "PLAIN_NS_PER_SCORE_DIM", "HOST_NS_PER_PIECE", "clear_memos", "CAUSAL_CHUNKS", "WINDOW_CHUNK"]

TILE = 128
#: When cutting pays: the GPU time the rectangles save against the host time they add, both
#: from one H200 run (softcap(50), bf16, B2 H16/4 S4096 D64; the host of that machine). The
#: plain call's GPU time per (score x head dim), forward / forward + backward: 0.575 ms and
#: 1.55 ms over 2^29 scores x 64. Host time per rectangle: ~90 us in a forward without
#: gradients, ~250 us per rectangle of a training call (its forward and backward rectangles,
#: their copies and the autograd node). GPU ms plain -> rectangles measured there: causal
#: forward 0.58 -> 0.42, forward + backward 1.55 -> 1.35 (host 0.7 -> 2.1 ms); a 1024-token
#: window 0.74 -> 0.38 and 1.83 -> 1.19; that window at B1 S8192 1.46 -> 0.42 and 3.57 -> 1.21.
#: A call is cut only when the estimated saving exceeds the added host time, so a host-bound
#: loop (a training step of a small model) never pays for it.
PLAIN_NS_PER_SCORE_DIM = (0.575e6 / (2 ** 29 * 64), 1.55e6 / (2 ** 29 * 64))  # indexed by grad
HOST_NS_PER_PIECE = (90e3, 250e3)  # indexed by grad
CAUSAL_CHUNKS = 4  # chunks of an unbounded (causal) band
WINDOW_CHUNK = 1024  # rows per chunk of a window band (at least the window, rounded to the tile)
_SEQ_DIM = {"bshd": 1, "sbhd": 0, "bhsd": 2}
_ELIGIBLE = BoundedMemo(128, "band_chunks.eligible")
_PIECES = BoundedMemo(256, "band_chunks.pieces")
_SPECS = BoundedMemo(512, "band_chunks.spec")
_CALLS = BoundedMemo(256, "band_chunks.calls")  # call signature -> (_Call or None,)


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


def eligible(spec: AttentionSpec) -> bool:
    """Whether `spec` is a banded score_mod call that rectangles serve exactly (memoized)."""
    hit = _ELIGIBLE.get(spec)
    if hit is None:
        hit = _eligible(spec)
        _ELIGIBLE.put(spec, hit)
    return hit


def _eligible(spec: AttentionSpec) -> bool:
    band = spec.band
    if (spec.score_mod is None or band is None or band.right is None or spec.qkv_format not in _SEQ_DIM
            or spec.padding or spec.dropout_p or spec.backend == "reference"):
        return False
    from .distributed.sharding import index_uses, tensor_axes

    uses, axes = index_uses(spec.score_mod), tensor_axes(spec.score_mod)
    if uses is None or axes is None or uses & {"q_idx", "kv_idx", "length"}:
        return False
    return not any(a in ("q_idx", "kv_idx") or a is None for ax in axes.values() for a in ax)


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
    backward = []
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
    return Pieces(tuple(forward), tuple(backward), area / (sq * skv))


def pays(pieces: Pieces, scores: int, head_dim: int, grad: bool) -> bool:
    """Whether cutting a call of `scores` (B * H * Sq * Skv) is estimated to save more GPU time
    than the host time its rectangles add (see PLAIN_NS_PER_SCORE_DIM, HOST_NS_PER_PIECE)."""
    saving = (1.0 - pieces.work) * scores * head_dim * PLAIN_NS_PER_SCORE_DIM[grad]
    count = len(pieces.forward) + (len(pieces.backward) if grad else 0)
    return saving > count * HOST_NS_PER_PIECE[grad]


def piece_spec(spec: AttentionSpec, band: Band) -> AttentionSpec:
    """The spec of one rectangle: the call's with the rectangle's band, returning its lse."""
    key = (spec, band)
    hit = _SPECS.get(key)
    if hit is None:
        hit = dataclasses.replace(spec, attn_mask_type="no_mask", band=band, return_lse=True)
        _SPECS.put(key, hit)
    return hit


def _trains_extras(mod: Any, sinks: Optional[torch.Tensor]) -> bool:
    """Gradients other than dq, dk, dv asked for (score_mod tables, sinks): not served here."""
    if sinks is not None and sinks.requires_grad:
        return True
    tensors = mod.tensors() if hasattr(mod, "tensors") else {}
    return any(t.requires_grad for t in tensors.values())


def _views(p: Piece, seq: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """The rectangle's query rows and key / value rows (views)."""
    return (query.narrow(seq, p.q0, p.q1 - p.q0), key.narrow(seq, p.k0, p.k1 - p.k0),
            value.narrow(seq, p.k0, p.k1 - p.k0))


def run_in_pieces(spec: AttentionSpec, mod: Any, query: Any, key: Any, value: Any,
                  sinks: Optional[torch.Tensor], sig: Optional[tuple] = None):
    """out (and lse, (B, H, Sq)) of `spec` computed rectangle by rectangle, or None when the
    call does not qualify or would not gain (the caller then runs the plain path). `sig`: the
    call's `plan.call_signature` when the caller has it (it is the plain path's plan key too).
    What to run is decided once per signature and memoized with the rectangles' runners: a
    repeated call does one lookup, then the kernels."""
    if sig is None:
        if not eligible(spec):
            return None
        sig = call_signature(spec, query, key, value, NO_VARLEN, mod, sinks)
        if sig is None:
            return None  # the plain path validates and names the argument
    hit = _CALLS.get(sig)  # the key holds the spec: an ineligible one is memoized as "not served" too
    if hit is None:
        served = eligible(spec)
        hit = (_make_call(spec, mod, query, key, value, sinks, grad=signature_records_grad(sig)) if served else None,)
        _CALLS.put(sig, hit)
    call = hit[0]
    if call is None:
        return None
    if call.backward:
        out, lse = BandChunks.apply(call, mod, sinks, query, key, value)
    else:
        out, lse = _forward(call, query, key, value, mod, sinks)
    return (out, lse) if spec.return_lse else out


def clear_memos() -> None:
    """Forget every memoized decision (after changing a threshold)."""
    for memo in (_ELIGIBLE, _PIECES, _SPECS, _CALLS):
        memo.clear()


class _Call(NamedTuple):
    forward: Tuple[Piece, ...]
    forward_runners: tuple
    seq: int
    backward: Tuple[Piece, ...] = ()
    backward_runners: tuple = ()


def _make_call(spec: AttentionSpec, mod: Any, query: Any, key: Any, value: Any, sinks: Optional[torch.Tensor],
               grad: bool) -> Optional[_Call]:
    """The rectangles and their runners for this signature, or None when not served here."""
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in (query, key, value)):
        return None
    seq = _SEQ_DIM[spec.qkv_format]
    sq, skv = query.shape[seq], key.shape[seq]
    if value.shape[seq] != skv or (grad and _trains_extras(mod, sinks)):
        return None
    pieces = plan_pieces(spec.band, sq, skv)
    scores = query.numel() // max(1, query.shape[-1]) * skv
    if pieces is None or not pays(pieces, scores, query.shape[-1], grad):
        return None

    def runners(parts, force_grad):
        q, k, v = (query, key, value) if force_grad else (query.detach(), key.detach(), value.detach())
        out = []
        for p in parts:
            if p.band is None:
                out.append(None)
                continue
            out.append(get_plan(piece_spec(spec, p.band), mod, *_views(p, seq, q, k, v), NO_VARLEN, sinks,
                                force_grad=force_grad).runner)
        return tuple(out)

    call = _Call(pieces.forward, runners(pieces.forward, False), seq)
    if grad:
        call = call._replace(backward=pieces.backward, backward_runners=runners(pieces.backward, True))
    return call


def _forward(call: _Call, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mod: Any,
             sinks: Optional[torch.Tensor]):
    """(out, lse (B, H, Sq), fp32 or the float64 of float64 inputs): each query chunk in place."""
    seq = call.seq
    out = torch.empty(tuple(query.shape[:-1]) + (value.shape[-1],), dtype=query.dtype, device=query.device)
    lse = None
    for p, runner in zip(call.forward, call.forward_runners):
        o, l = attention(runner, *_views(p, seq, query, key, value), NO_VARLEN, mod, sinks)
        out.narrow(seq, p.q0, p.q1 - p.q0).copy_(o)
        if lse is None:
            lse = torch.empty(tuple(l.shape[:2]) + (query.shape[seq],), dtype=l.dtype, device=l.device)
        lse[:, :, p.q0:p.q1].copy_(l)
    return out, lse


class BandChunks(torch.autograd.Function):
    """apply(call, mod, sinks, q, k, v) -> (out, lse): the forward's query chunks; a backward over
    key chunks from the saved output and lse, each writing its dK / dV in place and adding its
    share of dQ into an fp32 accumulator (the first chunk's own dQ when it spans every query)."""

    @staticmethod
    def forward(ctx, call: _Call, mod: Any, sinks: Optional[torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor):
        out, lse = _forward(call, query, key, value, mod, sinks)
        ctx.call, ctx.mod, ctx.sinks = call, mod, sinks
        ctx.mod_values = getattr(mod, "_values", None)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Optional[torch.Tensor], _grad_lse: Optional[torch.Tensor]):
        if grad_out is None:
            return None, None, None, None, None, None
        call, mod = ctx.call, ctx.mod
        check_mod_unchanged(mod, ctx.mod_values)
        query, key, value, out, lse = ctx.saved_tensors
        seq, sq = call.seq, query.shape[call.seq]
        acc = torch.float64 if query.dtype == torch.float64 else torch.float32
        dq = None
        dk, dv = torch.empty_like(key), torch.empty_like(value)
        for p, runner in zip(call.backward, call.backward_runners):
            kc = p.k1 - p.k0
            dk_p, dv_p = dk.narrow(seq, p.k0, kc), dv.narrow(seq, p.k0, kc)
            if runner is None:
                dk_p.zero_()
                dv_p.zero_()
                continue
            rows = p.q1 - p.q0
            grads = runner.backward_with_lse(
                *_views(p, seq, query, key, value), out.narrow(seq, p.q0, rows), lse[:, :, p.q0:p.q1], NO_VARLEN,
                mod, ctx.sinks, grad_out.narrow(seq, p.q0, rows))
            if dq is None and rows == sq:
                dq = grads[0].to(acc)
            else:
                if dq is None:
                    dq = torch.zeros(query.shape, dtype=acc, device=query.device)
                dq.narrow(seq, p.q0, rows).add_(grads[0])
            dk_p.copy_(grads[1])
            dv_p.copy_(grads[2])
        if dq is None:
            dq = torch.zeros(query.shape, dtype=acc, device=query.device)
        return None, None, None, dq.to(query.dtype), dk, dv
