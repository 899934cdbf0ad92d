"""A causal or windowed score_mod call served as rectangles of the band, on cuDNN.

cuDNN 9.19 declines its own band (causal, sliding window) next to a score_mod callback
(measured on H200), so the band becomes a select inside the callback and the kernel computes
every (query tile, key tile) pair: twice the causal triangle, S / W times a window W. Here the
band is cut into rectangles, each a complete sub-attention with a band of its own:

* forward: query chunks [q0, q1), each over the keys [k0, k1) its rows can reach;
* backward: key chunks [k0, k1), each with the queries [q0, q1) that reach them, from the
  forward's output and log-sum-exp (cuDNN's backward reads exactly O and Stats, so a key
  subset with the full rows' lse gives that subset's exact dK, dV and its share of dQ); for a
  top-left window on bshd, the band in two packed calls (`band_ragged`); or, where rectangles'
  fixed costs outweigh the tiles they skip, the plain call's backward from that same stitched
  output and lse.

Where to cut and whether it pays: `band_pieces` (the rectangles' geometry and the cost model).

Exact only when the score_mod reads no position and no length (they would be the
rectangle's) and indexes no tensor by position; dense layouts without padding or dropout;
no trained score_mod tables or sinks (their gradients are not split). Whether and how to cut
is estimated per call signature from the GPU work it saves and the host time it adds
(`band_pieces.strategy`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Tuple

import torch

from ...memo import BoundedMemo
from ...mod_axes import index_uses, tensor_axes
from ...mod_values import check_mod_unchanged, tensor_versions
from ...planning import planner
from ...problem import Band
from ...spec import AttentionSpec
from ...static import NO_VARLEN, Refusal
from . import band_pieces
from .band_pieces import Piece, plan_pieces, strategy
from .band_ragged import RaggedWindowBackward, area_fraction, geometry
from .common import grad_output

__all__ = ["eligible", "route", "run_call", "run_in_pieces", "BandChunks", "clear_memos"]

_SEQ_DIM = {"bshd": 1, "sbhd": 0, "bhsd": 2}
_ELIGIBLE = BoundedMemo(128, "band_chunks.eligible")
_SPECS = BoundedMemo(512, "band_chunks.spec")
_ROUTES = BoundedMemo(256, "band_chunks.routes")  # call signature -> Call or the plain CallPlan


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
    uses, axes = index_uses(spec.score_mod), tensor_axes(spec.score_mod)
    if uses is None or axes is None or uses & {"q_idx", "kv_idx", "length"}:
        return False
    return not any(a in ("q_idx", "kv_idx") or a is None for ax in axes.values() for a in ax)


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
    tensors = {} if mod is None else mod.tensors()
    return any(t.requires_grad for t in tensors.values())


def _views(p: Piece, seq: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """The rectangle's query rows and key / value rows (views)."""
    return (query.narrow(seq, p.q0, p.q1 - p.q0), key.narrow(seq, p.k0, p.k1 - p.k0),
            value.narrow(seq, p.k0, p.k1 - p.k0))


def route(spec: AttentionSpec, mod: Any, query: Any, key: Any, value: Any, sinks: Optional[torch.Tensor],
          sig: tuple) -> Any:
    """How a call of `spec` with call signature `sig` runs: its rectangles (`Call`), or the plain
    path's plan when rectangles do not serve it or would not gain. Decided once per signature;
    a repeated call is one lock-free lookup (no more than the plain path's own plan lookup)."""
    hit = _ROUTES.peek(sig)  # the key holds the spec: an ineligible one is memoized as the plain plan
    if hit is None:
        call = None
        if eligible(spec):
            call = _make_call(spec, mod, query, key, value, sinks, grad=planner().signature_records_grad(sig))
        if call is None:
            call = planner().get_plan(spec, mod, query, key, value, NO_VARLEN, sinks, sig=sig)
        hit = call
        _ROUTES.put(sig, hit)
    return hit


def run_call(call: "Call", spec: AttentionSpec, mod: Any, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, sinks: Optional[torch.Tensor]):
    """out (and lse (B, H, Sq) when the spec returns it) of a call `route` cut into rectangles."""
    if call.trains:
        out, lse = BandChunks.apply(call, mod, sinks, query, key, value)
    else:
        out, lse = _forward(call, query, key, value, mod, sinks)
    return (out, lse) if spec.return_lse else out


