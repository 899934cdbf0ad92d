"""Context parallelism: Q, K, V sharded along the sequence over a process group.

    from fused_attn.distributed import context_parallel_attention, shard_sequence
    q_local = shard_sequence(q, group)                 # this rank's chunks r and 2N-1-r
    out_local = context_parallel_attention(q_local, k_local, v_local, group, cp_comm="auto",
                                           attn_mask_type="causal")   # + dot_product_attention kwargs
    out_local.sum().backward()                         # the distributed backward

Shapes: the local shards of `dot_product_attention`'s inputs: bshd (B, S/N, H, D), sbhd, bhsd,
or thd (T/N, H, D) with the *global* cu_seqlens_q / cu_seqlens_kv (B+1,) and global
max_seqlen_q / max_seqlen_kv (each sequence split into 2N chunks: every length a multiple of
2N, or of N with layout="contiguous"). Returns the local output shard (and the local fp32 lse
with return_lse=True: (B, H, S/N) or (H, T/N)), differentiable with respect to q, k, v and the
score_mod's floating tensor parameters (summed over the group).

cp_comm (which strategy; docs/distributed.md compares them):
    "ring"        K/V travel around the group point to point, each exchange posted before the
                  current block's attention and waited after it (`cp_ring`)
    "all_gather"  K/V gathered once, no overlap (`cp_ring`)
    "all_to_all"  head-parallel: all-to-all to whole sequences of H/N heads, one attention call
                  per rank, all-to-all back (`cp_heads`; heads and kv heads multiples of N)
    "auto"        "all_to_all" when the heads divide, else "ring" (`cp_strategy.choose_cp_comm`)
layout: "load_balanced" (default; rank r holds chunks r and 2N-1-r) or "contiguous" (rank r
holds chunk r: DTensor's Shard(seq)). DTensor inputs sharded along the sequence on one mesh dim
(and by batch / heads on others) are accepted: cp_group may then be None (the mesh dim's group),
and the result is a DTensor placed like the query. cp_group may be any process group (a
subgroup, a DeviceMesh dim's group): ranks are addressed through it.

Supported by ring / all-gather: attn_mask_type "no_mask" / "causal" ("causal_bottom_right" when
Sq == Skv), GQA, softmax_scale, deterministic, every backend; score_mods that do not read
positions (softcap, ...) on every backend; position-dependent score_mods (causal / ALiBi /
windows / a bias as score_mods) at global positions: traced ones on every backend for dense
layouts (one cuDNN graph for every block, offsets bound per call), every kind on the reference
backend. Head-parallel additionally serves window_size and position-dependent score_mods of
packed batches on cuDNN (its call sees the global sequence). Refused with NotImplementedError:
sinks, dropout, padding masks, padded thd offsets; windows on ring / all-gather; on cuDNN,
position-dependent score_mods of packed (thd) batches under ring / all-gather.

Faults: an exception on one rank (a kernel error, a bad input only that rank sees) propagates
there with a note naming the rank, strategy and phase; the other ranks block in the next
exchange and raise when the group's timeout expires (`init_process_group(timeout=...)` /
`new_group(timeout=...)`; NCCL's watchdog aborts the communicator then). Nothing waits forever.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import cp_ring
from .cp_args import CP_COMMS, CallArgs, check_choice, ring_config, validate
from .cp_faults import failure_note
from .cp_layout import LAYOUTS

__all__ = ["context_parallel_attention", "ContextParallelAttention", "module_context_parallel", "CP_COMMS"]


class _ContextParallel(torch.autograd.Function):
    """apply(cp, comm, q, k, v, *mod tensors) -> (out, lse); the backward runs the engine's backward."""

    @staticmethod
    def forward(ctx, cp: cp_ring.CPConfig, comm: str, query, key, value, *extras):
        fwd = cp_ring.ring_forward if comm == "ring" else cp_ring.allgather_forward
        with failure_note(comm, "forward", cp.rank, cp.n):
            out, lse = fwd(cp, query, key, value)
        ctx.cp, ctx.comm = cp, comm
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mark_non_differentiable(lse)
        # no zero-filled gradient for lse (non-differentiable) per backward; None grad_out below
        ctx.set_materialize_grads(False)
        ctx.n_extras = len(extras)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        if grad_out is None:  # no gradient reached out: nothing to propagate
            return (None,) * (5 + ctx.n_extras)
        query, key, value, out, lse = ctx.saved_tensors
        cp = ctx.cp
        bwd = cp_ring.ring_backward if ctx.comm == "ring" else cp_ring.allgather_backward
        tensors = {n: cp.mod.tensors()[n] for n in cp.grad_names}
        with failure_note(ctx.comm, "backward", cp.rank, cp.n):
            dq, dk, dv, extra = bwd(cp, query, key, value, out, lse, grad_out, tensors)
        # cp, comm, query, key, value, *mod tensors
        return (None, None, dq, dk, dv, *extra)


