"""Document-packed attention: several documents per batch row, each attending only within itself.

Shape legend:
    B: batch rows      S: tokens per row (every row the same)      H / H_kv: heads      D: head dim
    MAX_DOCS: documents per row (rows with fewer documents repeat S as sentinels)

Row b of ``cu_seq`` (B, MAX_DOCS+1) int32 holds the document boundaries of batch row b, e.g. with
S = 8 and MAX_DOCS = 3, ``[0, 3, 8, 8]`` is two documents [0, 3) and [3, 8) plus one empty one.
Causal attention for that row (x: attended)::

    q\\k 0 1 2 3 4 5 6 7
    0   x . . . . . . .
    1   x x . . . . . .
    2   x x x . . . . .
    3   . . . x . . . .
    4   . . . x x . . .
    ...

The (B, S, H, D) tensors are viewed as packed (B*S, H, D) tokens with global offsets
b*S + cu_seq[b, :-1] (plus a final B*S), so shapes stay uniform across batch rows (the op can be
sharded by batch or heads) and no token is copied.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .functional import _is_dtensor, run_call, run_spec
from .memo import BoundedMemo, capturing
from . import extensions
from .plan import Varlen
from .spec import loaded_mod, resolve_spec, stored_mod
from .validation import check_gqa, check_ranked, check_window, keyable_call

__all__ = ["doc_packed_attn", "doc_cu_seqlens", "check_doc_boundaries"]


def doc_cu_seqlens(cu_seq: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Global packed offsets ((B*MAX_DOCS)+1,) int32 from per-row boundaries (B, MAX_DOCS+1).

    Computed on cu_seq's device with no host synchronisation. Sentinel documents become
    zero-length sequences: b*S + S equals the start (b+1)*S of the next row's first document.
    """
    batch = cu_seq.shape[0]
    starts = cu_seq[:, :-1] + torch.arange(batch, device=cu_seq.device, dtype=cu_seq.dtype).unsqueeze(1) * seq_len
    end = torch.full((1,), batch * seq_len, device=cu_seq.device, dtype=cu_seq.dtype)
    return torch.cat([starts.reshape(-1), end]).to(torch.int32)


def check_doc_boundaries(cu_seq: object, batch: int, seq_len: int, device: torch.device,
                         max_doc_len: Optional[int] = None, read_device_table: bool = False) -> Optional[int]:
    """Validate ``cu_seq`` (B, MAX_DOCS+1) int32; raises TypeError/ValueError naming the problem.

    Structure (type, dtype, rank, batch, device: the query's or the CPU) is checked on the host;
    values (start at 0, end at S, non-decreasing, documents no longer than max_doc_len) on the
    host for CPU tables and, with read_device_table, for device tables (copied to the host: one
    synchronisation), returning the longest document; otherwise (device tables, fake tensors,
    torch.compile) the value check is an asynchronous device assertion (no sync) and the return
    value is None.
    """
    if not isinstance(cu_seq, torch.Tensor):
        raise TypeError(f"cu_seq must be a (B, MAX_DOCS+1) int32 torch.Tensor, got {type(cu_seq).__name__}")
    if cu_seq.dtype != torch.int32:
        raise TypeError(f"cu_seq must have dtype torch.int32, got {cu_seq.dtype} (convert it with cu_seq.int())")
    if cu_seq.dim() != 2:
        raise ValueError(f"cu_seq must have shape (B, MAX_DOCS+1) (2 dims), got shape {tuple(cu_seq.shape)}")
    if cu_seq.shape[0] != batch:
        raise ValueError(f"cu_seq must have one row per batch element: expected {batch} rows, got {cu_seq.shape[0]}")
    if cu_seq.shape[1] < 2:
        raise ValueError(f"cu_seq needs at least 2 columns (MAX_DOCS >= 1), got shape {tuple(cu_seq.shape)}")
    if cu_seq.device != device and cu_seq.device.type != "cpu":
        raise ValueError(f"cu_seq must be on the query's device {device} or on the CPU, got {cu_seq.device}")
    limit = seq_len if max_doc_len is None else max_doc_len
    if _is_fake(cu_seq):
        return None  # fake / meta (tracing): no values to check or read
    read_here = (cu_seq.device.type == "cpu" or read_device_table) and not _is_fake(cu_seq)
    if torch.compiler.is_compiling() or not read_here:
        # No host read on the hot path: a bad table stops the program at the next synchronization
        # with this device-side assertion (CPU tables raise ValueError right here).
        lens = cu_seq[:, 1:] - cu_seq[:, :-1]
        ok = ((cu_seq[:, 0] == 0).all() & (cu_seq[:, -1] == seq_len).all() & (lens >= 0).all()
              & (lens <= limit).all())
        torch._assert_async(ok, f"cu_seq rows must start at 0, end at S={seq_len}, be non-decreasing, and hold "
                                f"documents no longer than max_doc_len={limit}")
        return None
    rows = cu_seq.tolist()
    longest = 0
    for b, row in enumerate(rows):
        if any(x < 0 or x > seq_len for x in row):
            raise ValueError(f"cu_seq row {b} has values outside [0, S={seq_len}]: {row}")
        if row[0] != 0:
            raise ValueError(f"cu_seq row {b} does not start at 0: {row}")
        if row[-1] != seq_len:
            raise ValueError(f"cu_seq row {b} does not end at S={seq_len} (pad short rows by repeating S): {row}")
        for i in range(1, len(row)):
            if row[i] < row[i - 1]:
                raise ValueError(f"cu_seq row {b} is decreasing (boundaries must be non-decreasing): {row}")
            if row[i] - row[i - 1] > limit:
                raise ValueError(f"cu_seq row {b} has a document of length {row[i] - row[i - 1]} > max_doc_len="
                                 f"{limit}: {row}")
            longest = max(longest, row[i] - row[i - 1])
    return longest


