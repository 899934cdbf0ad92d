"""Validation of context-parallel calls: what every strategy accepts, and each strategy's config.

`validate` checks what the strategies share (refused arguments, qkv_format, unknown keywords, the
group, the score_mod) and returns `CallArgs`; `ring_config` resolves a ring / all-gather call
(`cp_ring.CPConfig`); head-parallel calls (`cp_heads`) take `CallArgs` as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from score_mods.positions import at_positions
from score_mods.trace import TracedMod

from . import cp_ring
from .cp_layout import LAYOUTS, DenseLayout, ThdLayout
from .cp_mods import reads_positions

__all__ = ["CP_COMMS", "CallArgs", "check_choice", "validate", "ring_config"]

#: cp_comm values: the strategies, and "auto" (see `cp_strategy.choose_cp_comm`)
CP_COMMS = ("ring", "all_gather", "all_to_all", "auto")
_PASS = ("qkv_format", "softmax_scale", "score_mod", "score_mod_tensors", "score_mod_bprop", "score_mod_bprop_tensors",
         "backend", "deterministic")
_LENGTHS = ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv")
#: arguments context parallelism refuses unless they have these values
_REFUSED = (("sinks", None), ("softmax_type", "vanilla"), ("dropout_p", 0.0), ("cu_seqlens_q_padded", None),
            ("cu_seqlens_kv_padded", None))


def check_choice(arg: str, value: Any, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{arg}={value!r} is not supported; accepted: {', '.join(map(repr, choices))}")


@dataclass
class CallArgs:
    """A validated call: kwargs without score_mod_* and lengths; mod: the normalized score_mod;
    varlen: cu_seqlens_* / max_seqlen_* (thd: checked, max_seqlen filled in; dense: Nones)."""

    group: Any
    n: int
    rank: int
    fmt: str
    layout: str
    kwargs: Dict[str, Any]
    mod: Any
    varlen: Dict[str, Any]


def validate(query: torch.Tensor, key: torch.Tensor, group: Any, layout: str, kwargs: Dict[str, Any]) -> CallArgs:
    """Checks shared by every strategy (ValueError / TypeError / NotImplementedError naming the argument)."""
    check_choice("layout", layout, LAYOUTS)
    kwargs = dict(kwargs)
    for name, default in _REFUSED:
        value = kwargs.pop(name, default)
        if value is not default and (default is None or value != default):
            shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(f"context parallelism does not support {name}={shown} (only {default!r})")
    fmt = kwargs.get("qkv_format", "bshd")
    check_choice("qkv_format", fmt, ("bshd", "sbhd", "bhsd", "thd"))
    unknown = sorted(set(kwargs) - set(_PASS) - {"attn_mask_type", "window_size"} - set(_LENGTHS))
    if unknown:
        raise TypeError(f"context_parallel_attention got unexpected keyword(s) {unknown}")
    if group is None:
        group = dist.group.WORLD
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of cp_group")
    from score_mods import as_score_mod

    mod = as_score_mod(kwargs.get("score_mod"), tensors=kwargs.get("score_mod_tensors"),
                       bprop=kwargs.get("score_mod_bprop"), bprop_tensors=kwargs.get("score_mod_bprop_tensors"))
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("score_mod")}
    varlen = {k: kwargs.pop(k, None) for k in _LENGTHS}
    if fmt == "thd":
        varlen = _thd_lengths(query, varlen)
    elif any(v is not None for v in varlen.values()):
        raise ValueError(f"cu_seqlens / max_seqlen are only accepted with qkv_format='thd' under context "
                         f"parallelism, got qkv_format={fmt!r}")
    return CallArgs(group, n, rank, fmt, layout, kwargs, mod, varlen)


def _thd_lengths(query: torch.Tensor, varlen: Dict[str, Any]) -> Dict[str, Any]:
    cu_q, cu_kv = varlen["cu_seqlens_q"], varlen["cu_seqlens_kv"]
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.numel() < 2:
            raise ValueError(f"qkv_format='thd' under context parallelism needs {name}: the global (B+1,) int32 "
                             f"offsets, got {t if not isinstance(t, torch.Tensor) else tuple(t.shape)}")
        if t.device != query.device:
            raise ValueError(f"{name} must be on the query's device {query.device}, got {t.device}")
    if cu_q.numel() != cu_kv.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_kv must have the same size, got {cu_q.numel()} and "
                         f"{cu_kv.numel()}")
    mq, mk = varlen["max_seqlen_q"], varlen["max_seqlen_kv"]
    if mq is None or mk is None:  # the documented host read
        lens = torch.stack([cu_q, cu_kv]).diff(dim=1).amax(dim=1).tolist()
        mq, mk = (lens[0] if mq is None else mq), (lens[1] if mk is None else mk)
    return dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=int(mq), max_seqlen_kv=int(mk))


# ----------------------------------------------------------------------------- ring / all-gather


def _positions_refusal(mod: Any, fmt: str) -> Optional[str]:
    """Why a score_mod that reads positions cannot run on cuDNN under ring / all-gather, or None."""
    head = (f"score_mod {mod.name!r} reads positions (q_idx / kv_idx / lengths), so under context parallelism it "
            "needs global positions")
    if fmt == "thd":
        return (f"{head}, which differ per sequence in a packed (thd) batch; cuDNN reads per-sequence operands of "
                "packed graphs wrongly, so pass backend='reference' (or pad the batch and shard it as bshd, or use "
                "cp_comm='all_to_all', whose attention call sees the global sequence)")
    if not isinstance(mod, TracedMod):
        return f"{head}; only traced score_mods get them on cuDNN (pass backend='reference')"
    why = at_positions(mod, 0, 0, 1, 1).cudnn_unsupported
    return None if why is None else f"{head}; {why}"


def _causal(kwargs: Dict[str, Any], sq: int, skv: int) -> bool:
    mask = kwargs.pop("attn_mask_type", "no_mask")
    window = kwargs.pop("window_size", None)
    if window is not None and tuple(window) not in ((-1, -1), (-1, 0)):
        raise NotImplementedError(f"context parallelism does not support sliding windows, got window_size={window!r} "
                                  "(cp_comm='all_to_all' does)")
    if window is not None and tuple(window) == (-1, 0) and mask == "no_mask":
        mask = "causal"
    if mask == "no_mask":
        return False
    if mask == "causal" or (mask == "causal_bottom_right" and sq == skv):
        if sq != skv:
            raise NotImplementedError(f"context parallelism with attn_mask_type='causal' needs equal query and key "
                                      f"lengths, got {sq} and {skv} tokens per shard")
        return True
    raise NotImplementedError(f"context parallelism supports attn_mask_type 'no_mask' and 'causal' "
                              f"('causal_bottom_right' with Sq == Skv), got {mask!r}")


def _grad_names(mod: Any) -> Tuple[str, ...]:
    """The mod's floating tensor parameters the reference differentiates (its order); none when
    no tensor requires grad (their gradients would be summed over the group for nothing)."""
    if mod is None:
        return ()
    specs = {} if mod is None else mod.specs
    names = tuple(n for n, t in mod.tensors().items() if t.is_floating_point() and n in specs)
    return names if any(mod.tensors()[n].requires_grad for n in names) else ()


def ring_config(query: torch.Tensor, key: torch.Tensor, args: CallArgs, overlap: bool) -> cp_ring.CPConfig:
    """Resolve a ring / all-gather call: the layout, the mask, the score_mod per block."""
    fmt, mod, n, rank = args.fmt, args.mod, args.n, args.rank
    kwargs = dict(args.kwargs)
    affine = reads_positions(mod)
    backend = kwargs.get("backend", "auto")
    on_cudnn = backend == "cudnn" or (backend == "auto" and query.is_cuda)
    if affine and on_cudnn:
        why = _positions_refusal(mod, fmt)
        if why is not None:
            raise NotImplementedError(why)
    if mod is not None and not affine:
        kwargs["score_mod"] = mod  # the same mod in every block call
    if fmt == "thd":
        v = args.varlen
        lay = ThdLayout(args.layout, n, rank, v["cu_seqlens_q"], v["cu_seqlens_kv"], v["max_seqlen_q"],
                        v["max_seqlen_kv"], query.shape[0], key.shape[0])
        lay.check_values()
        sq, skv = lay.max["q"], lay.max["kv"]
    else:
        seq = {"bshd": 1, "sbhd": 0, "bhsd": 2}[fmt]
        lay = DenseLayout(fmt, args.layout, n, rank, query.shape[seq], key.shape[seq])
        sq, skv = query.shape[seq], key.shape[seq]
    causal = _causal(kwargs, sq, skv)
    names = _grad_names(mod)
    if names and on_cudnn:
        raise NotImplementedError("score_mod tensor parameters that require grad run on the reference backend under "
                                  "ring / all-gather context parallelism (pass backend='reference')")
    return cp_ring.CPConfig(group=args.group, n=n, rank=rank, layout=lay, causal=causal, kwargs=kwargs, mod=mod,
                            affine=affine, overlap=overlap, grad_names=names)
