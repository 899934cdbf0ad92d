"""transformers' mask interface for fused_attn: what a masking_utils mask function means.

`parse_mask_function` reads a composition of masking_utils primitives as a `MaskPattern` (causal
or bidirectional, sliding window, packed sequences) and refuses every other pattern;
`attention_mask_function` is the function `register()` adds to `AttentionMaskInterface`: it
returns None, a 2-D padding mask or packed segment ids, never a dense (B, 1, Sq, Skv) mask.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from ._hf_refusal import _refused

_MU = "transformers.masking_utils"


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
