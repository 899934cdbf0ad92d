"""Variable-length (packed) attention with the signature of `torch.nn.attention.varlen.varlen_attn`.

A user swaps ``from torch.nn.attention.varlen import varlen_attn, AuxRequest`` for
``from fused_attn import varlen_attn, AuxRequest`` and may additionally pass a ``score_mod``.

Shape legend:
    N: number of sequences            T_q / T_k: total query / key tokens (sum of lengths)
    H_q / H_kv: query / key-value heads (H_kv == H_q unless enable_gqa)
    D / D_v: query-key / value head dim

Alignment (as flash-attention, and therefore torch's varlen_attn): causal masks and sliding
windows are *bottom-right* aligned per sequence. With q_len / k_len the lengths of one sequence
and shift = k_len - q_len, query i may attend key j iff

    i + shift - left <= j <= i + shift + right      (left / right = -1: unbounded)

so window_size=(-1, 0) (causal) with q_len=2, k_len=4 gives::

    q\\k 0 1 2 3
    0   x x x .
    1   x x x x

and a query row with no allowed key (q_len > k_len under causal) gets output 0 and lse -inf.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Tuple, Union

import torch


from .doc_packed import doc_packed_attn
from .functional import run_call, run_spec
from .memo import BoundedMemo
from .plan import Varlen
from .problem import Band
from .spec import AttentionSpec, loaded_mod, resolve_spec, stored_mod
from .validation import check_gqa, check_ranked, check_window, keyable_call

__all__ = ["AuxRequest", "varlen_attn", "varlen_attn_out", "doc_packed_attn"]


class AuxRequest(NamedTuple):
    """Which auxiliary outputs `varlen_attn` returns (lse: also return the log-sum-exp).

    A frozen record with the same field and constructor as torch's ``AuxRequest``.
    """

    lse: bool = False


def _check_window(window_size: object) -> Tuple[int, int]:
    """Validate a flash-style (left, right) window; -1 means unbounded on that side."""
    if window_size is None:
        raise ValueError("window_size must be a (left, right) pair of ints; use (-1, -1) for full attention, "
                         "(-1, 0) for causal")
    return check_window(window_size)


def _check_max(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _check_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool) -> None:
    """torch's rule: mismatched head counts need enable_gqa=True and H_q % H_kv == 0."""
    check_ranked((("query", query), ("key", key), ("value", value)), "THD")
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must agree on (T_k, H_kv), got key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    check_gqa(query.shape[1], key.shape[1], enable_gqa)


def _spec(left: int, right: int, same_lengths: bool, scale: Optional[float], score_mod: object,
          want_lse: bool) -> Tuple[AttentionSpec, object]:
    """The thd spec of a flash-style window, bottom-right aligned per sequence (top-left when
    queries and keys share one cu_seqlens tensor: the alignments then agree, and the top-left
    form is the one cuDNN serves next to a score_mod)."""
    mask = "causal" if right == 0 else "no_mask"
    window = None if (left, right) in ((-1, -1), (-1, 0)) else (left, right)
    spec, mod = resolve_spec(qkv_format="thd", attn_mask_type=mask, window_size=window, softmax_scale=scale,
                             score_mod=score_mod, return_lse=want_lse)
    if spec.band is not None and not same_lengths:
        spec = _bottom_right(spec)
    return spec, mod


def _bottom_right(spec: AttentionSpec) -> AttentionSpec:
    hit = _BR.get(spec)
    if hit is None:
        hit = dataclasses.replace(spec, band=Band(spec.band.left, spec.band.right, True))
        _BR.put(spec, hit)
    return hit


