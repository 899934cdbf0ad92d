"""The correctness check of every benchmarked implementation: `Impl`, the naive float64
reference (`naive_attention`, `reference_and_bounds`) and the comparison within the project's
bound (`check_impl`, `check_tensor`, `fused_attn.testing.bound_from`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from fused_attn.testing import DEFAULT_FACTOR, DEFAULT_FLOOR, bound_from, max_error
from fused_attn.testing import reference_attention as _testing_reference

#: The naive references are computed in blocks of query rows of at most this many scores
#: (float64: 128 MiB a score matrix; fwd + bwd peaks at about 6-9 of them), see `naive_attention`.
REF_BLOCK_SCORES = 1 << 24
#: How the checks work, for the notes of the result files (every suite checks bf16 inputs).
CHECK_RULE = (f"max_err: max |result - float64 reference| on the checked slice; bound: {DEFAULT_FACTOR:g} x the same "
              f"error of the naive bf16 torch computation (fp32 softmax) + {DEFAULT_FLOOR[torch.bfloat16]:g} x "
              "max(1, max|reference|) (fused_attn.testing.bound_from); worst: the checked quantity "
              "(out, dq, dk, dv) closest to its bound")


class ImplWrongError(RuntimeError):
    """An implementation produced a wrong (or non-finite) result in the correctness check.

    key, err, bound: the checked quantity, its max abs error and the bound it exceeded.
    """

    def __init__(self, message: str, *, key: Optional[str] = None, err: Optional[float] = None,
                 bound: Optional[float] = None) -> None:
        super().__init__(message)
        self.key, self.err, self.bound = key, err, bound


@dataclass
class Impl:
    """One implementation on fixed inputs.

    fwd(): the timed forward call. fwd_bwd(): the timed forward + backward call (None: forward
    only). outputs(): dict with "out" (and "dq", "dk", "dv" when fwd_bwd exists) in the suite's
    canonical layout, for the correctness check. required: a failure to *run* is an error
    (our own code) rather than a skipped peer.
    """

    name: str
    fwd: Callable[[], object]
    fwd_bwd: Optional[Callable[[], object]]
    outputs: Callable[[], Dict[str, torch.Tensor]]
    required: bool = False
    note: str = ""


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, dtype: torch.dtype,
                    mask: Optional[torch.Tensor] = None, score_fn: Optional[Callable[..., torch.Tensor]] = None,
                    grad_out: Optional[torch.Tensor] = None, params: Optional[Dict[str, torch.Tensor]] = None,
                    block_scores: int = REF_BLOCK_SCORES) -> Dict[str, torch.Tensor]:
    """`fused_attn.testing.reference_attention` in `dtype`, with its autograd gradients.

    q (B, H, Sq, D), k / v (B, Hkv, Skv, D) logical, H % Hkv == 0; mask bool broadcastable to
    (B, H, Sq, Skv), True = attend; score_fn(score, b, h, q_idx, kv_idx) with broadcast index
    tensors. Matmuls in `dtype`, softmax in fp32 (float64 when `dtype` is float64): float64 is the
    exact reference, bf16 the naive same-dtype computation of the project's tolerance rule.
    Returns {"out"} and, given grad_out (B, H, Sq, Dv), also "dq", "dk", "dv"; all in `dtype`.
    params: name -> leaf tensor (requires grad, in `dtype`) that score_fn reads (a trained bias);
    with grad_out, their gradients are returned too, as "d<name>".

    Computed in blocks of query rows of at most `block_scores` scores, so a float64 reference
    holds score matrices of at most 128 MiB (about 1 GiB at its peak) whatever the checked slice;
    dk and dv are summed over the blocks in the softmax dtype and rounded to `dtype` once (one
    block: plain autograd).
    """
    b, h, sq, _ = q.shape
    skv = k.shape[2]
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    qd, kd, vd = (t.detach().to(dtype) for t in (q, k, v))
    full_mask = None if mask is None else torch.broadcast_to(mask.to(q.device), (b, h, sq, skv))
    rows = max(1, min(sq, block_scores // max(1, b * h * skv)))
    outs: List[torch.Tensor] = []
    dqs: List[torch.Tensor] = []
    dk = dv = None
    named = dict(params or {})
    d_params: Dict[str, torch.Tensor] = {}
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        leaves = [t.detach().requires_grad_(grad_out is not None) for t in (qd[:, :, r0:r1], kd, vd)]
        fn = None if score_fn is None else (lambda s, bi, hi, qi, ki, _r0=r0: score_fn(s, bi, hi, qi + _r0, ki))
        out = _testing_reference(*leaves, scale, None if full_mask is None else full_mask[:, :, r0:r1], fn,
                                 dtype=dtype, softmax_dtype=soft)[0]
        outs.append(out.detach())
        if grad_out is not None:
            gq, gk, gv, *gp = torch.autograd.grad(out, leaves + list(named.values()), grad_out[:, :, r0:r1].to(dtype))
            dqs.append(gq)
            for name, g in zip(named, gp):
                d_params[name] = g.to(soft) if name not in d_params else d_params[name].add_(g)
            dk = gk.to(soft) if dk is None else dk.add_(gk)
            dv = gv.to(soft) if dv is None else dv.add_(gv)
        del out, leaves
    result = {"out": torch.cat(outs, dim=2)}
    if grad_out is not None:
        result.update(dq=torch.cat(dqs, dim=2), dk=dk.to(dtype), dv=dv.to(dtype))
        result.update({f"d{name}": g.to(dtype) for name, g in d_params.items()})
    return result


def reference_and_bounds(compute: Callable[[torch.dtype], Dict[str, torch.Tensor]],
                         dtype: torch.dtype) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
    """(expected, bounds) of a correctness check, by the project's rule (`fused_attn.testing`).

    compute(dt): the suite's naive computation (see `naive_attention`) on the checked slice of
    the inputs, in dt. expected = compute(float64); bounds[key] = `bound_from(compute(dtype)[key],
    expected[key], dtype)`: DEFAULT_FACTOR x the max error of the same computation in the inputs'
    dtype, plus the dtype's floor x max(1, max|expected|). The same-dtype results are freed here.
    """
    expected = compute(torch.float64)
    same = compute(dtype)
    bounds = {key: bound_from(same[key], expected[key], dtype) for key in expected}
    del same
    return expected, bounds


def check_tensor(name: str, key: str, got: torch.Tensor, want: torch.Tensor, bound: float) -> float:
    """max |got - want| (`fused_attn.testing.max_error`); raises ImplWrongError naming `name`,
    `key`, the error and the bound when the shapes differ or the error is above `bound` (NaN is)."""
    if tuple(got.shape) != tuple(want.shape):
        raise ImplWrongError(f"{name}: {key} shape {tuple(got.shape)} != expected {tuple(want.shape)}",
                             key=key, err=float("inf"), bound=bound)
    err = max_error(got, want)
    if not err <= bound:
        bad = int((~torch.isfinite(got.detach())).sum())
        extra = f" ({bad} non-finite entries)" if bad else ""
        raise ImplWrongError(f"{name}: {key} max abs error {err:.3g} > bound {bound:.3g} "
                             f"vs the float64 reference{extra}", key=key, err=err, bound=bound)
    return err


def check_impl(impl: Impl, expected: Dict[str, torch.Tensor], bounds: Dict[str, float],
               select: Callable[[str, torch.Tensor], torch.Tensor]) -> Dict[str, float]:
    """Compare `impl.outputs()` (sliced by `select(key, tensor)`) with the float64 `expected`.

    Returns the max abs error per key; raises ImplWrongError (see `check_tensor`) when one is
    above its bound.
    """
    outs = impl.outputs()
    return {key: check_tensor(impl.name, key, select(key, outs[key]), want, bounds[key])
            for key, want in expected.items() if key in outs}


def worst_error(errs: Dict[str, float], bounds: Dict[str, float],
                keys: Optional[Sequence[str]] = None) -> Tuple[Optional[str], Optional[float], Optional[float]]:
    """(key, error, bound) of the checked quantity closest to its bound (largest error / bound)
    among `keys` (default: all of `errs`); (None, None, None) when there is none."""
    cand = [k for k in (keys if keys is not None else errs) if k in errs]
    if not cand:
        return None, None, None
    key = max(cand, key=lambda k: errs[k] / bounds[k] if bounds[k] > 0 else float("inf"))
    return key, errs[key], bounds[key]
