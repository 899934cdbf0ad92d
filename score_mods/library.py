"""The score_mod library: small named factories returning ScoreMods, and `compose`.

Masks (masked scores become -inf; i = q_idx, j = kv_idx within the sequence):

    causal()               j <= i                       q\\k 0 1 2 3      (Sq = Skv = 4)
                                                        0   x . . .
                                                        1   x x . .
    causal_bottom_right()  j <= i + kv_len - q_len      (Sq = 2, Skv = 4: row 0 sees 0..2)
    sliding_window(l, r)   -l <= j - (i + shift) <= r   (shift = kv_len - q_len if bottom_right
                                                         else 0; -1 = unbounded side)
    document_mask(ids)     ids[i] == ids[j]
    padding_mask()         i < q_len and j < kv_len

Window sizes and softcap's cap are runtime scalars: new values never rebuild a cuDNN graph.
Factories name their mods with their values, attention-gym style: softcap(30.0).name ==
"softcap_30", sliding_window(128, 0).name == "sliding_window_128_0" (names never enter keys).
`and_masks` / `or_masks` combine mask mods (or flex-style mask_mod functions) like flex's.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

from . import bands, expr
from .bands import band_of  # noqa: F401 - re-exported
from .base import ScoreMod
from .expr import Node, TensorParam, kv_len, q_len, tanh, where
from .origins import origin_named
from .templates import template
from .trace import TracedMod, mask_mod, score_mod
from .tracing import _fmt, mask_root

_NEG_INF = -math.inf


_causal = score_mod(bands.causal, name="causal")
_causal_br = score_mod(bands.causal_bottom_right, name="causal_bottom_right")


@score_mod(name="softcap")
def _softcap(score, b, h, q_idx, kv_idx, cap=30.0):
    return cap * tanh(score / cap)


@score_mod(name="post_scale_bias")
def _bias(score, b, h, q_idx, kv_idx, bias=TensorParam("float")):
    return score + bias[b, h, q_idx, kv_idx]


@score_mod(name="alibi")
def _alibi(score, b, h, q_idx, kv_idx, slopes=TensorParam("float")):
    return score + slopes[h] * (kv_idx - q_idx)


@score_mod(name="document_mask")
def _doc1(score, b, h, q_idx, kv_idx, doc_ids=TensorParam("int")):
    return where(doc_ids[q_idx] == doc_ids[kv_idx], score, _NEG_INF)


@score_mod(name="document_mask")
def _doc2(score, b, h, q_idx, kv_idx, doc_ids=TensorParam("int")):
    return where(doc_ids[b, q_idx] == doc_ids[b, kv_idx], score, _NEG_INF)


@score_mod(name="document_mask_runs")
def _doc_runs1(score, b, h, q_idx, kv_idx, run_start=TensorParam("int"), run_end=TensorParam("int")):
    return where((kv_idx >= run_start[q_idx]) & (kv_idx < run_end[q_idx]), score, _NEG_INF)


@score_mod(name="document_mask_runs")
def _doc_runs2(score, b, h, q_idx, kv_idx, run_start=TensorParam("int"), run_end=TensorParam("int")):
    return where((kv_idx >= run_start[b, q_idx]) & (kv_idx < run_end[b, q_idx]), score, _NEG_INF)


@score_mod(name="padding_mask")
def _padding(score, b, h, q_idx, kv_idx):
    return where((q_idx < q_len()) & (kv_idx < kv_len()), score, _NEG_INF)


def _as_band(mod: TracedMod, left: Any, right: Any, bottom_right: bool) -> TracedMod:
    """Mark a pure mask mod with the diagonal band it equals: (left, right, bottom_right), None =
    unbounded. `dot_product_attention` runs such a mod, when it is the whole score_mod, as the
    backend's native band (cuDNN then skips masked tiles instead of computing and masking them)."""
    mod.native_band = (left, right, bottom_right)
    return mod


_as_band(_causal, None, 0, False)
_as_band(_causal_br, None, 0, True)


def causal() -> TracedMod:
    """Top-left causal mask: query i attends keys j <= i."""
    return _causal


def causal_bottom_right() -> TracedMod:
    """Bottom-right causal mask: j <= i + kv_len - q_len (the last query sees every key)."""
    return _causal_br


def padding_mask() -> TracedMod:
    """Mask keys/queries past the sequence's lengths: i < q_len and j < kv_len."""
    return _padding


def _finite_positive(fn: str):
    def check(name: str, v: float) -> None:
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{fn}: {name} must be a finite float > 0, got {v!r}")

    return check


def _non_negative(fn: str):
    def check(name: str, v: float) -> None:
        if not v >= 0:
            raise ValueError(f"{fn}: {name} must be >= 0, got {v!r}")

    return check


def _with_checks(mod: TracedMod, **checks) -> TracedMod:
    for name, check in checks.items():
        mod.specs[name] = mod.specs[name].renamed(name)
        mod.specs[name].check = check
    return mod


