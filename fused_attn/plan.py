"""Call plans: everything a call needs, decided once per (spec, tensor signature).

    plan = get_plan(spec, mod, q, k, v, varlen)   # a dict lookup on a cache hit
    out, lse = plan.run(q, k, v, varlen, mod)       # allocate, bind, execute

A *signature* is what changes the plan: shapes (for thd: everything but the token count),
strides, dtypes, devices, whether gradients are needed, pointer alignment, the cu_seqlens
tensors' shapes, the max_seqlen buckets, the score_mod's tensor parameters' descriptions, the
sinks tensor's, and the score_mod's structural values (values a backend turns into structure,
such as a window's native band). A plan keeps structure, never a user's tensor: its spec holds
the mod's `structure_only()`. A *plan* holds the validated `StaticProblem`, the chosen backend and the reason,
and that backend's runner (graphs, slot order, allocation recipes). A cache hit validates
nothing: the checks that depend on the signature ran when the plan was made; the only per-call
checks are the ones that need values (cu_seqlens: an asynchronous device assertion; max_seqlen:
host ints).

`auto` never runs the reference for CUDA tensors silently: the plan records why cuDNN declined,
`fused_attn.explain(...)` returns it, and making such a plan warns once (`FallbackWarning`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple, Optional, Tuple

import torch

from . import engine_speed, engines, planning
from . import length_checks as L
from . import validation as V
from .memo import BoundedMemo
from .layouts import logical_shape
from .spec import AttentionSpec, frozen_template
from .static import NO_VARLEN, Refusal, StaticProblem, Varlen, bucket
from .static import mod_signature as _mod_sig

__all__ = ["Varlen", "StaticProblem", "CallPlan", "get_plan", "call_signature", "clear_plans", "FallbackWarning",
           "Refusal", "Explanation", "NO_VARLEN"]


class FallbackWarning(UserWarning):
    """`backend="auto"` runs CUDA tensors on the reference backend (with the reason)."""


class Explanation(NamedTuple):
    """What `explain` reports: the backend a call runs on and why, and the names of the
    backend's known faults (quirks) whose workarounds shaped the plan."""

    backend: str
    reason: str
    problem: str
    quirks: Tuple[str, ...] = ()
    #: the problem family backend="auto" looks up in the measured engine tables (`engine_speed`)
    family: str = ""
    #: the engine that runs the backward: `backend`, or another where auto splits a training call
    backward_backend: str = ""


class CallPlan:
    """The decided plan of one (spec, signature): backend, reason and runner."""

    __slots__ = ("problem", "backend", "reason", "runner")

    def __init__(self, problem: StaticProblem, backend: str, reason: str, runner: Any) -> None:
        self.problem, self.backend, self.reason, self.runner = problem, backend, reason, runner

    def __repr__(self) -> str:
        return f"<CallPlan {self.backend}: {self.problem.describe()}>"


# ----------------------------------------------------------------------------- signatures


def _tensor_sig(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def _mod_structure(mod: Any) -> Any:
    """The values of this call's mod that a backend turns into structure
    (`ScoreMod.structural_values`: a window's native band): part of the plan key."""
    return None if mod is None else mod.structural_values()


def signature(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: Varlen, mod: Any,
              sinks: Optional[torch.Tensor], force_grad: bool = False) -> tuple:
    """The plan-cache key of a call (raises AttributeError/TypeError on non-tensors: the slow
    path then validates and names the bad argument)."""
    grad = force_grad or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                                       or (sinks is not None and sinks.requires_grad)))
    try:
        align = (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
    except RuntimeError:  # tensors without storage (fake tensors under tracing): treated as aligned
        align = 0
    msig = _mod_sig(mod)
    if msig and not grad and torch.is_grad_enabled():
        grad = any(s[-1] for s in msig)
    if spec.qkv_format == "thd":
        cu_q, cu_kv = varlen.cu_seqlens_q, varlen.cu_seqlens_kv
        shapes = (q.shape[1:], q.stride(), k.shape[1:], k.stride(), v.shape[1:], v.stride())
        lens = (cu_q.shape, cu_q.dtype, cu_q.device, cu_kv.shape, cu_kv.dtype, cu_kv.device, cu_q is cu_kv,
                None if varlen.cu_seqlens_q_padded is None else varlen.cu_seqlens_q_padded.shape,
                None if varlen.cu_seqlens_kv_padded is None else varlen.cu_seqlens_kv_padded.shape,
                _bucket_arg(varlen.max_seqlen_q), _bucket_arg(varlen.max_seqlen_kv))
    else:
        shapes = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride())
        cu_q, cu_kv = varlen.cu_seqlens_q, varlen.cu_seqlens_kv
        lens = None if cu_q is None and cu_kv is None else (
            None if cu_q is None else (cu_q.shape, cu_q.dtype, cu_q.device),
            None if cu_kv is None else (cu_kv.shape, cu_kv.dtype, cu_kv.device), cu_q is cu_kv,
            varlen.cu_seqlens_q_padded is not None, varlen.cu_seqlens_kv_padded is not None,
            varlen.max_seqlen_q, varlen.max_seqlen_kv)
    return (spec, shapes, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, grad, align == 0, lens, msig,
            None if sinks is None else _tensor_sig(sinks), _mod_structure(mod))


