"""The checks of per-sequence lengths for `dot_product_attention` (cu_seqlens, max_seqlen).

Structure (`check_length_structure`: types, shapes, devices, which arguments a mask type takes)
runs once per call plan; the checks that need the *values* of cu_seqlens tensors
(`check_length_values`) run per call: on CPU one host read, on CUDA an asynchronous device
assertion (no host sync). Each raises TypeError or ValueError naming the argument, the value
received and what is accepted.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from .layouts import logical_shape
from .memo import BoundedMemo, capturing
from .validation import PADDING_TYPES

__all__ = ["LengthStructure", "check_max_seqlen", "check_length_structure", "derive_max_seqlens",
           "check_length_values", "within", "within_by_runs", "assert_within"]


def check_max_seqlen(arg: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg} must be a Python int or None, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{arg} must be >= 0, got {value}")
    return value


class LengthStructure(NamedTuple):
    """Signature-level facts of the length arguments (see `check_length_structure`).

    max_seqlen_q / max_seqlen_kv: dense: Sq / Skv; thd: the max_seqlen arguments (ints).
    check_q / check_kv: the sizes a score_mod's tensor parameters must cover on the query /
    key axes (dense: Sq / Skv; thd: the max_seqlen arguments).
    """

    max_seqlen_q: int
    max_seqlen_kv: int
    check_q: int
    check_kv: int


def _check_cu_meta(arg: str, t: Any, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a (B+1,) int32 torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{arg} must have dtype torch.int32, got {t.dtype} (convert it with {arg}.int())")
    if t.dim() != 1 or t.numel() < 2:
        raise ValueError(f"{arg} must be 1-D of shape (B+1,) with B >= 1, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{arg} must be on the query's device {device}, got {t.device}")
    return t


def check_length_structure(qkv_format: str, attn_mask_type: str, query: torch.Tensor, key: torch.Tensor,
                           varlen: Any) -> LengthStructure:
    """Check the varlen arguments' types, dtypes, shapes and devices (no tensor values read).

    thd: cu_seqlens_q/kv required, (B+1,) int32 on the query's device, equal sizes;
    cu_seqlens_*_padded optional, same shape; max_seqlen_q/kv ints (the caller derives them
    from cu_seqlens when not given). Dense: cu_seqlens_q/kv only with a padding mask type, shape
    (B+1,); max_seqlen_* optional ints, at most the tensors' sequence lengths.
    """
    cu_q, cu_kv = varlen.cu_seqlens_q, varlen.cu_seqlens_kv
    cu_q_pad, cu_kv_pad = varlen.cu_seqlens_q_padded, varlen.cu_seqlens_kv_padded
    max_q = check_max_seqlen("max_seqlen_q", varlen.max_seqlen_q)
    max_kv = check_max_seqlen("max_seqlen_kv", varlen.max_seqlen_kv)
    dev, packed = query.device, qkv_format == "thd"
    if not packed:
        for arg, t in (("cu_seqlens_q_padded", cu_q_pad), ("cu_seqlens_kv_padded", cu_kv_pad)):
            if t is not None:
                raise ValueError(f"{arg} is only accepted with qkv_format='thd', got qkv_format={qkv_format!r}")
        ql, kl = logical_shape(query, qkv_format), logical_shape(key, qkv_format)
        batch, sq, skv = ql[0], ql[2], kl[2]
        _check_max_against("max_seqlen_q", max_q, [sq], "the query's sequence length")
        _check_max_against("max_seqlen_kv", max_kv, [skv], "the key's sequence length")
        if attn_mask_type not in PADDING_TYPES:
            if cu_q is not None or cu_kv is not None:
                raise ValueError(
                    f"cu_seqlens_q/cu_seqlens_kv given with qkv_format={qkv_format!r} and attn_mask_type="
                    f"{attn_mask_type!r}: use attn_mask_type='padding' or 'padding_causal' for padded batches")
            return LengthStructure(sq, skv, sq, skv)
    if cu_q is None or cu_kv is None:
        what = "qkv_format='thd'" if packed else f"attn_mask_type={attn_mask_type!r}"
        raise ValueError(f"{what} needs both cu_seqlens_q and cu_seqlens_kv, got "
                         f"cu_seqlens_q={'None' if cu_q is None else 'a tensor'}, "
                         f"cu_seqlens_kv={'None' if cu_kv is None else 'a tensor'}")
    _check_cu_meta("cu_seqlens_q", cu_q, dev)
    _check_cu_meta("cu_seqlens_kv", cu_kv, dev)
    if cu_q.numel() != cu_kv.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_kv must have the same batch size, got shapes "
                         f"{tuple(cu_q.shape)} and {tuple(cu_kv.shape)}")
    if not packed and cu_q.numel() != batch + 1:
        raise ValueError(f"cu_seqlens_q must have shape (B+1,) = ({batch + 1},) for batch size {batch}, got "
                         f"{tuple(cu_q.shape)}")
    for arg, t in (("cu_seqlens_q_padded", cu_q_pad), ("cu_seqlens_kv_padded", cu_kv_pad)):
        if t is not None:
            _check_cu_meta(arg, t, dev)
            if t.numel() != cu_q.numel():
                raise ValueError(f"{arg} must have the shape of cu_seqlens_q {tuple(cu_q.shape)}, got {tuple(t.shape)}")
    if not packed:
        return LengthStructure(sq, skv, sq, skv)
    if max_q is None or max_kv is None:  # pragma: no cover - the entry points derive them first
        raise ValueError("qkv_format='thd' needs max_seqlen_q and max_seqlen_kv")
    return LengthStructure(max_q, max_kv, max_q, max_kv)


def _check_offsets(arg: str, row: List[int]) -> None:
    if row[0] != 0:
        raise ValueError(f"{arg} must start at 0, got {row[0]} (first entries {row[:4]})")
    for i in range(1, len(row)):
        if row[i] < row[i - 1]:
            raise ValueError(f"{arg} must be non-decreasing, got {row[i - 1]} then {row[i]} at index {i}")


def derive_max_seqlens(varlen: Any) -> Tuple[int, int]:
    """Host max lengths of a thd batch from its cu_seqlens (one device->host copy: a sync on
    CUDA). Used only when max_seqlen_q/kv are not given."""
    cu_q, cu_kv = varlen.cu_seqlens_q, varlen.cu_seqlens_kv
    for arg, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() < 2:
            return (varlen.max_seqlen_q or 0, varlen.max_seqlen_kv or 0)  # check_length_structure names it
    if cu_q.device.type == "meta" or cu_kv.device.type == "meta":  # no values: check_length_structure names it
        return (varlen.max_seqlen_q or 0, varlen.max_seqlen_kv or 0)
    rows = [cu_q, cu_kv]
    if cu_q.shape != cu_kv.shape or cu_q.device != cu_kv.device or cu_q.dtype != cu_kv.dtype:
        return (varlen.max_seqlen_q or 0, varlen.max_seqlen_kv or 0)
    lens = (torch.stack(rows)[:, 1:] - torch.stack(rows)[:, :-1]).amax(dim=1).tolist()
    mq = varlen.max_seqlen_q if varlen.max_seqlen_q is not None else max(int(lens[0]), 0)
    mk = varlen.max_seqlen_kv if varlen.max_seqlen_kv is not None else max(int(lens[1]), 0)
    return mq, mk


def check_length_values(qkv_format: str, query: torch.Tensor, key: torch.Tensor, varlen: Any,
                        limits: Tuple[int, int]) -> None:
    """Check cu_seqlens *values*: start at 0, non-decreasing, end at the token count (thd, or
    the padded offsets' end), padded slots hold their sequence, lengths <= limits (dense: the
    tensors' sequence lengths; thd: max_seqlen). CPU tensors: one host read, ValueError naming
    the problem. CUDA tensors: one asynchronous device assertion (no host sync), memoized per
    (tensor, version) so a step's backward and repeated calls skip it."""
    names = ["cu_seqlens_q", "cu_seqlens_kv"]
    tensors = [varlen.cu_seqlens_q, varlen.cu_seqlens_kv]
    for arg, t in (("cu_seqlens_q_padded", varlen.cu_seqlens_q_padded),
                   ("cu_seqlens_kv_padded", varlen.cu_seqlens_kv_padded)):
        if t is not None:
            names.append(arg)
            tensors.append(t)
    for arg, t in zip(names, tensors):
        if t.is_meta:
            raise NotImplementedError(
                f"{arg} is a meta tensor (no data), but qkv_format={qkv_format!r} calls read the cu_seqlens values (checks "
                "and sequence offsets) per call; pass real cu_seqlens tensors (for shapes only, trace the call under "
                "torch.compile or FakeTensorMode)")
    packed = qkv_format == "thd"
    tokens = (query.shape[0], key.shape[0]) if packed else None
    if query.device.type == "cuda":
        key_ = (tuple((id(t), t._version) for t in tensors), tuple(names), tokens, limits)
        if _CHECKED.get_identity(key_, tuple(tensors)) is None:
            _check_values_on_device(names, tensors, tokens, limits)
            _CHECKED.put_identity(key_, tuple(tensors), True)
        return
    rows = dict(zip(names, torch.stack(tensors).tolist()))  # the one host read
    for arg, row in rows.items():
        _check_offsets(arg, row)
    host_q = [b - a for a, b in zip(rows["cu_seqlens_q"], rows["cu_seqlens_q"][1:])]
    host_kv = [b - a for a, b in zip(rows["cu_seqlens_kv"], rows["cu_seqlens_kv"][1:])]
    if packed:
        for side, count, lens in (("q", tokens[0], host_q), ("kv", tokens[1], host_kv)):
            _check_packed_totals(side, count, rows[f"cu_seqlens_{side}"], rows.get(f"cu_seqlens_{side}_padded"), lens)
        _check_max_against("max_seqlen_q", limits[0], host_q, "a sequence length")
        _check_max_against("max_seqlen_kv", limits[1], host_kv, "a sequence length")
    else:
        for arg, lens, s in (("cu_seqlens_q", host_q, limits[0]), ("cu_seqlens_kv", host_kv, limits[1])):
            if max(lens) > s:
                raise ValueError(f"{arg} gives a sequence length {max(lens)} > the tensors' sequence length {s}")


def _check_packed_totals(side: str, tokens: int, cu: List[int], pad: Optional[List[int]], lens: List[int]) -> None:
    tensor = "query" if side == "q" else "key/value"
    if pad is None:
        if cu[-1] != tokens:
            raise ValueError(f"cu_seqlens_{side}[-1] must equal the {tensor} token count {tokens}, got {cu[-1]}")
        return
    if pad[-1] != tokens:
        raise ValueError(f"cu_seqlens_{side}_padded[-1] must equal the {tensor} token count {tokens}, got {pad[-1]}")
    for b, n in enumerate(lens):
        if pad[b + 1] - pad[b] < n:
            raise ValueError(f"cu_seqlens_{side}_padded leaves {pad[b + 1] - pad[b]} tokens for sequence {b} of "
                             f"length {n}: each padded slot must hold its sequence")


def _check_max_against(arg: str, value: Optional[int], lengths: List[int], what: str) -> None:
    if value is not None and lengths and value < max(lengths):
        raise ValueError(f"{arg}={value} is smaller than {what} ({max(lengths)})")


#: CUDA cu_seqlens already checked, keyed by ((id, version) of each tensor, ...) and holding the tensors weakly. An entry
#: of a freed tensor misses (its id may be reused), and an in-place edit bumps
#: the version: a hit means the very same values.
_CHECKED = BoundedMemo(64, "length_checks.cu_seqlens")


def within(values: torch.Tensor, lo: List[int], hi: List[int], also: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A device bool: every `values[i]` (1-D int tensor) lies in [lo[i], hi[i]] (host ints) and,
    if given, the bool tensor `also` is all true.

    The bounds travel as one small host->device copy (pinned, non-blocking on CUDA), so the
    check is a clamp, a comparison and a reduction whatever the number of conditions, and no
    host synchronisation. While a CUDA graph is being captured the copy would read, at every
    replay, a pinned buffer the graph does not own: the bounds then go in as kernel scalars
    (`within_by_runs`)."""
    if capturing((values,)):
        ok = within_by_runs(values, lo, hi)
    else:
        bounds = torch.tensor([lo, hi], dtype=values.dtype, pin_memory=values.device.type == "cuda")
        bounds = bounds.to(values.device, non_blocking=True)
        ok = values.clamp(bounds[0], bounds[1]).eq_(values).all()
    return ok if also is None else ok & also.all()


def within_by_runs(values: torch.Tensor, lo: List[int], hi: List[int]) -> torch.Tensor:
    """`within` without a host->device copy: one clamp against kernel scalars per run of equal
    (lo, hi) bounds (a few runs: the bounds of cu_seqlens checks repeat per row)."""
    oks, start = [], 0
    for i in range(1, len(lo) + 1):
        if i == len(lo) or lo[i] != lo[start] or hi[i] != hi[start]:
            part = values[start:i]
            oks.append(part.clamp(lo[start], hi[start]).eq_(part).all())
            start = i
    return torch.stack(oks).all()


def assert_within(values: torch.Tensor, lo: List[int], hi: List[int], message: str,
                  also: Optional[torch.Tensor] = None) -> None:
    """One asynchronous device assertion of `within(values, lo, hi, also)`; CPU tensors fail
    right here (`_assert_async` raises on CPU)."""
    torch._assert_async(within(values, lo, hi, also), message)


def _check_values_on_device(names: List[str], tensors: List[torch.Tensor], tokens: Optional[Tuple[int, int]],
                            limits: Tuple[int, int]) -> None:
    """The value checks as one asynchronous device assertion: a violation stops the program
    at the next synchronization with the message below, instead of a ValueError at the call."""
    rows = torch.stack(tensors)
    n, batch = len(tensors), rows.shape[1] - 1
    diffs = rows[:, 1:] - rows[:, :-1]
    parts, lo, hi = [diffs.reshape(-1), rows[:, 0]], [], []
    big = 2 ** 31 - 1
    for i in range(n):  # lengths: the real ones <= their limit, padded slots >= 0
        lo += [0] * batch
        hi += [limits[i]] * batch if i < 2 else [big] * batch
    lo += [0] * n
    hi += [0] * n
    also = None
    if tokens is not None:
        end_q = names.index("cu_seqlens_q_padded") if "cu_seqlens_q_padded" in names else 0
        end_kv = names.index("cu_seqlens_kv_padded") if "cu_seqlens_kv_padded" in names else 1
        parts += [rows[end_q, -1:], rows[end_kv, -1:]]
        lo += [tokens[0], tokens[1]]
        hi += [tokens[0], tokens[1]]
        if n > 2:  # each padded slot holds its sequence
            real = [0 if name.startswith("cu_seqlens_q") else 1 for name in names[2:]]
            also = diffs[2:] >= diffs[real]
    assert_within(torch.cat(parts), lo, hi,
                  "fused_attn: invalid cu_seqlens: each must start at 0, be non-decreasing, end at the token count "
                  "(thd), and give lengths <= max_seqlen / the tensors' sequence length", also)
