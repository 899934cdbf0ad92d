"""`DotProductAttention`: an nn.Module holding the attention configuration (Transformer Engine style)."""

from __future__ import annotations

import inspect
from typing import Any, Optional, Tuple, Union

import torch
from torch import nn

from . import validation as V
from .functional import dot_product_attention, fuse_masks
from .layouts import dims
from .problem import BACKENDS, MASK_TYPES, QKV_FORMATS

__all__ = ["DotProductAttention"]

_CALL_KWARGS = frozenset(inspect.signature(dot_product_attention).parameters) - {"query", "key", "value"}
#: Per-call overrides that change what the configured score_mod composes with.
_MASK_KWARGS = frozenset({"attn_mask_type", "window_size", "qkv_format", "score_mod", "score_mod_tensors",
                          "score_mod_bprop", "score_mod_bprop_tensors"})


def _stable_mod(current: Any, new: Any) -> Any:
    """The score_mod object the module passes per call, kept the same object across value changes.

    A traced mod with the same structure and tensor parameters as `current` updates `current`'s
    float values (and its scalar tensor) in place, so torch.compile, which guards on the object,
    sees one object and a tensor of values: changing softcap 30 -> 50 neither rebuilds a cuDNN
    graph nor recompiles. Otherwise a private copy (the user's object is never mutated).
    """
    try:
        from score_mods.trace import TracedMod
    except ImportError:  # pragma: no cover - score_mods ships with fused_attn
        return new
    if not isinstance(new, TracedMod):
        return new
    if isinstance(current, TracedMod) and current.take_values(new):
        return current
    copy = new.private_copy()
    copy.scalar_tensor()  # made here, outside any compiled region
    from .ops import prepare_score_mod

    prepare_score_mod(copy)
    return copy


