"""torch.library custom ops for torch.compile: ``fused_attn::attn_fwd`` and ``fused_attn::attn_bwd``.

`backends/select.py` calls :func:`attention` while ``torch.compiler.is_compiling()``; eager calls
keep the backends' own autograd path (less host overhead). The ops take the flattened fields of
an :class:`~fused_attn.problem.AttentionProblem`; one implementation serves every device and
calls ``fused_attn.backends.<backend>.forward / backward``.

Score modifiers cannot be op arguments. :func:`register_score_mod` keeps a process-wide registry
``stable key string -> ScoreMod template`` (the key hashes ``repr(score_mod.cache_key)``); the op
receives that string plus the float parameters (a CPU float64 tensor, so new values never
recompile) and tensor parameters
(``Tensor[]``, in ``tensors()`` order) and rebinds them with ``template.rebind(scalars, tensors)``.

Saved state: the forward op returns (out, lse, saved); ``saved`` is the backend's private tensor
for backward. A backend whose ``forward`` returns a tensor there must provide
``saved_like(problem) -> Tensor`` (an empty tensor of the right shape, dtype and device that works
on fake tensors) so the fake implementation can describe it; ``None`` travels as a (0,) tensor.

Aliasing: a custom op's outputs may alias neither its inputs nor each other. A backend whose lse
is a view of ``saved`` (cuDNN dense: lse is Stats (B, H, Sq, 1) squeezed) defines
``lse_from_saved(problem, saved) -> Optional[Tensor]`` (the view, or None where lse is a tensor
of its own; it must work on fake tensors): the op then returns a (0,) placeholder for lse and
:func:`attention` takes the view outside the op, at no cost. Any other output that still shares
storage with an input or an earlier output is cloned (a safety net; no backend needs it today).

Limitations: gradients flow to query, key and value only (not to lse or score_mod tensors).
"""

from __future__ import annotations

import hashlib
import importlib
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .problem import AttentionProblem, Band

__all__ = ["attention", "register_score_mod", "prepare_score_mod", "lookup_score_mod", "score_mod_key"]

_REGISTRY: Dict[str, object] = {}
_REGISTRY_LOCK = threading.Lock()


def score_mod_key(score_mod: object) -> str:
    """Stable string for a ScoreMod's structural cache key (same across processes)."""
    digest = hashlib.sha256(repr(score_mod.cache_key).encode()).hexdigest()[:20]
    return f"{getattr(score_mod, 'name', 'score_mod')}:{digest}"


def prepare_score_mod(score_mod: object) -> str:
    """Register `score_mod` now, in eager code, and remember its key on the object: a compiled
    model that reuses the object then reads a constant string instead of tracing the
    registration (DotProductAttention does this for its configured score_mod)."""
    key = score_mod_key(score_mod)
    with _REGISTRY_LOCK:
        _REGISTRY.setdefault(key, score_mod)
    score_mod._op_key = key
    return key


@torch.compiler.assume_constant_result
def register_score_mod(score_mod: object) -> str:
    """Register `score_mod` as the template for its structural key; return the key string.

    Run once at trace time under torch.compile (the key is a structural constant)."""
    key = score_mod_key(score_mod)
    with _REGISTRY_LOCK:
        _REGISTRY.setdefault(key, score_mod)
    return key


def lookup_score_mod(key: str, scalars: Sequence[float], tensors: Sequence[torch.Tensor]) -> object:
    """The registered template for `key`, rebound to the given parameter values."""
    try:
        template = _REGISTRY[key]
    except KeyError:
        raise ValueError(f"score_mod key {key!r} is not registered; call fused_attn.ops.register_score_mod first") from None
    names_s = list(template.scalars())
    names_t = list(template.tensors())
    if len(names_s) != len(scalars) or len(names_t) != len(tensors):
        raise ValueError(
            f"score_mod {key!r} takes {len(names_s)} scalars and {len(names_t)} tensors, "
            f"got {len(scalars)} and {len(tensors)}"
        )
    if not names_s and not names_t:
        return template
    rebind = getattr(template, "rebind", None)
    if rebind is None:
        raise NotImplementedError(
            f"score_mod {template.name!r} has parameters but no rebind(scalars, tensors); "
            "it cannot be used under torch.compile"
        )
    return rebind(dict(zip(names_s, (float(s) for s in scalars))), dict(zip(names_t, tensors)))