def run_in_pieces(spec: AttentionSpec, mod: Any, query: Any, key: Any, value: Any,
                  sinks: Optional[torch.Tensor], sig: Optional[tuple] = None):
    """out (and lse) of `spec` computed rectangle by rectangle, or None when the call does not
    qualify or would not gain (the caller then runs the plain path). `sig`: the call's
    `plan.call_signature` when the caller has it."""
    if sig is None:
        if not eligible(spec):
            return None
        sig = planner().call_signature(spec, query, key, value, NO_VARLEN, mod, sinks)
        if sig is None:
            return None  # the plain path validates and names the argument
    how = route(spec, mod, query, key, value, sinks, sig)
    return run_call(how, spec, mod, query, key, value, sinks) if isinstance(how, Call) else None


def clear_memos() -> None:
    """Forget every memoized decision (after changing a threshold, and with the call plans)."""
    for memo in (_ELIGIBLE, _SPECS, _ROUTES):
        memo.clear()
    band_pieces.clear_memo()


class Call(NamedTuple):
    """A cut call: its query rectangles and their runners; with gradients, key rectangles and
    their runners, `backward_ragged` (a `band_ragged.RaggedWindowBackward`) or `backward_full`,
    the plain call's runner (its backward reads the rectangles' stitched output and lse)."""

    forward: Tuple[Piece, ...]
    forward_runners: tuple
    seq: int
    trains: bool = False
    backward: Tuple[Piece, ...] = ()
    backward_runners: tuple = ()
    backward_full: Any = None
    backward_ragged: Any = None


def _ragged_geometry(spec: AttentionSpec, query: Any, key: Any, sinks: Optional[torch.Tensor], grad: bool):
    """The packed-window backward's geometry for this call, or None where it does not apply
    (see `band_ragged`: bshd, Sq == Skv, a top-left window with right bound 0, no sinks; not
    deterministic: the key gradients are summed with index_add)."""
    band = spec.band
    if (not grad or sinks is not None or spec.deterministic or spec.qkv_format != "bshd" or band.bottom_right
            or band.left is None or band.right != 0 or query.shape[1] != key.shape[1]):
        return None
    return geometry(query.shape[0], query.shape[1], band.left)


def _make_call(spec: AttentionSpec, mod: Any, query: Any, key: Any, value: Any, sinks: Optional[torch.Tensor],
               grad: bool) -> Optional[Call]:
    """The rectangles and their runners for this signature, or None when not served here."""
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in (query, key, value)):
        return None
    seq = _SEQ_DIM[spec.qkv_format]
    sq, skv = query.shape[seq], key.shape[seq]
    if value.shape[seq] != skv or (grad and _trains_extras(mod, sinks)):
        return None
    pieces = plan_pieces(spec.band, sq, skv)
    scores = query.numel() // max(1, query.shape[-1]) * skv
    ragged = None if pieces is None else _ragged_geometry(spec, query, key, sinks, grad)
    how = None if pieces is None else strategy(pieces, scores, query.shape[-1], grad, query.numel(),
                                               None if ragged is None else area_fraction(ragged))
    if how is None:
        return None

    layouts = _layouts(spec.qkv_format, query, key, value)
    try:
        call = Call(pieces.forward, _runners(spec, mod, query, key, value, sinks, pieces.forward, False, layouts),
                     seq, trains=grad)
        if how == "ragged" and ragged is None:
            how = "forward"  # (a forced strategy on a call the packed window does not serve)
        if how == "ragged":
            try:
                call = call._replace(backward_ragged=RaggedWindowBackward(spec, mod, query, key, value, ragged))
            except Refusal:
                how = "forward"  # cuDNN declines a packed graph: the plain backward (exact too)
        if grad and how == "both":
            call = call._replace(backward=pieces.backward,
                                 backward_runners=_runners(spec, mod, query, key, value, sinks, pieces.backward, True,
                                                           layouts))
        elif grad and how != "ragged":
            call = call._replace(backward_full=planner().get_plan(spec, mod, query, key, value, NO_VARLEN, sinks,
                                                                  force_grad=True).runner)
    except Refusal:
        return None  # a rectangle cuDNN declines: the plain path serves the call
    return call


