"""The cuDNN runner for dense (bshd / sbhd / bhsd) call plans.

Decided once per plan: the logical (B, H, S, D) strides of the caller's layout (no permutes on
the hot path: the graph takes the caller's pointers with those strides), the output and gradient
layouts, the lowering (masks, score_mod, bias, sinks), the graph keys. Per call: allocate the
output and Stats, bind pointers, execute.

Shapes: q (B, H, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv) logically; out in the query's
format with Dv (contiguous); Stats fp32 (B, H, Sq, 1) = the log-sum-exp; lse = Stats viewed
(B, H, Sq).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ...cache import GraphKey
from . import lowering as L
from . import quirks, runtime
from .common import (Graphs, check_runtime_tensors, dropout_rng, grad_output, operand_description, rng_views,
                     sinks_view)
from .dense_padded_keys import PaddedKeysBackward
from .dense_layout import (_PERM, Into, _contiguous_strides, _format_shape, _logical_strides,
                           _logical_to_format, normalized)
from .graphs import dense_strides_like

__all__ = ["DenseRunner", "Into"]

class DenseRunner(PaddedKeysBackward):
    """forward/backward of one dense plan on cuDNN.

    into: None (the runner allocates its outputs densely), or the layouts of caller-owned
    destinations (`Into`) that `forward(dest=)` / `backward(dest=)` then write in place."""

    backend = "cudnn"

    def __init__(self, problem: Any, version: int, into: Optional[Into] = None) -> None:
        self.static = p = problem
        spec = p.spec
        self.fmt = spec.qkv_format
        b, h, hkv, sq, skv, d, dv = p.batch, p.heads, p.kv_heads, p.seqlen_q, p.seqlen_kv, p.head_dim, p.head_dim_v
        self.dims = ((b, h, sq, d), (b, hkv, skv, d), (b, hkv, skv, dv))
        self.out_shape = _format_shape(self.fmt, (b, h, sq, dv))
        self.into = into
        fmt_out_strides = _contiguous_strides(self.out_shape) if into is None else into.out
        o_strides = normalized((b, h, sq, dv), _logical_strides(self.fmt, fmt_out_strides))
        self.stats_shape = (b, h, sq, 1)
        self.lse_shape = (b, h, sq)
        self.device = p.device
        self.dev = p.device.index if p.device.index is not None else torch.cuda.current_device()
        self.trained = frozenset(t[0] for t in p.mod_tensors if t[-1] and p.needs_grad)
        self.lowering = L.plan_lowering(spec, spec.score_mod, (b, h, sq, skv), has_lengths=spec.padding,
                                        trained=self.trained)
        self.has_mod = self.lowering.graph_mod is not None
        self.padding = spec.padding
        in_strides = tuple(normalized(dm, st) for dm, st in zip(self.dims, (p.q_strides, p.k_strides, p.v_strides)))
        self.copy_inputs = not p.aligned or any(st[3] != 1 or any(x % 8 for x in st[:3]) for st in in_strides)
        if self.copy_inputs:  # served from aligned, contiguous copies (see check_runtime_tensors)
            in_strides = tuple(normalized(dm, _logical_strides(self.fmt, _contiguous_strides(_format_shape(self.fmt, dm))))
                               for dm in self.dims)
        self.grad_strides = tuple(_logical_to_format(self.fmt, dense_strides_like(dm, st))
                                  for dm, st in zip(self.dims, in_strides))
        layouts = {}
        if into is not None:  # a None in into.grads keeps that gradient's dense layout
            self.grad_strides = tuple(d if g is None else g for d, g in zip(self.grad_strides, into.grads))
            layouts = dict(stats_strides=tuple(into.stats),  # as given: cuDNN wants Stats' last stride 1
                           grad_strides=tuple(normalized(dm, _logical_strides(self.fmt, g))
                                              for dm, g in zip(self.dims, self.grad_strides)))
        self.scale = torch.full((1, 1, 1, 1), p.scale, dtype=torch.float32)
        self.sinks = sinks_view(p)
        self._memo_token = object()  # names this runner's entry in a mod's bound-operand memo (see _operands)
        operands = self._operands(spec.score_mod)
        self.bias_cast = None
        bias = None
        if self.lowering.bias is not None:
            dense = self.lowering.bias == "dense"  # a materialized, trained term: dBias needs the io dtype
            with torch.no_grad():
                bias = L.bias_tensor(self.lowering, spec.score_mod, p.device, p.dtype if dense else torch.float32)
        bias_desc = None
        if bias is not None:
            trained = p.needs_grad and (self.lowering.bias == "dense" or any(t[-1] for t in p.mod_tensors))
            if trained and bias.dtype != p.dtype:
                # cuDNN's dBias needs the bias in the io dtype (measured: an fp32 bias with dBias is declined)
                self.bias_cast = p.dtype
            dtype = self.bias_cast or bias.dtype
            strides = _contiguous_strides(tuple(bias.shape)) if self.bias_cast else tuple(bias.stride())
            bias_desc = (tuple(bias.shape), normalized(tuple(bias.shape), strides), str(dtype).replace("torch.", ""),
                         trained)
        self.bias_grad = bias_desc is not None and bias_desc[3]
        common = dict(dtype=str(p.dtype).replace("torch.", ""), q_dims=self.dims[0], k_dims=self.dims[1],
                      v_dims=self.dims[2], q_strides=in_strides[0], k_strides=in_strides[1],
                      v_strides=in_strides[2], o_strides=o_strides, scale=None, band=self.lowering.band,
                      padding=self.padding, ragged=False,
                      score_mod=None if not self.has_mod else self.lowering.graph_mod.cache_key,
                      operands=operand_description(operands), device_index=self.dev, backend_version=version,
                      bias=bias_desc, sinks=self.sinks is not None, dropout=spec.dropout_p, **layouts)
        fwd_key = GraphKey(direction="fwd", deterministic=False, **common)
        # the backward reads Stats packed whatever the forward wrote: cuDNN < 9.26 takes no other
        # layout ("a non-ragged Stats input of sdpa_backward must be a packed BHSD tensor")
        common["stats_strides"] = None
        bwd_key = GraphKey(direction="bwd", deterministic=spec.deterministic, **common) if p.needs_grad else None
        self.kv_pad, bwd_lowering = 0, None
        if (p.needs_grad and not self.padding and skv % 128 == 64 and (self.has_mod or bias is not None)
                and (quirks.applies("nan_dq_kv_64_mod_128", version)
                     or (self.has_mod and bias is not None
                         and quirks.applies("nan_dq_kv_64_mod_128_score_mod_bias", version)))):
            bwd_key, bwd_lowering = self._padded_backward(common, bias_desc, version)
        padded_for = ()
        if self.kv_pad:
            padded_for = tuple(n for n in ("nan_dq_kv_64_mod_128", "nan_dq_kv_64_mod_128_score_mod_bias")
                               if quirks.applies(n, version))[:1]
        self.quirks = quirks.shaping(version, score_mod=self.has_mod, padded_keys=padded_for,
                                     banded=self.lowering.band is not None or spec.band is not None)
        self.graphs = Graphs(fwd_key, bwd_key, self.lowering.graph_mod, operands, self.dev, bwd_lowering)
        self.graphs.build_all()

    # ------------------------------------------------------------------ per call

    def _operands(self, mod: Any, backward: bool = False) -> Dict[str, torch.Tensor]:
        if backward and self.kv_pad:
            ops = L.mod_operands(self.bwd_lowering, mod, has_lengths=True, device=self.device)
            ops = {f"sm:{k}": t for k, t in ops.items()}
            ops["attn_scale"] = L.attn_scale(self.bwd_lowering, mod, self.static.scale, self.scale)
            return ops
        traced = mod is not None and mod.root is not None
        memos = mod.backend_memo().setdefault("dense_operands", {}) if traced else None
        memo = None if memos is None else memos.get(self._memo_token)
        if memo is not None and memo[0] is mod.bound_values:
            return dict(memo[1])
        ops = L.mod_operands(self.lowering, mod, has_lengths=self.padding, device=self.device)
        ops = {f"sm:{k}": t for k, t in ops.items()}
        ops["attn_scale"] = L.attn_scale(self.lowering, mod, self.static.scale, self.scale)
        if memos is not None and not mod.needs_dims:
            # A traced mod's operands (scalar inputs and tensor views: in-place tensor edits show
            # through) stay valid until its values change in place, which replaces its
            # `bound_values`: the same object with the same values binds the same operands.
            # Materialized operands are recomputed per call, so those mods are not memoized. The
            # memo lives on the mod (a few runners each): it ends with the mod, so no runner keeps
            # a call's tensors.
            if len(memos) >= 8:
                memos.clear()
            memos[self._memo_token] = (mod.bound_values, dict(ops))
        return ops

    def grad_inputs(self, mod: Any, sinks: Optional[torch.Tensor]) -> tuple:
        out = []
        if self.lowering.bias is not None:
            out.append(self._bias(mod))
        if sinks is not None:
            out.append(sinks)
        return tuple(out)

    def _lengths(self, varlen: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        b = self.dims[0][0]
        cu_q, cu_kv = varlen.cu_seqlens_q, varlen.cu_seqlens_kv
        seq_q = (cu_q[1:] - cu_q[:-1]).view(b, 1, 1, 1)
        seq_kv = seq_q if cu_kv is cu_q else (cu_kv[1:] - cu_kv[:-1]).view(b, 1, 1, 1)
        return seq_q, seq_kv

    def op_grads(self, mod: Any, sinks: Optional[torch.Tensor], grads: tuple) -> list:
        """The extra gradients of `backward_call` as gradients of the op's inputs: the bias part's
        tensor parameters (a view's dBias reshaped to the parameter; a materialized term's dBias
        pulled back to its tables by autograd), then the sinks."""
        extra = list(grads[3:])
        out = []
        if self.lowering.bias is not None:
            d_bias = extra.pop(0)
            _, bias_part = L.split(mod)
            tensors = bias_part.tensors()
            if d_bias is None:
                out.extend(None for _ in tensors)
            elif self.lowering.bias == "view":
                out.extend(d_bias.reshape(t.shape).to(t.dtype) for t in tensors.values())
            else:
                leaves = {n: t.detach().requires_grad_(t.is_floating_point()) for n, t in tensors.items()}
                with torch.enable_grad():
                    from score_mods import materialize

                    g = materialize(bias_part.bind(**leaves), self.lowering.dims, device=self.device,
                                    dtype=self.static.dtype)
                    wrt = [t for t in leaves.values() if t.requires_grad]
                    got = iter(torch.autograd.grad(g, wrt, d_bias.to(g.dtype), allow_unused=True))
                out.extend(next(got) if t.requires_grad else None for t in leaves.values())
        out.extend(extra)
        return out

    def _bias(self, mod: Any) -> torch.Tensor:
        dtype = self.static.dtype if self.lowering.bias == "dense" else torch.float32
        return L.bias_tensor(self.lowering, mod, self.device, dtype)

    def _bind(self, q, k, v, varlen, mod, sinks, rng=None, extras=None):
        """(q, k, v as bound, the input bindings, lengths, bias) of a call."""
        if self.copy_inputs:
            q, k, v = check_runtime_tensors(self.fmt, q, k, v)
        bind = self._operands(mod) if self.has_mod else {"attn_scale": self.scale}
        bind.update(q=q, k=k, v=v)
        seqs = None
        if self.padding:
            seqs = self._lengths(varlen)
            bind["seq_q"], bind["seq_kv"] = seqs
        bias = None
        if self.lowering.bias is not None:
            bias = extras[0] if extras else self._bias(mod)
            bind["bias"] = bias if self.bias_cast is None else bias.detach().to(self.bias_cast).contiguous()
        if self.sinks is not None:
            bind["sink"] = self.sinks(sinks)
        if self.static.spec.dropout_p:
            bind["dropout_seed"], bind["dropout_offset"] = rng_views(rng) if rng is not None else dropout_rng(q.device)
        return (q, k, v), bind, seqs, bias

    def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=None, dest=None):
        """(out, lse or None, saved, state); dest: (out, Stats) views in the `Into` layouts to
        write instead of fresh buffers."""
        (q, k, v), bind, seqs, bias = self._bind(q, k, v, varlen, mod, sinks, rng, extras)
        if dest is not None:
            out, stats = dest
        else:
            # two allocations, not one buffer with two views: autograd treats an output that is a
            # view of a temporary as a view (measured: ~10 us more per forward and ~15 us per backward)
            # new_empty: the query's dtype and device without parsing them per call
            out = q.new_empty(self.out_shape)
            stats = q.new_empty(self.stats_shape, dtype=torch.float32)
        bind["o"], bind["stats"] = out, stats
        self.graphs.run("fwd", bind)
        # the state must not hold the output: autograd would keep it (and its graph) alive in a
        # reference cycle out -> grad_fn -> ctx.state -> out, freed only by the garbage collector
        del bind["o"], bind["stats"]
        if self.padding:
            self._clear_rows(out, stats, seqs)
        lse = stats.view(self.lse_shape) if self.static.spec.return_lse else None
        saved = (q, k, v, out, stats) + (() if bias is None else (bias,)) + (() if sinks is None else (sinks,))
        return out, lse, saved, (bind, seqs, bias is not None, sinks is not None, mod)

    def infer(self, q, k, v, varlen, mod, sinks):
        """(out, lse or None) of a call without gradients: when the lse is not returned either, the
        graph's Stats output goes to the stream's scratch buffer (one allocation less per call)."""
        numel = self.stats_shape[0] * self.stats_shape[1] * self.stats_shape[2]
        if self.static.spec.return_lse or self.padding or 4 * numel > runtime.SCRATCH_MAX_BYTES:
            out, lse, _, _ = self.forward(q, k, v, varlen, mod, sinks)
            return out, lse
        (q, k, v), bind, _, _ = self._bind(q, k, v, varlen, mod, sinks)
        out = q.new_empty(self.out_shape)
        bind["o"], bind["stats"] = out, runtime.scratch_for(self.dev, numel)
        self.graphs.run("fwd", bind)
        return out, None

    def backward_with_lse(self, q, k, v, out, lse, varlen, mod, sinks, grad_out, dest=None):
        """Gradients from a given output and fp32 lse (B, H, Sq), e.g. of a larger attention this
        call is one key chunk of: cuDNN's backward reads exactly these (O, Stats). With `Into`
        layouts, out / grad_out are views in them (lse is read packed: a copy when it is a view)
        and dest = (dQ or None, dK, dV) views to write (None: a fresh dQ)."""
        stats = lse.detach().to(torch.float32).contiguous().view(self.stats_shape)  # packed: see __init__
        return self.backward_call(q, k, v, out, stats, varlen, mod, sinks, grad_out, dest=dest)

    def backward_call(self, q, k, v, out, stats, varlen, mod, sinks, grad_out, rng=None, dest=None):
        """The backward from the call's arguments (the custom-op path, which keeps no state;
        `rng`: the forward's dropout seed and offset; `dest`: see backward_with_lse)."""
        (q, k, v), bind, seqs, bias = self._bind(q, k, v, varlen, mod, sinks, rng)
        if self.into is None and not out.is_contiguous():  # the graph reads O (and dO) as the forward writes it
            out = out.contiguous()
        saved = (q, k, v, out, stats) + (() if bias is None else (bias,)) + (() if sinks is None else (sinks,))
        return self.backward((bind, seqs, bias is not None, sinks is not None, mod), saved, grad_out, dest=dest)

    def _clear_rows(self, out: torch.Tensor, stats: torch.Tensor, seqs) -> None:
        """Padded batches: rows past a query length are 0 with lse -inf (cuDNN's padding mask
        does this itself, a score_mod does not), and so are the rows of a sequence with no key."""
        seq_q, seq_kv = seqs
        o = out.permute(_PERM[self.fmt])
        if self.has_mod:
            past = torch.arange(o.shape[2], device=o.device).view(1, 1, -1, 1) >= seq_q
            o.masked_fill_(past, 0.0)
            stats.masked_fill_(past, float("-inf"))
        if seq_kv is not seq_q:
            empty = seq_kv == 0
            o.masked_fill_(empty, 0.0)
            stats.masked_fill_(empty, float("-inf"))

    def backward(self, state, saved, grad_out, dest=None):
        bind_fwd, seqs, has_bias, has_sinks, mod = state
        q, k, v, out, stats = saved[:5]
        extra = list(saved[5:])
        d_o = grad_output(grad_out, out)
        if self.kv_pad:
            got = self._padded_backward_run(bind_fwd, mod, q, k, v, out, stats, extra, has_bias, has_sinks, d_o)
            if dest is None:
                return got
            for g, d in zip(got[1:3], dest[1:]):
                d.copy_(g)
            return (got[0],) + tuple(dest[1:]) + got[3:]
        grads = [t.new_empty_strided(t.shape, st) if d is None else d
                 for t, st, d in zip((q, k, v), self.grad_strides, dest or (None, None, None))]
        if self.padding:  # rows past a length get no gradient, whatever the kernel leaves there
            for g in grads:
                g.zero_()
        bind = dict(bind_fwd)
        bind.update(o=out, dO=d_o, stats=stats, dQ=grads[0], dK=grads[1], dV=grads[2])
        extra_grads = []
        d_bias = None
        if has_bias:
            bias = extra.pop(0)
            if self.bias_grad:
                d_bias = bind["dBias"] = torch.empty(bias.shape, dtype=self.bias_cast or bias.dtype, device=bias.device)
        d_sink = None
        if self.sinks is not None:  # the graph always writes dSink, also when no sink needs it
            d_sink = bind["dSink"] = torch.empty((1, self.dims[0][1], 1, 1), dtype=torch.float32, device=q.device)
        self.graphs.run("bwd", bind)
        if has_bias:  # casts only after the run: a cast taken before it would copy an unwritten buffer
            extra_grads.append(None if d_bias is None else d_bias.to(bias.dtype))
        if has_sinks:
            extra_grads.append(d_sink.view(-1).to(extra.pop(0).dtype))
        if self.padding and self.has_mod:
            seq_q, seq_kv = seqs
            for g, lens in zip(grads, (seq_q, seq_kv, seq_kv)):
                gl = g.permute(_PERM[self.fmt])
                gl.masked_fill_(torch.arange(gl.shape[2], device=g.device).view(1, 1, -1, 1) >= lens, 0.0)
        return tuple(grads) + tuple(extra_grads)
