"""`dot_product_attention`: resolve the spec, look up the call plan, run it.

The first call with a new configuration resolves an `AttentionSpec` (memoized on the
arguments); the first call with a new tensor signature makes a `CallPlan` (validation, backend
choice and reason, graphs). Every later call is a memo hit, a plan hit, and the plan's run.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from . import abstract, engines, extensions
from .length_checks import derive_max_seqlens
from .autograd import attention
from .key_range import trim_unattended_keys
from .plan import (NO_VARLEN, CallPlan, Explanation, Varlen, call_signature, check_values, explain_plan, get_plan,
                   routed_engine)
from .spec import AttentionSpec, resolve_spec

__all__ = ["dot_product_attention", "explain", "run_spec", "run_call", "attention_forward", "attention_backward"]


def dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    qkv_format: str = "bshd",
    attn_mask_type: str = "no_mask",
    window_size: Optional[Tuple[int, int]] = None,
    softmax_scale: Optional[float] = None,
    score_mod: Any = None,
    score_mod_tensors: Optional[dict] = None,
    score_mod_bprop: Any = None,
    score_mod_bprop_tensors: Optional[dict] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_kv: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_kv: Optional[int] = None,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool = False,
    softmax_type: str = "vanilla",
    sinks: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """softmax(mask(score_mod(softmax_scale * Q K^T))) V.

    Shapes (B batch, S seq, H / Hkv heads, D / Dv head dims, T packed tokens):
        qkv_format "bshd": query (B, Sq, H, D), key (B, Skv, Hkv, D), value (B, Skv, Hkv, Dv)
                   "sbhd": (S, B, H, D)   "bhsd": (B, H, S, D)
                   "thd":  query (Tq, H, D), key/value (Tkv, Hkv, D|Dv) with cu_seqlens_q/kv (B+1,) int32
        The format is not guessed from the shapes: (B, H, S, D) tensors under the default "bshd"
        run as if S were the heads (DotProductAttention catches it from its head counts).
        out: the query's format with Dv; lse (return_lse=True): fp32 (B, H, Sq), or (H, Tq) for thd.
    H must be a multiple of Hkv (GQA/MQA). softmax_scale defaults to 1/sqrt(D).

    attn_mask_type:
        "no_mask"; "causal" (top-left: query i sees keys j <= i); "causal_bottom_right"
        (j <= i + Skv - Sq: the last query sees every key); "padding" / "padding_causal"
        (dense formats: sequence b has cu_seqlens_q[b+1] - cu_seqlens_q[b] real queries and
        likewise keys; rows past it are 0 with lse -inf and receive no gradient; with thd the
        padding types equal their non-padding twins, since thd always has lengths).

    window_size = (left, right), -1 = unbounded (flash-attention): query i sees keys j with
    -left <= j - (i + shift) <= right, shift = Skv - Sq (per sequence) with causal_bottom_right
    and 0 (top-left) otherwise. A causal type needs right in (0, -1). Sq = 3, Skv = 5:

        window (1, 0), top-left          causal_bottom_right + window (1, 0)  (shift = 2)
        q\\k 0 1 2 3 4                     q\\k 0 1 2 3 4
        0   x . . . .                     0   . x x . .
        1   x x . . .                     1   . . x x .
        2   . x x . .                     2   . . . x x

    Rows with no allowed key give out 0 and lse -inf, never NaN.

    score_mod: a `score_mods.ScoreMod`, a function (score, b, h, q_idx, kv_idx) -> score, or a
    raw cuDNN callback with score_mod_tensors / score_mod_bprop / score_mod_bprop_tensors. It
    sees scaled scores. Masks and windows are then applied as score_mods after it.

    cu_seqlens_*_padded (thd only): token offsets of each sequence when there are gaps.
    max_seqlen_q/kv: Python ints >= every length; for thd, None derives them from cu_seqlens
    (one device->host copy, a sync on CUDA: give them to keep the call sync-free). cu_seqlens
    values are checked per call (CPU: ValueError; CUDA: an asynchronous device assertion).

    softmax_type: "vanilla"; "off-by-one" (softmax with an extra logit 0 per row, no value);
    "learnable" (the extra logit per head is `sinks`, a floating (H,) tensor, trainable: it
    receives a gradient). lse then includes the sink. dropout_p: attention dropout probability.

    backend: "auto" (cuDNN on CUDA, the torch engine on CPU, when they can serve; else the
    reference, with the reason: `explain`), "cudnn", "torch" (torch's CPU kernels: SDPA flash,
    compiled flex for score_mods at inference) or "reference"; an explicit backend that cannot
    serve raises NotImplementedError with the reason.
    deterministic: use cuDNN's deterministic backward (the reference is always deterministic).
    """
    config = (qkv_format, attn_mask_type, window_size, softmax_scale, score_mod_tensors, score_mod_bprop,
              score_mod_bprop_tensors, return_lse, backend, deterministic, softmax_type, dropout_p)
    if (cu_seqlens_q is None and cu_seqlens_kv is None and max_seqlen_q is None and max_seqlen_kv is None
            and cu_seqlens_q_padded is None and cu_seqlens_kv_padded is None):
        varlen = NO_VARLEN
    else:
        varlen = Varlen(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q,
                        max_seqlen_kv)
    return run_call(_resolve_call, config, score_mod, query, key, value, varlen, sinks)


def _resolve_call(config: tuple, score_mod: Any) -> Tuple[AttentionSpec, Any]:
    """`dot_product_attention`'s spec from its configuration arguments (memoized)."""
    (qkv_format, attn_mask_type, window_size, softmax_scale, score_mod_tensors, score_mod_bprop,
     score_mod_bprop_tensors, return_lse, backend, deterministic, softmax_type, dropout_p) = config
    return resolve_spec(qkv_format, attn_mask_type, window_size, softmax_scale, score_mod, score_mod_tensors,
                        score_mod_bprop, score_mod_bprop_tensors, return_lse, backend, deterministic, softmax_type,
                        dropout_p)


