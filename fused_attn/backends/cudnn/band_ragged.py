"""The backward of a sliding-window score_mod call as two packed (thd) calls.

cuDNN 9.19 declines its own band next to a score_mod callback, so a window becomes a select in
the callback and the plain backward computes every (query tile, key tile) pair: S / W times the
window's work. `band_chunks` cuts the forward into query rectangles; this module gives such a
call a backward over the band only, in two ragged cuDNN graphs instead of one rectangle each:

* body: query chunks [q0, q1) of C rows past the head, each with its keys [q0 - L, q1) gathered
  into one packed key buffer (chunks overlap in keys). In each chunk's own positions query a
  sees key b iff 0 <= b - a <= L: one top-left band `Band(0, L)` for every chunk, whose right
  edge a + L <= kv_len - 1 keeps every query inside its chunk's keys exactly (cuDNN's ragged
  graphs apply no key-length mask next to a score_mod; the band needs none);
* head: the first W0 = ceil(L / C) * C rows of each batch with their keys [0, W0) under the
  call's own band (query and key lengths equal: the band ends on the diagonal).

Every key a query row attends lies in its own call, so each graph's backward from the call's
output and log-sum-exp rows (its per-token Stats: the call's lse transposed, token-major) is exact; dQ
rows are disjoint between the two, the body's dK / dV shares are added into the head's by index
in fp32. Exact only for score_mods that read no position or length and index no
tensor by position (`band_chunks.eligible`), bshd calls with Sq == Skv and a top-left window
(right bound 0), no sinks or trained tables. Memory: one gathered copy of K and V and their
gradients (about (C + L) / C times K's size).
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from ...layouts import token_rows
from ...planning import planner
from ...problem import Band
from ...spec import AttentionSpec
from ...static import Refusal, Varlen

__all__ = ["Geometry", "geometry", "chunk_rows", "RaggedWindowBackward", "area_fraction", "token_stats"]

TILE = 128


class Geometry(NamedTuple):
    """Host description of the two packed calls of a (B, S) window call with left bound L:
    head rows W0 per batch; body chunks (batch, q0, q1), keys [q0 - L, q1) each."""

    batch: int
    seq: int
    left: int
    chunk: int
    head_rows: int
    body: Tuple[Tuple[int, int, int], ...]


def chunk_rows(left: int) -> int:
    """Rows per body chunk: about half the window (less padding past the band than a whole
    window per chunk), a multiple of cuDNN's 128-row tile."""
    return max(TILE, -(-((left + 1) // 2) // TILE) * TILE)


def geometry(batch: int, seq: int, left: int) -> Optional[Geometry]:
    """The two calls' layout, or None when the head would cover every row (no gain)."""
    if left < 1:
        return None
    c = chunk_rows(left)
    head = -(-left // c) * c
    if head >= seq:
        return None
    body = tuple((b, q0, min(q0 + c, seq)) for b in range(batch) for q0 in range(head, seq, c))
    return Geometry(batch, seq, left, c, head, body)


def area_fraction(g: Geometry) -> float:
    """The two calls' (query x key) work over the plain call's B * S * S."""
    head = g.batch * g.head_rows * g.head_rows
    body = sum((q1 - q0) * (q1 - q0 + g.left) for _, q0, q1 in g.body)
    return (head + body) / (g.batch * g.seq * g.seq)


def _varlens(g: Geometry, device: torch.device) -> Tuple[Varlen, Varlen, torch.Tensor, int]:
    """(head varlen, body varlen, the body's key row index into the flat (B * S) keys, the
    body's first query row: its query offsets are taken from there)."""
    i32 = dict(dtype=torch.int32, device=device)
    cu_head = torch.arange(g.batch + 1, **i32) * g.head_rows
    head = Varlen(cu_head, cu_head, torch.arange(g.batch + 1, **i32) * g.seq,
                  torch.arange(g.batch + 1, **i32) * g.seq, g.head_rows, g.head_rows)
    starts = [b * g.seq + q0 for b, q0, _ in g.body]
    first = starts[0]
    q_lens = [q1 - q0 for _, q0, q1 in g.body]
    cu_q = torch.tensor(list(accumulate(q_lens, initial=0)), **i32)
    cu_kv = torch.tensor(list(accumulate((n + g.left for n in q_lens), initial=0)), **i32)
    padded_q = torch.tensor([s - first for s in starts] + [g.batch * g.seq - first], **i32)
    body = Varlen(cu_q, cu_kv, padded_q, None, g.chunk, g.chunk + g.left)
    index = torch.cat([torch.arange(s - g.left, s + n, device=device) for s, n in zip(starts, q_lens)])
    return head, body, index, first


class RaggedWindowBackward:
    """Gradients of a bshd window call (query (B, S, H, D), key / value (B, S, Hkv, D|Dv)) from its
    output and lse (B, H, S), over the band only (see the module docstring).

    Built once per call signature (its offsets and key-row index live on the device);
    raises static.Refusal when cuDNN declines either graph."""

    def __init__(self, spec: AttentionSpec, mod: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 g: Geometry) -> None:
        b, s = query.shape[:2]
        dev = query.device
        self.head_varlen, self.body_varlen, self.index, self.first = _varlens(g, dev)
        flat = [t.detach().reshape(b * s, t.shape[2], t.shape[3]) for t in (query, key, value)]
        body_kv = [t.index_select(0, self.index) for t in flat[1:]]
        self.head = _runner(_thd_spec(spec, spec.band), mod, flat, self.head_varlen)
        self.body = _runner(_thd_spec(spec, Band(0, g.left, False)), mod, [flat[0][self.first:]] + body_kv,
                            self.body_varlen)

    def backward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, mod: Any, grad_out: torch.Tensor):
        """(dq, dk, dv) in the inputs' shapes; out, grad_out (B, S, H, Dv); lse (B, H, S) fp32."""
        b, s, h, _ = query.shape
        rows = b * s
        q, k, v = (t.reshape(rows, t.shape[2], t.shape[3]) for t in (query, key, value))
        o, d_o = out.reshape(rows, h, out.shape[3]), grad_out.reshape(rows, h, grad_out.shape[3])
        stats = token_stats(lse)
        dq, dk, dv = self.head.backward_call(q, k, v, o, stats, self.head_varlen, mod, None, d_o)[:3]
        f = self.first
        body = self.body.backward_call(q[f:], k.index_select(0, self.index), v.index_select(0, self.index), o[f:],
                                       stats[f:], self.body_varlen, mod, None, d_o[f:])
        dq[f:] += body[0]  # the head's dQ is 0 on the body's rows and the other way round
        acc = torch.float64 if dk.dtype == torch.float64 else torch.float32  # key rows summed over chunks
        dk, dv = (g.to(acc).index_add_(0, self.index, part.to(acc)).to(g.dtype)
                  for g, part in ((dk, body[1]), (dv, body[2])))
        return dq.view(query.shape), dk.view(key.shape), dv.view(value.shape)


def token_stats(lse: torch.Tensor) -> torch.Tensor:
    """Both calls' Stats from the call's lse (B, H, S): fp32 (B * S, H, 1), one row per query token
    of the flat (B * S) rows, the layout a packed cuDNN runner reads (a packed call's tokens are
    rows of that buffer: the head's at their own rows, the body's from its first row on; rows
    outside a call's sequences are not read). The reference recomputes and ignores it."""
    return token_rows(lse.detach().to(torch.float32)).unsqueeze(-1)


def _thd_spec(spec: AttentionSpec, band: Optional[Band]) -> AttentionSpec:
    return dataclasses.replace(spec, qkv_format="thd", attn_mask_type="no_mask", band=band, padding=False,
                               return_lse=True)


def _runner(spec: AttentionSpec, mod: Any, views: List[torch.Tensor], varlen: Varlen) -> Any:
    """A packed runner for one of the two calls: cuDNN's ragged graph on CUDA tensors (the
    geometry bounds every band inside its keys), the reference elsewhere."""
    q, k, v = views
    if q.device.type != "cuda":
        return planner().get_plan(spec, mod, q, k, v, varlen, None, force_grad=True).runner
    from . import make_runner, refusal

    problem = planner().static_problem(spec, mod, q, k, v, varlen, None, force_grad=True)
    why = refusal(problem, keys_bounded=True)
    if why is not None:
        raise Refusal(why)
    return make_runner(problem, keys_bounded=True)
