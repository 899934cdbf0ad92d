"""How a call plan's masks, score_mod, bias and sinks become one cuDNN SDPA graph.

The backend, not the public API, decides how masks combine with a score_mod:

* no score_mod: cuDNN's own band (causal / window, top-left or bottom-right) and padding mask;
* a score_mod that *is* a library mask equal to the call's band (`causal()`, `sliding_window`):
  the native band (cuDNN skips masked tiles);
* a score_mod whose expression ends in `+ g` with g score-free (`split_additive_bias`): when g is
  a tensor parameter read at [..., q_idx, kv_idx] (post_scale_bias), or reads a table being
  trained, g goes to cuDNN's own bias input (applied after the score_mod callback, so masks
  commute with it) and, when it requires grad, the backward's dBias output gives it its gradient
  (through torch autograd for a materialized g);
* any other score_mod with a band or padding: cuDNN refuses its own masks next to a score_mod,
  so the masks are lowered after the user's mod, as a second score_mod in one chained callback
  (the outer masks' derivative is the identity: the backward callback is the user's).

`Lowering` is decided once per plan; per call only operand *values* are bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ...memo import BoundedMemo
from ...problem import Band
from .graphs import cudnn_band

__all__ = ["Lowering", "plan_lowering", "split", "bias_mode", "mod_operands", "attn_scale", "bias_tensor"]


@dataclass
class Lowering:
    """The graph-level decisions of one plan.

    band: (left_bound, right_bound, bottom_right) in cuDNN's convention or None; padding:
    cuDNN's padding mask with seq_len tensors (dense padding types, no score_mod); graph_mod:
    the ScoreMod lowered into the callbacks (the user's, or a chain of it and the masks) or None;
    user_mod: the user's part of it; user_prefix: the operand-name prefix of the user's mod inside
    graph_mod ("" when unchained); static_operands: operands of the mask part (values fixed per
    plan); bias: how the additive bias term reaches cuDNN's bias input — None, "view" (a tensor
    parameter read at [..., q_idx, kv_idx]: the tensor itself) or "dense" (the term materialized
    as a (B|1, H|1, Sq, Skv) tensor with autograd, for trained tables); dims: the graph dims
    (B, H, Sq, Skv) materialized operands are computed for.
    """

    band: Optional[Tuple[Optional[int], Optional[int], bool]]
    padding: bool
    graph_mod: Any
    user_mod: Any
    user_prefix: str
    static_operands: Dict[str, torch.Tensor]
    bias: Optional[str]
    dims: Tuple[int, int, int, int] = (1, 1, 1, 1)


def _normalized_band(band: Optional[Band], sq: int, skv: int) -> Optional[Tuple[Optional[int], Optional[int], bool]]:
    """cuDNN band bounds for `band`; bounds at least Sq + Skv wide are unbounded (they cannot
    exclude a key, and huge values would overflow cuDNN's int32 bounds)."""
    if band is None:
        return None
    wide = sq + skv
    left = None if band.left is None or band.left >= wide else band.left
    right = None if band.right is None or band.right >= wide else band.right
    if left is None and right is None:
        return None
    lb, rb = cudnn_band(left, right)
    return (lb, rb, bool(band.bottom_right))


def split(mod: Any) -> Tuple[Any, Any]:
    """(score part or None, bias part or None) of a traced mod (`split_additive_bias`), memoized
    on the mod per float values: a module's mod updated in place gets a fresh split, a repeated
    call reuses it (and its cached operands). The memo lives and dies with the mod (no
    process-wide cache keeps a call's tensors). Other mods: (mod, None)."""
    if mod is None or mod.root is None:
        return mod, None
    values, memo = tuple(mod.scalars().values()), mod.backend_memo()
    hit = memo.get("split_additive_bias")
    if hit is not None and hit[0] == values:
        return hit[1]
    parts = mod.split_additive_bias()
    memo["split_additive_bias"] = (values, parts)
    return parts


def bias_mode(mod: Any, trained: frozenset) -> Optional[str]:
    """How the mod's additive bias term goes to cuDNN's bias input: "view" when it is a floating
    tensor parameter read at [..., q_idx, kv_idx] (post_scale_bias: no copy), "dense" when it
    reads a table some call trains (materialized with autograd so dBias reaches the table),
    None when it stays inside the score_mod (cheaper: no S^2 tensor)."""
    _, bias_part = split(mod)
    if bias_part is None:
        return None
    if _view_param(bias_part) is not None:
        return "view"
    facts = mod.trainable()
    if any(name in trained and fact.floating and fact.bias_only for name, fact in facts.items()):
        return "dense"
    return None


def _view_param(bias_part: Any) -> Optional[Tuple[str, tuple]]:
    """(name, axes) when the bias part is `score + t[..., q_idx, kv_idx]` with t floating."""
    root = bias_part.root
    term = root.args[1] if root.op == "add" and root.args[0].op == "score" else None
    if term is None or term.op != "gather":
        return None
    from score_mods.expr import direct_axes

    axes = direct_axes(term)
    if axes is None or tuple(axes[-2:]) != ("q_idx", "kv_idx") or term.dtype == "b":
        return None
    return term.attr, tuple(axes)


def _mask_mod(band: Optional[Band], padding: bool) -> Any:
    """The library mask mod for a band and/or dense padding (None when neither)."""
    from score_mods.library import causal, causal_bottom_right, compose, padding_mask, sliding_window

    parts = []
    if band is not None:
        if band.left is None and band.right == 0:
            parts.append(causal_bottom_right() if band.bottom_right else causal())
        else:
            left = -1 if band.left is None else band.left
            right = -1 if band.right is None else band.right
            parts.append(sliding_window(left, right, band.bottom_right))
    if padding:
        parts.append(padding_mask())
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else compose(*parts)


def plan_lowering(spec: Any, mod: Any, dims: Tuple[int, int, int, int], has_lengths: bool,
                  trained: frozenset = frozenset()) -> Lowering:
    """Decide the graph structure for a plan (see the module docstring); dims: the graph's
    (B, H, Sq, Skv); trained: names of the mod's tensor parameters that require grad."""
    band, padding = spec.band, spec.padding
    sq, skv = dims[2], dims[3]
    bias = None
    if mod is not None:
        native = None if mod is None else mod.native_band
        if native is not None and (band is None or band == Band(*native)) and not padding:
            return Lowering(_normalized_band(Band(*native), sq, skv), False, None, None, "", {}, None, dims)
        bias = bias_mode(mod, trained)
        if bias is not None:
            mod = split(mod)[0]
            native = None if mod is None else mod.native_band
            if native is not None and (band is None or band == Band(*native)) and not padding:
                # bias + a causal mask: cuDNN's band next to its bias input, no score_mod callback
                return Lowering(_normalized_band(Band(*native), sq, skv), False, None, None, "", {}, bias, dims)
    if mod is None:
        return Lowering(_normalized_band(band, sq, skv), padding, None, None, "", {}, bias, dims)
    mask = _mask_mod(band, padding)
    if mask is None:
        return Lowering(None, False, mod, mod, "", {}, bias, dims)
    from score_mods.raw import ChainMod

    chain = ChainMod(f"{mod.name} + masks", (mod, mask))
    static = {f"m1_{k}": t for k, t in mask.cudnn_operands().items()}
    if mask.needs_host_lengths and not has_lengths:
        static.update({f"m1_{k}": t for k, t in mask.length_operands(sq, skv).items()})
    return Lowering(None, False, chain, mod, "m0_", static, bias, dims)


def _operands_of(mod: Any, dims: Tuple[int, int, int, int], device: Any) -> Dict[str, torch.Tensor]:
    if mod is not None and mod.needs_dims:
        return dict(mod.cudnn_operands(dims, device=device))
    return dict(mod.cudnn_operands())


def mod_operands(lowering: Lowering, mod: Any, has_lengths: bool, device: Any = None) -> Dict[str, torch.Tensor]:
    """The graph operands of this call's mod (values as bound now), named as the graph expects
    (without the "sm:" slot prefix), plus the plan's static mask operands."""
    if lowering.graph_mod is None:
        return {}
    if lowering.bias is not None:
        mod = split(mod)[0]
    sq, skv = lowering.dims[2], lowering.dims[3]
    ops = _operands_of(mod, lowering.dims, device)
    if mod.needs_host_lengths and not has_lengths:
        ops.update(mod.length_operands(sq, skv))
    prefix = lowering.user_prefix
    if prefix:
        ops = {prefix + k: t for k, t in ops.items()}
        ops.update(lowering.static_operands)
    if lowering.graph_mod.uses_lengths and not has_lengths:
        ops.update(_length_scalars(sq, skv))  # q_len / kv_len of a plain dense problem
    return ops


def attn_scale(lowering: Lowering, mod: Any, scale: float, plain: torch.Tensor) -> torch.Tensor:
    """The pass-by-value attention scale to bind for this call's mod: `plain` ((1, 1, 1, 1) fp32,
    the softmax scale) times the factor the graph's callback folded out of the mod
    (`ScoreMod.score_scale`, e.g. 1 / cap for softcap), memoized by value. The fold needs the
    factor positive and finite (it scales the score that masked positions hold as -inf)."""
    if lowering.graph_mod is None:
        return plain
    if lowering.bias is not None:
        mod = split(mod)[0]
    factor = mod.score_scale()
    if factor == 1.0:
        return plain
    if not (factor > 0.0 and math.isfinite(factor)):
        raise NotImplementedError(
            f"score_mod {mod.name!r} multiplies the score by {factor!r} before anything else; the cuDNN graph built "
            "for it folds that factor into the softmax scale, which needs it positive and finite. Use "
            "backend='reference' for this value")
    value = float(scale) * factor
    hit = _SCALES.peek(value)
    if hit is None:
        hit = torch.full((1, 1, 1, 1), value, dtype=torch.float32)
        _SCALES.put(value, hit)
    return hit


_SCALES = BoundedMemo(64, "cudnn.attn_scales", max_bytes=1 << 20)


def _length_scalars(sq: int, skv: int) -> Dict[str, torch.Tensor]:
    """CPU fp32 (1, 1, 1, 1) pass-by-value q_len / kv_len (bounded memo by value)."""
    hit = _LENGTHS.get((sq, skv))
    if hit is None:
        hit = {"q_len": torch.full((1, 1, 1, 1), float(sq)), "kv_len": torch.full((1, 1, 1, 1), float(skv))}
        _LENGTHS.put((sq, skv), hit)
    return hit


_LENGTHS = BoundedMemo(64, "cudnn.length_scalars", max_bytes=1 << 20)


def bias_tensor(lowering: Lowering, mod: Any, device: Any = None, dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
    """This call's bias as the 4-D (B|1, H|1, Sq, Skv) tensor the bias input takes, or None:
    the tensor parameter itself ("view"), or the term materialized with autograd ("dense")."""
    if lowering.bias is None:
        return None
    bias_part = split(mod)[1]
    if lowering.bias == "view":
        name, axes = _view_param(bias_part)
        t = bias_part.tensors()[name]
        shape = [1, 1, 1, 1]
        for d, a in enumerate(axes):
            shape[("b", "h", "q_idx", "kv_idx").index(a)] = t.shape[d]
        return t.reshape(shape)
    from score_mods import materialize

    return materialize(bias_part, lowering.dims, device=device, dtype=dtype)
