"""torch.library custom ops for torch.compile: ``fused_attn::attn_fwd`` and ``fused_attn::attn_bwd``.

`functional.run_call` calls :func:`attention_by_key` while ``torch.compiler.is_compiling()``; eager
calls run the call plan directly (less host overhead). The ops take the call's tensors by name plus a
*spec key*: a string naming an `AttentionSpec` registered when the call is traced (with the
backend chosen from the tensors' metadata at that time). The implementation looks the spec up,
rebinds its score_mod template to the call's values and runs the same call plan as eager calls.

Score modifiers cross the op boundary as that key plus their float parameters (one CPU float64
tensor: a new value never recompiles) and tensor parameters (``Tensor[]``, in ``tensors()``
order); the registry keeps templates without tensor data (meta tensors), bounded.

Outputs never alias inputs or each other: out and lse are fresh tensors; ``saved`` is the
backend's tensor for the backward (cuDNN's fp32 Stats, or an empty tensor for the reference).
Gradients flow to query, key, value, the sinks and the floating score_mod tensor parameters the
backend differentiates (empty tensors stand for "no gradient").
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from typing import Any, List, Optional, Sequence, Tuple

import torch

from score_mods.base import ScoreMod

from . import engines
from .cache_registry import MemoInfo, register_clear
from .plan import Varlen, get_plan
from .spec import AttentionSpec, frozen_template

__all__ = ["attention_by_key", "compiled_key", "op_keys_for", "register_spec", "lookup_spec", "spec_key", "static_int",
           "static_value", "traced_backend"]

_REGISTRY: "OrderedDict[str, AttentionSpec]" = OrderedDict()
_REGISTRY_MAX = 4096
_REGISTRY_LOCK = threading.Lock()


def _registry_info() -> MemoInfo:
    with _REGISTRY_LOCK:
        return MemoInfo("ops.specs", 0, 0, 0, len(_REGISTRY), _REGISTRY_MAX)


register_clear("ops.specs", None, _registry_info,
               keeps="compiled graphs name their spec by key; the specs hold no tensor data (meta templates)")


def spec_key(spec: AttentionSpec) -> str:
    """Stable string naming a spec (the same in every process), with its score_mod's structural
    values (a window's native band: another band is another registered spec)."""
    mod = spec.score_mod
    structure = () if mod is None else mod.structural_values()
    digest = hashlib.sha256((repr(spec) + (f"|{structure!r}" if structure else "")).encode()).hexdigest()[:24]
    name = "none" if mod is None else mod.base_name  # value-free: a new value keeps the key
    return f"{spec.backend}:{name}:{digest}"


def _without_tensor_data(mod: Any) -> Any:
    """The mod with its tensor parameters replaced by meta tensors of the same shape and dtype
    (the registry must not keep users' biases alive), never an object updated in place."""
    return frozen_template(mod)


def _register(spec: AttentionSpec) -> str:
    key = spec_key(spec)
    with _REGISTRY_LOCK:
        if key not in _REGISTRY:
            _REGISTRY[key] = dataclasses.replace(spec, score_mod=_without_tensor_data(spec.score_mod))
            while len(_REGISTRY) > _REGISTRY_MAX:
                _REGISTRY.popitem(last=False)
        else:
            _REGISTRY.move_to_end(key)
    return key


@torch.compiler.assume_constant_result
def register_spec(spec: AttentionSpec) -> str:
    """Register `spec` (at trace time: the key is a structural constant) and return its key."""
    return _register(spec)


def lookup_spec(key: str) -> AttentionSpec:
    """The registered spec for `key` (ValueError if unknown: a compiled graph outlived it)."""
    try:
        return _REGISTRY[key]
    except KeyError:
        raise ValueError(f"spec key {key!r} is not registered (the registry keeps the {_REGISTRY_MAX} most recent "
                         "specs); recompile the model") from None


def _bound_mod(spec: AttentionSpec, scalars: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Any:
    template = spec.score_mod
    if template is None:
        return None
    names_s, names_t = list(template.scalars()), list(template.tensors())
    if len(names_s) != scalars.numel() or len(names_t) != len(tensors):
        raise ValueError(f"score_mod {template.name!r} takes {len(names_s)} scalars and {len(names_t)} tensors, "
                         f"got {scalars.numel()} and {len(tensors)}")
    if not names_s and not names_t:
        return template
    return template.rebind(dict(zip(names_s, (float(x) for x in scalars.tolist()))), dict(zip(names_t, tensors)))


def _structure_mod(spec: AttentionSpec, tensors: Sequence[torch.Tensor]) -> Any:
    """The template bound to these (possibly fake) tensor parameters and its own float values:
    enough for shape decisions, no data read (fake implementations)."""
    template = spec.score_mod
    if template is None or not template.tensors():
        return template
    return template.rebind(template.scalars(), dict(zip(template.tensors(), tensors)))


def _plan(spec_key_: str, query, key, value, cu_q, cu_kv, cu_q_pad, cu_kv_pad, max_q, max_kv, sinks, scalars, tensors,
          backward: bool = False):
    """The call plan inside an op (inputs there never require grad: `backward` forces the
    backward graph into the plan of attn_bwd)."""
    spec = lookup_spec(spec_key_)
    mod = _bound_mod(spec, scalars, tensors)
    varlen = Varlen(cu_q, cu_kv, cu_q_pad, cu_kv_pad, max_q, max_kv)
    plan = get_plan(spec, mod, query, key, value, varlen, sinks, force_grad=backward)
    return spec, mod, varlen, plan


_T = torch.Tensor
_OT = Optional[torch.Tensor]


@torch.library.custom_op("fused_attn::attn_fwd", mutates_args=())
def attn_fwd(query: _T, key: _T, value: _T, cu_seqlens_q: _OT, cu_seqlens_kv: _OT, cu_seqlens_q_padded: _OT,
             cu_seqlens_kv_padded: _OT, max_seqlen_q: Optional[int], max_seqlen_kv: Optional[int], sinks: _OT,
             score_mod_scalars: _T, score_mod_tensors: List[_T], dropout_rng: _OT,
             spec_key: str) -> Tuple[_T, _T, _T]:
    """(out in the query's format, lse fp32 (B, H, Sq) / (H, Tq) or an empty tensor, saved)."""
    from .plan import check_values

    spec, mod, varlen, plan = _plan(spec_key, query, key, value, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                    cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, sinks, score_mod_scalars,
                                    score_mod_tensors)
    check_values(plan, query, key, varlen)
    out, lse, saved, _state = plan.runner.forward(query, key, value, varlen, mod, sinks, dropout_rng)
    stats = engines.get(plan.backend).op_saved(saved, query)
    # as the fake implementation: an empty lse unless the spec returns it (runners may compute one anyway)
    lse = lse.clone() if spec.return_lse and lse is not None else query.new_empty((0,), dtype=torch.float32)
    if out.untyped_storage().data_ptr() == stats.untyped_storage().data_ptr():  # pragma: no cover - cloned above
        out = out.clone()
    return out, lse, stats


@attn_fwd.register_fake
def _attn_fwd_fake(query, key, value, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                   max_seqlen_q, max_seqlen_kv, sinks, score_mod_scalars, score_mod_tensors, dropout_rng, spec_key):
    spec = lookup_spec(spec_key)
    out = query.new_empty(tuple(query.shape[:-1]) + (value.shape[-1],))
    packed = spec.is_packed
    if not spec.return_lse:
        lse = query.new_empty((0,), dtype=torch.float32)
    elif packed:
        lse = query.new_empty((query.shape[1], query.shape[0]), dtype=torch.float32)
    else:
        from .layouts import logical_shape

        b, h, s, _ = logical_shape(query, spec.qkv_format)
        lse = query.new_empty((b, h, s), dtype=torch.float32)
    from .plan import _static_problem

    mod = _structure_mod(spec, score_mod_tensors)
    varlen = Varlen(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q,
                    max_seqlen_kv)
    saved_shape = engines.get(spec.backend).saved_shape(
        lambda: _static_problem(spec, mod, query, key, value, varlen, sinks), query.shape[0])
    saved = query.new_empty(saved_shape, dtype=torch.float32)
    return out, lse, saved


@torch.library.custom_op("fused_attn::attn_bwd", mutates_args=())
def attn_bwd(grad_out: _T, query: _T, key: _T, value: _T, out: _T, saved: _T, cu_seqlens_q: _OT,
             cu_seqlens_kv: _OT, cu_seqlens_q_padded: _OT, cu_seqlens_kv_padded: _OT, max_seqlen_q: Optional[int],
             max_seqlen_kv: Optional[int], sinks: _OT, score_mod_scalars: _T, score_mod_tensors: List[_T],
             dropout_rng: _OT, spec_key: str) -> List[_T]:
    """[dq, dk, dv, *grads of runner.grad_inputs (empty tensors where none)]."""
    spec, mod, varlen, plan = _plan(spec_key, query, key, value, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                    cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, sinks, score_mod_scalars,
                                    score_mod_tensors, backward=True)
    grads = plan.runner.backward_call(query, key, value, out, saved, varlen, mod, sinks, grad_out, dropout_rng)
    grads = list(grads[:3]) + plan.runner.op_grads(mod, sinks, grads)
    inputs = [grad_out, query, key, value, out, saved]
    return [query.new_empty((0,)) if g is None else _fresh(g, inputs) for g in grads]


def _fresh(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """`t`, or a copy when it shares storage with an input (custom-op outputs may not alias)."""
    if t.numel() and any(t.untyped_storage().data_ptr() == i.untyped_storage().data_ptr()
                         for i in inputs if i is not None and i.numel()):
        return t.clone()
    return t


@attn_bwd.register_fake
def _attn_bwd_fake(grad_out, query, key, value, out, saved, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                   cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, sinks, score_mod_scalars, score_mod_tensors,
                   dropout_rng, spec_key):
    spec = lookup_spec(spec_key)
    grads = [torch.empty_like(t) for t in (query, key, value)]
    for t in _differentiated(spec, score_mod_tensors, sinks):
        grads.append(t.new_empty(t.shape) if t is not None else query.new_empty((0,)))
    return grads


def _differentiated(spec: AttentionSpec, tensors: Sequence[torch.Tensor], sinks: Optional[torch.Tensor]) -> list:
    """The extra inputs whose gradients the backward op returns, in its order: the score_mod's
    floating tensor parameters (reference: all of them; cuDNN: the bias term), then the sinks."""
    out: list = []
    template = spec.score_mod
    if template is not None:
        names = list(template.tensors())
        wanted = _grad_param_names(spec)
        out.extend(t for n, t in zip(names, tensors) if n in wanted)
    if sinks is not None:
        out.append(sinks)
    return out


def _grad_param_names(spec: AttentionSpec) -> set:
    return engines.get(spec.backend).grad_param_names(spec)


def _setup_context(ctx, inputs, output) -> None:
    (query, key, value, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q,
     max_seqlen_kv, sinks, score_mod_scalars, score_mod_tensors, dropout_rng, spec_key) = inputs
    out, _lse, saved = output
    ctx.save_for_backward(query, key, value, out, saved, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                          cu_seqlens_kv_padded, sinks, score_mod_scalars, dropout_rng, *score_mod_tensors)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_kv)
    ctx.spec_key = spec_key
    ctx.n_tensors = len(score_mod_tensors)


def _backward(ctx, grad_out, _grad_lse, _grad_saved):
    (query, key, value, out, saved, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, sinks,
     score_mod_scalars, dropout_rng, *score_mod_tensors) = ctx.saved_tensors
    max_seqlen_q, max_seqlen_kv = ctx.max_seqlens
    grads = attn_bwd(grad_out, query, key, value, out, saved, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                     cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, sinks, score_mod_scalars, score_mod_tensors,
                     dropout_rng, ctx.spec_key)
    dq, dk, dv, *extra = grads
    spec = lookup_spec(ctx.spec_key)
    targets = _differentiated(spec, score_mod_tensors, sinks)
    by_id = {id(t): (g if g.numel() or not t.numel() else None) for t, g in zip(targets, extra)}
    d_sinks = by_id.get(id(sinks)) if sinks is not None else None
    d_tensors = [by_id.get(id(t)) for t in score_mod_tensors]
    # One gradient per input, in the schema's order (None for non-differentiable arguments):
    # query, key, value, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
    # max_seqlen_q, max_seqlen_kv, sinks, score_mod_scalars, score_mod_tensors, dropout_rng, spec_key
    return dq, dk, dv, None, None, None, None, None, None, d_sinks, None, d_tensors, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _scalars(mod: Any) -> torch.Tensor:
    if mod is None:
        return torch.zeros(0, dtype=torch.float64)
    return mod.scalar_tensor()


def traced_spec(spec: AttentionSpec, device_type: str, dtype: torch.dtype, head_dim: int,
                head_dim_v: int) -> AttentionSpec:
    """`spec` with backend "auto" replaced by the backend its tensors' metadata selects."""
    if spec.backend != "auto":
        return spec
    return dataclasses.replace(spec, backend=engines.traced_choice("auto", device_type, dtype, head_dim, head_dim_v))


def op_keys_for(spec: AttentionSpec) -> dict:
    """{backend: registered spec key} for every backend `spec` may run on under torch.compile
    (DotProductAttention computes these eagerly, so a compiled model reads constants)."""
    names = engines.names()[1:] if spec.backend == "auto" else (spec.backend,)
    return {name: _register(dataclasses.replace(spec, backend=name)) for name in names}


@torch.compiler.assume_constant_result
def compiled_key(resolver: Any, args: tuple, score_mod: Any, mod_facts: Optional[tuple], device_type: str,
                 dtype: torch.dtype, head_dim: int, head_dim_v: int) -> str:
    """Run an entry point's spec resolution at trace time (eagerly) and register the result:
    `resolver(args, score_mod) -> (spec, mod)`; returns the spec key (a constant of the graph).
    A traced mod arrives as its `compile_structure()` (origin name, mod_facts) and resolves as
    the origin's meta-tensor stand-in; any other score_mod (mod_facts None) as itself."""
    if mod_facts is not None:
        from score_mods.trace import origin_named

        score_mod = origin_named(score_mod).stand_in(mod_facts)
    spec, _mod = resolver(args, score_mod)
    return _register(traced_spec(spec, device_type, dtype, head_dim, head_dim_v))


def call_key(resolver: Any, args: tuple, score_mod: Any, query: torch.Tensor, value: torch.Tensor) -> str:
    """`compiled_key` of an entry point's call: a traced mod crosses as its `compile_structure()`
    (a mod bound inside a compiled function is only tracked by torch.compile, not yet a complete
    Python object); anything else as itself."""
    structure = score_mod.compile_structure() if isinstance(score_mod, ScoreMod) else None
    mod_arg, facts = (score_mod, None) if structure is None else structure
    return compiled_key(resolver, static_value(args), mod_arg, facts, query.device.type, query.dtype,
                        static_int(query.shape[-1]), static_int(value.shape[-1]))


def static_value(x: Any) -> Any:
    """`x` with every number a Python constant (recursively through tuples): under
    torch.compile with dynamic shapes, int and float arguments (defaults included) arrive as
    symbolic values, which `compiled_key` cannot take. Each is pinned to its value by comparisons
    that torch.compile turns into guards: configuration values (head dims, windows, scales) are
    structural constants of the spec, so sequence lengths stay symbolic. Eager values pass as
    they are."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, float):
        return x.__float__()  # a symbolic float specializes to its value here
    if isinstance(x, int):
        return static_int(x)
    if isinstance(x, tuple):
        return tuple(static_value(y) for y in x)
    return x


def static_int(n: Any, bits: int = 31) -> int:
    """`n` as a Python int: itself in eager code; under torch.compile (where it may be symbolic)
    found by bisection over [-2**bits, 2**bits], each comparison one guard (see `static_value`)."""
    if type(n) is int and not torch.compiler.is_compiling():
        return n
    lo, hi = -(1 << bits), 1 << bits
    while lo < hi:
        mid = (lo + hi) // 2
        if n <= mid:
            hi = mid
        else:
            lo = mid + 1
    return lo


@torch.compiler.assume_constant_result
def traced_backend(device_type: str, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> str:
    """The backend `auto` selects for these metadata (a constant of the graph)."""
    probe = AttentionSpec("bshd", "no_mask", None, False, None, None, False, False, "auto")
    return traced_spec(probe, device_type, dtype, head_dim, head_dim_v).backend


@torch.compiler.assume_constant_result
def _template_scalars(key: str) -> tuple:
    template = lookup_spec(key).score_mod
    return () if template is None else tuple(template.scalars().values())


@torch.compiler.assume_constant_result
def _dropout_p(key: str) -> float:
    return lookup_spec(key).dropout_p


@torch.compiler.assume_constant_result
def _returns_lse(key: str) -> bool:
    return lookup_spec(key).return_lse


def attention_by_key(key: str, mod: Any, query: torch.Tensor, key_t: torch.Tensor, value: torch.Tensor,
                     varlen: Varlen, sinks: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run a registered spec through the custom ops (traceable, fullgraph); (out, lse or None).

    `mod`: the call's ScoreMod (its float values and tensors are read here), or None / a plain
    function (the registered template's values are used)."""
    from score_mods.base import ScoreMod

    if isinstance(mod, ScoreMod):
        scalars, tensors = _scalars(mod), list(mod.tensors().values())
    else:
        scalars, tensors = torch.tensor(_template_scalars(key), dtype=torch.float64), []
    rng = None
    if _dropout_p(key):
        rng = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=query.device)
    out, lse, _saved = attn_fwd(query, key_t, value, varlen.cu_seqlens_q, varlen.cu_seqlens_kv,
                                varlen.cu_seqlens_q_padded, varlen.cu_seqlens_kv_padded, varlen.max_seqlen_q,
                                varlen.max_seqlen_kv, sinks, scalars, tensors, rng, key)
    return out, (lse if _returns_lse(key) else None)
