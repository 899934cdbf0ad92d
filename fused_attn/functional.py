"""`dot_product_attention`: validate the arguments, build an AttentionProblem, dispatch to a backend."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from . import validation as V
from .backends import select
from .layouts import from_logical, logical_shape, to_logical
from .problem import BACKENDS, MASK_TYPES, QKV_FORMATS, AttentionProblem, Band

__all__ = ["dot_product_attention", "build_problem"]

_PADDING_TWIN = {"padding": "no_mask", "padding_causal": "causal"}


def dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    qkv_format: str = "bshd",
    attn_mask_type: str = "no_mask",
    window_size: Optional[Tuple[int, int]] = None,
    softmax_scale: Optional[float] = None,
    score_mod: Any = None,
    score_mod_tensors: Optional[dict] = None,
    score_mod_bprop: Any = None,
    score_mod_bprop_tensors: Optional[dict] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_kv: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_kv: Optional[int] = None,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """softmax(mask(score_mod(softmax_scale * Q K^T))) V.

    Shapes (B batch, S seq, H / Hkv heads, D / Dv head dims, T packed tokens):
        qkv_format "bshd": query (B, Sq, H, D), key (B, Skv, Hkv, D), value (B, Skv, Hkv, Dv)
                   "sbhd": (S, B, H, D)   "bhsd": (B, H, S, D)
                   "thd":  query (Tq, H, D), key/value (Tkv, Hkv, D|Dv) with cu_seqlens_q/kv (B+1,) int32
        out: the query's format with Dv; lse (return_lse=True): fp32 (B, H, Sq), or (H, Tq) for thd.
    H must be a multiple of Hkv (GQA/MQA). softmax_scale defaults to 1/sqrt(D).

    attn_mask_type:
        "no_mask"; "causal" (top-left: query i sees keys j <= i); "causal_bottom_right"
        (j <= i + Skv - Sq: the last query sees every key); "padding" / "padding_causal"
        (dense formats: sequence b has cu_seqlens_q[b+1] - cu_seqlens_q[b] real queries and
        likewise keys; rows past it are 0 with lse -inf and receive no gradient; with thd the
        padding types equal their non-padding twins, since thd always has lengths).

    window_size = (left, right), -1 = unbounded (flash-attention): query i sees keys j with
    -left <= j - (i + shift) <= right, shift = Skv - Sq (per sequence) with causal_bottom_right
    and 0 (top-left) otherwise. A causal type needs right in (0, -1). Sq = 3, Skv = 5:

        window (1, 0), top-left          causal_bottom_right + window (1, 0)  (shift = 2)
        q\\k 0 1 2 3 4                     q\\k 0 1 2 3 4
        0   x . . . .                     0   . x x . .
        1   x x . . .                     1   . . x x .
        2   . x x . .                     2   . . . x x

    Rows with no allowed key give out 0 and lse -inf, never NaN.

    score_mod: a `score_mods.ScoreMod`, a function (score, b, h, q_idx, kv_idx) -> score, or a
    raw cuDNN callback with score_mod_tensors / score_mod_bprop / score_mod_bprop_tensors. It
    sees scaled scores. Masks and windows are then applied as score_mods after it.

    cu_seqlens_*_padded (thd only): token offsets of each sequence when there are gaps.
    max_seqlen_q/kv: Python ints >= every length; for thd, None derives them from cu_seqlens.
    Validating cu_seqlens values costs one device->host copy (a sync on CUDA) per call.

    backend: "auto" (cuDNN on CUDA when it can serve, else the reference), "cudnn" or
    "reference"; an explicit backend that cannot serve raises NotImplementedError.
    deterministic: use cuDNN's deterministic backward (the reference is always deterministic).
    """
    problem, backend = build_problem(
        query, key, value, qkv_format=qkv_format, attn_mask_type=attn_mask_type, window_size=window_size,
        softmax_scale=softmax_scale, score_mod=score_mod, score_mod_tensors=score_mod_tensors,
        score_mod_bprop=score_mod_bprop, score_mod_bprop_tensors=score_mod_bprop_tensors,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_kv_padded=cu_seqlens_kv_padded, return_lse=return_lse, backend=backend,
        deterministic=deterministic)
    out, lse = select.run(problem, backend)
    if not problem.is_packed:
        out = from_logical(out, qkv_format)
    return (out, lse) if return_lse else out


def build_problem(query: Any, key: Any, value: Any, *, qkv_format: str = "bshd", attn_mask_type: str = "no_mask",
                  window_size: Any = None, softmax_scale: Any = None, score_mod: Any = None,
                  score_mod_tensors: Any = None, score_mod_bprop: Any = None, score_mod_bprop_tensors: Any = None,
                  cu_seqlens_q: Any = None, cu_seqlens_kv: Any = None, max_seqlen_q: Any = None,
                  max_seqlen_kv: Any = None, cu_seqlens_q_padded: Any = None, cu_seqlens_kv_padded: Any = None,
                  return_lse: bool = False, backend: str = "auto",
                  deterministic: bool = False) -> Tuple[AttentionProblem, str]:
    """Validate the arguments of `dot_product_attention`; return (AttentionProblem, backend name)."""
    V.check_choice("qkv_format", qkv_format, QKV_FORMATS)
    V.check_choice("attn_mask_type", attn_mask_type, MASK_TYPES)
    V.check_choice("backend", backend, BACKENDS)
    V.check_bool("return_lse", return_lse)
    V.check_bool("deterministic", deterministic)
    V.check_qkv(query, key, value, qkv_format)
    packed = qkv_format == "thd"
    window = V.check_window(window_size)
    band = V.resolve_band(_PADDING_TWIN.get(attn_mask_type, attn_mask_type) if packed else attn_mask_type, window)
    scale = V.check_scale(softmax_scale, query.shape[-1])
    lengths = V.check_lengths(qkv_format, attn_mask_type, query, key, cu_seqlens_q, cu_seqlens_kv,
                              cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv)
    mod = None
    if any(x is not None for x in (score_mod, score_mod_tensors, score_mod_bprop, score_mod_bprop_tensors)):
        from score_mods import as_score_mod

        mod = as_score_mod(score_mod, tensors=score_mod_tensors, bprop=score_mod_bprop,
                           bprop_tensors=score_mod_bprop_tensors)
    native = getattr(mod, "native_band", None)
    if native is not None:
        as_band = Band(*native)
        if band is None or band == as_band:  # a pure mask: the backend's own band serves it
            band, mod = as_band, None
    if mod is not None:
        mod = _with_masks(mod, band, padded=lengths.seqlens_q is not None)
        band = None
        heads = logical_shape(query, qkv_format)[1]
        batch = cu_seqlens_q.numel() - 1 if packed else logical_shape(query, qkv_format)[0]
        mod.check(device=query.device, batch=batch, heads=heads, seqlen_q=lengths.max_seqlen_q,
                  seqlen_kv=lengths.max_seqlen_kv)
    if packed:
        q, k, v = query, key, value
    else:
        q, k, v = (to_logical(t, qkv_format) for t in (query, key, value))
    problem = AttentionProblem(
        query=q, key=k, value=v, qkv_format=qkv_format, scale=scale, band=band,
        seqlens_q=lengths.seqlens_q, seqlens_kv=lengths.seqlens_kv,
        cu_seqlens_q=cu_seqlens_q if packed else None, cu_seqlens_kv=cu_seqlens_kv if packed else None,
        cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
        max_seqlen_q=lengths.max_seqlen_q, max_seqlen_kv=lengths.max_seqlen_kv, score_mod=mod,
        return_lse=return_lse, deterministic=deterministic)
    return problem, backend


def _with_masks(mod: Any, band: Optional[Band], padded: bool) -> Any:
    """compose(mod, <band as a score_mod>, <padding mask>): cuDNN refuses its masks with a score_mod."""
    from score_mods.library import causal, causal_bottom_right, compose, padding_mask, sliding_window

    parts = []
    if band is not None:
        if band.left is None and band.right == 0:
            parts.append(causal_bottom_right() if band.bottom_right else causal())
        else:
            left = -1 if band.left is None else band.left
            right = -1 if band.right is None else band.right
            parts.append(sliding_window(left, right, band.bottom_right))
    if padded:
        parts.append(padding_mask())
    return compose(mod, *parts) if parts else mod


def fuse_masks(score_mod: Any, attn_mask_type: str, window_size: Any, qkv_format: str) -> Optional[Any]:
    """The one ScoreMod that `dot_product_attention` would run for (score_mod, mask, window), or
    None when it would not compose (no score_mod, no band, a padding mask that needs per-call
    lengths, or a pure mask served by the backend's own band).

    `DotProductAttention` calls it once per configuration, so a compiled model never builds
    score_mod objects while being traced.
    """
    if score_mod is None or attn_mask_type in ("padding", "padding_causal"):
        return None
    from score_mods import ScoreMod, as_score_mod

    mod = as_score_mod(score_mod)
    if not isinstance(mod, ScoreMod):
        return None
    packed = qkv_format == "thd"
    band = V.resolve_band(_PADDING_TWIN.get(attn_mask_type, attn_mask_type) if packed else attn_mask_type,
                          V.check_window(window_size))
    native = getattr(mod, "native_band", None)
    if band is None or (native is not None and Band(*native) == band):
        return None
    return _with_masks(mod, band, padded=False)
