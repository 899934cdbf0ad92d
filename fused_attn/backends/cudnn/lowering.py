"""How a call plan's masks, score_mod, bias and sinks become one cuDNN SDPA graph.

The backend, not the public API, decides how masks combine with a score_mod:

* no score_mod: cuDNN's own band (causal / window, top-left or bottom-right) and padding mask;
* a score_mod that *is* a library mask equal to the call's band (`causal()`, `sliding_window`):
  the native band (cuDNN skips masked tiles);
* a score_mod whose expression ends in `+ tensor[..., q_idx, kv_idx]` (post_scale_bias and
  mods composed with it): the tensor goes to cuDNN's own bias input (applied after the score_mod
  callback, so masks commute with it) and, when it requires grad, the backward's dBias output
  gives it its gradient;
* any other score_mod with a band or padding: cuDNN refuses its own masks next to a score_mod,
  so the masks are lowered after the user's mod, as a second score_mod in one chained callback
  (the outer masks' derivative is the identity: the backward callback is the user's).

`Lowering` is decided once per plan; per call only operand *values* are bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ...memo import BoundedMemo
from ...problem import Band
from .graphs import cudnn_band

__all__ = ["Lowering", "plan_lowering", "split_bias"]


@dataclass
class Lowering:
    """The graph-level decisions of one plan.

    band: (left_bound, right_bound, bottom_right) in cuDNN's convention or None; padding:
    cuDNN's padding mask with seq_len tensors (dense padding types, no score_mod); graph_mod:
    the ScoreMod lowered into the callbacks (the user's, or a chain of it and the masks) or None;
    user_prefix: the operand-name prefix of the user's mod inside graph_mod ("" when unchained);
    static_operands: operands of the mask part (values fixed per plan); bias_param: name of the
    user's tensor parameter fed to the bias input, and its index axes.
    """

    band: Optional[Tuple[Optional[int], Optional[int], bool]]
    padding: bool
    graph_mod: Any
    user_mod: Any
    user_prefix: str
    static_operands: Dict[str, torch.Tensor]
    bias_param: Optional[Tuple[str, tuple]]


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


def split_bias(mod: Any) -> Optional[Tuple[Any, str, tuple]]:
    """(mod without the bias term or None, tensor parameter name, its axes) when the traced
    mod's expression is `X + t[..., q_idx, kv_idx]` with `t` a floating tensor parameter that
    appears nowhere else, else None."""
    root = getattr(mod, "root", None)
    if root is None or root.op != "add":
        return None
    from score_mods import expr

    for i in (0, 1):
        term, rest = root.args[i], root.args[1 - i]
        if term.op != "tparam":
            continue
        name, axes = term.attr
        spec = mod.specs.get(name)
        if spec is None or spec.tkind != "float" or tuple(axes[-2:]) != ("q_idx", "kv_idx"):
            continue
        if any(n.op == "tparam" and n.attr[0] == name for n in expr.topo_order(rest)):
            continue
        if rest.op == "score":
            return None, name, tuple(axes)
        from score_mods.trace import TracedMod

        specs = {p: s for p, s in mod.specs.items() if p != name}
        values = {p: v for p, v in mod._values.items() if p != name}
        return TracedMod(mod.name, rest, specs, values), name, tuple(axes)
    return None


_SPLITS = BoundedMemo(256, "cudnn.split_bias")


def _without_bias(mod: Any) -> Any:
    """`split_bias(mod)[0]`, memoized per (mod object, float values): a module's mod updated in
    place gets a fresh split, a repeated call reuses it (and its cached operands)."""
    key = (id(mod), tuple(mod.scalars().values()))
    hit = _SPLITS.get(key)
    if hit is not None and hit[0] is mod:
        return hit[1]
    rest = split_bias(mod)[0]
    _SPLITS.put(key, (mod, rest))
    return rest


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


def plan_lowering(spec: Any, mod: Any, sq: int, skv: int, has_lengths: bool) -> Lowering:
    """Decide the graph structure for a plan (see the module docstring)."""
    band, padding = spec.band, spec.padding
    bias = None
    if mod is not None:
        native = getattr(mod, "native_band", None)
        if native is not None and (band is None or band == Band(*native)) and not padding:
            return Lowering(_normalized_band(Band(*native), sq, skv), False, None, None, "", {}, None)
        split = split_bias(mod)
        if split is not None:
            rest, name, axes = split
            bias = (name, axes)
            mod = rest
    if mod is None:
        return Lowering(_normalized_band(band, sq, skv), padding, None, None, "", {}, bias)
    mask = _mask_mod(band, padding)
    if mask is None:
        return Lowering(None, False, mod, mod, "", {}, bias)
    from score_mods.raw import ChainMod

    chain = ChainMod(f"{mod.name} + masks", (mod, mask))
    static = {f"m1_{k}": t for k, t in mask.cudnn_operands().items()}
    if mask.needs_host_lengths and not has_lengths:
        static.update({f"m1_{k}": t for k, t in mask.length_operands(sq, skv).items()})
    return Lowering(None, False, chain, mod, "m0_", static, bias)


def mod_operands(lowering: Lowering, mod: Any, sq: int, skv: int, has_lengths: bool) -> Dict[str, torch.Tensor]:
    """The graph operands of this call's mod (values as bound now), named as the graph expects
    (without the "sm:" slot prefix), plus the plan's static mask operands."""
    if lowering.graph_mod is None:
        return {}
    if lowering.bias_param is not None:
        mod = _without_bias(mod)
    ops = dict(mod.cudnn_operands())
    if mod.needs_host_lengths and not has_lengths:
        ops.update(mod.length_operands(sq, skv))
    prefix = lowering.user_prefix
    if prefix:
        ops = {prefix + k: t for k, t in ops.items()}
        ops.update(lowering.static_operands)
    if lowering.graph_mod.uses_lengths and not has_lengths:
        ops.update(_length_scalars(sq, skv))  # q_len / kv_len of a plain dense problem
    return ops


def _length_scalars(sq: int, skv: int) -> Dict[str, torch.Tensor]:
    """CPU fp32 (1, 1, 1, 1) pass-by-value q_len / kv_len (bounded memo by value)."""
    hit = _LENGTHS.get((sq, skv))
    if hit is None:
        hit = {"q_len": torch.full((1, 1, 1, 1), float(sq)), "kv_len": torch.full((1, 1, 1, 1), float(skv))}
        _LENGTHS.put((sq, skv), hit)
    return hit


_LENGTHS = BoundedMemo(64, "cudnn.length_scalars")


def bias_tensor(lowering: Lowering, mod: Any) -> Optional[torch.Tensor]:
    """This call's bias as the 4-D (B|1, H|1, Sq, Skv) view the bias input takes, or None."""
    if lowering.bias_param is None:
        return None
    name, axes = lowering.bias_param
    t = mod.tensors()[name]
    shape = [1, 1, 1, 1]
    for d, a in enumerate(axes):
        shape[("b", "h", "q_idx", "kv_idx").index(a)] = t.shape[d]
    return t.reshape(shape)
