"""Backend-independent input checks for `dot_product_attention`.

Every check raises TypeError (wrong type/dtype) or ValueError (wrong value/shape/device) naming
the argument, the value received and what is accepted; they run once per call plan. The checks of
per-sequence lengths (cu_seqlens, max_seqlen) are `length_checks`.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import torch

from .layouts import logical_shape
from .problem import Band

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PADDING_TYPES = ("padding", "padding_causal")
CAUSAL_TYPES = ("causal", "causal_bottom_right", "padding_causal")
_FP32_MAX = 3.4028234663852886e38


def check_choice(arg: str, value: Any, choices: Sequence[str]) -> str:
    """`value` must be one of `choices` (strings)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{arg}={value!r} is not supported; accepted: {', '.join(map(repr, choices))}")
    return value


def check_bool(arg: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{arg} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def check_window(window_size: Any) -> Optional[Tuple[int, int]]:
    """None or (left, right) ints >= -1 (-1 = unbounded side), as in flash-attention."""
    if window_size is None:
        return None
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be None or a (left, right) pair of ints >= -1, got {window_size!r}")
    for side, v in zip(("left", "right"), window_size):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"window_size {side} must be an int >= -1 (-1 = unbounded), got {v!r} ({type(v).__name__})")
        if v < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 = unbounded), got {v}; accepted: ints in "
                             f"[-1, {MAX_WINDOW}]")
        if v > MAX_WINDOW:
            raise ValueError(f"window_size {side} must be <= {MAX_WINDOW} (a bound past the sequence lengths is "
                             f"unbounded already; -1 = unbounded), got {v}; accepted: ints in [-1, {MAX_WINDOW}]")
    return int(window_size[0]), int(window_size[1])


#: The largest window bound accepted (int32, as the kernels' band bounds).
MAX_WINDOW = 2 ** 31 - 1


def keyable_call(tensors: Tuple[Any, ...], window_size: Any, scale: Any) -> bool:
    """Whether a packed call's arguments can key a memo of its checked configuration: plain
    torch.Tensors, a window of exactly two ints, a float or None scale, outside torch.compile
    (so equal keys mean equal arguments: True / 1 / 1.0 never meet). Other calls are checked in
    full every time, and refused with the reason if bad."""
    return (all(type(t) is torch.Tensor for t in tensors) and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int
            and (scale is None or type(scale) is float) and not torch.compiler.is_compiling())


def resolve_band(attn_mask_type: str, window: Optional[Tuple[int, int]]) -> Optional[Band]:
    """The Band for a mask type and window (None: every key allowed)."""
    bottom_right = attn_mask_type == "causal_bottom_right"
    if attn_mask_type in CAUSAL_TYPES:
        left, right = window if window is not None else (-1, 0)
        if right not in (0, -1):
            raise ValueError(
                f"window_size={window!r} with attn_mask_type={attn_mask_type!r}: a causal mask needs the window's "
                "right bound to be 0 or -1; use attn_mask_type='no_mask' (or 'padding') for a two-sided window")
        return Band(None if left == -1 else left, 0, bottom_right)
    if window is None or window == (-1, -1):
        return None
    left, right = window
    return Band(None if left == -1 else left, None if right == -1 else right, False)


