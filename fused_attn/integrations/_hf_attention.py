"""The attention function of the transformers integration (transformers' AttentionInterface signature).

`make_attention_forward` returns the function `register()` adds to `AttentionInterface`: it maps
transformers' arguments (GQA, causal / KV cache, sliding_window, softcap, s_aux sinks, dropout,
scaling) onto `fused_attn.dot_product_attention` and dispatches a dense call or a thd call over the
lengths of a padding mask or packed batch (`_hf_lengths`); the mapping is described in
`fused_attn.integrations.transformers`.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Tuple

import torch

from ..functional import dot_product_attention
from ..memo import BoundedMemo
from ..tensor_kind import is_abstract
from ._hf_lengths import _check_same_offsets, _Lengths, _mask_lengths, _reduce_4d
from ._hf_refusal import _refused


def make_attention_forward(backend: str = "auto", deterministic: bool = False) -> Callable:
    """An attention function with transformers' AttentionInterface signature (see module doc)."""

    def fused_attn_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                           softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None,
                           **kwargs: Any) -> Tuple[torch.Tensor, None]:
        return _attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                          s_aux, backend, deterministic, kwargs), None

    fused_attn_forward.__doc__ = (f"transformers attention function running fused_attn.dot_product_attention "
                                  f"(backend={backend!r}); returns (out (B, Sq, H, Dv), None).")
    return fused_attn_forward


_SOFTCAPS = BoundedMemo(16, "integrations.transformers.softcap")
_WARNED: set = set()


def _softcap_mod(cap: Optional[float]) -> Any:
    """One `score_mods.softcap` object per value, shared by every layer and call."""
    if cap is None:
        return None
    from score_mods import softcap

    return _SOFTCAPS.get_or_create(float(cap), lambda: softcap(float(cap)))


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=4)