_BR = BoundedMemo(128, "varlen.bottom_right_spec")


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: Optional[torch.Tensor],
    max_q: int,
    max_k: int,
    *,
    return_aux: Optional[AuxRequest] = None,
    scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    score_mod: object = None,
    seqused_k: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention over packed variable-length sequences; drop-in for torch's ``varlen_attn``.

    Args:
        query: (T_q, H_q, D).  key: (T_k, H_kv, D).  value: (T_k, H_kv, D_v).
        cu_seq_q / cu_seq_k: (N+1,) int32 cumulative token offsets (start at 0, end at T_q / T_k).
        max_q / max_k: host ints >= the longest query / key sequence.
        return_aux: ``AuxRequest(lse=True)`` also returns the log-sum-exp.
        scale: softmax scale, default 1/sqrt(D).
        window_size: (left, right), flash-style and bottom-right aligned per sequence (see module
            docstring); (-1, -1) full, (-1, 0) causal, (W, 0) causal sliding window.
        enable_gqa: allow H_kv < H_q (H_q % H_kv == 0); otherwise head counts must match.
        score_mod: a ScoreMod (or anything `dot_product_attention(score_mod=...)` accepts),
            applied to scaled scores before the mask.
        seqused_k, block_table, num_splits: accepted for signature compatibility; anything but
            None raises NotImplementedError.

    Returns:
        out (T_q, H_q, D_v) in the query's dtype, or (out, lse) with lse fp32 (H_q, T_q)
        (the layout torch's varlen_attn actually returns), -inf on rows with no allowed key.
        Differentiable with respect to query, key and value.
    """
    for name, arg in (("seqused_k", seqused_k), ("block_table", block_table), ("num_splits", num_splits)):
        if arg is not None:
            raise NotImplementedError(
                f"varlen_attn: {name} (paged / split-KV decoding) is not supported, got {name}={arg!r}; "
                "pass None, or use torch.nn.attention.varlen.varlen_attn"
            )
    if cu_seq_k is None:
        raise NotImplementedError(
            "varlen_attn: cu_seq_k=None is only meaningful with a paged KV cache (block_table), "
            "which is not supported; pass the (N+1,) int32 key offsets"
        )
    key_ = _call_key(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux, scale, window_size,
                     enable_gqa, score_mod)
    hit = None if key_ is None else _CALLS.get_identity(key_, (score_mod,))
    if hit is not None:
        spec, mod = hit[0], loaded_mod(hit[1], score_mod)
        return run_spec(spec, mod, query, key, value, Varlen(cu_seq_q, cu_seq_k, None, None, max_q, max_k))
    if return_aux is not None and not isinstance(getattr(return_aux, "lse", None), bool):
        raise TypeError(f"return_aux must be None or AuxRequest(lse=...), got {return_aux!r}")
    _check_heads(query, key, value, enable_gqa)
    for name, cu in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be an (N+1,) int32 torch.Tensor, got {type(cu).__name__}")
    max_q = _check_max("max_q", max_q)
    max_k = _check_max("max_k", max_k)
    left, right = _check_window(window_size)
    want_lse = bool(return_aux is not None and return_aux.lse)
    varlen = Varlen(cu_seq_q, cu_seq_k, None, None, max_q, max_k)
    config = (left, right, cu_seq_q is cu_seq_k, scale, want_lse)
    if key_ is None:  # torch.compile, DTensor and other tensor types: the public path's own handling
        return run_call(_resolve, config, score_mod, query, key, value, varlen)
    spec, mod = _resolve(config, score_mod)
    _CALLS.put_identity(key_, (score_mod,), (spec, stored_mod(mod, score_mod)))
    return run_spec(spec, mod, query, key, value, varlen)


#: Checked varlen_attn calls: (spec, normalized score_mod) per (q / k / v shapes, max lengths,
#: window, scale, lse request, whether q and k share one cu_seqlens tensor, score_mod). The
#: layers of a model repeat one call's arguments, so only the first runs the argument checks
#: and resolves the spec (cu_seqlens values are checked on the device by every call). An entry
#: holds its score_mod weakly (a freed one's entry misses) and never the mod itself.
_CALLS = BoundedMemo(64, "varlen.calls")


def _call_key(query: object, key: object, value: object, cu_seq_q: object, cu_seq_k: object, max_q: object,
              max_k: object, return_aux: object, scale: object, window_size: object, enable_gqa: object,
              score_mod: object) -> Optional[tuple]:
    """The `_CALLS` key of a call, or None: only calls `keyable_call` accepts, with int max
    lengths, None or an AuxRequest and a bool enable_gqa, are keyed (equal keys mean equal
    arguments)."""
    if (type(max_q) is not int or type(max_k) is not int or type(enable_gqa) is not bool
            or (return_aux is not None and type(return_aux) is not AuxRequest)
            or not keyable_call((query, key, value, cu_seq_q, cu_seq_k), window_size, scale)):
        return None
    want_lse = None if return_aux is None else return_aux.lse
    if want_lse is not None and type(want_lse) is not bool:
        return None
    return (query.shape, key.shape, value.shape, max_q, max_k, want_lse, scale, window_size, enable_gqa,
            cu_seq_q is cu_seq_k, id(score_mod))


def varlen_attn_out(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: Optional[torch.Tensor],
    max_q: int,
    max_k: int,
    *,
    return_aux: Optional[AuxRequest] = None,
    scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    score_mod: object = None,
    seqused_k: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """`varlen_attn` writing its result into `out`; drop-in for torch's ``varlen_attn_out``.

    out: (T_q, H_q, D_v) in the query's dtype and on its device; every other argument as in
    `varlen_attn`. Returns `out` (or (out, lse)). Like torch's, it records no backward: with
    gradients required it raises (use `varlen_attn` for training, or call it under
    ``torch.no_grad()``). The attention is computed first and then copied into `out` (one write
    of the output more than `varlen_attn`), so `out` may alias the inputs.
    """
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    _check_heads(query, key, value, enable_gqa)
    want = (query.shape[0], query.shape[1], value.shape[2])
    if tuple(out.shape) != want or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must be a {want} {query.dtype} tensor on {query.device} (T_q, H_q, D_v), got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise NotImplementedError("varlen_attn_out writes into out and records no backward; use varlen_attn to train, "
                                  "or call varlen_attn_out under torch.no_grad()")
    got = varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux, scale=scale,
                      window_size=window_size, enable_gqa=enable_gqa, score_mod=score_mod, seqused_k=seqused_k,
                      block_table=block_table, num_splits=num_splits)
    if isinstance(got, tuple):
        out.copy_(got[0])
        return out, got[1]
    out.copy_(got)
    return out


def _resolve(config: tuple, score_mod: object) -> Tuple[AttentionSpec, object]:
    left, right, same_lengths, scale, want_lse = config
    return _spec(left, right, same_lengths, scale, score_mod, want_lse)