def check_scale(softmax_scale: Any, head_dim: int) -> float:
    """softmax_scale: None (1/sqrt(head_dim)) or a positive finite number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a positive finite float or None, got {softmax_scale!r} "
                        f"({type(softmax_scale).__name__})")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0 or softmax_scale > _FP32_MAX:
        raise ValueError(f"softmax_scale must be a positive float or None, finite in float32 (<= {_FP32_MAX:.3e}: "
                         f"scores are computed in float32), got {softmax_scale!r}")
    return float(softmax_scale)


def check_qkv(query: Any, key: Any, value: Any, qkv_format: str) -> None:
    """Types, ranks, dtypes, devices, batch/sequence agreement, heads and head dims of q/k/v."""
    rank = 3 if qkv_format == "thd" else 4
    dims = "(T, H, D)" if rank == 3 else f"({', '.join(qkv_format.upper())})"
    tensors = (("query", query), ("key", key), ("value", value))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be a {rank}-D {dims} tensor for qkv_format={qkv_format!r}, "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have a floating dtype (float16, bfloat16, float32, float64), got {t.dtype}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if not query.device == key.device == value.device:
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device}, "
                         f"{value.device}")
    q, k, v = (logical_shape(t, qkv_format) for t in (query, key, value))
    if rank == 4 and not q[0] == k[0] == v[0]:
        raise ValueError(f"query, key and value must have one batch size, got {q[0]}, {k[0]}, "
                         f"{v[0]} (qkv_format={qkv_format!r})")
    seq_k, seq_v = k[2], v[2]
    if seq_k != seq_v:
        raise ValueError(f"key and value must have one sequence length (token count), got {seq_k} and {seq_v}")
    h, hk, hv = q[1], k[1], v[1]
    if hk != hv:
        raise ValueError(f"key and value must have the same number of heads, got {hk} and {hv}")
    if h < 1 or hk < 1:
        raise ValueError(f"query, key and value need at least one head, got {h} query and {hk} key/value heads "
                         f"(qkv_format={qkv_format!r}: heads are dim {qkv_format.index('h')})")
    if h % hk != 0:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hk}) for GQA/MQA")
    if q[3] != k[3]:
        raise ValueError(f"query and key must have the same head dim, got {q[3]} and {k[3]}")
    for name, t in tensors:
        if t.shape[-1] < 1:
            raise ValueError(f"{name} must have a head dim >= 1, got shape {tuple(t.shape)}")


def check_ranked(tensors: Sequence[Tuple[str, Any]], dims: str) -> None:
    """Each (name, tensor) must be a torch.Tensor of shape `dims`, one letter a dim ("THD": (T, H, D))."""
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != len(dims):
            raise ValueError(f"{name} must have shape ({', '.join(dims)}) ({len(dims)} dims), got shape "
                             f"{tuple(t.shape)}")


def check_gqa(h_q: int, h_kv: int, enable_gqa: Any, q_heads: str = "H_q") -> None:
    """torch's head rule: h_q != h_kv needs enable_gqa=True and h_q % h_kv == 0 (q_heads: how
    the message names the query heads)."""
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {enable_gqa!r}")
    if not enable_gqa and h_q != h_kv:
        raise ValueError(
            f"query and key/value must have the same number of heads, got {q_heads}={h_q} and H_kv={h_kv}; "
            "pass enable_gqa=True for grouped-query attention"
        )
    if enable_gqa and (h_kv == 0 or h_q % h_kv != 0):
        raise ValueError(f"with enable_gqa=True, the number of query heads must be a multiple of kv heads, got "
                         f"{q_heads}={h_q} and H_kv={h_kv}")


def check_sinks(softmax_type: str, sinks: Any, heads: int, device: torch.device) -> bool:
    """softmax_type "learnable" needs sinks: a floating (H,) tensor on the query's device; the
    other types take none. Returns whether the call has a sink logit per head."""
    if softmax_type == "vanilla":
        if sinks is not None:
            raise ValueError("sinks given with softmax_type='vanilla'; use softmax_type='learnable'")
        return False
    if softmax_type == "off-by-one":
        if sinks is not None:
            raise ValueError("sinks given with softmax_type='off-by-one' (its sink logit is fixed at 0); use "
                             "softmax_type='learnable' for trained sinks")
        return True
    if sinks is None:
        raise ValueError("softmax_type='learnable' needs sinks: a floating (H,) tensor of per-head sink logits")
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape (H,), got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must have a floating dtype, got {sinks.dtype}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape (H,) = ({heads},), got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on the query's device {device}, got {sinks.device}")
    return True