_softcap = _with_checks(_softcap, cap=_finite_positive("softcap"))
_softcap._name_fn = lambda v: f"softcap_{_fmt(v['cap'])}"


def softcap(cap: float = 30.0) -> TracedMod:
    """cap * tanh(score / cap); cap > 0 is a runtime scalar (finite: softcap(inf) is the identity,
    pass no score_mod instead). Named "softcap_<cap>"."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0 or math.isinf(cap):
        raise ValueError(f"softcap: cap must be a finite float > 0, got {cap!r}")
    return _softcap(cap=float(cap))


def _window_size(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"sliding_window: {name} must be an int (-1 = unbounded), got {v!r} ({type(v).__name__})")
    if v < -1:
        raise ValueError(f"sliding_window: {name} must be >= -1 (-1 = unbounded), got {v}")
    return v


def sliding_window(left: int, right: int, bottom_right: bool = False) -> TracedMod:
    """Keep keys j with -left <= j - (i + shift) <= right (flash-attention window_size=(left, right)).

    shift = kv_len - q_len if bottom_right else 0; -1 leaves that side unbounded. left/right
    are runtime scalars (changing them keeps the graph); which sides are bounded is structure.
    """
    left, right = _window_size("left", left), _window_size("right", right)
    if not isinstance(bottom_right, bool):
        raise TypeError(f"sliding_window: bottom_right must be a bool, got {bottom_right!r}")
    structure = template(_window_structure, left != -1, right != -1, bottom_right)
    mod = structure(left=float(max(left, 0)), right=float(max(right, 0)))
    return _as_band(mod, None if left == -1 else left, None if right == -1 else right, bottom_right)


def _window_structure(left_bounded: bool, right_bounded: bool, bottom_right: bool) -> TracedMod:
    """The sliding window's DAG for which sides are bounded (left / right are runtime scalars)."""

    def body(score, b, h, q_idx, kv_idx, left=0.0, right=0.0):
        d = kv_idx - q_idx
        if bottom_right:
            d = d - (kv_len() - q_len())
        out = score
        if right_bounded:
            out = where(d <= right, out, _NEG_INF)
        if left_bounded:
            out = where(d >= -left, out, _NEG_INF)
        return out

    body.__name__ = "sliding_window"
    check = _non_negative("sliding_window")
    mod = _with_checks(score_mod(body), left=check, right=check)
    suffix = "_bottom_right" if bottom_right else ""
    mod._name_fn = lambda v: (f"sliding_window_{_fmt(v['left']) if left_bounded else -1}_"
                              f"{_fmt(v['right']) if right_bounded else -1}{suffix}")
    return mod


def _check_tensor(fn: str, name: str, t: Any, ranks: tuple, floating: bool) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in ranks:
        raise ValueError(f"{fn}: {name} must have {' or '.join(map(str, ranks))} dims, got shape {tuple(t.shape)}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{fn}: {name} must have a floating dtype, got {t.dtype}")
    if not floating and t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: {name} must be int32 or int64, got {t.dtype}")
    return t


def post_scale_bias(bias: torch.Tensor) -> TracedMod:
    """score + bias[b, h, q_idx, kv_idx]; bias (B|1, H|1, Sq, Skv), floating, on the inputs' device."""
    return _bias(bias=_check_tensor("post_scale_bias", "bias", bias, (4,), True))


