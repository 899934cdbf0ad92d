"""The context-parallel engines: ring and all-gather, forward and backward.

Both assemble one attention from calls of `fused_attn.functional.attention_forward` /
`attention_backward` on blocks of the local shards (see `cp_layout.plan_regions`).

Ring (forward): N steps; at step i rank r holds the keys/values of rank (r - i) mod N; the
exchange for step i+1 (`torch.distributed.batch_isend_irecv` of P2POps: send to r+1, receive
from r-1) is posted before step i's attention calls and waited after them, so it runs behind
the compute. Each call gives (out_i, lse_i); they are merged exactly in fp32:

    lse = logsumexp_i lse_i,     out = sum_i exp(lse_i - lse) out_i

(a running merge; rows no call attends keep lse -inf and out 0). Ring (backward): the keys and
values go around the ring again, each call gets the *global* output and lse (so its gradients
are exact: weights exp(s - lse), D = rowsum(dO * O)), dQ accumulates locally, and the dK / dV
accumulators of each key block travel with it (sent one step behind, overlapped with the next
step's compute) until they reach their owner after the last step. No forward recompute.

All-gather: the keys and values are gathered (`all_gather_into_tensor`) and put in global
order; with a causal mask each local query chunk c attends the global prefix [0, c] with a
bottom-right causal mask (one call per chunk); the backward gathers them again, accumulates the
key gradients in global order and returns each rank its part with `reduce_scatter_tensor`
(`all_reduce` on backends without it, e.g. gloo). No compute / communication overlap.

Accumulators are fp32 (fp64 for fp64 inputs); outputs are cast back to the input dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..functional import attention_backward, attention_forward
from .cp_layout import plan_regions
from .cp_mods import offset_mod

__all__ = ["CPConfig", "ring_forward", "ring_backward", "allgather_forward", "allgather_backward"]


@dataclass
class CPConfig:
    """One context-parallel call: the group, the layout, and the per-call attention arguments.

    kwargs: dot_product_attention arguments shared by every block call (qkv_format,
    softmax_scale, backend, deterministic, score_mod_* ...; not attn_mask_type / lengths).
    mod: the normalized score_mod (None); affine: it reads positions (wrap with offsets).
    grad_names: names of the mod's tensor parameters whose gradients the backend returns.
    """

    group: Any
    n: int
    rank: int
    layout: Any
    causal: bool
    kwargs: Dict[str, Any]
    mod: Any = None
    affine: bool = False
    overlap: bool = True
    grad_names: Tuple[str, ...] = ()
    stats: Dict[str, float] = field(default_factory=dict)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _peer(cp: CPConfig, r: int) -> int:
    return dist.get_global_rank(cp.group, r % cp.n)


def _exchange(cp: CPConfig, tensors: List[torch.Tensor]) -> Tuple[List[torch.Tensor], List[Any]]:
    """Post send-to-next / receive-from-previous of `tensors`; returns (receive buffers, requests)."""
    bufs = [torch.empty_like(t) for t in tensors]
    nxt, prv = _peer(cp, cp.rank + 1), _peer(cp, cp.rank - 1)
    ops = [dist.P2POp(dist.isend, t, nxt, cp.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, prv, cp.group) for b in bufs]
    reqs = dist.batch_isend_irecv(ops)
    if not cp.overlap:
        _wait(reqs)
        reqs = []
    return bufs, reqs


def _wait(reqs: List[Any]) -> None:
    for r in reqs:
        r.wait()


def _call_kwargs(cp: CPConfig, mask: str, q_chunk: int, kv_chunk: int, lengths: Dict[str, Any]) -> Dict[str, Any]:
    kw = dict(cp.kwargs)
    kw["attn_mask_type"] = mask
    kw.update(lengths)
    if cp.affine:
        kw["score_mod"] = offset_mod(cp.mod, *cp.layout.offsets(q_chunk, kv_chunk))
    return kw


def _merge(cp: CPConfig, acc_out: torch.Tensor, acc_lse: torch.Tensor, c0: int, c1: int, out: torch.Tensor,
           lse: torch.Tensor) -> None:
    """acc rows of local query chunks [c0, c1) <- the exact merge with (out, lse)."""
    lay = cp.layout
    a_out, a_lse = lay.take(acc_out, "q", c0, c1), lay.take_lse(acc_lse, c0, c1)
    new_lse = torch.logaddexp(a_lse, lse)
    safe = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))
    w_old = lay.lse_like_out(torch.exp(a_lse - safe)).to(acc_out.dtype)
    w_new = lay.lse_like_out(torch.exp(lse - safe)).to(acc_out.dtype)
    # rows a call does not attend may hold anything (a backend may leave them unwritten): select, not multiply
    new_out = a_out * w_old + torch.where(w_new > 0, out.to(acc_out.dtype) * w_new, torch.zeros_like(a_out))
    lay.put(acc_out, "q", c0, c1, new_out, add=False)
    lay.put_lse(acc_lse, c0, c1, new_lse)


def _lse_shape(cp: CPConfig, q: torch.Tensor) -> Tuple[int, ...]:
    if cp.layout.packed:
        return (q.shape[1], q.shape[0])
    from ..layouts import logical_shape

    b, h, s, _ = logical_shape(q, cp.layout.fmt)
    return (b, h, s)


def _out_shape(q: torch.Tensor, v: torch.Tensor) -> Tuple[int, ...]:
    return tuple(q.shape[:-1]) + (v.shape[-1],)


# ----------------------------------------------------------------------------- ring


def ring_forward(cp: CPConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(local out in q's dtype, local lse fp32)."""
    lay = cp.layout
    acc = _acc_dtype(q.dtype)
    acc_out = torch.zeros(_out_shape(q, v), dtype=acc, device=q.device)
    acc_lse = torch.full(_lse_shape(cp, q), -math.inf, dtype=torch.float32, device=q.device)
    q_ids = lay.ids(cp.rank)
    kv = [k.contiguous(), v.contiguous()]
    touched = set()  # local query chunks that hold a partial result already
    for step in range(cp.n):
        nxt, reqs = _exchange(cp, kv) if step < cp.n - 1 else (None, [])
        kv_ids = lay.ids((cp.rank - step) % cp.n)
        for reg in plan_regions(q_ids, kv_ids, cp.causal, cp.affine):
            kw = _call_kwargs(cp, reg.mask, q_ids[reg.i0], kv_ids[reg.j0], lay.call_kwargs(reg.i1 - reg.i0,
                                                                                            reg.j1 - reg.j0))
            o, l = attention_forward(lay.take(q, "q", reg.i0, reg.i1), lay.take(kv[0], "kv", reg.j0, reg.j1),
                                     lay.take(kv[1], "kv", reg.j0, reg.j1), **kw)
            rows = set(range(reg.i0, reg.i1))
            if rows & touched:
                _merge(cp, acc_out, acc_lse, reg.i0, reg.i1, o, l)
            else:  # the first partial result of these rows: a copy (rows no key reaches: out 0, lse -inf)
                keep = lay.lse_like_out(torch.isfinite(l))
                lay.put(acc_out, "q", reg.i0, reg.i1, torch.where(keep, o.to(acc), torch.zeros((), dtype=acc,
                                                                                                device=o.device)),
                        add=False)
                lay.put_lse(acc_lse, reg.i0, reg.i1, l)
            touched |= rows
        if nxt is not None:
            _wait(reqs)
            kv = nxt
    return acc_out.to(q.dtype), acc_lse