def signature_records_grad(key: tuple) -> bool:
    """Whether the call a `signature` key describes records a backward."""
    return key[8]


def _bucket_arg(n: Any) -> Any:
    """Bucket of a max_seqlen argument; anything that is not a plain int is kept as is (the
    slow path names it)."""
    if type(n) is int and n >= 0:
        return ("bucket", bucket(n))
    return ("raw", n)


# ----------------------------------------------------------------------------- the cache


#: Call plans by call signature (a plan holds no caller tensor: see `StaticProblem`).
PLANS = BoundedMemo(512, "plan.plans")


#: backend='auto' dense calls: the engine `engines.choose` picks, by call signature (`routed_engine`).
ROUTED = BoundedMemo(512, "plan.routed")


def clear_plans() -> None:
    """Drop every call plan and routed choice, and the engines' own memos that hold plans (the
    cuDNN band rectangles' routes); the graph cache keeps its graphs."""
    PLANS.clear()
    ROUTED.clear()
    engines.clear_memos()


def routed_engine(spec: AttentionSpec, mod: Any, q: Any, k: Any, v: Any, sinks: Optional[torch.Tensor],
                  sig: tuple) -> str:
    """The engine whose own way to serve a call (`engines.route`) applies to this dense call of
    signature `sig`: the requested backend, or for backend='auto' the engine `engines.choose`
    picks from the call's metadata, the same choice as the plain path's plan (memoized per
    signature). So a call that auto gives to another engine never takes cuDNN's route."""
    if spec.backend != "auto":
        return spec.backend
    name = ROUTED.peek(sig)
    if name is None:
        plan = PLANS.peek(sig)
        if plan is not None:
            name = plan.backend
        else:
            problem = _static_problem(_plan_spec(spec, mod), mod, q, k, v, NO_VARLEN, sinks)
            name = engines.choose(problem, build=False)[0]
        ROUTED.put(sig, name)
    return name


def call_signature(spec: AttentionSpec, q: Any, k: Any, v: Any, varlen: Varlen, mod: Any,
                   sinks: Optional[torch.Tensor], force_grad: bool = False) -> Optional[tuple]:
    """`signature`, or None for arguments it cannot describe (not tensors: the plan's checks
    then name the argument)."""
    try:
        return signature(spec, q, k, v, varlen, mod, sinks, force_grad)
    except (AttributeError, TypeError):
        return None


def get_plan(spec: AttentionSpec, mod: Any, q: Any, k: Any, v: Any, varlen: Varlen,
             sinks: Optional[torch.Tensor] = None, force_grad: bool = False, sig: Optional[tuple] = None) -> CallPlan:
    """The plan for this call: cached by signature, made (validated, backend chosen) on a miss.
    force_grad: plan for a backward even when no input requires grad (explicit backward calls).
    sig: this call's `call_signature`, when the caller already has it."""
    key = sig if sig is not None else call_signature(spec, q, k, v, varlen, mod, sinks, force_grad)
    if key is not None:
        plan = PLANS.get(key)
        if plan is not None:
            return plan
    plan = _make_plan(spec, mod, q, k, v, varlen, sinks, force_grad)
    if key is not None:
        PLANS.put(key, plan)
    return plan


# ----------------------------------------------------------------------------- making a plan


