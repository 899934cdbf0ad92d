"""Score mods of attention-gym: ALiBi, softcapping, activations in place of softmax, Graphormer's
spatial and edge biases, Sandwich, and T5's learned relative position bias."""

from __future__ import annotations

import math
from typing import Any, Callable, Union

import torch

import score_mods as sm

from ..base import ScoreMod
from ..templates import template
from .common import _float, _int, _ints, _mod

__all__ = [
    "alibi", "softcap", "activation", "graphormer_spatial", "graphormer_edge", "sandwich", "sandwich_table",
    "relative_position_bias",
]


def alibi(num_heads: int) -> ScoreMod:
    """attention-gym's ALiBi (``generate_alibi_bias``): score + (j - i) * 2^(-8 (h + 1) / H).

    The slope is computed in the expression from h (no tensor); H is structure. Unlike the
    library's ``alibi(alibi_slopes(H))``, this is the plain geometric series for every H, also
    when H is not a power of two.
    """
    H = _int("alibi", "num_heads", num_heads)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) * sm.pow(2.0, (h + 1) * (-8.0 / H))

    return _mod(f"alibi_h{H}", alibi)


def softcap(cap: float) -> ScoreMod:
    """tanh softcapping (``generate_tanh_softcap``): cap * tanh(score / cap); cap a runtime scalar.

    The library's ``softcap(cap)``, named with its value. ``approx=True`` (PTX tanh.approx) is a
    kernel-level instruction choice with the same math; cuDNN uses its own tanh.
    """
    mod = sm.softcap(cap)
    return mod.renamed(f"softcap_{mod.scalars()['cap']:g}")


def _gelu(x):
    return 0.5 * x * (1.0 + sm.erf(x * (1.0 / math.sqrt(2.0))))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + sm.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


#: name -> (activation in the language, its minimum over the reals: offset must exceed -minimum)
ACTIVATIONS = {
    "gelu": (_gelu, -0.16997),
    "gelu_tanh": (_gelu_tanh, -0.17004),
    "relu": (lambda x: sm.maximum(x, 0.0), 0.0),
    "sigmoid": (sm.sigmoid, 0.0),
    "silu": (lambda x: x * sm.sigmoid(x), -0.27847),
}


def activation(kind: Union[str, Callable] = "gelu", offset: float = 1.0) -> ScoreMod:
    """Softmax replaced by an activation f (``generate_activation_score_mod``): log(f(score) + offset),
    so the softmax numerator is f(s) + offset. `offset` (a runtime scalar) keeps the log's argument
    positive. kind: "gelu" (exact, via erf), "gelu_tanh", "relu", "sigmoid", "silu", or a
    function of one symbolic value written in the language.

    Recover f(S) V: ``out, lse = dot_product_attention(..., return_lse=True)``;
    ``out * lse.exp()[..., None] - offset * v_sum``, v_sum = the sum of the attended values.
    """
    if isinstance(kind, str):
        if kind not in ACTIVATIONS:
            raise ValueError(f"activation: kind must be one of {sorted(ACTIVATIONS)} or a function, got {kind!r}")
        f, low = ACTIVATIONS[kind]
        name = kind
    elif callable(kind):
        f, low, name = kind, 0.0, getattr(kind, "__name__", "custom").replace("<lambda>", "custom")
    else:
        raise TypeError(f"activation: kind must be a name or a function, got {kind!r}")
    offset = _float("activation", "offset", offset)
    if not offset > -low:
        raise ValueError(f"activation: offset must exceed {-low:g} so that {name}(s) + offset > 0, got {offset!r}")

    def activation(score, b, h, q_idx, kv_idx, offset=1.0):
        return sm.log(f(score) + offset)

    return _mod(f"activation_{name}", activation, offset=offset)


