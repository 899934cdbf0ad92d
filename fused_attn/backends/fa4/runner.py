"""Runs one plan on flash-attn-4's kernels (`_flash_attn_fwd` / `_flash_attn_bwd` of the pinned
release): the runner interface of `fused_attn.engines.Runner`.

Layouts: FA4 reads (B, S, H, D) tensors with any strides whose last dim is contiguous, so bshd
is passed as is and sbhd / bhsd as transposed views (no copies); the output is written into a
buffer in the query's own format. Its gradients come back in the inputs' layouts (FA4 allocates
them like its inputs). thd goes to the varlen kernels with cu_seqlens (int32) and max_seqlen.
lse: fp32 (B, H, Sq) dense / (H, Tq) thd, with sinks folded in, as the reference's.
Per call the runner reads the mod's values: the window of a library mask, the
tensors and scalars of a generated CuTe mod, the library's softcap among them (aux tensors /
aux scalars: new values never recompile).
The forward and the backward replay FA4's calls as recorded for the call's signature
(`recorded`, `replay`: FA4's buffers allocated, its kernels launched with the call's tensors):
FA4's host path runs once or twice per signature, and on every call where a recording is refused.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ...cache import GRAPH_CACHE
from ...lse_backward import into_dest, weightless_empty_rows
from ...problem import Band
from . import cute_load, install, recorded, replay
from .support import Plan, window

__all__ = ["Fa4Runner"]

_TO_BSHD = {"bshd": None, "sbhd": (1, 0, 2, 3), "bhsd": (0, 2, 1, 3), "thd": None}


def _bshd(t: torch.Tensor, fmt: str) -> torch.Tensor:
    perm = _TO_BSHD[fmt]
    return t if perm is None else t.permute(perm)


def _int32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None or t.dtype == torch.int32:
        return t
    return t.to(torch.int32)


def _aux_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor parameter as the kernel reads it: 1-D, contiguous, int32 for integer / bool ids,
    fp32 for float64 tables."""
    if t.dtype in (torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool):
        t = t.to(torch.int32)
    elif t.dtype == torch.float64:
        t = t.to(torch.float32)
    return t.reshape(-1).contiguous()


def _scalar(value: Any) -> Any:
    """A runtime scalar as the CuTe DSL passes it to the kernel (a Python number would be read
    as a compile-time constant, or not at all): cutlass.Int32 / cutlass.Float32."""
    import cutlass

    if isinstance(value, bool) or not isinstance(value, int):
        return cutlass.Float32(float(value))
    return cutlass.Int32(value)


