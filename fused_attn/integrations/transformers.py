"""fused_attn as a Hugging Face transformers attention implementation (transformers >= 5.17).

    import fused_attn.integrations.transformers as fa_hf
    fa_hf.register()                                   # adds attn_implementation="fused_attn"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fused_attn")
    # or, for a loaded model: model.set_attn_implementation("fused_attn")

`register()` adds two functions to transformers under one name: the attention function (the
`AttentionInterface` signature, called by every attention layer) and a mask function (the
`AttentionMaskInterface`, called once per forward and layer type by `create_causal_mask` /
`create_sliding_window_causal_mask`), so the model never builds a dense (B, 1, Sq, Skv) mask.

How transformers' arguments map onto `fused_attn.dot_product_attention`:

* query (B, H, Sq, D), key/value (B, Hkv, Skv, D|Dv): GQA is not expanded; the result is
  (B, Sq, H, Dv) (the call runs on bshd views, so the output needs no transpose copy).
* `is_causal` (kwarg, else `module.is_causal`, default True): "causal" when Sq == Skv, else
  "causal_bottom_right" (the queries are the last Sq keys: a KV cache).
* `sliding_window=W` (Mistral / Qwen2 / Gemma 2 / gpt-oss, the flash-attention convention of
  transformers): a causal query sees W keys including its own, i.e. eager's
  `kv_idx > q_idx - W`: window_size=(W - 1, 0); non-causal: (W - 1, W - 1). Omitted when it
  cannot exclude a key (W >= every length).
* `softcap=c` (Gemma 2's attn_logit_softcapping): score_mod `score_mods.softcap(c)`, one object
  per value (shared by every layer, so plans, graphs and compiled code are reused); masks and
  windows apply after it, as in eager.
* `s_aux` (gpt-oss sinks, (H,)): softmax_type="learnable", sinks=s_aux (trained: it gets a gradient).
* `scaling` -> softmax_scale; `dropout` -> dropout_p (models pass 0.0 outside training).
* Padding: the mask function returns the 2-D padding mask (bool (B, W), W = keys up to the last
  query); the attention function turns it, once per mask tensor, into packed thd with
  `cu_seqlens_*` and `cu_seqlens_*_padded` (no copy of q/k/v when their layout allows a view):
  left, right and per-row contiguous padding. Causal: padded query positions get 0 (as
  flash-attention; eager gives them an average of every value); bidirectional: every query
  attends the row's tokens (eager's semantics).
* Packed batches (`DataCollatorWithFlattening`): `cu_seq_lens_q/k` + `max_length_q/k` kwargs (no
  host sync), else the packing transformers detects in `position_ids` (when no cache is used:
  pass use_cache=False, as for eager and sdpa), which the mask function returns as int32
  segment ids (B, S) (0 = padding). transformers >= 5.24 evaluates such a row's pattern at
  per-sequence positions; for causal / bidirectional / window patterns that is the same mask.
* A prepared 4-D mask (bool, or additive 0 / large negative) is reduced to lengths when it is
  exactly causal/window + contiguous padding; anything else raises NotImplementedError.

Refused with NotImplementedError naming the case (never silently different): `or_mask_function`
/ custom and chunked / block-wise mask patterns, 4-D masks with biases or irregular patterns,
flex BlockMasks, the keywords in `UNSUPPORTED_KWARGS` (`position_bias`, sparse-attention
`indices` / `block_indices`, per-token `sinks`, `head_mask`), padding with holes inside a row,
a non-causal sliding window with a KV cache, packed position_ids with a padding mask or a cache. Padded batches cost one
host read per forward (per mask tensor, shared by the layers); dense and `cu_seq_lens_*` calls
cost none. torch.compile works with graph breaks at the mask handling (fullgraph=True does not:
transformers' mask closures cannot be read while tracing).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, NamedTuple, Optional, Tuple

import torch

from ..tensor_kind import is_abstract
from ..functional import dot_product_attention
from ..memo import BoundedMemo

__all__ = ["NAME", "register", "unregister", "make_attention_forward", "attention_forward", "attention_mask_function",
           "MaskPattern", "parse_mask_function", "UNSUPPORTED_KWARGS"]

#: The attn_implementation name `register()` uses by default.
NAME = "fused_attn"
_INSTALL = "pip install -e '.[hf]' from the fused_attn checkout (transformers>=5.17,<6)"


# ----------------------------------------------------------------------------- registration

def register(name: str = NAME, *, backend: str = "auto", deterministic: bool = False) -> str:
    """Register fused_attn with transformers as `attn_implementation=name`; returns `name`.

    backend / deterministic: passed to every `dot_product_attention` call ("auto": cuDNN on
    CUDA when it can serve, else the reference backend with a FallbackWarning).
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as exc:  # pragma: no cover - the tests skip without transformers
        raise ImportError(f"fused_attn.integrations.transformers needs transformers: {_INSTALL}") from exc
    AttentionInterface.register(name, make_attention_forward(backend=backend, deterministic=deterministic))
    AttentionMaskInterface.register(name, attention_mask_function)
    return name


