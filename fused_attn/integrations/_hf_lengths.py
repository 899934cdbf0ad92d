"""Padding masks and packed batches of the transformers integration -> fused_attn's thd arguments.

A 2-D padding mask or int32 segment ids (one host read per mask tensor, shared by the layers), a
prepared 4-D mask that is exactly causal / window + contiguous padding, or DataCollatorWithFlattening's
`cu_seq_lens_q/k` become `cu_seqlens_*` (+ `cu_seqlens_*_padded`) for a thd call (`_Lengths`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from ..memo import BoundedMemo
from ._hf_refusal import _refused

_PREPARED = BoundedMemo(16, "integrations.transformers.mask_lengths", max_bytes=64 << 20)


class _Lengths(NamedTuple):
    """A mask's conversion: dense (every row full: keys[:width]) or thd arguments."""

    dense: bool
    width: int
    cu_q: Optional[torch.Tensor] = None
    cu_kv: Optional[torch.Tensor] = None
    pad_q: Optional[torch.Tensor] = None
    pad_kv: Optional[torch.Tensor] = None
    max_q: int = 0
    max_kv: int = 0
    same_lengths: bool = True


def _check_same_offsets(cu_q: torch.Tensor, cu_k: torch.Tensor) -> None:
    """Causal packed self-attention: keys are split as queries (top-left == bottom-right)."""
    if cu_q.shape != cu_k.shape:
        raise _refused("causal packed attention with cu_seq_lens_k different from cu_seq_lens_q is not supported")
    if cu_q.device.type == "cpu" or torch.compiler.is_compiling():
        if cu_q.device.type == "cpu" and not torch.equal(cu_q, cu_k):
            raise _refused("causal packed attention with cu_seq_lens_k different from cu_seq_lens_q is not supported")
        return
    torch._assert_async((cu_q == cu_k).all(), "fused_attn (transformers): causal packed attention needs "
                                              "cu_seq_lens_k == cu_seq_lens_q")


# ----------------------------------------------------------------------------- masks -> lengths

@torch.compiler.disable  # one host read of the mask: a graph break under torch.compile
def _mask_lengths(mask: torch.Tensor, sq: int, causal: bool, windowed: bool) -> _Lengths:
    """A 2-D mask's thd arguments, computed once per mask tensor (one host read) and shared by
    the layers of a forward. bool / non-int32: padding (nonzero = token); int32: segment ids."""
    key = (id(mask), mask._version, tuple(mask.shape), sq, causal, windowed)
    hit = _PREPARED.get_identity(key, (mask,))
    if hit is not None:
        return hit
    host = mask.detach().to("cpu", torch.int64)
    segments = mask.dtype == torch.int32
    if not segments:
        host = (host != 0).to(torch.int64)
    lengths = _lengths_from_ids(host, sq, causal, windowed, segments, mask.device)
    _PREPARED.put_identity(key, (mask,), lengths)
    return lengths