def _extra_grads(cp: CPConfig, acc: Dict[str, torch.Tensor], extras: Tuple[torch.Tensor, ...]) -> None:
    for name, g in zip(cp.grad_names, extras):
        if g is None or not g.numel():
            continue
        if name in acc:
            acc[name] += g
        else:
            acc[name] = g.to(_acc_dtype(g.dtype)).clone()


def _reduce_extras(cp: CPConfig, acc: Dict[str, torch.Tensor], like: Dict[str, torch.Tensor]) -> List[Any]:
    """Sum the score_mod tensor gradients over the group (each rank saw its own queries)."""
    out = []
    for name in cp.grad_names:
        g = acc.get(name)
        t = like[name]
        if g is None:
            g = torch.zeros(t.shape, dtype=_acc_dtype(t.dtype), device=t.device)
        if cp.n > 1:
            dist.all_reduce(g, group=cp.group)
        out.append(g.to(t.dtype))
    return out


def ring_backward(cp: CPConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dout: torch.Tensor, mod_tensors: Dict[str, torch.Tensor]):
    """(dq, dk, dv, [grads of the mod's tensor parameters in cp.grad_names order])."""
    lay = cp.layout
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    extra: Dict[str, torch.Tensor] = {}
    q_ids = lay.ids(cp.rank)
    dout = dout.contiguous()
    kv = [k.contiguous(), v.contiguous()]
    d_recv, d_reqs = None, []
    dkv: List[torch.Tensor] = []
    for step in range(cp.n):
        nxt, reqs = _exchange(cp, kv) if step < cp.n - 1 else (None, [])
        kv_ids = lay.ids((cp.rank - step) % cp.n)
        dkv = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
        for reg in plan_regions(q_ids, kv_ids, cp.causal, cp.affine):
            kw = _call_kwargs(cp, reg.mask, q_ids[reg.i0], kv_ids[reg.j0], lay.call_kwargs(reg.i1 - reg.i0,
                                                                                            reg.j1 - reg.j0))
            grads = attention_backward(
                lay.take(q, "q", reg.i0, reg.i1), lay.take(kv[0], "kv", reg.j0, reg.j1),
                lay.take(kv[1], "kv", reg.j0, reg.j1), lay.take(out, "q", reg.i0, reg.i1),
                lay.take_lse(lse, reg.i0, reg.i1), lay.take(dout, "q", reg.i0, reg.i1), **kw)
            lay.put(dq, "q", reg.i0, reg.i1, grads[0].to(acc), add=True)
            lay.put(dkv[0], "kv", reg.j0, reg.j1, grads[1].to(acc), add=True)
            lay.put(dkv[1], "kv", reg.j0, reg.j1, grads[2].to(acc), add=True)
            _extra_grads(cp, extra, tuple(grads[3:]))
        if d_recv is not None:  # the accumulators of this key block from the previous rank
            _wait(d_reqs)
            dkv[0] += d_recv[0]
            dkv[1] += d_recv[1]
        if nxt is not None:
            _wait(reqs)
            kv = nxt
        if cp.n > 1:
            d_recv, d_reqs = _exchange(cp, dkv)
    if cp.n > 1:  # after N hops every block's accumulators are back with their owner
        _wait(d_reqs)
        dkv = d_recv
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), _reduce_extras(cp, extra, mod_tensors)