#: Checked global offsets (and the longest document of a host table) per boundary table, keyed
#: (id, version, B, S, max_doc_len, device).
#: A model's layers share one table per step, so only its first call checks and derives them
#: (and the thd preparation, memoized per offsets tensor, is shared too). An entry holds its
#: table weakly (a freed table's entry misses: its id may be reused); an in-place edit bumps the version.
_OFFSETS = BoundedMemo(64, "doc_packed.offsets", max_bytes=64 << 20)


def checked_offsets(cu_seq: object, batch: int, seq_len: int, device: torch.device,
                    max_doc_len: Optional[int]) -> Tuple[torch.Tensor, Optional[int]]:
    """(global offsets on `device`, the longest document or None): `check_doc_boundaries` then
    `doc_cu_seqlens`, memoized per table (not while compiling). A CPU table for device queries
    is read on the host (its longest document comes free) and its offsets go to the device in
    one asynchronous copy from pinned memory this function owns. A device table without
    max_doc_len is read on the host too (one synchronisation per table: the layers of a step
    share it), except while a CUDA graph is captured: the graph is then sized for S."""
    if torch.compiler.is_compiling() or not isinstance(cu_seq, torch.Tensor) or _is_fake(cu_seq):
        check_doc_boundaries(cu_seq, batch, seq_len, device, max_doc_len)
        if _is_fake(cu_seq):  # offsets of the right shape: no values exist to derive them from
            return cu_seq.new_empty((cu_seq.shape[0] * (cu_seq.shape[1] - 1) + 1,), device=device), None
        return doc_cu_seqlens(cu_seq, seq_len).to(device), None
    # before the memo: a CPU table's entry is not a CUDA tensor's, so capture does not make it miss
    if device.type == "cuda" and cu_seq.device.type == "cpu" and torch.cuda.is_current_stream_capturing():
        raise ValueError("cu_seq is a CPU boundary table, read on the host: a CUDA graph would replay the documents "
                         "of its capture whatever the table holds later; to capture doc_packed_attn pass the table "
                         "on the query's device (with max_doc_len)")
    key = (id(cu_seq), cu_seq._version, batch, seq_len, max_doc_len, device)
    hit = _OFFSETS.get_identity(key, (cu_seq,))
    if hit is None:
        read = max_doc_len is None and cu_seq.is_cuda and not capturing((cu_seq,))
        longest = check_doc_boundaries(cu_seq, batch, seq_len, device, max_doc_len, read_device_table=read)
        offsets = doc_cu_seqlens(cu_seq, seq_len)
        if offsets.device != device:  # a host table for device queries
            staged = offsets.pin_memory() if device.type == "cuda" else offsets
            offsets = staged.to(device, non_blocking=True)
        hit = (offsets, longest)
        _OFFSETS.put_identity(key, (cu_seq,), hit)
    return hit


