"""The cuDNN runner for packed (thd) call plans.

q (Tq, H, D), k (Tkv, Hkv, D), v (Tkv, Hkv, Dv) run on a ragged graph of logical dims
(B_bucket, H, S_bucket, D) with strides (S_bucket*H*D, D, H*D, 1) and element offsets per
sequence; the token count never enters the plan or the graph key. Stats is the fp32
log-sum-exp as one row per query token, (Tq, H, 1) at ragged offsets token * H: the backward
reads it as is, lse (H, Tq) is its transpose, and a given lse becomes Stats by transposing back.
Tokens between sequences (padded offsets) hold -inf where anything reads them (lse, sinks).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch

from ...cache import GraphKey, intern_key
from . import lowering as L
from . import quirks
from . import varlen as VL
from .common import (Graphs, check_runtime_tensors, dropout_rng, grad_output, operand_description, rng_views,
                     sinks_view)
from .graphs import thd_strides

__all__ = ["ThdRunner"]

#: cuDNN's ragged backward accumulates dQ in an fp32 workspace of B_bucket x S_bucket x H x D (the
#: number of sequences times the longest one, not the token count). When that reaches this many
#: bytes and at least TOKEN_SIZED_RATIO times the token-sized workspace, the backward is built for
#: a token capacity instead (`max_total_seq_len`, the next power of two of the token count), whose
#: workspace follows the tokens. Measured on H200 (gradients bit-equal): 8 rows of 8192 tokens in
#: 64 documents each, H16 D128 causal, workspace 4128 -> 516 MiB and fwd+bwd 2.30 -> 2.07 ms; but
#: at 16 or 64 documents of B2 S8192 H16 D64 (272 / 545 MB) the token-sized form ran 3-4% slower
#: (its dot(dO, O) pre-pass 81 -> 97 us), so smaller workspaces keep the dims-sized form.
TOKEN_SIZED_WORKSPACE_BYTES = 1 << 30
TOKEN_SIZED_RATIO = 4


class ThdRunner:
    """forward/backward of one packed plan on cuDNN."""

    backend = "cudnn"
    validates_lengths = True  # prepare() checks cu_seqlens values (one device assertion)

    def __init__(self, problem: Any, version: int) -> None:
        self.static = p = problem
        spec = p.spec
        bb = VL.bucket_batch(p.batch)
        sq, skv = p.seqlen_q, p.seqlen_kv
        if spec.band is not None and spec.band.bottom_right:
            sq = skv = max(sq, skv)  # cuDNN's bottom-right band refuses max_s_q > max_s_kv
        h, hkv, d, dv = p.heads, p.kv_heads, p.head_dim, p.head_dim_v
        self.dims = ((bb, h, sq, d), (bb, hkv, skv, d), (bb, hkv, skv, dv))
        self.heads, self.head_dim_v = h, dv
        self.dev = p.device.index if p.device.index is not None else torch.cuda.current_device()
        # query-side offsets: q / o (heads * dims) and the per-token Stats rows (heads)
        self.layout = VL.ThdLayout(p.batch, bb, tuple(sorted({h * d, h * dv, h})),
                                   tuple(sorted({hkv * d, hkv * dv})), p.device)
        self.lowering = L.plan_lowering(spec, spec.score_mod, (bb, h, sq, skv), has_lengths=True)
        self.has_mod = self.lowering.graph_mod is not None
        self.gaps_q, self.gaps = p.q_offsets, p.q_offsets or p.kv_offsets
        # a top-left band never reaches keys past q_len + right of a sequence: they are not
        # counted as keys (the kernel loads whole tiles, and NaN there would reach attending
        # rows); they get zero gradients (see key_range)
        band = spec.band
        self.trim_right = None
        if (band is not None and not band.bottom_right and band.right is not None and not p.same_lengths
                and spec.score_mod_key is None and not spec.dropout_p):
            self.trim_right = band.right
            self.gaps = True
        self.copy_inputs = not p.aligned or any(
            st != (n * dd, dd, 1) for st, n, dd in ((p.q_strides, h, d), (p.k_strides, hkv, d), (p.v_strides, hkv, dv)))
        self.scale = torch.full((1, 1, 1, 1), p.scale, dtype=torch.float32)
        self.sinks = sinks_view(p)
        operands = self._operands(spec.score_mod)
        strides = tuple(thd_strides(dm) for dm in self.dims)
        common = dict(dtype=str(p.dtype).replace("torch.", ""), q_dims=self.dims[0], k_dims=self.dims[1],
                      v_dims=self.dims[2], q_strides=strides[0], k_strides=strides[1], v_strides=strides[2],
                      o_strides=thd_strides(self.dims[0][:3] + (dv,)), scale=None, band=self.lowering.band,
                      padding=False, ragged=True,
                      score_mod=None if not self.has_mod else self.lowering.graph_mod.cache_key,
                      operands=operand_description(operands), device_index=self.dev, backend_version=version,
                      bias=None, sinks=self.sinks is not None, dropout=spec.dropout_p)
        fwd_key = GraphKey(direction="fwd", deterministic=False, **common)
        # Quirk `ragged_sink_backward` (an out-of-bounds read in the ragged backward's dot(dO, O)
        # pre-pass with a sink token). The sink needs no place in the backward graph: given the
        # forward's Stats (whose lse includes the sink) the plain backward's weights
        # exp(s - lse) and D = rowsum(dO * O) are the sink-aware ones, so dQ, dK, dV are exact,
        # and dSink = -sum_t exp(sink - lse_t) D_t is a reduction (`_sink_grad`).
        self.sink_in_bwd = self.sinks is not None and not quirks.applies("ragged_sink_backward", version)
        self.quirks = quirks.shaping(version, score_mod=self.has_mod, banded=spec.band is not None,
                                     sink_split=self.sinks is not None and not self.sink_in_bwd)
        bwd_common = dict(common, sinks=self.sink_in_bwd)
        bwd_key = GraphKey(direction="bwd", deterministic=spec.deterministic, **bwd_common) if p.needs_grad else None
        self.graphs = Graphs(fwd_key, bwd_key, self.lowering.graph_mod, operands, self.dev)
        self.graphs.build_all()
        self._dq_bytes_per_row = h * d * 4  # one token's fp32 dQ accumulator
        self._padded_workspace = bb * sq * self._dq_bytes_per_row
        # capacity -> backward key sized for it; bounded: one per power-of-two token bucket
        self._token_sized: Dict[Tuple[int, int], GraphKey] = {}
        self._token_sized_declined = False

    def token_sized_key(self, tokens_q: int, tokens_kv: int) -> Optional[GraphKey]:
        """The backward key sized for this call's token counts, or None for the plan's own (see
        TOKEN_SIZED_WORKSPACE_BYTES)."""
        if self._padded_workspace < TOKEN_SIZED_WORKSPACE_BYTES or self._token_sized_declined:
            return None
        cap_q = VL.bucket_seqlen(tokens_q)
        if self._padded_workspace < TOKEN_SIZED_RATIO * cap_q * self._dq_bytes_per_row:
            return None
        cap = (cap_q, VL.bucket_seqlen(tokens_kv))
        key = self._token_sized.get(cap)
        if key is None:
            key = self._token_sized.setdefault(
                cap, intern_key(dataclasses.replace(self.graphs.keys["bwd"], token_capacity=cap)))
        return key

    def _operands(self, mod: Any) -> Dict[str, torch.Tensor]:
        ops = L.mod_operands(self.lowering, mod, has_lengths=True, device=self.static.device)
        ops = {f"sm:{k}": t for k, t in ops.items()}
        ops["attn_scale"] = L.attn_scale(self.lowering, mod, self.static.scale, self.scale)
        return ops

    def grad_inputs(self, mod: Any, sinks: Optional[torch.Tensor]) -> tuple:
        return () if sinks is None else (sinks,)

    def _bind_lengths(self, bind: Dict[str, Any], thd: VL.ThdBatch) -> None:
        bind["seq_q"], bind["seq_kv"] = thd.seq_q, thd.seq_kv
        if self.trim_right is not None:  # keys past q_len + right are attended by no query
            bind["seq_kv"] = thd.kv_lengths_within(self.trim_right)
        for (side, mult), t in thd.offsets.items():
            bind[f"roff_{side}_{mult}"] = t

    def _bind(self, q, k, v, varlen, mod, sinks, rng=None):
        """(q, k, v as bound, the input bindings, the prepared batch) of a call."""
        VL.check_offset_ranges(q, k, v)
        if self.copy_inputs:
            q, k, v = check_runtime_tensors("thd", q, k, v)
        thd = VL.prepare(self.layout, varlen, (q.shape[0], k.shape[0]), (varlen.max_seqlen_q, varlen.max_seqlen_kv))
        bind = self._operands(mod) if self.has_mod else {"attn_scale": self.scale}
        bind.update(q=q, k=k, v=v)
        self._bind_lengths(bind, thd)
        if self.sinks is not None:
            bind["sink"] = self.sinks(sinks)
        if self.static.spec.dropout_p:
            bind["dropout_seed"], bind["dropout_offset"] = rng_views(rng) if rng is not None else dropout_rng(q.device)
        return (q, k, v), bind, thd

    def stats_rows(self, tokens: int) -> tuple:
        """The shape of the Stats a call of `tokens` query tokens saves: (Tq, H, 1) fp32."""
        return (tokens, self.heads, 1)

    def backward_with_lse(self, q, k, v, out, lse, varlen, mod, sinks, grad_out):
        """Gradients from a given output and packed fp32 lse (H, Tq) (see DenseRunner)."""
        stats = lse.detach().to(torch.float32).t().contiguous().unsqueeze(-1)  # (Tq, H, 1)
        return self.backward_call(q, k, v, out, stats, varlen, mod, sinks, grad_out)

    def op_grads(self, mod: Any, sinks: Any, grads: tuple) -> list:
        """The extra gradients of `backward_call`, already per op input (see DenseRunner.op_grads)."""
        return list(grads[3:])

    def backward_call(self, q, k, v, out, stats, varlen, mod, sinks, grad_out, rng=None):
        """The backward from the call's arguments (the custom-op path, which keeps no state;
        `rng`: the forward's dropout seed and offset)."""
        (q, k, v), bind, thd = self._bind(q, k, v, varlen, mod, sinks, rng)
        if not out.is_contiguous():  # the graph reads O (and dO) in the layout the forward writes
            out = out.contiguous()
        saved = (q, k, v, out, stats) + (() if sinks is None else (sinks,))
        return self.backward((bind, thd, sinks is not None), saved, grad_out)

    def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=None):
        (q, k, v), bind, thd = self._bind(q, k, v, varlen, mod, sinks, rng)
        # new_empty / new_zeros: the query's dtype and device without parsing them per call
        shape = (q.shape[0], self.heads, self.head_dim_v)
        out = q.new_zeros(shape) if self.gaps_q else q.new_empty(shape)  # tokens between sequences stay 0
        rows = self.stats_rows(q.shape[0])
        read = self.static.spec.return_lse or sinks is not None  # gap rows are read: they hold -inf
        stats = (q.new_full(rows, float("-inf"), dtype=torch.float32) if self.gaps_q and read
                 else q.new_empty(rows, dtype=torch.float32))
        bind["o"], bind["stats"] = out, stats
        self.graphs.run("fwd", bind)
        del bind["o"], bind["stats"]  # no reference cycle through the output (see DenseRunner.forward)
        if not self.static.same_lengths:
            # sequences with queries but no key: out rows 0 and lse -inf (the reference's answer)
            empty = VL.token_rows_of_empty_kv(thd, q.shape[0]).view(-1, 1, 1)
            stats.masked_fill_(empty, float("-inf"))
            out.masked_fill_(empty, 0.0)
        lse = stats.view(rows[:2]).t().contiguous() if self.static.spec.return_lse else None
        saved = (q, k, v, out, stats) + (() if sinks is None else (sinks,))
        return out, lse, saved, (bind, thd, sinks is not None)

    def backward(self, state, saved, grad_out):
        bind_fwd, _thd, has_sinks = state
        q, k, v, out, stats = saved[:5]
        d_o = grad_output(grad_out, out)
        grads = [t.new_zeros(t.shape) if self.gaps else t.new_empty(t.shape) for t in (q, k, v)]
        bind = dict(bind_fwd)
        if not self.sink_in_bwd:
            bind.pop("sink", None)
        bind.update(o=out, dO=d_o, stats=stats, dQ=grads[0], dK=grads[1], dV=grads[2])
        d_sink = None
        if self.sink_in_bwd:  # the graph always writes dSink, also when no sink needs it
            d_sink = bind["dSink"] = torch.empty((1, self.heads, 1, 1), dtype=torch.float32, device=q.device)
        self._run_backward(bind, q.shape[0], k.shape[0])
        if not has_sinks:
            return tuple(grads)
        if d_sink is None:
            d_sink = self._sink_grad(bind_fwd["sink"], stats, out, d_o)
        # cast only after the run: a cast taken before it would copy the unwritten buffer
        return tuple(grads) + (d_sink.view(-1).to(saved[5].dtype),)

    def _run_backward(self, bind: Dict[str, Any], tokens_q: int, tokens_kv: int) -> None:
        key = self.token_sized_key(tokens_q, tokens_kv)
        if key is not None:
            try:
                self.graphs.run_variant("bwd", key, bind)
                return
            except NotImplementedError:  # cuDNN declines the token-sized form here: the plan's own graph
                self._token_sized_declined = True
        self.graphs.run("bwd", bind)

    @staticmethod
    def _sink_grad(sink: torch.Tensor, stats: torch.Tensor, out: torch.Tensor, d_o: torch.Tensor) -> torch.Tensor:
        """dSink (H,) fp32 = -sum over query tokens of exp(sink_h - lse_t,h) * rowsum(dO * O)_t,h: the
        sink's column of dS = P * (dP - D) has dP = 0 (the sink has no value). lse (with the sink)
        is the forward's Stats (-inf on tokens outside every sequence: they contribute nothing)."""
        lse = stats.view(stats.shape[:2]).t()  # (H, T)
        dot = (d_o.float() * out.float()).sum(-1).t()  # (H, T)
        weight = torch.exp(sink.view(-1, 1) - lse)
        return -(torch.where(torch.isfinite(lse), weight, 0.0) * dot).sum(1)
