"""What the FA4 engine runs, decided from a problem's metadata (`static.StaticProblem`).

FA4 serves natively: dense bshd / sbhd / bhsd (strided views) and packed thd (cu_seqlens),
causal and sliding-window bands (FA4 aligns bands bottom-right: a top-left band is exact only
when every sequence has Sq == Skv), GQA / MQA, learnable and off-by-one sinks, the lse, a
deterministic backward, fp16 / bf16, head dims 8..256 in multiples of 8 (sm90; sm100: FA4's own
narrower set). A mod that is exactly a library mask
runs as FA4's band; any other traced score_mod runs as generated CuTe callables
(`cute_source`), its float parameters as runtime scalars.

Refused, each with its reason (cuDNN or the reference serves them): dropout, dense padding
masks, thd with padded offsets, raw cuDNN callbacks, score_mods whose tensor parameters need a
gradient (FA4 has no gradient for them), ops without an exact CuTe form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch

from ...problem import Band
from . import cute_source

__all__ = ["Plan", "decide", "window"]

_DTYPES = (torch.float16, torch.bfloat16)
_SM100_PAIRS = ((192, 128), (256, 256))


@dataclass(frozen=True)
class Plan:
    """How one problem runs on FA4: `band` the fixed band of the spec (or None), `mod_band` True
    when the call's mod is a library mask read per call, `source` the generated CuTe module of any other
    mod (None without one), `sinks` the softmax_type's sink ("learnable" / "off-by-one" / None)."""

    band: Optional[Band]
    mod_band: bool
    source: Optional[cute_source.Source]
    sinks: Optional[str]


def _head_dims(problem: Any, major: int) -> Optional[str]:
    d, dv = problem.head_dim, problem.head_dim_v
    if d % 8 or dv % 8 or not (8 <= d <= 256 and 8 <= dv <= 256):
        return f"head dims ({d}, {dv}): FA4 takes multiples of 8 from 8 to 256"
    if major == 10 and not ((d <= 128 and dv <= 128) or (d, dv) in _SM100_PAIRS):
        return f"head dims ({d}, {dv}): FA4 on sm100 takes up to 128, or (192, 128), or (256, 256)"
    return None


def _band_refusal(band: Optional[Band], problem: Any) -> Optional[str]:
    if band is None or band.bottom_right:
        return None
    square = problem.same_lengths if problem.spec.is_packed else problem.seqlen_q == problem.seqlen_kv
    if square:
        return None
    return ("a top-left band with query and key lengths that may differ: FA4 aligns causal masks and windows to the "
            "bottom-right corner")


def decide(problem: Any, major: int) -> Union[Plan, str]:
    """The Plan for `problem` on a device of compute capability `major`, or why FA4 cannot run it."""
    spec = problem.spec
    if problem.device.type != "cuda":
        return f"the FA4 engine needs CUDA tensors, got {problem.device.type}"
    if problem.dtype not in _DTYPES:
        return f"dtype {problem.dtype}: FA4 takes float16 or bfloat16"
    why = _head_dims(problem, major)
    if why:
        return why
    if spec.dropout_p:
        return "dropout_p > 0: FA4 has no attention dropout"
    if spec.padding:
        return "a dense padding mask (cu_seqlens with bshd/sbhd/bhsd tensors): the cuDNN engine serves it"
    if spec.is_packed and (problem.q_offsets or problem.kv_offsets):
        return "thd with padded offsets (cu_seqlens_*_padded): the cuDNN engine serves it"
    band = spec.band
    why = _band_refusal(band, problem)
    if why:
        return why
    sinks = spec.softmax_type if spec.has_sinks else None
    mod = spec.score_mod
    if mod is None:
        return Plan(band, False, None, sinks)
    native = mod.native_band
    if native is not None:
        if band is not None and band != Band(*native):
            return "a library mask score_mod next to a different attn_mask_type band"
        why = _band_refusal(Band(*native), problem)
        return why if why else Plan(None, True, None, sinks)
    if problem.needs_grad and any(entry[5] for entry in problem.mod_tensors):
        names = ", ".join(entry[0] for entry in problem.mod_tensors if entry[5])
        return f"score_mod tensor parameters that need a gradient ({names}): FA4 computes no gradient for them"
    # the library's softcap runs as generated CuTe too (its cap an aux scalar): FA4's own softcap
    # argument builds and hashes a fresh score_mod closure per call (measured on an H200: 1.68 ms of
    # host time per fwd+bwd step against 1.28 for FA4's plain call)
    if mod.root is None:
        return f"score_mod {mod.name!r} is not a traced mod (raw cuDNN callbacks are cuDNN graph code)"
    try:
        source = cute_source.source_for(mod)
    except cute_source.Unsupported as exc:
        return f"score_mod {mod.name!r}: {exc}"
    return Plan(band, False, source, sinks)


def window(band: Optional[Band]) -> Tuple[bool, Optional[int], Optional[int]]:
    """(causal, window_size_left, window_size_right) of FA4 for a band (None: unbounded side)."""
    if band is None:
        return False, None, None
    if band.left is None and band.right == 0:
        return True, None, None
    return False, band.left, band.right