def _positive_int(arg: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{arg} must be a positive int, got {value}")
    return value


class DotProductAttention(nn.Module):
    """Scaled dot-product attention with masks, windows, GQA, varlen and score_mods.

    Args:
        num_attention_heads: H, query heads.
        kv_channels: head dim D of query/key and value, or a (D_qk, D_v) pair.
        num_gqa_groups: Hkv, key/value heads (default H); H must be a multiple of it.
        qkv_format, attn_mask_type, window_size, softmax_scale, score_mod, backend,
        deterministic: defaults for `fused_attn.dot_product_attention`.

    forward(query, key, value, **overrides): any keyword of `dot_product_attention`
    (attn_mask_type, score_mod, cu_seqlens_q, return_lse, ...) overrides the default for one call.
    Shapes: see `dot_product_attention` (e.g. bshd: query (B, S, H, D) -> out (B, S, H, D_v)).
    """

    def __init__(self, num_attention_heads: int, kv_channels: Union[int, Tuple[int, int]],
                 num_gqa_groups: Optional[int] = None, qkv_format: str = "bshd", attn_mask_type: str = "no_mask",
                 window_size: Optional[Tuple[int, int]] = None, softmax_scale: Optional[float] = None,
                 score_mod: Any = None, backend: str = "auto", deterministic: bool = False) -> None:
        super().__init__()
        self.num_attention_heads = _positive_int("num_attention_heads", num_attention_heads)
        if isinstance(kv_channels, (tuple, list)):
            if len(kv_channels) != 2:
                raise ValueError(f"kv_channels must be an int or a (qk, v) pair of ints, got {kv_channels!r}")
            self.head_dim_qk = _positive_int("kv_channels[0]", kv_channels[0])
            self.head_dim_v = _positive_int("kv_channels[1]", kv_channels[1])
        else:
            self.head_dim_qk = self.head_dim_v = _positive_int("kv_channels", kv_channels)
        self.num_gqa_groups = (self.num_attention_heads if num_gqa_groups is None
                               else _positive_int("num_gqa_groups", num_gqa_groups))
        if self.num_attention_heads % self.num_gqa_groups != 0:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_gqa_groups ({self.num_gqa_groups})")
        self.qkv_format = V.check_choice("qkv_format", qkv_format, QKV_FORMATS)
        self.attn_mask_type = V.check_choice("attn_mask_type", attn_mask_type, MASK_TYPES)
        self.window_size = V.check_window(window_size)
        if self.window_size is not None:
            V.resolve_band(attn_mask_type, self.window_size)  # causal + two-sided window -> ValueError
        if softmax_scale is not None:
            V.check_scale(softmax_scale, self.head_dim_qk)
        self.softmax_scale = softmax_scale
        self.score_mod = score_mod
        self.backend = V.check_choice("backend", backend, BACKENDS)
        self.deterministic = V.check_bool("deterministic", deterministic)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                **overrides: Any) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        unknown = sorted(set(overrides) - _CALL_KWARGS)
        if unknown:
            raise TypeError(f"DotProductAttention.forward got unexpected keyword(s) {unknown}; accepted: "
                            f"{sorted(_CALL_KWARGS)}")
        kwargs = dict(qkv_format=self.qkv_format, attn_mask_type=self.attn_mask_type, window_size=self.window_size,
                      softmax_scale=self.softmax_scale, score_mod=self.score_mod, backend=self.backend,
                      deterministic=self.deterministic)
        if self._call_mod is not None and not _MASK_KWARGS.intersection(overrides):
            # The configured score_mod (composed once with the configured mask; see the setter).
            kwargs["score_mod"] = self._call_mod
            if self._mask_fused:
                kwargs.update(attn_mask_type="no_mask", window_size=None)
        kwargs.update(overrides)
        fmt = V.check_choice("qkv_format", kwargs["qkv_format"], QKV_FORMATS)
        rank = 3 if fmt == "thd" else 4
        if all(isinstance(t, torch.Tensor) and t.dim() == rank for t in (query, key, value)):
            self._check_config(query, key, value, fmt)  # the functional API checks everything else
        return dot_product_attention(query, key, value, **kwargs)

    @property
    def score_mod(self) -> Any:
        """The configured score_mod; setting it recomposes it with the configured mask once."""
        return self._score_mod

    @score_mod.setter
    def score_mod(self, value: Any) -> None:
        self._score_mod = value
        fused = fuse_masks(value, self.attn_mask_type, self.window_size, self.qkv_format)
        self._mask_fused = fused is not None
        self._call_mod = _stable_mod(getattr(self, "_call_mod", None), value if fused is None else fused)

    def _check_config(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, fmt: str) -> None:
        want = (("query", query, self.num_attention_heads, self.head_dim_qk, "num_attention_heads"),
                ("key", key, self.num_gqa_groups, self.head_dim_qk, "num_gqa_groups"),
                ("value", value, self.num_gqa_groups, self.head_dim_v, "num_gqa_groups"))
        for name, t, heads, dim, heads_arg in want:
            _, h, _, d = dims(t, fmt)
            if h != heads:
                raise ValueError(f"{name} has {h} heads but the module was built with {heads_arg}={heads} "
                                 f"(qkv_format={fmt!r}, shape {tuple(t.shape)})")
            if d != dim:
                raise ValueError(f"{name} has head dim {d} but the module was built with kv_channels="
                                 f"{(self.head_dim_qk, self.head_dim_v)} (qkv_format={fmt!r}, shape {tuple(t.shape)})")

    def extra_repr(self) -> str:
        kv = self.head_dim_qk if self.head_dim_qk == self.head_dim_v else (self.head_dim_qk, self.head_dim_v)
        parts = [f"num_attention_heads={self.num_attention_heads}", f"kv_channels={kv}",
                 f"num_gqa_groups={self.num_gqa_groups}", f"qkv_format={self.qkv_format!r}",
                 f"attn_mask_type={self.attn_mask_type!r}"]
        if self.window_size is not None:
            parts.append(f"window_size={self.window_size}")
        if self.softmax_scale is not None:
            parts.append(f"softmax_scale={self.softmax_scale}")
        if self.score_mod is not None:
            parts.append(f"score_mod={getattr(self.score_mod, 'name', getattr(self.score_mod, '__name__', 'custom'))}")
        parts.append(f"backend={self.backend!r}")
        if self.deterministic:
            parts.append("deterministic=True")
        return ", ".join(parts)
