"""A hand-built cuDNN frontend SDPA graph pair (forward + backward), no library code.

The "raw cuDNN graph" row of the dense benchmark: the same dims and layout as the library's
call, built directly with `import cudnn` and executed into preallocated tensors, so the gap
between this row and the fused_attn row is the library's own added cost.

Shape legend: B batch, S sequence, H query heads, Hkv key-value heads, D head dim.
Tensors are BSHD: q / out (B, S, H, D), k / v (B, S, Hkv, D); the graph sees logical
(B, H, S, D) dims with BSHD strides.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def _bshd_strides(seq: int, heads: int, dim: int) -> list:
    return [seq * heads * dim, dim, heads * dim, 1]


def _bind_stream(handle, bound):
    """Point `handle` at the current CUDA stream if it is not `bound` already; returns the stream."""
    import cudnn

    stream = torch.cuda.current_stream().cuda_stream
    if stream != bound:
        cudnn.set_stream(handle=handle, stream=stream)
    return stream


def _build(graph) -> None:
    import cudnn

    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()


class RawSdpa:
    """Forward and backward cuDNN SDPA graphs for one bf16 BSHD problem.

    Args:
        q: (B, S, H, D) bf16 CUDA tensor; k, v: (B, S, Hkv, D), contiguous.
        causal: top-left causal mask (cuDNN's own).
        backward: also build the backward graph (`fwd_bwd`).
    After construction `fwd()` writes `out` (B, S, H, D) and `lse` (B, H, S, 1) fp32;
    `fwd_bwd(do)` additionally writes `dq`, `dk`, `dv`.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 backward: bool = True, scale: Optional[float] = None) -> None:
        import cudnn

        if q.dtype != torch.bfloat16 or not q.is_cuda:
            raise ValueError(f"RawSdpa needs bf16 CUDA tensors, got q {q.dtype} on {q.device}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4 or not t.is_contiguous():
                raise ValueError(f"RawSdpa needs contiguous (B, S, H, D) tensors, got {name} {tuple(t.shape)}")
        self.q, self.k, self.v = q, k, v
        b, s, h, d = q.shape
        hkv = k.shape[2]
        self.scale = scale if scale is not None else 1.0 / math.sqrt(d)
        self.causal = causal
        self.handle = cudnn.create_handle()
        self._stream = None
        self.out = torch.empty_like(q)
        self.lse = torch.empty(b, h, s, 1, device=q.device, dtype=torch.float32)
        self._fwd_graph, self._fwd_pack = self._forward_graph(b, s, h, hkv, d)
        self._fwd_ws = torch.empty(self._fwd_graph.get_workspace_size(), device=q.device, dtype=torch.uint8)
        self._bwd_graph = None
        if backward:
            self.dq, self.dk, self.dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            self.do = torch.empty_like(q)
            self._bwd_graph, self._bwd_pack = self._backward_graph(b, s, h, hkv, d)
            self._bwd_ws = torch.empty(self._bwd_graph.get_workspace_size(), device=q.device, dtype=torch.uint8)
            self._bwd_uids = [t.get_uid() for t in self._bwd_pack]  # q, k, v, o, dO, stats, dq, dk, dv
        self._fwd_uids = [t.get_uid() for t in self._fwd_pack]  # q, k, v, o, stats

    def _new_graph(self):
        import cudnn

        dt = cudnn.data_type
        return cudnn.pygraph(io_data_type=dt.BFLOAT16, intermediate_data_type=dt.FLOAT,
                             compute_data_type=dt.FLOAT, handle=self.handle)

    def _qkv(self, g, b, s, h, hkv, d):
        import cudnn

        bf16 = cudnn.data_type.BFLOAT16
        qt = g.tensor(dim=[b, h, s, d], stride=_bshd_strides(s, h, d), data_type=bf16, name="q")
        kt = g.tensor(dim=[b, hkv, s, d], stride=_bshd_strides(s, hkv, d), data_type=bf16, name="k")
        vt = g.tensor(dim=[b, hkv, s, d], stride=_bshd_strides(s, hkv, d), data_type=bf16, name="v")
        return qt, kt, vt

    def _forward_graph(self, b, s, h, hkv, d):
        import cudnn

        dt = cudnn.data_type
        g = self._new_graph()
        qt, kt, vt = self._qkv(g, b, s, h, hkv, d)
        o, stats = g.sdpa(q=qt, k=kt, v=vt, attn_scale=self.scale, generate_stats=True,
                          use_causal_mask=self.causal, name="raw_sdpa")
        o.set_output(True).set_dim([b, h, s, d]).set_stride(_bshd_strides(s, h, d)).set_data_type(dt.BFLOAT16)
        stats.set_output(True).set_data_type(dt.FLOAT)
        _build(g)
        return g, {qt: self.q, kt: self.k, vt: self.v, o: self.out, stats: self.lse}

    def _backward_graph(self, b, s, h, hkv, d):
        import cudnn

        dt = cudnn.data_type
        g = self._new_graph()
        qt, kt, vt = self._qkv(g, b, s, h, hkv, d)
        st = _bshd_strides(s, h, d)
        ot = g.tensor(dim=[b, h, s, d], stride=st, data_type=dt.BFLOAT16, name="o")
        dot = g.tensor(dim=[b, h, s, d], stride=st, data_type=dt.BFLOAT16, name="dO")
        lt = g.tensor(dim=[b, h, s, 1], stride=[h * s, s, 1, 1], data_type=dt.FLOAT, name="stats")
        dq, dk, dv = g.sdpa_backward(q=qt, k=kt, v=vt, o=ot, dO=dot, stats=lt, attn_scale=self.scale,
                                     use_causal_mask=self.causal, name="raw_sdpa_bwd")
        dq.set_output(True).set_dim([b, h, s, d]).set_stride(st).set_data_type(dt.BFLOAT16)
        for t in (dk, dv):
            t.set_output(True).set_dim([b, hkv, s, d]).set_stride(_bshd_strides(s, hkv, d)).set_data_type(dt.BFLOAT16)
        _build(g)
        pack = {qt: self.q, kt: self.k, vt: self.v, ot: self.out, dot: self.do, lt: self.lse,
                dq: self.dq, dk: self.dk, dv: self.dv}
        return g, pack

    def _set_stream(self) -> None:
        self._stream = _bind_stream(self.handle, self._stream)

    def fwd(self) -> torch.Tensor:
        """Run the forward graph; returns `out` (B, S, H, D)."""
        self._set_stream()
        self._fwd_graph.execute(self._fwd_pack, self._fwd_ws, handle=self.handle)
        return self.out

    def fwd_ordered(self) -> torch.Tensor:
        """The forward through the frontend's ordered execute (`tensor_uids=`): its cheapest public call."""
        if not hasattr(self, "_fwd_ordered"):
            self._fwd_ordered = ([t.get_uid() for t in self._fwd_pack], list(self._fwd_pack.values()))
        self._set_stream()
        uids, bufs = self._fwd_ordered
        self._fwd_graph.execute(bufs, self._fwd_ws, handle=self.handle, tensor_uids=uids)
        return self.out

    def run_fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor) -> None:
        """The forward graph on caller buffers (the construction's shapes and strides; lse
        (B, H, S, 1) fp32) through the ordered execute."""
        self._set_stream()
        self._fwd_graph.execute([q, k, v, out, lse], self._fwd_ws, handle=self.handle, tensor_uids=self._fwd_uids)

    def run_bwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, do: torch.Tensor,
                lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """The backward graph on caller buffers (see `run_fwd`)."""
        if self._bwd_graph is None:
            raise ValueError("RawSdpa was built with backward=False; run_bwd is not available")
        self._set_stream()
        self._bwd_graph.execute([q, k, v, out, do, lse, dq, dk, dv], self._bwd_ws, handle=self.handle,
                                tensor_uids=self._bwd_uids)

    def fwd_bwd(self, do: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward then backward with upstream gradient `do` (B, S, H, D); returns (out, dq, dk, dv)."""
        if self._bwd_graph is None:
            raise ValueError("RawSdpa was built with backward=False; fwd_bwd is not available")
        if do.data_ptr() != self.do.data_ptr():
            self.do.copy_(do)
        self.fwd()
        self._bwd_graph.execute(self._bwd_pack, self._bwd_ws, handle=self.handle)
        return self.out, self.dq, self.dk, self.dv


class RawRaggedSdpa:
    """Forward and backward cuDNN SDPA graphs over packed (thd) bf16 sequences, no library code.

    Built once for `batch` sequences of at most `max_seqlen` tokens, H heads of dim D (no GQA),
    top-left causal or not; every call binds the per-call lengths and ragged offsets. Packed
    tensors: q / k / v / out (T, H, D); per call `seq_lens` (B, 1, 1, 1) int32, `offsets`
    (B + 1, 1, 1, 1) int32 element offsets (token offset * H * D) and `stats_offsets` (token
    offset * H); lse (T, H, 1) fp32, one row per token (cuDNN's ragged Stats: padded Stats cost
    the forward a fill kernel of the whole padded buffer).
    The floor row of the varlen training step: what a hand-written ragged call costs.
    """

    def __init__(self, batch: int, max_seqlen: int, heads: int, dim: int, device: torch.device, *,
                 causal: bool, scale: Optional[float] = None) -> None:
        import cudnn

        self.dims = (batch, heads, max_seqlen, dim)
        self.scale = scale if scale is not None else 1.0 / math.sqrt(dim)
        self.causal = causal
        self.handle = cudnn.create_handle()
        self._stream = None
        self._fwd_graph, self._fwd_uids = self._graph(backward=False)
        self._bwd_graph, self._bwd_uids = self._graph(backward=True)
        size = max(self._fwd_graph.get_workspace_size(), self._bwd_graph.get_workspace_size())
        self._ws = torch.empty(size, device=device, dtype=torch.uint8)

    def _graph(self, backward: bool):
        import cudnn

        dt = cudnn.data_type
        b, h, s, d = self.dims
        g = cudnn.pygraph(io_data_type=dt.BFLOAT16, intermediate_data_type=dt.FLOAT,
                          compute_data_type=dt.FLOAT, handle=self.handle)
        st = _bshd_strides(s, h, d)  # a packed (T, H, D) tensor seen as (B, H, S, D)

        def ints(name, n):
            return g.tensor(dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32, name=name)

        seq, off, stats_off = ints("seq", b), ints("off", b + 1), ints("stats_off", b + 1)

        def io(name):
            t = g.tensor(dim=[b, h, s, d], stride=st, data_type=dt.BFLOAT16, name=name)
            t.set_ragged_offset(off)
            return t

        def out(t):
            t.set_output(True).set_dim([b, h, s, d]).set_stride(st).set_data_type(dt.BFLOAT16)
            t.set_ragged_offset(off)

        q, k, v = io("q"), io("k"), io("v")
        kw = dict(attn_scale=self.scale, use_padding_mask=True, seq_len_q=seq, seq_len_kv=seq,
                  use_causal_mask=self.causal)
        if not backward:
            o, stats = g.sdpa(q=q, k=k, v=v, generate_stats=True, name="raw_thd", **kw)
            out(o)
            stats.set_output(True).set_data_type(dt.FLOAT).set_dim([b, h, s, 1]).set_stride([h * s, 1, h, 1])
            stats.set_ragged_offset(stats_off)
            order = [q, k, v, o, stats, seq, off, stats_off]
        else:
            o, d_o = io("o"), io("dO")
            stats = g.tensor(dim=[b, h, s, 1], stride=[h * s, 1, h, 1], data_type=dt.FLOAT, name="stats")
            stats.set_ragged_offset(stats_off)
            dq, dk, dv = g.sdpa_backward(q=q, k=k, v=v, o=o, dO=d_o, stats=stats, name="raw_thd_bwd", **kw)
            for t in (dq, dk, dv):
                out(t)
            order = [q, k, v, o, d_o, stats, dq, dk, dv, seq, off, stats_off]
        _build(g)
        return g, [t.get_uid() for t in order]

    def _set_stream(self) -> None:
        self._stream = _bind_stream(self.handle, self._stream)

    def run_fwd(self, q, k, v, out, lse, seq_lens, offsets, stats_offsets) -> None:
        """Forward into caller buffers (see the class docstring)."""
        self._set_stream()
        self._fwd_graph.execute([q, k, v, out, lse, seq_lens, offsets, stats_offsets], self._ws, handle=self.handle,
                                tensor_uids=self._fwd_uids)

    def run_bwd(self, q, k, v, out, do, lse, dq, dk, dv, seq_lens, offsets, stats_offsets) -> None:
        """Backward into caller buffers (see the class docstring)."""
        self._set_stream()
        self._bwd_graph.execute([q, k, v, out, do, lse, dq, dk, dv, seq_lens, offsets, stats_offsets], self._ws,
                                handle=self.handle, tensor_uids=self._bwd_uids)