def _backend(name: str):
    """fused_attn.backends.<name>; an attribute lookup once imported (traceable by dynamo)."""
    from . import backends

    mod = getattr(backends, name, None)
    return mod if mod is not None else importlib.import_module(f"fused_attn.backends.{name}")


def _problem(
    query, key, value, qkv_format, scale, band, seqlens_q, seqlens_kv, cu_q, cu_kv, cu_q_pad, cu_kv_pad,
    max_q, max_kv, sm_key, sm_scalars, sm_tensors, deterministic,
) -> AttentionProblem:
    """Rebuild the AttentionProblem from the ops' flat arguments (band: [] or [left, right, bottom_right])."""
    band_obj = None
    if band:
        band_obj = Band(None if band[0] < 0 else band[0], None if band[1] < 0 else band[1], bool(band[2]))
    score_mod = lookup_score_mod(sm_key, sm_scalars.tolist(), sm_tensors) if sm_key else None
    return AttentionProblem(
        query=query, key=key, value=value, qkv_format=qkv_format, scale=scale, band=band_obj,
        seqlens_q=seqlens_q, seqlens_kv=seqlens_kv, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
        cu_seqlens_q_padded=cu_q_pad, cu_seqlens_kv_padded=cu_kv_pad, max_seqlen_q=max_q,
        max_seqlen_kv=max_kv, score_mod=score_mod, return_lse=True, deterministic=deterministic,
    )


_T = torch.Tensor
_OT = Optional[torch.Tensor]


@torch.library.custom_op("fused_attn::attn_fwd", mutates_args=())
def attn_fwd(
    query: _T, key: _T, value: _T, backend: str, qkv_format: str, scale: float, band: List[int],
    seqlens_q: _OT, seqlens_kv: _OT, cu_seqlens_q: _OT, cu_seqlens_kv: _OT,
    cu_seqlens_q_padded: _OT, cu_seqlens_kv_padded: _OT, max_seqlen_q: Optional[int],
    max_seqlen_kv: Optional[int], score_mod_key: str, score_mod_scalars: _T,
    score_mod_tensors: List[_T], deterministic: bool,
) -> Tuple[_T, _T, _T]:
    """Forward: (out in the query's format, lse fp32 (B,H,Sq) / (H,Tq), backend-saved tensor)."""
    problem = _problem(query, key, value, qkv_format, scale, band, seqlens_q, seqlens_kv, cu_seqlens_q,
                       cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q,
                       max_seqlen_kv, score_mod_key, score_mod_scalars, score_mod_tensors, deterministic)
    mod = _backend(backend)
    out, lse, saved = mod.forward(problem)
    if saved is None:
        saved = query.new_empty((0,))
    elif not hasattr(mod, "saved_like"):
        raise NotImplementedError(
            f"backend {backend!r} returns a saved tensor but defines no saved_like(problem); "
            "it cannot run under torch.compile"
        )
    if _lse_from_saved(mod, problem, saved) is not None:
        lse = saved.new_empty((0,))  # attention() takes the view of saved outside the op
    inputs = (query, key, value, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
              cu_seqlens_kv_padded, score_mod_scalars, *score_mod_tensors)
    return _unaliased((_in_layout(out, query), lse, saved), inputs)