def _acc(dtype: torch.dtype) -> torch.dtype:
    """dQ's accumulation dtype: fp32, float64 for float64 inputs (the reference)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _layouts(fmt: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """The rectangles' `Into` layouts: they write into the whole call's out (contiguous in the
    format), its lse (B, H, Sq) fp32 and its dK, dV (contiguous); dQ goes to fresh buffers
    (key chunks overlap in queries: their shares are summed)."""
    from .dense import Into, _contiguous_strides as _contiguous

    sq = query.shape[_SEQ_DIM[fmt]]
    heads = query.shape[1] if fmt == "bhsd" else query.shape[2]
    out_shape = tuple(query.shape[:-1]) + (value.shape[-1],)
    return Into(_contiguous(out_shape), (heads * sq, sq, 1, 1),
                (None, _contiguous(tuple(key.shape)), _contiguous(tuple(value.shape))))


def _runners(spec: AttentionSpec, mod: Any, query: Any, key: Any, value: Any, sinks: Optional[torch.Tensor],
             parts: Tuple[Piece, ...], force_grad: bool, layouts: Any) -> tuple:
    """One cuDNN runner per rectangle (None for one no query attends), writing in `layouts`;
    raises static.Refusal when cuDNN declines one."""
    from . import make_runner, refusal

    seq = _SEQ_DIM[spec.qkv_format]
    q, k, v = (query, key, value) if force_grad else (query.detach(), key.detach(), value.detach())
    out = []
    for p in parts:
        if p.band is None:
            out.append(None)
            continue
        pspec, views = piece_spec(spec, p.band), _views(p, seq, q, k, v)
        problem = planner().static_problem(pspec, mod, *views, NO_VARLEN, sinks, force_grad)
        if pspec.backend != "reference" and refusal(problem) is None:
            out.append(make_runner(problem, into=layouts))
        else:  # the reference (CPU calls): it copies into the same destinations
            out.append(planner().get_plan(pspec, mod, *views, NO_VARLEN, sinks, force_grad=force_grad).runner)
    return tuple(out)


def _forward(call: Call, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mod: Any,
             sinks: Optional[torch.Tensor]):
    """(out, lse (B, H, Sq) fp32, as every backend keeps it): each query chunk's runner writes
    its rows of both in place."""
    seq = call.seq
    out = torch.empty(tuple(query.shape[:-1]) + (value.shape[-1],), dtype=query.dtype, device=query.device)
    b, h = (query.shape[0], query.shape[1]) if seq == 2 else (query.shape[1 - seq], query.shape[2])
    lse = torch.empty((b, h, query.shape[seq]), dtype=torch.float32, device=query.device)
    for p, runner in zip(call.forward, call.forward_runners):
        dest = (out.narrow(seq, p.q0, p.q1 - p.q0), lse[:, :, p.q0:p.q1].unsqueeze(-1))
        runner.forward(*_views(p, seq, query, key, value), NO_VARLEN, mod, sinks, dest=dest)
    return out, lse


class BandChunks(torch.autograd.Function):
    """apply(call, mod, sinks, q, k, v) -> (out, lse): the forward's query chunks; a backward over
    key chunks from the saved output and lse, each writing its dK / dV in place and adding its
    share of dQ into an fp32 accumulator (the first chunk's own dQ when it spans every query),
    or the plain call's backward from that output and lse (`Call.backward_full`)."""

    @staticmethod
    def forward(ctx, call: Call, mod: Any, sinks: Optional[torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor):
        out, lse = _forward(call, query, key, value, mod, sinks)
        ctx.call, ctx.mod, ctx.sinks = call, mod, sinks
        ctx.mod_values, ctx.mod_versions = None if mod is None else mod.bound_values, tensor_versions(mod)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled (B, H, Sq) gradient for lse per backward
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Optional[torch.Tensor], _grad_lse: Optional[torch.Tensor]):
        if grad_out is None:
            return None, None, None, None, None, None
        call, mod = ctx.call, ctx.mod
        check_mod_unchanged(mod, ctx.mod_values, ctx.mod_versions)
        query, key, value, out, lse = ctx.saved_tensors
        if call.backward_ragged is not None:
            grads = call.backward_ragged.backward(query, key, value, out, lse, mod, grad_output(grad_out, out))
            return (None, None, None) + tuple(grads)
        if call.backward_full is not None:
            grads = call.backward_full.backward_with_lse(query, key, value, out, lse, NO_VARLEN, mod, ctx.sinks,
                                                         grad_out)
            return None, None, None, grads[0], grads[1], grads[2]
        seq, sq = call.seq, query.shape[call.seq]
        grad_out = grad_output(grad_out, out)  # the rectangles read dO in out's layout
        dq = None
        dk = torch.empty(key.shape, dtype=key.dtype, device=key.device)
        dv = torch.empty(value.shape, dtype=value.dtype, device=value.device)
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
                mod, ctx.sinks, grad_out.narrow(seq, p.q0, rows), dest=(None, dk_p, dv_p))
            if dq is None and rows == sq:
                dq = grads[0].to(_acc(query.dtype))
            else:
                if dq is None:
                    dq = torch.zeros(query.shape, dtype=_acc(query.dtype), device=query.device)
                dq.narrow(seq, p.q0, rows).add_(grads[0])
        if dq is None:
            dq = torch.zeros(query.shape, dtype=_acc(query.dtype), device=query.device)
        return None, None, None, dq.to(query.dtype), dk, dv