# ----------------------------------------------------------------------------- all-gather


# torch 2.13 names them *_single (the *_tensor names are deprecated aliases)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_stacked(t: torch.Tensor, group: Any, n: int, async_op: bool = False):
    """(N, *t.shape) of every rank's `t` (the concatenated form: gloo accepts no other); with
    async_op, (buffer, work)."""
    t = t.contiguous()
    buf = torch.empty((n * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    work = _ALL_GATHER(buf, t, group=group, async_op=async_op)
    buf = buf.view((n,) + tuple(t.shape))
    return (buf, work) if async_op else buf


def _gather(cp: CPConfig, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """Every rank's shard, in global sequence order."""
    pending = [all_gather_stacked(t, cp.group, cp.n, async_op=True) for t in tensors]
    _wait([w for _, w in pending])
    return [cp.layout.to_global(b) for b, _ in pending]


def _scatter_sum(cp: CPConfig, g: torch.Tensor) -> torch.Tensor:
    """Sum of every rank's global-order gradient, this rank's part (reduce-scatter)."""
    parts = cp.layout.to_rank_major(g).contiguous()
    if dist.get_backend(cp.group) == "gloo":  # gloo has no reduce_scatter_tensor
        dist.all_reduce(parts, group=cp.group)
        return parts[cp.rank]
    out = torch.empty(parts.shape[1:], dtype=parts.dtype, device=parts.device)
    _REDUCE_SCATTER(out, parts.view((-1,) + tuple(parts.shape[2:])), group=cp.group)
    return out


def _ag_blocks(cp: CPConfig) -> List[Tuple[int, int, Optional[int]]]:
    """(c0, c1, prefix chunk or None): the calls of one rank: with a causal mask one per local
    query chunk (keys: the global prefix up to that chunk); otherwise every local query against
    every key (per chunk when a position-dependent mod needs contiguous query chunks)."""
    lay = cp.layout
    ids = lay.ids(cp.rank)
    if cp.causal:
        return [(s, s + 1, ids[s]) for s in range(lay.m)]
    if cp.affine and lay.m > 1 and ids[1] != ids[0] + 1:
        return [(s, s + 1, None) for s in range(lay.m)]
    return [(0, lay.m, None)]


def _ag_call(cp: CPConfig, c0: int, c1: int, prefix: Optional[int], kg: torch.Tensor):
    lay = cp.layout
    ids = lay.ids(cp.rank)
    if prefix is None:
        return kg, _call_kwargs(cp, "no_mask", ids[c0], 0, lay.global_kwargs(c1 - c0))
    lengths = lay.call_kwargs(c1 - c0, 0)
    lengths.update(lay.prefix_kwargs(prefix))
    return lay.prefix(kg, prefix), _call_kwargs(cp, "causal_bottom_right", ids[c0], 0, lengths)


def allgather_forward(cp: CPConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    lay = cp.layout
    kg, vg = _gather(cp, [k, v])
    out = torch.zeros(_out_shape(q, v), dtype=q.dtype, device=q.device)
    lse = torch.full(_lse_shape(cp, q), -math.inf, dtype=torch.float32, device=q.device)
    for c0, c1, prefix in _ag_blocks(cp):
        kr, kw = _ag_call(cp, c0, c1, prefix, kg)
        vr = vg if prefix is None else lay.prefix(vg, prefix)
        o, l = attention_forward(lay.take(q, "q", c0, c1), kr, vr, **kw)
        lay.put(out, "q", c0, c1, o, add=False)
        lay.put_lse(lse, c0, c1, l)
    return out, lse


def allgather_backward(cp: CPConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, dout: torch.Tensor, mod_tensors: Dict[str, torch.Tensor]):
    lay = cp.layout
    acc = _acc_dtype(q.dtype)
    kg, vg = _gather(cp, [k, v])
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkg = torch.zeros(kg.shape, dtype=acc, device=kg.device)
    dvg = torch.zeros(vg.shape, dtype=acc, device=vg.device)
    extra: Dict[str, torch.Tensor] = {}
    dout = dout.contiguous()
    for c0, c1, prefix in _ag_blocks(cp):
        kr, kw = _ag_call(cp, c0, c1, prefix, kg)
        vr = vg if prefix is None else lay.prefix(vg, prefix)
        grads = attention_backward(lay.take(q, "q", c0, c1), kr, vr, lay.take(out, "q", c0, c1),
                                   lay.take_lse(lse, c0, c1), lay.take(dout, "q", c0, c1), **kw)
        lay.put(dq, "q", c0, c1, grads[0].to(acc), add=True)
        if prefix is None:
            dkg += grads[1]
            dvg += grads[2]
        else:
            lay.put_prefix(dkg, prefix, grads[1])
            lay.put_prefix(dvg, prefix, grads[2])
        _extra_grads(cp, extra, tuple(grads[3:]))
    dk, dv = _scatter_sum(cp, dkg), _scatter_sum(cp, dvg)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), _reduce_extras(cp, extra, mod_tensors)