def _is_fake(t: torch.Tensor) -> bool:
    """Whether `t` has no values to read: a fake tensor (tracing), a meta tensor, or any tensor
    under an active FakeTensorMode (`abstract.is_abstract`); never while torch.compile traces
    (its tensors stand for real ones)."""
    if torch.compiler.is_compiling():
        return False
    from .tensor_kind import is_abstract

    return is_abstract(t)


def _check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool) -> None:
    check_ranked((("query", query), ("key", key), ("value", value)), "BSHD")
    if key.shape[:3] != value.shape[:3] or query.shape[:2] != key.shape[:2]:
        raise ValueError(
            "query, key and value must share (B, S) and key/value must share H_kv, got "
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if query.shape[3] != key.shape[3]:
        raise ValueError(f"query and key must have the same head dim, got {query.shape[3]} and {key.shape[3]}")
    check_gqa(query.shape[2], key.shape[2], enable_gqa, q_heads="H")


def _mask(is_causal: bool, window_size: object) -> Tuple[str, Optional[Tuple[int, int]]]:
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if window_size is None:
        raise ValueError("window_size must be a (left, right) pair of ints (-1 = unbounded), got None")
    left, right = check_window(window_size)
    if is_causal:
        if right not in (-1, 0):
            raise ValueError(f"is_causal=True allows window_size right of -1 or 0, got window_size={window_size!r}")
        return "causal", (None if left == -1 else (left, 0))
    if left == -1 and right == -1:
        return "no_mask", None
    return "no_mask", (left, right)


def _packed(t: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (B*S, H, D): a view when B and S are mergeable (always for BSHD-contiguous)."""
    return t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])


def doc_packed_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq: torch.Tensor,
    *,
    is_causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    score_mod: object = None,
    scale: Optional[float] = None,
    max_doc_len: Optional[int] = None,
) -> torch.Tensor:
    """Attention within documents packed into uniform batch rows.

    Args:
        query: (B, S, H, D).  key: (B, S, H_kv, D).  value: (B, S, H_kv, D_v).
        cu_seq: (B, MAX_DOCS+1) int32 per-row document boundaries: each row starts at 0, is
            non-decreasing and ends at S (rows with fewer documents repeat S). On the query's
            device, or on the CPU (as data loaders make it): a host table is checked on the host
            (ValueError at the call), its longest document sizes the graph when max_doc_len is
            not given, and its offsets reach the device in one asynchronous copy (no sync).
        is_causal: causal within each document.
        window_size: flash-style (left, right) window within each document, -1 unbounded
            (queries and keys of a document have equal lengths, so alignment does not matter).
        enable_gqa: allow H_kv < H (H % H_kv == 0).
        score_mod: optional score modifier; its q_idx / kv_idx are positions within the document.
        scale: softmax scale, default 1/sqrt(D).
        max_doc_len: optional host int >= the longest document. The cuDNN graph is sized by it
            (rounded up to a power of two), so many short documents cost what their tokens cost
            (not tiles for S-long documents that end early). Default: the longest document of
            the table, read on the host once per table (free for a CPU table; one
            synchronisation for a device table, shared by every layer that passes the same
            table); inside CUDA graph capture, S. Give it to avoid the read.

    Returns:
        out (B, S, H, D_v), differentiable (the backward uses the saved output and log-sum-exp).

    Cost: with max_doc_len given (or a CPU table), no device->host synchronisation on CUDA
    (device cu_seq values are then checked by an asynchronous device assertion, which also
    checks max_doc_len); without it, a device table is read and checked on the host once
    (ValueError for a bad table).
    """
    if type(query) is not torch.Tensor and _is_dtensor(query):
        return extensions.get("dtensor_doc_packed")(query, key, value, cu_seq, is_causal=is_causal,
                                                    window_size=window_size, enable_gqa=enable_gqa,
                                                    score_mod=score_mod, scale=scale, max_doc_len=max_doc_len)
    key_ = _call_key(query, key, value, cu_seq, is_causal, window_size, enable_gqa, score_mod, scale, max_doc_len)
    if key_ is not None and capturing((query,)):  # the table's checks differ inside capture
        key_ = None
    hit = None if key_ is None else _CALLS.get_identity(key_, (cu_seq, score_mod))
    if hit is None:
        varlen, mask_type, window = _validated_call(query, key, value, cu_seq, is_causal, window_size, enable_gqa,
                                                    max_doc_len)
        if key_ is None:  # torch.compile, CUDA graph capture, other tensor types: the public path
            out = run_call(_resolve, (mask_type, window, scale), score_mod, _packed(query), _packed(key),
                           _packed(value), varlen)
            return out.view(query.shape[0], query.shape[1], out.shape[-2], out.shape[-1])
        spec, mod = _resolve((mask_type, window, scale), score_mod)
        hit = (varlen, spec, stored_mod(mod, score_mod))
        _CALLS.put_identity(key_, (cu_seq, score_mod), hit)
    varlen, spec, mod = hit[0], hit[1], loaded_mod(hit[2], score_mod)
    out = run_spec(spec, mod, _packed(query), _packed(key), _packed(value), varlen)
    return out.view(query.shape[0], query.shape[1], out.shape[-2], out.shape[-1])


#: Validated doc_packed calls: (Varlen, spec, normalized score_mod) per (boundary table, its
#: version, q / k / v shapes, device, score_mod, the other arguments; see `_call_key`). The
#: layers of a model repeat one call's arguments, so only the first runs the checks, derives the
#: offsets and resolves the spec. An entry holds its table and score_mod weakly (a freed one's
#: entry misses) and never the mod itself; an in-place edit of the table bumps its version; calls during CUDA
#: graph capture (checked here by the query's stream: a CPU table's entry would not see it) or
#: torch.compile, and calls with other tensor types, are checked in full.
_CALLS = BoundedMemo(64, "doc_packed.calls", max_bytes=64 << 20)


def _call_key(query: object, key: object, value: object, cu_seq: object, is_causal: object, window_size: object,
              enable_gqa: object, score_mod: object, scale: object, max_doc_len: object) -> Optional[tuple]:
    """The `_CALLS` key of a call, or None: only calls `keyable_call` accepts, with bool flags and
    an int or None max_doc_len, are keyed (so True and 1 never share an entry)."""
    if (type(is_causal) is not bool or type(enable_gqa) is not bool
            or (max_doc_len is not None and type(max_doc_len) is not int)
            or not keyable_call((query, key, value, cu_seq), window_size, scale)):
        return None
    return (id(cu_seq), cu_seq._version, query.shape, key.shape, value.shape, query.device, is_causal, window_size,
            enable_gqa, id(score_mod), scale, max_doc_len)


def _validated_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq: object, is_causal: object,
                    window_size: object, enable_gqa: object, max_doc_len: object) -> Tuple[Varlen, str, object]:
    """Every check of a doc_packed call's arguments (TypeError / ValueError naming the bad one)
    and its (Varlen over the global offsets, mask type, window)."""
    _check_qkv(query, key, value, enable_gqa)
    batch, seq_len = query.shape[0], query.shape[1]
    if max_doc_len is not None and (isinstance(max_doc_len, bool) or not isinstance(max_doc_len, int)
                                    or not 0 <= max_doc_len <= seq_len):
        raise ValueError(f"max_doc_len must be None or an int in [0, S={seq_len}], got {max_doc_len!r}")
    mask_type, window = _mask(is_causal, window_size)
    cu, longest = checked_offsets(cu_seq, batch, seq_len, query.device, max_doc_len)
    if max_doc_len is None:
        max_doc_len = seq_len if longest is None else longest
    return Varlen(cu, cu, None, None, max_doc_len, max_doc_len), mask_type, window


def _resolve(config: tuple, score_mod: object):
    mask_type, window, scale = config
    return resolve_spec(qkv_format="thd", attn_mask_type=mask_type, window_size=window, softmax_scale=scale,
                        score_mod=score_mod)
