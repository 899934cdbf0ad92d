"""Calls on fake or meta tensors: shapes, dtypes, devices and autograd, no kernel, no value read.

Tracers (FakeTensorMode, as AutoParallel and torch.export use it) and meta-device models call the
public entry points with tensors that have metadata but no data. Such a call goes through the
custom ops of `fused_attn.ops`, whose fake implementations give the outputs' metadata and whose
registered autograd gives them a grad_fn; nothing reads cu_seqlens or a document table, nothing
executes a cuDNN graph (`backends.cudnn.runtime.execute` refuses tensors without storage).

    out = attention(spec, mod, q, k, v, varlen, sinks)     # out, or (out, lse) with spec.return_lse

thd calls without max_seqlen_q / max_seqlen_kv take the token counts as their bounds (an upper
bound of every length, known without reading cu_seqlens).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from .tensor_kind import is_abstract

__all__ = ["is_abstract", "attention", "forward_with_lse", "backward_shapes"]

def _bounded(spec: Any, query: torch.Tensor, key: torch.Tensor, varlen: Any) -> Any:
    """thd without max lengths: the token counts (no read of cu_seqlens)."""
    if spec.is_packed and (varlen.max_seqlen_q is None or varlen.max_seqlen_kv is None):
        return varlen._replace(
            max_seqlen_q=query.shape[0] if varlen.max_seqlen_q is None else varlen.max_seqlen_q,
            max_seqlen_kv=key.shape[0] if varlen.max_seqlen_kv is None else varlen.max_seqlen_kv)
    return varlen


def _op_key(spec: Any, mod: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, varlen: Any,
            sinks: Optional[torch.Tensor]) -> Tuple[str, Any]:
    """(registered spec key, varlen) after the metadata checks every call gets (ValueError /
    TypeError naming the argument)."""
    from . import ops
    from .plan import _static_problem

    varlen = _bounded(spec, query, key, varlen)
    _static_problem(spec, mod, query, key, value, varlen, sinks)  # metadata only
    traced = ops.traced_spec(spec, query.device.type, query.dtype, query.shape[-1], value.shape[-1])
    return ops.register_spec(traced), varlen


def attention(spec: Any, mod: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, varlen: Any,
              sinks: Optional[torch.Tensor] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """`functional.run_spec` for abstract inputs: out in the query's format with Dv (and lse fp32
    (B, H, Sq) / (H, Tq) when the spec returns it), differentiable through the custom ops."""
    from . import ops

    op_key, varlen = _op_key(spec, mod, query, key, value, varlen, sinks)
    out, lse = ops.attention_by_key(op_key, mod, query, key, value, varlen, sinks)
    return out if lse is None else (out, lse)


def forward_with_lse(spec: Any, mod: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, varlen: Any,
                     sinks: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """`functional.attention_forward` for abstract inputs: (out, lse), no autograd."""
    with torch.no_grad():
        return attention(spec, mod, query, key, value, varlen, sinks)


def backward_shapes(spec: Any, mod: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, varlen: Any,
                    sinks: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """`functional.attention_backward` for abstract inputs: (dq, dk, dv, then one tensor per
    differentiated score_mod tensor parameter and the sinks), each shaped like its input."""
    from . import ops

    op_key, _ = _op_key(spec, mod, query, key, value, varlen, sinks)
    tensors = [] if mod is None else list(mod.tensors().values())
    extra = ops._differentiated(ops.lookup_spec(op_key), tensors, sinks)
    return tuple(torch.empty_like(t) for t in (query, key, value, *extra))