def _static_problem(spec: AttentionSpec, mod: Any, q: Any, k: Any, v: Any, varlen: Varlen,
                    sinks: Optional[torch.Tensor], force_grad: bool = False) -> StaticProblem:
    """Every signature-level check of `dot_product_attention`'s tensors (ValueError/TypeError)."""
    fmt = spec.qkv_format
    V.check_qkv(q, k, v, fmt)
    packed = fmt == "thd"
    structure = L.check_length_structure(fmt, spec.attn_mask_type, q, k, varlen)
    ql, kl, vl = (logical_shape(t, fmt) for t in (q, k, v))
    batch = varlen.cu_seqlens_q.numel() - 1 if packed else ql[0]
    if packed:
        sq, skv = bucket(structure.max_seqlen_q), bucket(structure.max_seqlen_kv)
        strides = (tuple(q.stride()), tuple(k.stride()), tuple(v.stride()))
    else:
        sq, skv = ql[2], kl[2]
        perm = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}[fmt]
        strides = tuple(tuple(t.stride(i) for i in perm) for t in (q, k, v))
    scale = V.check_scale(spec.softmax_scale, ql[3])
    if mod is not None:
        mod.check(device=q.device, batch=batch, heads=ql[1], seqlen_q=structure.check_q, seqlen_kv=structure.check_kv)
    has_sinks = V.check_sinks(spec.softmax_type, sinks, ql[1], q.device)
    grad = force_grad or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                                       or (sinks is not None and sinks.requires_grad)))
    msig = _mod_sig(mod)
    if msig and torch.is_grad_enabled() and any(s[-1] for s in msig):
        grad = True
    return StaticProblem(
        spec=spec, batch=batch, heads=ql[1], kv_heads=kl[1], seqlen_q=sq, seqlen_kv=skv, head_dim=ql[3],
        head_dim_v=vl[3], dtype=q.dtype, device=q.device, q_strides=strides[0], k_strides=strides[1],
        v_strides=strides[2], scale=scale, needs_grad=grad,
        aligned=_aligned(q, k, v),
        same_lengths=varlen.cu_seqlens_q is varlen.cu_seqlens_kv,
        q_offsets=varlen.cu_seqlens_q_padded is not None, kv_offsets=varlen.cu_seqlens_kv_padded is not None,
        mod_tensors=msig, sinks=has_sinks and sinks is not None)


def _aligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """16-byte aligned data pointers (fake and meta tensors, which have none, count as aligned)."""
    from .tensor_kind import is_abstract

    if is_abstract(q, k, v):
        return True
    try:
        return ((q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15) == 0
    except RuntimeError:
        return True


def _plan_spec(spec: AttentionSpec, mod: Any) -> AttentionSpec:
    """The spec a plan keeps: a runner takes its graphs' operand shapes and structural values
    (a native band) from spec.score_mod, so that is this call's mod, without its data (the plan
    outlives the call; under torch.compile the spec holds the registry's template, whose tensor
    parameters are stand-ins of another shape)."""
    if mod is not None and mod.cache_key == spec.score_mod_key:
        return dataclasses.replace(spec, score_mod=frozen_template(mod))
    return spec


def _make_plan(spec: AttentionSpec, mod: Any, q: Any, k: Any, v: Any, varlen: Varlen,
               sinks: Optional[torch.Tensor], force_grad: bool = False) -> CallPlan:
    spec = _plan_spec(spec, mod)
    problem = _static_problem(spec, mod, q, k, v, varlen, sinks, force_grad)
    backend, reason, runner = engines.choose(problem)
    if backend == "reference" and problem.device.type == "cuda" and spec.backend == "auto":
        warnings.warn(f"fused_attn: backend='auto' runs this call on the reference backend (PyTorch math, slow): "
                      f"{reason}. Problem: {problem.describe()}. Pass backend='reference' to silence this, or see "
                      "fused_attn.explain(...).", FallbackWarning, stacklevel=4)
    return CallPlan(problem, backend, reason, runner)


def check_values(plan: Any, query: torch.Tensor, key: torch.Tensor, varlen: Varlen) -> None:
    """The per-call cu_seqlens value checks, unless the plan's runner does them itself."""
    problem = plan.problem
    if not problem.has_lengths or getattr(plan.runner, "validates_lengths", False):
        return
    if problem.spec.is_packed:
        limits = (varlen.max_seqlen_q, varlen.max_seqlen_kv)
    else:
        limits = (problem.seqlen_q, problem.seqlen_kv)
    L.check_length_values(problem.spec.qkv_format, query, key, varlen, limits)


def explain_plan(spec: AttentionSpec, mod: Any, q: Any, k: Any, v: Any, varlen: Varlen,
                 sinks: Optional[torch.Tensor] = None) -> Explanation:
    """Which backend runs this call and why (builds the plan if needed; runs nothing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        plan = get_plan(spec, mod, q, k, v, varlen, sinks)
    return Explanation(plan.backend, plan.reason, plan.problem.describe(), tuple(getattr(plan.runner, "quirks", ())),
                       engine_speed.family(plan.problem), getattr(plan.runner, "backward_backend", plan.backend))


planning.install(planning.Planner(
    get_plan=get_plan, static_problem=_static_problem, call_signature=call_signature,
    signature_records_grad=signature_records_grad, is_plan=lambda x: type(x) is CallPlan, clear_plans=clear_plans))