def run_call(resolver: Any, config: tuple, score_mod: Any, query: Any, key: Any, value: Any, varlen: Varlen,
             sinks: Optional[torch.Tensor] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The body of the public entry points: `resolver(config, score_mod) -> (spec, mod)` then the
    plan. Under torch.compile the resolution runs once at trace time (its key is a constant).
    DTensor inputs go to `fused_attn.distributed` (batch / head sharding, context parallelism)."""
    if type(query) is not torch.Tensor and _is_dtensor(query):
        return extensions.get("dtensor_call")(resolver, config, score_mod, query, key, value, varlen, sinks)
    if torch.compiler.is_compiling():
        from . import ops

        key_ = ops.call_key(resolver, config, score_mod, query, value)
        out, lse = ops.attention_by_key(key_, score_mod, query, key, value, _compiled_varlen(varlen), sinks)
        return out if lse is None else (out, lse)
    spec, mod = resolver(config, score_mod)
    return run_spec(spec, mod, query, key, value, varlen, sinks)


def _is_dtensor(t: Any) -> bool:
    """A DTensor (checked only for inputs that are not plain tensors; no import otherwise)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _compiled_varlen(varlen: Varlen) -> Varlen:
    if varlen.cu_seqlens_q is not None and (varlen.max_seqlen_q is None or varlen.max_seqlen_kv is None):
        raise ValueError("under torch.compile, packed (thd) calls need max_seqlen_q and max_seqlen_kv (deriving them "
                         "from cu_seqlens would read the device on the host)")
    return varlen


def _complete(spec: AttentionSpec, varlen: Varlen) -> Varlen:
    """thd without max_seqlen: derive it from cu_seqlens (the documented host read)."""
    if spec.is_packed and (varlen.max_seqlen_q is None or varlen.max_seqlen_kv is None):
        if abstract.is_abstract(varlen.cu_seqlens_q, varlen.cu_seqlens_kv):
            return varlen  # nothing to read: the abstract path bounds them by the token counts
        mq, mk = derive_max_seqlens(varlen)
        return varlen._replace(max_seqlen_q=mq, max_seqlen_kv=mk)
    return varlen


def run_spec(spec: AttentionSpec, mod: Any, query: Any, key: Any, value: Any, varlen: Varlen,
             sinks: Optional[torch.Tensor] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Run a resolved spec on tensors: the body of every entry point (module, varlen, doc_packed).
    Fake and meta tensors go through the custom ops' fake implementations (`abstract`)."""
    if abstract.is_abstract(query):
        return abstract.attention(spec, mod, query, key, value, varlen, sinks)
    varlen = _complete(spec, varlen)
    if spec.may_cut_band and varlen is NO_VARLEN and getattr(query, "is_cuda", False):
        # the engine's own way to serve the call (cuDNN: rectangles of the band), or the plain plan:
        # one lookup either way
        sig = call_signature(spec, query, key, value, varlen, mod, sinks)
        if sig is not None:
            engine = routed_engine(spec, mod, query, key, value, sinks, sig)
            how = engines.route(engine, spec, mod, query, key, value, sinks, sig)
            if type(how) is CallPlan:
                return _run_plan(spec, mod, query, key, value, varlen, sinks, how)
            if how is not None:
                return how(spec, mod, query, key, value, sinks)
    return _run_plan(spec, mod, query, key, value, varlen, sinks)


def _run_plan(spec: AttentionSpec, mod: Any, query: Any, key: Any, value: Any, varlen: Varlen,
              sinks: Optional[torch.Tensor], plan: Optional[CallPlan] = None
              ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    if plan is None:
        if spec.trims_keys:  # a plain causal / windowed dense call: never read keys no query attends
            key, value = trim_unattended_keys(spec.qkv_format, spec.band, query, key, value)
        plan = get_plan(spec, mod, query, key, value, varlen, sinks)
    check_values(plan, query, key, varlen)
    out, lse = attention(plan.runner, query, key, value, varlen, mod, sinks)
    return (out, lse) if spec.return_lse else out


def explain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Explanation:
    """Which backend `dot_product_attention(query, key, value, **kwargs)` runs on, and why.

    Returns Explanation(backend, reason, problem, quirks, family, backward_backend): e.g.
    ("reference", "cuDNN cannot serve it: ...", "qkv_format='bshd', ...", ...). backend runs the
    forward; backward_backend the backward (another engine where backend="auto" splits a training
    call). Makes (and caches) the call plan; runs no attention.
    """
    cfg, varlen, sinks = _split_kwargs(kwargs, "explain")
    spec, mod = resolve_spec(**cfg)
    return explain_plan(spec, mod, query, key, value, _complete(spec, varlen), sinks)


_SPEC_ARGS = frozenset({"qkv_format", "attn_mask_type", "window_size", "softmax_scale", "score_mod",
                        "score_mod_tensors", "score_mod_bprop", "score_mod_bprop_tensors", "return_lse", "backend",
                        "deterministic", "softmax_type", "dropout_p"})


def _split_kwargs(kwargs: dict, who: str) -> Tuple[dict, Varlen, Optional[torch.Tensor]]:
    """(spec keyword arguments, Varlen, sinks) of dot_product_attention-style keyword arguments."""
    cfg = dict(kwargs)
    names = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q",
             "max_seqlen_kv")
    varlen = Varlen(*(cfg.pop(n, None) for n in names))
    sinks = cfg.pop("sinks", None)
    unknown = sorted(set(cfg) - _SPEC_ARGS)
    if unknown:
        raise TypeError(f"{who} got unexpected keyword(s) {unknown}; it takes dot_product_attention's arguments")
    return cfg, varlen, sinks


def _split_call_kwargs(kwargs: dict) -> Tuple[AttentionSpec, Any, Varlen, Optional[torch.Tensor]]:
    cfg, varlen, sinks = _split_kwargs(kwargs, "attention_forward / attention_backward")
    cfg["return_lse"] = True
    spec, mod = resolve_spec(**cfg)
    return spec, mod, _complete(spec, varlen), sinks


def attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `dot_product_attention(query, key, value, **kwargs)` without autograd.

    A building block for callers that assemble one attention from pieces (context
    parallelism: one key/value chunk at a time, merged with the lse): out in the query's
    format, lse fp32 (B, H, Sq) or (H, Tq) for thd. Pair it with `attention_backward`.
    """
    spec, mod, varlen, sinks = _split_call_kwargs(kwargs)
    if abstract.is_abstract(query, key, value):
        return abstract.forward_with_lse(spec, mod, query, key, value, varlen, sinks)
    with torch.no_grad():
        plan = get_plan(spec, mod, query, key, value, varlen, sinks)
        check_values(plan, query, key, varlen)
        out, lse, _, _ = plan.runner.forward(query, key, value, varlen, mod, sinks)
    return out, lse


def attention_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, grad_out: torch.Tensor, **kwargs: Any) -> Tuple[torch.Tensor, ...]:
    """Gradients (dq, dk, dv, then the score_mod's differentiated tensor parameters and the
    sinks, as the backend reports them) of one call, given the output `out` and fp32 `lse`
    it is normalized by — which may belong to a larger attention over more keys than
    key/value hold (the global output and lse of a context-parallel ring): the weights are
    exp(score - lse), and D = rowsum(grad_out * out) uses the given output.
    """
    spec, mod, varlen, sinks = _split_call_kwargs(kwargs)
    if abstract.is_abstract(query, key, value, grad_out):
        return abstract.backward_shapes(spec, mod, query, key, value, varlen, sinks)
    if spec.dropout_p:
        raise NotImplementedError("attention_backward with dropout_p > 0: the backward needs the forward's dropout "
                                  "mask, which attention_forward does not return; assemble pieces without dropout")
    plan = get_plan(spec, mod, query, key, value, varlen, sinks, force_grad=True)
    check_values(plan, query, key, varlen)
    return plan.runner.backward_with_lse(query, key, value, out, lse, varlen, mod, sinks, grad_out)