def alibi(slopes: torch.Tensor) -> TracedMod:
    """score + slopes[h] * (kv_idx - q_idx); slopes (H,) floating (see `alibi_slopes`)."""
    return _alibi(slopes=_check_tensor("alibi", "slopes", slopes, (1,), True))


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The standard geometric ALiBi slopes (H,) fp32: 2^(-8 k / n) for the nearest power of two n."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"alibi_slopes: num_heads must be an int >= 1, got {num_heads!r}")

    def pow2(n: int) -> list:
        start = 2.0 ** (-8.0 / n)
        return [start ** (k + 1) for k in range(n)]

    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = pow2(n) + pow2(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def document_mask(doc_ids: torch.Tensor, contiguous: bool = False) -> TracedMod:
    """Attend iff doc_ids[q_idx] == doc_ids[kv_idx]; doc_ids (S,) or (B, S) int32/int64 (Sq == Skv == S).

    contiguous=True: attend iff q_idx and kv_idx lie in the same *run* of equal ids, written as
    per-query bounds run_start[q_idx] <= kv_idx < run_end[q_idx] (computed on the device, no
    host read). The same mask when every document is one contiguous run (packed documents:
    ids = [0 0 0 1 1 2 ...]); an id that comes back later ([0 0 1 0]) starts a new document.
    Its backward runs on cuDNN, which computes the equality form's backward wrongly (cuDNN 9.19
    reads the key-axis ids[kv_idx] wrongly there), so that form trains on the reference."""
    t = _check_tensor("document_mask", "doc_ids", doc_ids, (1, 2), False)
    if not isinstance(contiguous, bool):
        raise TypeError(f"document_mask: contiguous must be a bool, got {contiguous!r}")
    if not contiguous:
        return (_doc1 if t.dim() == 1 else _doc2)(doc_ids=t)
    start, end = _run_bounds(t)
    return (_doc_runs1 if t.dim() == 1 else _doc_runs2)(run_start=start, run_end=end)


def _run_bounds(ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(run_start, run_end) int64, shaped like ids (.., S): the first index of each position's run
    of equal ids and one past its last (device ops: a cummax and a reversed cummin)."""
    s = ids.shape[-1]
    pos = torch.arange(s, device=ids.device).expand(ids.shape)
    starts = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    run_start = torch.where(starts, pos, torch.zeros_like(pos)).cummax(-1).values
    ends = torch.ones_like(starts)
    ends[..., :-1] = starts[..., 1:]
    run_end = torch.where(ends, pos + 1, torch.full_like(pos, s)).flip(-1).cummin(-1).values.flip(-1)
    return run_start, run_end


# --------------------------------------------------------------------------- composition

def _prefix_dag(root: Node, prefix: str, score: Optional[Node]) -> Node:
    def renamed(n: Node, args: tuple) -> Optional[Node]:
        if n.op == "score":
            return score
        if n.op == "param":
            return Node("param", attr=prefix + n.attr, dtype=n.dtype)
        if n.op == "gather":
            return Node("gather", args, prefix + n.attr, n.dtype)
        return None

    return expr.substitute(root, renamed)


def _merged_values(mods) -> Dict[str, Any]:
    """The parts' bound values under their fused names "m<i>_<name>"."""
    return {f"m{i}_{p}": m._values.get(p) for i, m in enumerate(mods) for p in m.specs}


def _fuse_structure(op: str, *origin_names: str) -> TracedMod:
    """The fused structure of parts (op "compose", "and" or "or") given by their origins' names,
    their defaults bound."""
    origins = [origin_named(n) for n in origin_names]
    if op == "compose":
        root = Node("score")
        for i, m in enumerate(origins):
            root = _prefix_dag(m.root, f"m{i}_", root)
    else:
        cond = None
        for i, m in enumerate(origins):
            c = _prefix_dag(m.mask_condition(), f"m{i}_", None)
            cond = c if cond is None else Node(op, (cond, c), dtype="b")
        root = mask_root(cond)
    specs = {f"m{i}_{p}": s.renamed(f"m{i}_{p}") for i, m in enumerate(origins) for p, s in m.specs.items()}
    return TracedMod(op, root, specs, _merged_values(origins))


def _fuse(op: str, name: str, mods: tuple) -> TracedMod:
    """The parts fused: their origins' structure (made once, see templates) with their values."""
    return template(_fuse_structure, op, *(m.origin_name for m in mods))._copy(_merged_values(mods),
                                                                                        name=name)


def compose(*mods: ScoreMod) -> ScoreMod:
    """One ScoreMod applying `mods` left to right: compose(softcap(30), causal()).

    Traced mods fuse into one DAG (one set of cuDNN ops); parameters are renamed
    "m<i>_<name>" (i = position) so parts never collide. Raw cuDNN callbacks are chained.
    """
    if not mods:
        raise ValueError("compose() needs at least one score_mod")
    for i, m in enumerate(mods):
        if not isinstance(m, ScoreMod):
            raise TypeError(f"compose(): argument {i} is {type(m).__name__}, expected a ScoreMod")
    if len(mods) == 1:
        return mods[0]
    name = f"compose({', '.join(m.name for m in mods)})"
    if not all(isinstance(m, TracedMod) for m in mods):
        from .raw import ChainMod

        return ChainMod(name, mods)
    return _fuse("compose", name, mods)


def _as_mask(fn: str, i: int, m: Any) -> TracedMod:
    if isinstance(m, TracedMod):
        if not m.is_mask:
            raise TypeError(f"{fn}(): argument {i} ({m.name!r}) is not a mask (it changes scores); pass mask mods")
        return m
    if isinstance(m, ScoreMod) or not callable(m):
        raise TypeError(f"{fn}(): argument {i} is {type(m).__name__}, expected a mask mod or a mask_mod function")
    return mask_mod(m)


def _combine_masks(fn: str, op: str, mods: tuple) -> TracedMod:
    if not mods:
        raise ValueError(f"{fn}() needs at least one mask")
    masks = [_as_mask(fn, i, m) for i, m in enumerate(mods)]
    if len(masks) == 1:
        return masks[0]
    return _fuse(op, f"{fn}({', '.join(m.name for m in masks)})", tuple(masks))


def and_masks(*masks: Any) -> TracedMod:
    """Attend where every mask attends (flex's and_masks). Arguments: mask mods (causal(),
    @mask_mod functions, ...) or plain (b, h, q_idx, kv_idx) -> condition functions;
    parameters are renamed "m<i>_<name>" as in compose."""
    return _combine_masks("and_masks", "and", masks)


def or_masks(*masks: Any) -> TracedMod:
    """Attend where any mask attends (flex's or_masks); see and_masks."""
    return _combine_masks("or_masks", "or", masks)