class Fa4Runner:
    """forward -> (out in the query's format, lse or None, saved (q, k, v, out, lse), state);
    backward -> (dq, dk, dv[, d_sinks]) in the inputs' layouts."""

    backend = "fa4"

    def __init__(self, problem: Any, plan: Plan) -> None:
        self.static = problem
        self.plan = plan
        spec = problem.spec
        self.fmt = spec.qkv_format
        self.packed = spec.is_packed
        self.scale = float(problem.scale)
        self.deterministic = bool(spec.deterministic)
        self.return_lse = bool(spec.return_lse)
        store = GRAPH_CACHE.store
        install.persist_kernels(None if store is None else store.directory)
        self.fns = None if plan.source is None else cute_load.load(plan.source)
        self.owner = recorded.new_owner()  # keys this runner's recorded calls
        self.quirks: Tuple[str, ...] = ()

    # -- per-call kernel arguments
    def _band(self, mod: Any) -> Optional[Band]:
        if self.plan.mod_band:
            return Band(*mod.native_band)
        return self.plan.band

    def _common(self, varlen: Any, mod: Any, sinks: Optional[torch.Tensor], q: torch.Tensor) -> Dict[str, Any]:
        causal, left, right = window(self._band(mod))
        args: Dict[str, Any] = dict(softmax_scale=self.scale, causal=causal, window_size_left=left,
                                    window_size_right=right)
        if self.packed:
            args.update(cu_seqlens_q=_int32(varlen.cu_seqlens_q), cu_seqlens_k=_int32(varlen.cu_seqlens_kv),
                        max_seqlen_q=varlen.max_seqlen_q, max_seqlen_k=varlen.max_seqlen_kv)
        if self.plan.sinks == "learnable":
            args["learnable_sink"] = sinks
        elif self.plan.sinks == "off-by-one":
            args["learnable_sink"] = torch.zeros(self.static.heads, dtype=torch.float32, device=q.device)
        if self.fns is not None:
            source = self.plan.source
            tensors = mod.tensors()
            values = mod.scalars_typed()
            args["aux_tensors"] = [_aux_tensor(tensors[n]) for n in source.tensors] or None
            args["aux_scalars"] = tuple(_scalar(values[n]) for n in source.scalars) or None
        return args

    # -- the runner interface
    def grad_inputs(self, mod: Any, sinks: Optional[torch.Tensor]) -> tuple:
        """The learnable sinks (FA4's dsink) when given; nothing else besides q, k, v."""
        return () if sinks is None or self.plan.sinks != "learnable" else (sinks,)

    def op_grads(self, mod: Any, sinks: Optional[torch.Tensor], grads: tuple) -> list:
        return list(grads[3:])

    def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=None, dest=None):
        """(out, lse or None, saved, state); dest: (out, (B, H, Sq, 1) lse) views to copy into."""
        args = self._common(varlen, mod, sinks, q)
        if self.fns is not None:
            args["score_mod"] = self.fns.score_mod
        # thd: cu_seqlens end at the token count (checked per call), so every row is written
        out = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
        qb, kb, vb, ob = (_bshd(t, self.fmt) for t in (q, k, v, out))
        lse_shape = (qb.shape[1], qb.shape[0]) if self.packed else (qb.shape[0], qb.shape[2], qb.shape[1])
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        with torch.no_grad():
            self._launch_forward(qb, kb, vb, ob, lse, args)
        if dest is not None:
            dest[0].copy_(out)
            dest[1].copy_(lse.unsqueeze(-1))
        return out, (lse if self.return_lse else None), (q, k, v, out, lse), (varlen, mod, sinks)

    def forward_lse(self, saved: tuple) -> torch.Tensor:
        """The forward's fp32 lse ((B, H, Sq) dense / (H, Tq) thd, sinks folded in) from `saved`."""
        return saved[4]

    def _launch_forward(self, q, k, v, out, lse, args: Dict[str, Any]) -> None:
        """FA4's forward into `out` and `lse` ((B, S, H, D) views), replayed where recorded."""
        own = (q, k, v, out, lse, args.get("cu_seqlens_q"), args.get("cu_seqlens_k"), args.get("learnable_sink"))
        self._recorded_call("forward", own, args, lambda: install.module()._flash_attn_fwd(
            q, k, v, out=out, lse=lse, return_lse=True, **args))

    def backward(self, state, saved, grad_out):
        varlen, mod, sinks = state
        q, k, v, out, lse = saved
        return self._backward(q, k, v, out, lse, varlen, mod, sinks, grad_out)

    def backward_call(self, q, k, v, out, stats, varlen, mod, sinks, grad_out, rng=None):
        """The backward from the call's arguments (the custom-op path): `stats` is the forward's lse."""
        return self._backward(q, k, v, out, stats, varlen, mod, sinks, grad_out)

    def backward_with_lse(self, q, k, v, out, lse, varlen, mod, sinks, grad_out, dest=None):
        """Gradients of one chunk of a larger attention whose output and fp32 lse are given."""
        lse = lse.detach().to(torch.float32)
        lse = weightless_empty_rows(lse).contiguous()
        return into_dest(self._backward(q, k, v, out, lse, varlen, mod, sinks, grad_out), dest)

    def _backward(self, q, k, v, out, lse, varlen, mod, sinks, grad_out) -> tuple:
        args = self._common(varlen, mod, sinks, q)
        if self.fns is not None:
            args["score_mod"], args["score_mod_bwd"] = self.fns.score_mod, self.fns.score_mod_bwd
        own = tuple(_bshd(t, self.fmt) for t in (q, k, v, out, grad_out)) + (
            lse, args.get("cu_seqlens_q"), args.get("cu_seqlens_k"), args.get("learnable_sink"))
        with torch.no_grad():
            got = self._launch_backward(own, args)
        dq, dk, dv = (_bshd(g, self.fmt) for g in got[:3])
        extra = ()
        if self.plan.sinks == "learnable" and sinks is not None:
            extra = (got[3].to(sinks.dtype),)
        return (dq, dk, dv) + extra

    def _launch_backward(self, own: tuple, args: Dict[str, Any]) -> tuple:
        """FA4's backward of `own` (q, k, v, out, dout as (B, S, H, D) views, lse, cu_seqlens,
        sinks), replayed where recorded: (dq, dk, dv[, dsinks])."""
        q, k, v, out, dout, lse = own[:6]
        return self._recorded_call("backward", own, args, lambda: install.module()._flash_attn_bwd(
            q, k, v, out, dout, lse, deterministic=self.deterministic, **args))

    def _recorded_call(self, call: str, own: tuple, args: Dict[str, Any], run: Callable[[], Any]) -> Any:
        """`run()` (one FA4 call, "forward" or "backward", on `own` with `args`), or its recording
        replayed with `own` and this call's aux data where the signature has one (`replay`); the
        first calls of a signature run FA4's function and record it. What the runner fixes (the
        score_mod callables, deterministic) is in no signature: recordings are the runner's own."""
        aux_tensors, aux_scalars = args.get("aux_tensors"), args.get("aux_scalars")
        constants = (call, args["softmax_scale"], args["causal"], args["window_size_left"], args["window_size_right"],
                     args.get("max_seqlen_q"), args.get("max_seqlen_k"))
        sig = recorded.signature(own, aux_tensors, aux_scalars, constants)
        entry = recorded.lookup(self.owner, sig)
        if type(entry) is replay.Replay:
            return replay.replay(entry, own, aux_tensors, aux_scalars)
        if entry is not None:  # a signature FA4's own path serves (recorded.Host)
            return run()
        got, recording = replay.record(run, own, aux_tensors, aux_scalars)
        if recording is not None:
            recorded.store(self.owner, sig, recording)
        return got