def unregister(name: str = NAME) -> None:
    """Remove `name` from transformers' attention and mask interfaces (no error if absent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)


# ----------------------------------------------------------------------------- mask function

_MU = "transformers.masking_utils"


def _refused(what: str) -> NotImplementedError:
    return NotImplementedError(f"fused_attn (transformers): {what}")


class MaskPattern(NamedTuple):
    """What a transformers mask function (a composition of masking_utils primitives) means.

    causal: causal (True) or bidirectional base; window: the sliding-window overlay's size
    (None: none); packed: the (B, S) sequence index of each token (packed position_ids), or None.
    """

    causal: bool
    window: Optional[int]
    packed: Optional[torch.Tensor]


def _cell(fn: Callable, name: str) -> Any:
    return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


_REFUSED = {
    "or_masks.<locals>.or_mask": "a union of mask patterns (or_mask_function, e.g. bidirectional image tokens)",
    "chunked_overlay.<locals>.inner_mask": "chunked attention (attention_chunk_size, e.g. Llama 4)",
    "blockwise_overlay.<locals>.inner_mask": "block-wise bidirectional groups (block_sequence_ids)",
}


def parse_mask_function(mask_function: Callable) -> MaskPattern:
    """The MaskPattern of a masking_utils mask function; NotImplementedError for any other pattern."""
    leaves: list = []
    stack = [mask_function]
    remapped = False
    while stack:
        fn = stack.pop()
        qual = getattr(fn, "__qualname__", "") if getattr(fn, "__module__", None) == _MU else None
        if qual == "and_masks.<locals>.and_mask":
            stack.extend(_cell(fn, "mask_functions"))
        elif qual == "remap_positions_for_packed_sequence.<locals>.inner_mask":
            # transformers >= 5.24 evaluates the pattern at per-sequence positions of packed rows. Within
            # one packed sequence positions rise by exactly 1 (that is how transformers finds the
            # sequences), so q - kv is unchanged, and every pattern accepted here depends on q - kv only
            # (causal, bidirectional, windows): the remap changes nothing inside a sequence, and the
            # packed-sequence mask (required below) removes every pair across sequences.
            remapped = True
            stack.append(_cell(fn, "mask_function"))
        else:
            leaves.append(fn)
    base, window, packed = None, None, None
    for fn in leaves:
        qual = getattr(fn, "__qualname__", type(fn).__name__)
        if getattr(fn, "__module__", None) != _MU or qual in _REFUSED:
            what = _REFUSED.get(qual, f"the custom mask function {getattr(fn, '__module__', '?')}.{qual}")
            raise _refused(f"{what} cannot be expressed as causal / sliding window / padding / packed sequences; use "
                           "attn_implementation='sdpa' or 'eager'")
        if qual == "causal_mask_function":
            base = True if base is None else base
        elif qual == "bidirectional_mask_function":
            base = False if base is None else base
        elif qual == "sliding_window_overlay.<locals>.inner_mask":
            window = int(_cell(fn, "sliding_window"))
        elif qual == "sliding_window_bidirectional_overlay.<locals>.inner_mask":
            window = int(_cell(fn, "sliding_window"))
        elif qual == "packed_sequence_mask_function.<locals>.inner_mask":
            packed = _cell(fn, "packed_sequence_mask")
        else:
            raise _refused(f"the mask primitive {_MU}.{qual} is not supported; use attn_implementation='sdpa' or "
                           "'eager'")
    if base is None:
        raise _refused("a mask function without a causal or bidirectional base is not supported; use "
                       "attn_implementation='sdpa' or 'eager'")
    if remapped and packed is None:
        raise _refused("positions remapped per packed sequence without the packed-sequence mask are not supported; "
                       "use attn_implementation='sdpa' or 'eager'")
    return MaskPattern(base, window, packed)


@torch.compiler.disable  # reads closures and mask values on the host: a graph break under torch.compile
def attention_mask_function(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
                            mask_function: Optional[Callable] = None, attention_mask: Optional[torch.Tensor] = None,
                            **kwargs: Any) -> Optional[torch.Tensor]:
    """transformers' mask-interface function for fused_attn: never builds a (B, 1, Sq, Skv) mask.

    Returns None (no padding, no packing: the attention function uses causal / window alone),
    a bool (B, W) padding mask over the keys 0..W-1 the queries can reach (W = the keys up to
    the last query; the queries are the last q_length of them), or int32 (B, S) segment ids of
    packed sequences (0 = padding). Raises NotImplementedError for patterns it cannot carry.
    """
    pattern = parse_mask_function(mask_function) if mask_function is not None else MaskPattern(True, None, None)
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    device = kwargs.get("device", "cpu")
    if pattern.packed is not None:
        if attention_mask is not None or q_offset or kv_offset or q_length != kv_length:
            raise _refused("packed position_ids together with a padding mask or a KV cache are not supported")
        return pattern.packed.to(device=device, dtype=torch.int32) + 1
    width = kv_length
    if pattern.causal:  # keys after the last query are masked for every query: drop them
        width = q_offset + q_length - kv_offset
        if not q_length <= width <= kv_length:
            raise _refused(f"queries at {q_offset}..{q_offset + q_length - 1} do not end inside the keys "
                           f"{kv_offset}..{kv_offset + kv_length - 1}")
    if attention_mask is None:
        return None if width == kv_length else torch.ones(batch_size, width, dtype=torch.bool, device=device)
    mask = attention_mask.to(device=device, dtype=torch.bool)
    if mask.shape[-1] < kv_offset + width:  # as eager: keys past the 2-D mask are padding
        mask = torch.nn.functional.pad(mask, (0, kv_offset + width - mask.shape[-1]))
    return mask if (kv_offset == 0 and mask.shape[-1] == width) else mask[:, kv_offset:kv_offset + width]


# ----------------------------------------------------------------------------- attention function

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
_PREPARED = BoundedMemo(16, "integrations.transformers.mask_lengths")
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


#: The default attention function (backend "auto").
attention_forward = make_attention_forward()