def _lse_from_saved(mod, problem: AttentionProblem, saved: torch.Tensor) -> Optional[torch.Tensor]:
    """The backend's lse as a view of `saved`, or None when its lse is a tensor of its own."""
    hook = getattr(mod, "lse_from_saved", None)
    return None if hook is None else hook(problem, saved)


def _unaliased(outputs: Sequence[torch.Tensor], inputs: Sequence[Optional[torch.Tensor]]) -> Tuple[torch.Tensor, ...]:
    """`outputs` with any tensor that shares storage with an input or an earlier output cloned
    (same strides), as custom ops require. Empty tensors get a fresh (free) storage of their own."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel() > 0}
    result = []
    for t in outputs:
        if t.numel() == 0:
            t = t.new_empty_strided(t.shape, t.stride())
        else:
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
            seen.add(t.untyped_storage().data_ptr())
        result.append(t)
    return tuple(result)


def _empty_like_layout(t: torch.Tensor, last: int) -> torch.Tensor:
    """Empty tensor of t's shape with last dim `last`, in t's memory order (e.g. BSHD under a BHSD view)."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -d))  # outermost first
    shape = list(t.shape[:-1]) + [last]
    buf = t.new_empty([shape[d] for d in order])
    return buf.permute([order.index(d) for d in range(t.dim())])


def _in_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t in like's memory order (what the fake kernels promise); a copy only if the backend differs."""
    want = _empty_like_layout(like, t.shape[-1])
    if t.stride() == want.stride():
        return t
    return want.copy_(t)


@attn_fwd.register_fake
def _attn_fwd_fake(query, key, value, backend, qkv_format, scale, band, seqlens_q, seqlens_kv, cu_seqlens_q,
                   cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv,
                   score_mod_key, score_mod_scalars, score_mod_tensors, deterministic):
    out = _empty_like_layout(query, value.shape[-1])
    if qkv_format == "thd":
        lse = query.new_empty((query.shape[1], query.shape[0]), dtype=torch.float32)
    else:  # dense ops receive logical (B, H, S, D) tensors
        lse = query.new_empty(query.shape[:3], dtype=torch.float32)
    mod = _backend(backend)
    if hasattr(mod, "saved_like"):
        # Shapes only: no score_mod (its float values are data the fake tensors do not hold).
        problem = _problem(query, key, value, qkv_format, scale, band, seqlens_q, seqlens_kv, cu_seqlens_q,
                           cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q,
                           max_seqlen_kv, "", score_mod_scalars, [], deterministic)
        saved = mod.saved_like(problem)
        if _lse_from_saved(mod, problem, saved) is not None:
            lse = saved.new_empty((0,))
    else:
        saved = query.new_empty((0,))
    return _in_layout(out, query), lse, saved


@torch.library.custom_op("fused_attn::attn_bwd", mutates_args=())
def attn_bwd(
    grad_out: _T, query: _T, key: _T, value: _T, out: _T, saved: _T, backend: str, qkv_format: str,
    scale: float, band: List[int], seqlens_q: _OT, seqlens_kv: _OT, cu_seqlens_q: _OT, cu_seqlens_kv: _OT,
    cu_seqlens_q_padded: _OT, cu_seqlens_kv_padded: _OT, max_seqlen_q: Optional[int],
    max_seqlen_kv: Optional[int], score_mod_key: str, score_mod_scalars: _T,
    score_mod_tensors: List[_T], deterministic: bool,
) -> Tuple[_T, _T, _T]:
    """Backward: (dq, dk, dv) with the shapes of query, key, value."""
    problem = _problem(query, key, value, qkv_format, scale, band, seqlens_q, seqlens_kv, cu_seqlens_q,
                       cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q,
                       max_seqlen_kv, score_mod_key, score_mod_scalars, score_mod_tensors, deterministic)
    saved_arg = None if saved.numel() == 0 and saved.dim() == 1 else saved
    grads = _backend(backend).backward(problem, out, saved_arg, grad_out)
    inputs = (grad_out, query, key, value, out, saved, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv,
              cu_seqlens_q_padded, cu_seqlens_kv_padded, score_mod_scalars, *score_mod_tensors)
    return _unaliased(tuple(_in_layout(g, t) for g, t in zip(grads, (query, key, value))), inputs)