def _table(fn: str, name: str, t: Any, rank: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != rank:
        raise TypeError(f"{fn}: {name} must be a floating torch.Tensor with {rank} dims, got "
                        f"{type(t).__name__ if not isinstance(t, torch.Tensor) else (t.dtype, tuple(t.shape))}")
    return t


def graphormer_spatial(distances: torch.Tensor, table: torch.Tensor) -> ScoreMod:
    """Graphormer spatial encoding (``generate_graphormer_spatial_bias``): score + table[h, d(i, j)],
    d the shortest-path distance bucket between nodes i and j.

    distances: (B|1, N, N) ints in [0, num_buckets); table: (H, num_buckets) learnable (a float
    tensor parameter; pass an nn.Parameter, gradients flow on the reference backend).
    """
    fn = "graphormer_spatial"
    dist = _ints(fn, "distances", distances, 3)
    table = _table(fn, "table", table, 2)
    if dist.numel() and (int(dist.min()) < 0 or int(dist.max()) >= table.shape[1]):
        raise ValueError(f"{fn}: distances must lie in [0, {table.shape[1]}) (the table's buckets)")

    def graphormer_spatial(score, b, h, q_idx, kv_idx, table=sm.TensorParam(), distances=sm.TensorParam("int")):
        return score + table[h, distances[b, q_idx, kv_idx]]

    return _mod(f"graphormer_spatial_{table.shape[1]}", graphormer_spatial, table=table, distances=dist.to(torch.int32))


def graphormer_edge(path_edge_types: torch.Tensor, path_lengths: torch.Tensor, table: torch.Tensor) -> ScoreMod:
    """Graphormer edge encoding (``generate_graphormer_edge_bias``): score + the mean over the first
    len(i, j) edges of the shortest i-j path of table[h, n, type of edge n] (0 when len = 0).

    path_edge_types: (B|1, N, N, K) ints in [0, num_edge_types); path_lengths: (B|1, N, N) ints in
    [0, K]; table: (H, K, num_edge_types) learnable. The mean is written as a weighted sum,
    sum_n w[b, i, j, n] * table[h, n, type_n] with w = [n < len] / max(len, 1) computed here (a
    float tensor parameter, not learned), so the mod has no condition and keeps its cuDNN
    backward. The K path positions are unrolled (K is structure).
    """
    fn = "graphormer_edge"
    types = _ints(fn, "path_edge_types", path_edge_types, 4)
    lengths = _ints(fn, "path_lengths", path_lengths, 3)
    table = _table(fn, "table", table, 3)
    K = types.shape[-1]
    if K < 1 or table.shape[1] != K:
        raise ValueError(f"{fn}: table must have one row per path position (K = {K}), got shape {tuple(table.shape)}")
    if types.numel() and (int(types.min()) < 0 or int(types.max()) >= table.shape[2]):
        raise ValueError(f"{fn}: path_edge_types must lie in [0, {table.shape[2]}) (the table's edge types)")
    if lengths.shape != types.shape[:-1] or (lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > K)):
        raise ValueError(f"{fn}: path_lengths must have shape {tuple(types.shape[:-1])} and lie in [0, {K}]")
    positions = torch.arange(K, device=lengths.device)
    weight = (positions < lengths[..., None]).to(table.dtype) / lengths.clamp(min=1)[..., None].to(table.dtype)

    def graphormer_edge(score, b, h, q_idx, kv_idx, table=sm.TensorParam(), path_types=sm.TensorParam("int"),
                        path_weight=sm.TensorParam()):
        bias = 0.0
        for n in range(K):
            bias = bias + path_weight[b, q_idx, kv_idx, n] * table[h, n, path_types[b, q_idx, kv_idx, n]]
        return score + bias

    return _mod(f"graphormer_edge_k{K}", graphormer_edge, table=table, path_types=types.to(torch.int32),
                path_weight=weight)