def _heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: CallArgs, return_lse: bool):
    from .cp_heads import heads_attention

    with failure_note("all_to_all", "forward", args.rank, args.n):
        return heads_attention(query, key, value, args.group, args.n, args.rank, args.layout, args.mod, args.kwargs,
                               args.varlen, return_lse)


@torch._dynamo.disable
def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp_group: Any = None,
                               cp_comm: str = "ring", *, layout: str = "load_balanced", return_lse: bool = False,
                               cp_overlap: bool = True, **kwargs: Any):
    """Attention over a sequence sharded across `cp_group` (see the module docstring).

    cp_overlap=False waits for each ring exchange before computing (to measure how much of the
    communication the overlap hides; results are identical)."""
    from .dtensor import is_dtensor

    check_choice("cp_comm", cp_comm, CP_COMMS)
    if any(is_dtensor(t) for t in (query, key, value)):
        from .cp_shard import context_parallel_dtensor

        return context_parallel_dtensor(context_parallel_attention, query, key, value, cp_group, cp_comm, layout,
                                        return_lse, cp_overlap, kwargs)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    args = validate(query, key, cp_group, layout, kwargs)
    comm = cp_comm
    if comm == "auto":
        from .cp_strategy import choose

        comm, _ = choose(query, key, args.fmt, args.n, args.mod)
    if comm == "all_to_all":
        return _heads(query, key, value, args, return_lse)
    cp = ring_config(query, key, args, cp_overlap)
    extras = [cp.mod.tensors()[n] for n in cp.grad_names]
    out, lse = _ContextParallel.apply(cp, comm, query, key, value, *extras)
    return (out, lse) if return_lse else out


class ContextParallelAttention(nn.Module):
    """A `DotProductAttention` run with context parallelism: forward(q, k, v, **overrides) takes
    the local shards and returns the local output (see `context_parallel_attention`).

    The module's configuration (qkv_format, attn_mask_type, window_size, softmax_scale,
    score_mod, backend, deterministic) applies; per-call keywords override it. The logic lives
    in `context_parallel_attention`, so DotProductAttention may take cp_group / cp_comm itself."""

    def __init__(self, attention: nn.Module, cp_group: Any = None, cp_comm: str = "ring",
                 layout: str = "load_balanced") -> None:
        super().__init__()
        check_choice("cp_comm", cp_comm, CP_COMMS)
        check_choice("layout", layout, LAYOUTS)
        self.attention, self.cp_group, self.cp_comm, self.layout = attention, cp_group, cp_comm, layout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **overrides: Any):
        return module_context_parallel(self.attention, self.cp_group, self.cp_comm, self.layout, query, key, value,
                                       **overrides)

    def extra_repr(self) -> str:
        return f"cp_comm={self.cp_comm!r}, layout={self.layout!r}"


def module_context_parallel(attn: nn.Module, cp_group: Any, cp_comm: str, layout: str, query: torch.Tensor,
                            key: torch.Tensor, value: torch.Tensor, **overrides: Any):
    """`context_parallel_attention` with a `DotProductAttention`'s configuration (qkv_format,
    attn_mask_type, window_size, softmax_scale, score_mod, backend, deterministic); per-call
    keywords override it. Used by `ContextParallelAttention` and by `DotProductAttention(...,
    cp_group=...)`."""
    if attn.softmax_type != "vanilla":
        raise NotImplementedError(f"context parallelism does not support softmax_type={attn.softmax_type!r}")
    if attn.training and attn.attention_dropout:
        raise NotImplementedError("context parallelism does not support attention dropout")
    kwargs = dict(qkv_format=attn.qkv_format, attn_mask_type=attn.attn_mask_type, window_size=attn.window_size,
                  softmax_scale=attn.softmax_scale, score_mod=attn._call_mod, backend=attn.backend,
                  deterministic=attn.deterministic)
    kwargs.update(overrides)
    attn._check_config(query, key, value, kwargs["qkv_format"])
    return context_parallel_attention(query, key, value, cp_group, cp_comm, layout=layout, **kwargs)