@attn_bwd.register_fake
def _attn_bwd_fake(grad_out, query, key, value, out, saved, *rest):
    return tuple(_empty_like_layout(t, t.shape[-1]) for t in (query, key, value))


_N_FWD_ARGS = 19


def _setup_context(ctx, inputs, output) -> None:
    out, _lse, saved = output
    query, key, value = inputs[:3]
    ctx.save_for_backward(query, key, value, out, saved, *(t if t is not None else query.new_empty(0) for t in inputs[7:13]), *inputs[17])
    ctx.present = tuple(t is not None for t in inputs[7:13])
    ctx.n_sm_tensors = len(inputs[17])
    # Gradient structure autograd expects: Tensor[] one entry per element; int[] / float[] are one
    # leaf when non-empty but an empty list when empty.
    ctx.list_lens = {17: len(inputs[17])}
    ctx.list_lens.update({6: 0} if len(inputs[6]) == 0 else {})
    ctx.static = (inputs[3], inputs[4], inputs[5], inputs[6], inputs[13], inputs[14], inputs[15], inputs[16], inputs[18])


def _backward(ctx, grad_out, _grad_lse, _grad_saved):
    query, key, value, out, saved, *rest = ctx.saved_tensors
    optional = [t if present else None for t, present in zip(rest[:6], ctx.present)]
    sm_tensors = list(rest[6:])
    backend, qkv_format, scale, band, max_q, max_kv, sm_key, sm_scalars, deterministic = ctx.static
    dq, dk, dv = attn_bwd(grad_out, query, key, value, out, saved,
                          backend, qkv_format, scale, band, *optional, max_q, max_kv, sm_key, sm_scalars,
                          sm_tensors, deterministic)
    # One gradient per input, lists matched element-wise (autograd checks the structure).
    rest_grads = [[None] * ctx.list_lens[i] if i in ctx.list_lens else None for i in range(3, _N_FWD_ARGS)]
    return (dq, dk, dv, *rest_grads)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _band_arg(band: Optional[Band]) -> List[int]:
    if band is None:
        return []
    return [-1 if band.left is None else band.left, -1 if band.right is None else band.right, int(band.bottom_right)]


def attention(problem: AttentionProblem, backend_name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run `problem` on backend `backend_name` through the custom ops; returns (out, lse).

    Traceable by torch.compile (fullgraph); differentiable with respect to query, key, value.
    """
    sm = problem.score_mod
    if sm is not None:
        sm_key = getattr(sm, "_op_key", None)
        if sm_key is None:
            sm_key = register_score_mod(sm)
        # A CPU fp64 tensor, not float[]: a changed value then never recompiles the graph.
        made = getattr(sm, "scalar_tensor", None)
        scalars = made() if made is not None else torch.tensor(list(sm.scalars().values()), dtype=torch.float64)
        tensors = list(sm.tensors().values())
    else:
        sm_key, scalars, tensors = "", torch.zeros(0, dtype=torch.float64), []
    out, lse, saved = attn_fwd(
        problem.query, problem.key, problem.value, backend_name, problem.qkv_format, float(problem.scale),
        _band_arg(problem.band), problem.seqlens_q, problem.seqlens_kv, problem.cu_seqlens_q,
        problem.cu_seqlens_kv, problem.cu_seqlens_q_padded, problem.cu_seqlens_kv_padded,
        problem.max_seqlen_q, problem.max_seqlen_kv, sm_key, scalars, tensors, bool(problem.deterministic),
    )
    from_saved = _lse_from_saved(_backend(backend_name), problem, saved)
    return out, (lse if from_saved is None else from_saved)