def _window(sliding_window: Any, causal: bool, max_q: int, max_kv: int) -> Optional[Tuple[int, int]]:
    """transformers' sliding_window W (keys within W tokens, the query's own included) as a
    flash-style window_size; None when it excludes no key."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")
    left = sliding_window - 1
    if causal:
        return None if max_kv - 1 <= left else (left, 0)
    return None if max(max_q, max_kv) - 1 <= left else (left, left)


#: Attention-function keywords that change the result and that fused_attn does not implement:
#: a call giving one of them (not None) is refused instead of computing plain attention.
UNSUPPORTED_KWARGS = {
    "position_bias": "position_bias (T5-style relative attention bias)",
    "indices": "indices (sparse attention: each query's selected keys, e.g. DeepSeek V3.2's indexer)",
    "block_indices": "block_indices (block-sparse key selection)",
    "sinks": "sinks (per-token sink logits; per-head sinks, passed as s_aux, are supported)",
    "head_mask": "head_mask (per-head scaling of the attention probabilities)",
}


def _attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, s_aux, backend,
               deterministic, kwargs) -> torch.Tensor:
    for name, what in UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise _refused(f"{what} is not supported; use attn_implementation='eager' (or another implementation "
                           "that supports it)")
    if kwargs.get("output_attentions", False):
        _warn_once("fused_attn does not return attention weights (output_attentions=True gives None); use "
                   "attn_implementation='eager' to get them")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"fused_attn (transformers): query/key/value must be (B, H, S, D), got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    common = dict(softmax_scale=scaling, score_mod=_softcap_mod(softcap), dropout_p=float(dropout or 0.0),
                  backend=backend, deterministic=bool(kwargs.get("deterministic") or deterministic))
    if s_aux is not None:
        common.update(softmax_type="learnable", sinks=s_aux)
    call = _Call(query, key, value, causal, sliding_window, common)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if is_abstract(query, key, value, attention_mask, cu_q, cu_k):
        # fake / meta tensors (tracing): the mask's values are unknown and never read; the output
        # has the metadata of the dense call of the same shapes, which is traced instead
        return call.dense(key, value)
    if cu_q is not None or cu_k is not None:
        if attention_mask is not None and attention_mask.dtype != torch.int32:
            raise _refused("both a padding attention_mask and cu_seq_lens_q/k were given; pass one of them")
        return call.packed_kwargs(cu_q, cu_k, kwargs.get("max_length_q"), kwargs.get("max_length_k"))
    if attention_mask is None:
        return call.dense(key, value)
    if not isinstance(attention_mask, torch.Tensor):
        raise _refused(f"an attention_mask of type {type(attention_mask).__name__} (e.g. a flex BlockMask) is not "
                       "supported; build the model with attn_implementation='fused_attn' so transformers calls "
                       "fused_attn's mask function")
    if attention_mask.dim() == 4:
        attention_mask = _reduce_4d(attention_mask, query.shape[0], query.shape[2], key.shape[2], causal,
                                    _window(sliding_window, causal, 1 << 62, 1 << 62))
    if attention_mask.dim() != 2:
        raise _refused(f"an attention_mask of shape {tuple(attention_mask.shape)} is not supported (2-D padding "
                       "masks, int32 segment ids or reducible 4-D masks are)")
    return call.masked(attention_mask)


class _Call:
    """One attention call: the configuration plus the dense / thd dispatch."""

    def __init__(self, query, key, value, causal, sliding_window, common):
        self.query, self.key, self.value = query, key, value
        self.causal, self.sliding_window, self.common = causal, sliding_window, common
        self.batch, self.heads, self.sq, self.d = query.shape

    def dense(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        sq, skv = self.sq, key.shape[2]
        mask = "no_mask"
        if self.causal:
            mask = "causal" if sq == skv else "causal_bottom_right"
        window = _window(self.sliding_window, self.causal, sq, skv)
        if window is not None and not self.causal and sq != skv:
            raise _refused("a non-causal sliding window with Sq != Skv (a KV cache) is not supported")
        return dot_product_attention(self.query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                     qkv_format="bshd", attn_mask_type=mask, window_size=window, **self.common)

    def thd(self, lengths: _Lengths, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        b, h, sq, d = self.query.shape
        q = self.query.transpose(1, 2).reshape(b * sq, h, d)
        k = key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[3])
        v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[3])
        mask = "no_mask"
        if self.causal:
            mask = "causal" if lengths.same_lengths else "causal_bottom_right"
        window = _window(self.sliding_window, self.causal, lengths.max_q if lengths.max_q is not None else q.shape[0],
                         lengths.max_kv if lengths.max_kv is not None else k.shape[0])
        if window is not None and not self.causal and not lengths.same_lengths:
            raise _refused("a non-causal sliding window with queries and keys of different lengths (a KV cache) is "
                           "not supported")
        out = dot_product_attention(q, k, v, qkv_format="thd", attn_mask_type=mask, window_size=window,
                                    cu_seqlens_q=lengths.cu_q, cu_seqlens_kv=lengths.cu_kv,
                                    cu_seqlens_q_padded=lengths.pad_q, cu_seqlens_kv_padded=lengths.pad_kv,
                                    max_seqlen_q=lengths.max_q, max_seqlen_kv=lengths.max_kv, **self.common)
        return out.view(b, sq, h, out.shape[-1])

    def packed_kwargs(self, cu_q, cu_k, max_q, max_k) -> torch.Tensor:
        """DataCollatorWithFlattening's cu_seq_lens_q/k (+ max_length_q/k): every token of the
        flattened batch belongs to a sequence (flash-attention's varlen convention)."""
        if cu_q is None or cu_k is None:
            raise ValueError("fused_attn (transformers): cu_seq_lens_q and cu_seq_lens_k must be given together")
        dev = self.query.device
        cu_q = cu_q.to(device=dev, dtype=torch.int32)
        cu_k = cu_k.to(device=dev, dtype=torch.int32)
        same = self.key.shape[2] == self.sq
        if same and cu_k is not cu_q and (self.causal or self.sliding_window is not None):
            _check_same_offsets(cu_q, cu_k)  # the alignment of a causal mask / window needs it
            cu_k = cu_q
        if max_q is None or max_k is None:  # the core derives them (a host read)
            max_q = max_k = None
        lengths = _Lengths(False, self.key.shape[2], cu_q, cu_k, None, None, None if max_q is None else int(max_q),
                           None if max_k is None else int(max_k), same_lengths=same and cu_k is cu_q)
        return self.thd(lengths, self.key, self.value)

    def masked(self, mask: torch.Tensor) -> torch.Tensor:
        width = mask.shape[1]
        if mask.shape[0] != self.batch or not self.sq <= width <= self.key.shape[2]:
            raise _refused(f"attention_mask of shape {tuple(mask.shape)} does not fit queries (B={self.batch}, "
                           f"Sq={self.sq}) and keys (Skv={self.key.shape[2]})")
        lengths = _mask_lengths(mask, self.sq, self.causal, self.sliding_window is not None)
        key, value = self.key, self.value
        if width < key.shape[2]:
            key, value = key[:, :, :width], value[:, :, :width]
        if lengths.dense:
            return self.dense(key, value)
        return self.thd(lengths, key, value)


#: The default attention function (backend "auto").
attention_forward = make_attention_forward()