def _runs(ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs of equal nonzero ids per row of (B, W) int64: (row, start, end exclusive) in row-major order."""
    zero = torch.zeros_like(ids[:, :1])
    prev = torch.cat([zero, ids[:, :-1]], dim=1)
    nxt = torch.cat([ids[:, 1:], zero], dim=1)
    nz = ids != 0
    starts = (nz & (ids != prev)).nonzero()
    ends = (nz & (ids != nxt)).nonzero()
    return starts[:, 0], starts[:, 1], ends[:, 1] + 1


def _lengths_from_ids(ids: torch.Tensor, sq: int, causal: bool, windowed: bool, segments: bool,
                      device: torch.device) -> _Lengths:
    batch, width = ids.shape
    rows, start, end = _runs(ids)
    run_ids = ids[rows, start]
    same_row = rows[1:] == rows[:-1]
    if bool((same_row & (run_ids[1:] <= run_ids[:-1])).any()):
        b = int(rows[1:][same_row & (run_ids[1:] <= run_ids[:-1])][0])
        what = "a packed sequence" if segments else "the tokens"
        raise _refused(f"attention_mask row {b} has padding inside {what} (row {ids[b].tolist()}); only left/right "
                       "padding (contiguous tokens per sequence) can be served")
    if segments:
        if width != sq:
            raise _refused("packed segment ids need Sq == Skv (no KV cache)")
        lk = end - start
        m = int(lk.max()) if lk.numel() else 0
        if not bool((ids == 0).any()):
            cu = _cu(lk, device)
            return _Lengths(False, width, cu, cu, None, None, m, m, True)
        (lk,), (off,) = _leading_gap([lk], [rows * width + start])
        cu, pad = _cu(lk, device), _offsets(off, batch * width, device)
        return _Lengths(False, width, cu, cu, pad, pad, m, m, True)
    # padding: at most one run per row
    s = torch.zeros(batch, dtype=torch.int64)
    e = torch.zeros(batch, dtype=torch.int64)
    s[rows], e[rows] = start, end
    if bool(((s == 0) & (e == width)).all()):
        return _Lengths(True, width)
    shift = width - sq
    if causal or windowed:
        if windowed and not causal and shift:
            raise _refused("a non-causal sliding window with a KV cache and padding is not supported")
        qs = (s - shift).clamp(min=0)
        qe = torch.maximum(e - shift, qs)
    else:  # bidirectional: every query attends the row's tokens (eager's padding_mask_function)
        qs, qe = torch.zeros(batch, dtype=torch.int64), torch.full((batch,), sq, dtype=torch.int64)
    b = torch.arange(batch)
    same = bool((qe - qs == e - s).all())
    (lq, lk), (off_q, off_k) = _leading_gap([qe - qs, e - s], [b * sq + qs, b * width + s])
    cu_q = _cu(lq, device)
    cu_k = cu_q if same else _cu(lk, device)  # one tensor: the core then knows q_len == kv_len per sequence
    pad_q, pad_k = _offsets(off_q, batch * sq, device), _offsets(off_k, batch * width, device)
    return _Lengths(False, width, cu_q, cu_k, pad_q, pad_k, int(lq.max()), int(lk.max()), same)


def _leading_gap(lengths: list, offsets: list) -> Tuple[list, list]:
    """cu_seqlens_*_padded must start at 0: a gap before the first sequence (left padding of
    row 0) becomes a leading zero-length sequence, on every side so the counts agree."""
    if all(int(o[0]) == 0 for o in offsets):
        return lengths, offsets
    zero = torch.zeros(1, dtype=torch.int64)
    return [torch.cat([zero, n]) for n in lengths], [torch.cat([zero, o]) for o in offsets]


def _cu(lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu.to(device)


def _offsets(starts: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    return torch.cat([starts, torch.tensor([total])]).to(device=device, dtype=torch.int32)


@torch.compiler.disable  # host reads of the mask: a graph break under torch.compile
def _reduce_4d(mask: torch.Tensor, batch: int, sq: int, skv: int, causal: bool,
               window: Optional[Tuple[int, int]]) -> torch.Tensor:
    """A prepared (B|1, 1|H, Sq, Skv) mask -> the bool (B, W) padding mask it equals (causal /
    window + contiguous padding, valid query rows compared exactly); NotImplementedError otherwise."""
    if mask.shape[-2:] != (sq, skv) or mask.shape[0] not in (1, batch):
        raise _refused(f"a 4-D attention_mask of shape {tuple(mask.shape)} does not match Sq={sq}, Skv={skv}")
    hit = _PREPARED.get_identity(("4d", id(mask), mask._version, causal, window), (mask,))
    if hit is not None:
        return hit
    m = mask.detach()
    if m.dtype == torch.bool:
        allowed = m
    else:
        blocked = (m == -math.inf) | (m <= torch.finfo(m.dtype).min / 2)
        if not bool(((m == 0) | blocked).all()):
            raise _refused("a 4-D float attention_mask with values other than 0 and a large negative number (an "
                           "additive bias) cannot be reduced to lengths; use attn_implementation='sdpa' or 'eager'")
        allowed = m == 0
    if allowed.shape[1] != 1:
        if not bool((allowed == allowed[:, :1]).all()):
            raise _refused("a 4-D attention_mask that differs between heads cannot be reduced to lengths")
    allowed = allowed[:, 0].cpu()
    kvalid = allowed.any(dim=1)  # (B, Skv)
    width = skv
    if causal:
        rows = allowed.any(dim=2)  # (B, Sq)
        if bool(rows.any()):
            last_key = torch.where(allowed, torch.arange(skv), -1).amax(dim=2)  # (B, Sq)
            shifts = (last_key - torch.arange(sq))[rows]
            width = sq + int(shifts.max())
    if not sq <= width <= skv:
        raise _refused("this 4-D attention_mask is not causal + padding")
    qi = torch.arange(sq).view(1, sq, 1) + (width - sq)
    kj = torch.arange(skv).view(1, 1, skv)
    expected = kvalid[:, None, :] & (kj < width)
    if causal:
        expected = expected & (kj <= qi)
    if window is not None:
        expected = expected & (kj >= qi - window[0]) & (kj <= qi + window[1])
    own = torch.gather(kvalid, 1, qi[0, :, 0].clamp(max=skv - 1).expand(kvalid.shape[0], sq)) if causal \
        else torch.ones(allowed.shape[0], sq, dtype=torch.bool)
    rows_to_check = own[:, :, None].expand_as(expected)
    if not torch.equal(expected[rows_to_check], allowed.expand_as(expected)[rows_to_check]):
        raise _refused("this 4-D attention_mask is not a causal / sliding-window mask with contiguous padding, so "
                       "it cannot be reduced to lengths; use attn_implementation='sdpa' or 'eager'")
    out = kvalid[:, :width].expand(batch, width).to(mask.device)
    _PREPARED.put_identity(("4d", id(mask), mask._version, causal, window), (mask,), out)
    return out