def sandwich_table(max_seq_len: int, d_bar: int = 128, dtype: torch.dtype = torch.float32,
                   device: Any = None) -> torch.Tensor:
    """(2 max_seq_len - 1,) Sandwich relative table: entry r + max_seq_len - 1 is
    sum_k cos(r w_k), w_k = 10000^(-2k / d_bar), k < d_bar / 2 (computed in float64)."""
    M, d = _int("sandwich_table", "max_seq_len", max_seq_len), _int("sandwich_table", "d_bar", d_bar, 2)
    w = torch.pow(10000.0, -2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    r = torch.arange(1 - M, M, dtype=torch.float64).abs()
    return torch.cos(r[:, None] * w).sum(-1).to(dtype=dtype, device=device)


def sandwich(num_heads: int, max_seq_len: int, d_bar: int = 128, dtype: torch.dtype = torch.float32,
             device: Any = None) -> ScoreMod:
    """Sandwich (``generate_sandwich_bias``): score + rel[i - j] * H / (8 (h + 1)), with rel the
    sinusoidal position-position inner product (`sandwich_table`) and ALiBi-like head ratios.

    The table is a tensor parameter indexed by i - j + max_seq_len - 1 (max_seq_len is
    structure; Sq and Skv must not exceed it); the head ratio is computed from h.
    """
    H = _int("sandwich", "num_heads", num_heads)
    M = _int("sandwich", "max_seq_len", max_seq_len)

    def sandwich(score, b, h, q_idx, kv_idx, rel=sm.TensorParam()):
        return score + rel[q_idx - kv_idx + (M - 1)] * (H / 8.0) / (h + 1)

    return _mod(f"sandwich_h{H}_m{M}", sandwich, rel=sandwich_table(M, d_bar, dtype, device))


def relative_position_bias(table: torch.Tensor, max_distance: int = 128, bidirectional: bool = True) -> ScoreMod:
    """Learned T5 relative position bias (not in attention-gym): score + table[h, bucket(j - i)].

    table: (H, num_buckets) learnable. Buckets as in T5: with `bidirectional`, half the buckets
    are for keys after the query; within a half, distances below half of it are exact and larger
    ones share log-spaced buckets up to `max_distance` (the last bucket takes the rest). The
    bucket count, max_distance and direction are structure.
    """
    fn = "relative_position_bias"
    table = _table(fn, "table", table, 2)
    md = _int(fn, "max_distance", max_distance)
    if not isinstance(bidirectional, bool):
        raise TypeError(f"{fn}: bidirectional must be a bool, got {bidirectional!r}")
    n = table.shape[1] // 2 if bidirectional else table.shape[1]
    exact = n // 2
    if exact < 1 or md <= exact:
        raise ValueError(f"{fn}: needs at least {4 if bidirectional else 2} buckets and max_distance > {exact}, "
                         f"got {table.shape[1]} buckets and max_distance {md}")
    # the structure is made once per (buckets, max_distance, direction): a model may build this
    # mod from its table in every forward, also under torch.compile(fullgraph=True)
    return template(_relative_position_structure, table.shape[1], md, bidirectional).bind(table=table)


def _relative_position_structure(buckets: int, md: int, bidirectional: bool) -> ScoreMod:
    n = buckets // 2 if bidirectional else buckets
    exact = n // 2
    log_scale = (n - exact) / math.log(md / exact)

    def relative_position_bias(score, b, h, q_idx, kv_idx, table=sm.TensorParam()):
        rel = kv_idx - q_idx
        if bidirectional:
            first, dist = sm.where(rel > 0, n, 0), rel.abs()
        else:
            first, dist = 0, sm.maximum(-rel, 0)
        far = exact + sm.floor(sm.log(sm.maximum(dist, exact) / exact) * log_scale)
        bucket = first + sm.where(dist < exact, dist, sm.minimum(far, n - 1))
        return score + table[h, bucket]

    name = f"relative_position_bias_{buckets}_{md}{'' if bidirectional else '_causal'}"
    return _mod(name, relative_position_bias)
