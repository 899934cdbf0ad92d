"""Build cuDNN frontend SDPA forward and backward graphs from a `GraphKey`.

Graph dims are logical (B, H, S, D); the memory layout lives only in the strides (bshd, sbhd,
bhsd, or thd with ragged offsets). `construct` creates the operation graph (pure Python, runs
without a GPU up to `validate()`); `build` plans and compiles it into a `CompiledGraph`
whose ordered slot list drives `execute` on the hot path.

Slots (names of the buffers bound at execute, see `CompiledGraph.slots`):
    q, k, v, o, stats                      forward (o, stats are outputs)
    q, k, v, o, dO, stats, dQ, dK, dV      backward (dQ, dK, dV are outputs)
                                           stats: fp32 (B, H, Sq, 1); thd: one row per query
                                           token, a packed (Tq, H, 1) buffer with ragged offsets
    seq_q, seq_kv                          (B, 1, 1, 1) int32 lengths (padding / thd)
    roff_q_<m>, roff_kv_<m>                (B+1, 1, 1, 1) int32 element offsets, thd only;
                                           <m> the multiplier (heads * head dim; heads for stats)
    sm:<name>                              score_mod operands; q_len / kv_len are the
                                           seq_len tensors (padding / thd) or CPU fp32 scalars
    attn_scale                             CPU fp32 (1, 1, 1, 1) pass-by-value softmax scale
                                           (a new scale never rebuilds a graph)
    bias, dBias                            cuDNN's own post-score_mod bias (B|1, H|1, Sq, Skv)
                                           and its gradient (backward, when trained)
    sink, dSink                            (1, H, 1, 1) fp32 sink logits and their gradient
    dropout_seed, dropout_offset           (1, 1, 1, 1) int64 device tensors of the Philox RNG

Execution: `CompiledGraph.fast` holds what the lowered graph's raw-pointer execute needs (the
user slots in the backend's sorted-uid order and the plan index); `runtime.execute` uses it
when present and the frontend's public ordered `execute` otherwise. Both run the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...cache import GraphKey
from . import quirks
from .isolation import IsolatingGraph

__all__ = ["CompiledGraph", "construct", "build", "cudnn_band", "grad_strides", "dense_strides_like"]

Dims = Tuple[int, ...]


def cudnn_band(left: Optional[int], right: Optional[int]) -> Tuple[Optional[int], Optional[int]]:
    """Map a flash-attention window (keys i-left .. i+right allowed) to cuDNN's band bounds.

    cuDNN's `diagonal_band_left_bound` counts the diagonal itself: a left bound L keeps keys
    i-(L-1) .. i (measured on an H100: left bound L equals a flash window left of L - 1;
    benchmarks/results/frontend_probe_h100.md, second probe).
    So left_bound = left + 1. The right bound is the flash right directly (0 = causal).
    """
    return (None if left is None else left + 1), right


def dense_strides_like(dims: Sequence[int], strides: Sequence[int]) -> Tuple[int, ...]:
    """Strides of a dense tensor of `dims` laid out in the memory order of `strides`.

    Equal to `strides` when they already describe a dense tensor (e.g. a bshd view);
    used for every buffer this backend allocates (output, gradients).
    """
    order = sorted(range(len(dims)), key=lambda d: (-strides[d], -d))  # outermost first
    out = [0] * len(dims)
    step = 1
    for d in reversed(order):
        out[d] = step
        step *= dims[d]
    return tuple(out)


def thd_strides(dims: Sequence[int]) -> Tuple[int, int, int, int]:
    """Strides of a packed (T, H, D) tensor seen as (B_bucket, H, S_bucket, D)."""
    _, h, s, d = dims
    return (s * h * d, d, h * d, 1)


def grad_strides(key: GraphKey) -> Tuple[Dims, Dims, Dims]:
    """Strides of dQ, dK, dV: the key's own when it has them, else dense in the memory order of
    q, k, v (thd: packed)."""
    if key.grad_strides is not None:
        return key.grad_strides
    if key.ragged:
        return thd_strides(key.q_dims), thd_strides(key.k_dims), thd_strides(key.v_dims)
    return (dense_strides_like(key.q_dims, key.q_strides), dense_strides_like(key.k_dims, key.k_strides),
            dense_strides_like(key.v_dims, key.v_strides))


@dataclass
class CompiledGraph:
    """A built graph plus what execute needs: slot names and uids in the same order, and the
    raw-pointer fast path (lowered graph, slot names in sorted-uid order, plan index) or None."""

    graph: Any
    slots: Tuple[str, ...]
    uids: List[int]
    workspace_size: int
    fast: Optional[Tuple[Any, Tuple[str, ...], int]] = None


def fast_path(graph: Any, named: Dict[str, Any]) -> Optional[Tuple[Any, Tuple[str, ...], int]]:
    """(lowered graph, slots in its sorted-uid order, plan index) for raw-pointer execution, or
    None when this frontend build does not offer it or a user slot is not one of ours."""
    try:
        lowered = graph._lowered_graph
        if lowered is None or graph.selected_engine is not None:
            return None
        lowered._prepare_variant_pack_template()
        order = [int(u) for u in lowered._get_variant_pack_uids_sorted()]
        cfg = graph._materialize_backend_plan(graph._plan_index) if graph._plans else None
        index = -1 if cfg is None or cfg.cpp_index is None else int(cfg.cpp_index)
    except Exception:  # noqa: BLE001 - private API of the pinned frontend: absent means "use the public path"
        return None
    by_uid = {int(t.get_uid()): name for name, t in named.items()}
    if not order or any(u not in by_uid for u in order):
        return None
    return lowered, tuple(by_uid[u] for u in order), index


_DTYPE_BY_NAME = {
    "float16": lambda c: c.data_type.HALF, "bfloat16": lambda c: c.data_type.BFLOAT16,
    "float32": lambda c: c.data_type.FLOAT,
}


def _dense_strides(dims: Sequence[int]) -> Tuple[int, ...]:
    out, step = [0] * len(dims), 1
    for d in reversed(range(len(dims))):
        out[d] = step
        step *= dims[d]
    return tuple(out)


def _io_type(cudnn: Any, dtype: str) -> Any:
    if dtype == "float16":
        return cudnn.data_type.HALF
    if dtype == "bfloat16":
        return cudnn.data_type.BFLOAT16
    raise TypeError(f"cuDNN SDPA graphs take float16 or bfloat16, got {dtype}")


class _Builder:
    """Collects named graph inputs/outputs while one graph is constructed."""

    def __init__(self, cudnn: Any, key: GraphKey, handle: Any) -> None:
        self.cudnn = cudnn
        self.key = key
        self.io = _io_type(cudnn, key.dtype)
        self.graph = cudnn.pygraph(
            io_data_type=self.io,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=handle,
        )
        self.named: Dict[str, Any] = {}
        self.offsets: Dict[Tuple[str, int], Any] = {}

    def tensor(self, name: str, dims: Sequence[int], strides: Sequence[int], dtype: Any = None) -> Any:
        t = self.graph.tensor(dim=list(dims), stride=list(strides), data_type=dtype or self.io, name=name)
        self.named[name] = t
        return t

    def tensor_like(self, name: str, template: torch.Tensor) -> Any:
        """A graph input like `template` (CPU tensors become pass-by-value)."""
        t = self.graph.tensor_like(template, name=name)
        self.named[name] = t
        return t

    def int_tensor(self, name: str, n: int) -> Any:
        return self.tensor(name, (n, 1, 1, 1), (1, 1, 1, 1), self.cudnn.data_type.INT32)

    def ragged(self, side: str, dims: Sequence[int]) -> Any:
        """The (B+1, 1, 1, 1) element-offset tensor for `side` ("q"/"kv") and heads*dim of dims."""
        mult = dims[1] * dims[3]
        off = self.offsets.get((side, mult))
        if off is None:
            off = self.int_tensor(f"roff_{side}_{mult}", dims[0] + 1)
            self.offsets[(side, mult)] = off
        return off

    def io_tensor(self, name: str, side: str, dims: Sequence[int], strides: Sequence[int]) -> Any:
        t = self.tensor(name, dims, strides)
        if self.key.ragged:
            t.set_ragged_offset(self.ragged(side, dims))
        return t

    def output(self, name: str, t: Any, side: Optional[str], dims: Sequence[int], strides: Sequence[int],
               dtype: Any = None) -> None:
        t.set_output(True).set_dim(list(dims)).set_stride(list(strides)).set_data_type(dtype or self.io)
        if side is not None and self.key.ragged:
            t.set_ragged_offset(self.ragged(side, dims))
        t.set_name(name)
        self.named[name] = t


def _o_dims(key: GraphKey) -> Dims:
    return key.q_dims[:3] + (key.v_dims[3],)


def _stats_dims(key: GraphKey) -> Tuple[Dims, Dims]:
    """Stats' dims and strides: packed (B, H, Sq, 1), the caller's strides, or for thd graphs
    token-major rows (one per query token, heads innermost) at ragged offsets token * H. The
    ragged form is also the fast one: with padded Stats cuDNN's ragged forward first fills the
    whole (B_bucket, H, S_bucket) buffer in a kernel of its own (H200, cuDNN 9.19: 5.9 us of a
    16-document call's 135, 10.8 of a 64-document call's 125)."""
    b, h, s, _ = key.q_dims
    if key.ragged:
        return (b, h, s, 1), (h * s, 1, h, 1)
    return (b, h, s, 1), key.stats_strides or (h * s, s, 1, 1)


def _common_kwargs(b: _Builder, score_mod: Any, operand_templates: Dict[str, torch.Tensor],
                   backward: bool) -> Dict[str, Any]:
    """sdpa / sdpa_backward keyword arguments for masks, lengths and the score_mod."""
    key, cudnn = b.key, b.cudnn
    kw: Dict[str, Any] = {}
    if key.scale is None:
        kw["attn_scale"] = b.tensor_like("attn_scale", torch.ones((1, 1, 1, 1), dtype=torch.float32))
    else:
        kw["attn_scale"] = key.scale
    if key.bias is not None:
        dims, strides, dtype, _ = key.bias
        kw["bias"] = b.tensor("bias", dims, strides, _DTYPE_BY_NAME[dtype](cudnn))
    if key.sinks:
        kw["sink_token"] = b.tensor("sink", (1, key.q_dims[1], 1, 1), (key.q_dims[1], 1, 1, 1), cudnn.data_type.FLOAT)
    if key.dropout:
        one = ((1, 1, 1, 1), (1, 1, 1, 1), cudnn.data_type.INT64)
        kw["dropout"] = (key.dropout, b.tensor("dropout_seed", *one), b.tensor("dropout_offset", *one))
    if key.band is not None:
        left, right, bottom_right = key.band
        kw["diagonal_alignment"] = (cudnn.diagonal_alignment.BOTTOM_RIGHT if bottom_right
                                    else cudnn.diagonal_alignment.TOP_LEFT)
        if left is not None:
            kw["diagonal_band_left_bound"] = left
        if right is not None:
            kw["diagonal_band_right_bound"] = right
    seq_q = seq_kv = None
    if key.padding or key.ragged:
        seq_q = b.int_tensor("seq_q", key.q_dims[0])
        seq_kv = b.int_tensor("seq_kv", key.q_dims[0])
        kw["seq_len_q"], kw["seq_len_kv"] = seq_q, seq_kv
        # cuDNN refuses its own padding mask together with a score_mod; lengths still apply.
        kw["use_padding_mask"] = score_mod is None
    if score_mod is not None:
        operands = {n: b.tensor_like(f"sm:{n}", t) for n, t in operand_templates.items()}
        if score_mod is not None and score_mod.uses_lengths and seq_q is not None:
            operands["q_len"], operands["kv_len"] = seq_q, seq_kv
        memo: Dict[Any, Any] = {}
        guard = _input_guard(key, cudnn)
        # The callback receives attention scale x score: the runners bind attn_scale x
        # score_mod.score_scale() (lowering.attn_scale), the factor the scaled lowering folds out.
        kw["score_mod"] = lambda g, s: score_mod.lower_scaled_forward(guard(g, s), s, operands, memo)
        if backward:
            kw["score_mod_bprop"] = lambda g, ds: score_mod.lower_scaled_backward(guard(g, ds), ds, operands, memo)
    return kw


def _input_guard(key: GraphKey, cudnn: Any) -> Any:
    """guard(graph, callback input) -> the graph object the callbacks build with: the graph itself,
    or, where quirk `score_reused_in_pointwise` applies, one `IsolatingGraph` per graph that
    reads each callback input through a copy next to values computed from it."""
    if not quirks.applies("score_reused_in_pointwise", key.backend_version):
        return lambda g, t: g
    proxies: Dict[int, IsolatingGraph] = {}

    def guard(g: Any, t: Any) -> Any:
        proxy = proxies.get(id(g))
        if proxy is None or proxy._graph is not g:
            proxy = proxies[id(g)] = IsolatingGraph(g, cudnn.data_type.FLOAT)
        proxy.root(t)
        return proxy

    return guard


def construct(key: GraphKey, score_mod: Any = None, operand_templates: Optional[Dict[str, torch.Tensor]] = None,
              handle: Any = None) -> Tuple[Any, Dict[str, Any]]:
    """Create the operation graph for `key` (no planning); returns (graph, {slot: IR tensor}).

    operand_templates: torch tensors shaped like the score_mod operands (including q_len /
    kv_len CPU scalars for plain dense problems), used for `tensor_like` only.
    """
    import cudnn

    b = _Builder(cudnn, key, handle)
    q = b.io_tensor("q", "q", key.q_dims, key.q_strides)
    k = b.io_tensor("k", "kv", key.k_dims, key.k_strides)
    v = b.io_tensor("v", "kv", key.v_dims, key.v_strides)
    stats_dims, stats_strides = _stats_dims(key)
    o_dims = _o_dims(key)
    if key.direction == "fwd":
        kw = _common_kwargs(b, score_mod, operand_templates or {}, backward=False)
        o, stats = b.graph.sdpa(q=q, k=k, v=v, generate_stats=True, name="sdpa", **kw)
        b.output("o", o, "q", o_dims, key.o_strides)
        b.output("stats", stats, "q", stats_dims, stats_strides, cudnn.data_type.FLOAT)
    else:
        o = b.io_tensor("o", "q", o_dims, key.o_strides)
        d_o = b.io_tensor("dO", "q", o_dims, key.o_strides)
        stats = b.tensor("stats", stats_dims, stats_strides, cudnn.data_type.FLOAT)
        if key.ragged:
            stats.set_ragged_offset(b.ragged("q", stats_dims))
        kw = _common_kwargs(b, score_mod, operand_templates or {}, backward=True)
        if key.deterministic:
            kw["use_deterministic_algorithm"] = True
        if key.token_capacity is not None:  # workspace sized by the tokens (see thd.ThdRunner)
            kw["max_total_seq_len_q"], kw["max_total_seq_len_kv"] = key.token_capacity
        if key.bias is not None and key.bias[3]:
            dims, _, dtype, _ = key.bias
            kw["dBias"] = b.tensor("dBias", dims, _dense_strides(dims), _DTYPE_BY_NAME[dtype](cudnn))
            b.named["dBias"].set_output(True)
        if key.sinks:
            h = key.q_dims[1]
            kw["dSink_token"] = b.tensor("dSink", (1, h, 1, 1), (h, 1, 1, 1), cudnn.data_type.FLOAT)
            b.named["dSink"].set_output(True)
        dq, dk, dv = b.graph.sdpa_backward(q=q, k=k, v=v, o=o, dO=d_o, stats=stats, name="sdpa_bwd", **kw)
        sq, sk, sv = grad_strides(key)
        b.output("dQ", dq, "q", key.q_dims, sq)
        b.output("dK", dk, "kv", key.k_dims, sk)
        b.output("dV", dv, "kv", key.v_dims, sv)
    return b.graph, b.named


def build(key: GraphKey, score_mod: Any, operand_templates: Dict[str, torch.Tensor], handle: Any) -> CompiledGraph:
    """Construct, plan and compile the graph for `key` on the current CUDA device.

    Any frontend failure becomes NotImplementedError naming the configuration and the
    alternative; the frontend's own traceback is not chained.
    """
    import cudnn

    try:
        graph, named = construct(key, score_mod, operand_templates, handle)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        workspace = int(graph.get_workspace_size())
    except Exception as exc:  # noqa: BLE001 - frontend errors have many types
        message = f"{type(exc).__name__}: {exc}"
    else:
        slots = tuple(named)
        fast = fast_path(graph, named)
        if fast is not None and fast[2] >= 0:
            try:  # the plan actually executed must get its own requirement
                workspace = max(workspace, int(fast[0].get_workspace_size_plan_at_index(fast[2])))
            except Exception:  # noqa: BLE001 - private API: keep the graph-level figure
                pass
        return CompiledGraph(graph, slots, [named[s].get_uid() for s in slots], workspace, fast)
    raise NotImplementedError(
        f"cuDNN cannot run this attention configuration ({key.describe()}): {message.strip()[:600]}. "
        "Use backend='reference' for it."
    ) from None
