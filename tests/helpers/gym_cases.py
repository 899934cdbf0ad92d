"""The cases of score_mods.gym's ports at awkward sizes (S = 1, odd lengths, Sq != Skv where the mask
allows it, canvases that are not powers of two): each builds the port and its oracle from
`helpers.gym_oracles`, with fresh learnable tables; shared by tests/score_mods/test_score_mods_gym.py
and its GPU twin."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import pytest
import torch

import fused_attn
import score_mods as sm
from score_mods import gym

from helpers.gym_oracles import (D, F64, ancestors, og_activation, og_alibi, og_batchify, og_block_diffusion,
                                 og_causal, og_dilated_sliding_window, og_document, og_document_causal,
                                 og_flamingo, og_global_sliding_window, og_graphormer_edge,
                                 og_graphormer_spatial, og_jetspec_training, og_jetspec_tree, og_morton_natten,
                                 og_natten_as_published, og_prefix_lm, og_sandwich, og_shared_prefix,
                                 og_sliding_window, og_softcap, og_sta, og_svg_spatial, og_svg_temporal, og_t5,
                                 og_tiled_natten, og_vsa)

flex = pytest.importorskip("torch.nn.attention.flex_attention")


@dataclass
class Case:
    """One port at one size. make(tables) -> (port, oracle mask_mod or None, oracle score_mod or None);
    tables: learnable float64 tables by name (fresh leaves per test), shared by port and oracle."""

    id: str
    make: Callable[[Dict[str, torch.Tensor]], Tuple[sm.ScoreMod, Optional[Callable], Optional[Callable]]]
    sq: int
    skv: int
    b: int = 1
    h: int = 2
    tables: Dict[str, Callable[[torch.Generator], torch.Tensor]] = field(default_factory=dict)
    nontrivial: bool = True  # the port changes the output at this size
    _kind: str = "mask"      # "mask" (compared structurally too) or "mod"


CASES: Dict[str, Case] = {}


def case(id: str, sq: int, skv: Optional[int] = None, kind: str = "mask", **kw):
    def register(make):
        CASES[id] = Case(id, make, sq, sq if skv is None else skv, _kind=kind, **kw)
        return make
    return register


T = torch.tensor


def doc_offsets(lengths):
    return T([0] + torch.tensor(lengths).cumsum(0).tolist())


# ---- 1-D masks
case("causal_5x7", 5, 7)(lambda t: (gym.causal(), og_causal(), None))
case("causal_1", 1, nontrivial=False)(lambda t: (gym.causal(), og_causal(), None))
case("sliding_window_3", 11)(lambda t: (gym.sliding_window(3), og_sliding_window(3), None))
case("sliding_window_0_4x9", 4, 9)(lambda t: (gym.sliding_window(0), og_sliding_window(0), None))
case("sliding_window_2_rebound_5", 9)(lambda t: (gym.sliding_window(2).bind(left=5.0), og_sliding_window(5), None))
case("dilated_w4_d2", 13)(
    lambda t: (gym.dilated_sliding_window(4, 2), og_dilated_sliding_window(4, 2), None))
case("dilated_w5_d3_7x10", 7, 10)(
    lambda t: (gym.dilated_sliding_window(5, 3), og_dilated_sliding_window(5, 3), None))
case("global_sliding_window_1", 11)(
    lambda t: (gym.global_sliding_window(1, [1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]),
               og_global_sliding_window(1, T([1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]).bool()), None))
case("global_sliding_window_s1", 1, nontrivial=False)(
    lambda t: (gym.global_sliding_window(0, [0]), og_global_sliding_window(0, T([False])), None))
case("prefix_lm_4", 9)(lambda t: (gym.prefix_lm(4), og_prefix_lm(4), None))
case("prefix_lm_5_3x8", 3, 8)(lambda t: (gym.prefix_lm(5), og_prefix_lm(5), None))
case("prefix_lm_2_rebound_6", 8)(lambda t: (gym.prefix_lm(2).bind(prefix=6), og_prefix_lm(6), None))


def _causal_pred(b, h, q, kv):
    return kv <= q


def _lookback1(b, h, q, kv):
    return (kv <= q) & (q - kv <= 1)


for _name, _lengths in (("docs_3_1_4_2", [3, 1, 4, 2]), ("docs_1", [1])):
    _off = doc_offsets(_lengths)
    _s = int(_off[-1])
    case(f"document_{_name}", _s, nontrivial=_s > 1)(
        lambda t, o=_off: (gym.document(o), og_document(o), None))
    case(f"document_causal_{_name}", _s, nontrivial=_s > 1)(
        lambda t, o=_off: (gym.document_causal(o), og_document_causal(o), None))
    case(f"document_inner_causal_{_name}", _s, nontrivial=_s > 1)(
        lambda t, o=_off: (gym.document(o, _causal_pred), og_document(o, _causal_pred), None))
case("document_inner_lookback", 10)(
    lambda t: (gym.document(doc_offsets([3, 1, 4, 2]), _lookback1), og_document(doc_offsets([3, 1, 4, 2]), _lookback1), None))
case("shared_prefix_5docs", 12)(
    lambda t: (gym.shared_prefix(doc_offsets([2, 3, 1, 4, 2]), [0, 0, 0, 3, 3]),
               og_shared_prefix(doc_offsets([2, 3, 1, 4, 2]), T([0, 0, 0, 3, 3])), None))
case("shared_prefix_1", 1, nontrivial=False)(
    lambda t: (gym.shared_prefix([0, 1], [0]), og_shared_prefix(T([0, 1]), T([0])), None))

# ---- neighbourhoods: plain NATTEN is checked against attention-gym's own definition on square
# canvases, and against its tiled definition with 1x1 tiles (right for any canvas) elsewhere.
case("natten_5x5_k3x3", 25)(lambda t: (gym.natten(5, 5, 3, 3), og_natten_as_published(5, 5, 3, 3), None))
case("natten_6x4_k3x3", 24)(lambda t: (gym.natten(6, 4, 3, 3), og_tiled_natten(6, 4, 3, 3, 1, 1), None))
case("natten_3x5_k3x5", 15, nontrivial=False)(
    lambda t: (gym.natten(3, 5, 3, 5), og_tiled_natten(3, 5, 3, 5, 1, 1), None))
case("natten_7x3_k5x1", 21)(lambda t: (gym.natten(7, 3, 5, 1), og_tiled_natten(7, 3, 5, 1, 1, 1), None))
case("natten_1x1_k1x1", 1, nontrivial=False)(
    lambda t: (gym.natten(1, 1, 1, 1), og_natten_as_published(1, 1, 1, 1), None))
case("tiled_natten_6x4_k3x3_t3x2", 24)(
    lambda t: (gym.tiled_natten(6, 4, 3, 3, 3, 2), og_tiled_natten(6, 4, 3, 3, 3, 2), None))
case("tiled_natten_4x4_k3x3_t2x2", 16)(
    lambda t: (gym.tiled_natten(4, 4, 3, 3, 2, 2), og_tiled_natten(4, 4, 3, 3, 2, 2), None))
case("morton_natten_4x4_k3x3", 16)(
    lambda t: (gym.morton_natten(4, 4, 3, 3), og_morton_natten(4, 4, 3, 3), None))
case("morton_natten_6x6_k3x3", 52)(  # codes up to morton(5, 5) = 51, with holes
    lambda t: (gym.morton_natten(6, 6, 3, 3), og_morton_natten(6, 6, 3, 3), None))
case("morton_natten_2x4_k1x3", 11)(
    lambda t: (gym.morton_natten(2, 4, 1, 3), og_morton_natten(2, 4, 1, 3), None))
case("sta_2d_c4x6_k4x4_t2x2_text3", 27)(
    lambda t: (gym.sta_2d((4, 6), (4, 4), (2, 2), text_len=3), og_sta((4, 6), (4, 4), (2, 2), 3), None))
case("sta_2d_c6x9_k6x3_t2x3_wide", 54, 56)(
    lambda t: (gym.sta_2d((6, 9), (6, 3), (2, 3)), og_sta((6, 9), (6, 3), (2, 3), 0), None))
case("sta_3d_c2x4x6_k2x4x2_t1x2x2_text2", 50)(
    lambda t: (gym.sta_3d((2, 4, 6), (2, 4, 2), (1, 2, 2), text_len=2), og_sta((2, 4, 6), (2, 4, 2), (1, 2, 2), 2),
               None))
case("sta_3d_c3x2x2_k2x1x2_t1x1x1_text1", 13)(
    lambda t: (gym.sta_3d((3, 2, 2), (2, 1, 2), (1, 1, 1), text_len=1), og_sta((3, 2, 2), (2, 1, 2), (1, 1, 1), 1),
               None))

# ---- video, sparse and structured masks
case("svg_spatial_sink", 32)(
    lambda t: (gym.svg_spatial(2, 6, width=1, attn_sink=True, round_width=4), og_svg_spatial(2, 5, 6, 1, True, 4),
               None))
case("svg_spatial_round3", 32)(
    lambda t: (gym.svg_spatial(2, 6, width=2, round_width=3), og_svg_spatial(2, 5, 6, 2, False, 3), None))
case("svg_temporal_p3_f4_t5", 23)(
    lambda t: (gym.svg_temporal(3, 4, 5, width=2), og_svg_temporal(3, 4, 5, 2), None))
case("svg_temporal_p0_f3_t4", 12)(
    lambda t: (gym.svg_temporal(0, 3, 4, width=2), og_svg_temporal(0, 3, 4, 2), None))


def _topk(gen=None):
    g = torch.Generator().manual_seed(11)
    return torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(2 * 2 * 3)]).view(2, 2, 3, 2)


case("vsa_b2h2_t4", 12, 16, b=2)(
    lambda t: (gym.vsa(gym.vsa_block_map(_topk(), 4), 4), og_vsa(_topk(), 4), None))
case("vsa_b2h2_t4_padded", 12, 16, b=2)(
    lambda t: (gym.vsa(gym.vsa_block_map(_topk(), 4), 4, [4, 3, 4, 2]), og_vsa(_topk(), 4, T([4, 3, 4, 2])), None))
case("vsa_shared_map_t3", 6, 9)(
    lambda t: (gym.vsa(T([[[[1, 0, 1], [0, 1, 0]]]]), 3), og_vsa(T([[[[0, 2], [1, 1]]]]).expand(1, 2, 2, 2), 3), None))
case("block_diffusion_6_b4", 12)(lambda t: (gym.block_diffusion(6, 4), og_block_diffusion(6, 4), None))
case("block_diffusion_5_b2_6x10", 5, 10)(lambda t: (gym.block_diffusion(5, 2), og_block_diffusion(5, 2), None))
case("block_diffusion_1_b1", 2)(lambda t: (gym.block_diffusion(1, 1), og_block_diffusion(1, 1), None))
_PARENTS = [-1, 0, 1, 1, 3, 3, 0]
case("jetspec_tree_p3_n7", 7, 10)(
    lambda t: (gym.jetspec_tree(3, gym.tree_ancestors(_PARENTS)), og_jetspec_tree(3, ancestors(_PARENTS)), None))
case("jetspec_tree_p0_n7", 7)(
    lambda t: (gym.jetspec_tree(0, gym.tree_ancestors(_PARENTS)), og_jetspec_tree(0, ancestors(_PARENTS)), None))
case("jetspec_tree_p2_n1", 1, 3, nontrivial=False)(
    lambda t: (gym.jetspec_tree(2, gym.tree_ancestors([-1])), og_jetspec_tree(2, ancestors([-1])), None))
case("jetspec_training_p3_b4", 8, 11)(
    lambda t: (gym.jetspec_training(3, 4), og_jetspec_training(3, 4), None))
case("jetspec_training_p0_b3", 6)(
    lambda t: (gym.jetspec_training(0, 3), og_jetspec_training(0, 3), None))
_SPANS = [[0, 4], [2, 9], [9, 11]]
case("flamingo_3x2_text12", 12, 6)(  # text token 11 sees no image
    lambda t: (gym.flamingo(_SPANS, 2), og_flamingo(T(_SPANS), 2), None))
case("flamingo_1x1", 1, nontrivial=False)(lambda t: (gym.flamingo([[0, 1]], 1), og_flamingo(T([[0, 1]]), 1), None))
case("batchify_4", 10)(lambda t: (gym.batchify(4), og_batchify(4), None))
case("batchify_3_causal", 8)(
    lambda t: (gym.batchify(3, _causal_pred), og_batchify(3, _causal_pred), None))


# ---- score mods
def _rand_table(*shape):
    return lambda g: torch.randn(*shape, generator=g, dtype=F64)


case("alibi_h3_5x7", 5, 7, kind="mod", h=3)(lambda t: (gym.alibi(3), None, og_alibi(3)))
case("alibi_h1_1", 1, kind="mod", h=1, nontrivial=False)(lambda t: (gym.alibi(1), None, og_alibi(1)))
case("softcap_0.5", 6, 9, kind="mod")(lambda t: (gym.softcap(0.5), None, og_softcap(0.5)))
case("softcap_0.5_causal", 7, kind="mod")(
    lambda t: (sm.compose(gym.softcap(0.5), gym.causal()), og_causal(), og_softcap(0.5)))
for _kind, _offset in (("gelu", 1.0), ("gelu_tanh", 0.5), ("relu", 0.25), ("sigmoid", 1.0), ("silu", 2.0)):
    case(f"activation_{_kind}", 5, 7, kind="mod")(
        lambda t, k=_kind, o=_offset: (gym.activation(k, o), None, og_activation(k, o)))
case("activation_custom", 5, kind="mod")(
    lambda t: (gym.activation(lambda x: sm.exp(-x * x), 0.5), None,
               lambda s, b, h, q, kv: torch.log(torch.exp(-s * s) + 0.5)))


def _graph(b, n, seed):
    """Random undirected graphs (B, N, N) and their BFS hop distances (unreachable: n)."""
    g = torch.Generator().manual_seed(seed)
    adj = torch.rand(b, n, n, generator=g) < 0.35
    adj = (adj | adj.transpose(-1, -2)) & ~torch.eye(n, dtype=torch.bool)
    dist = torch.full((b, n, n), n, dtype=torch.int64)
    for bi in range(b):
        for src in range(n):
            dist[bi, src, src], frontier, d = 0, [src], 0
            while frontier:
                d += 1
                nxt = [v for u in frontier for v in adj[bi, u].nonzero().flatten().tolist() if dist[bi, src, v] == n]
                for v in nxt:
                    dist[bi, src, v] = d
                frontier = list(dict.fromkeys(nxt))
    return adj, dist


def _spatial_inputs():
    _, dist = _graph(2, 7, seed=5)
    return dist.clamp(max=4)  # buckets 0..3 exact, 4 = far or unreachable


def _edge_inputs():
    """Random path edge types (B, N, N, K) and path lengths (B, N, N) in [0, K]."""
    g = torch.Generator().manual_seed(8)
    _, dist = _graph(2, 6, seed=9)
    lengths = torch.where(dist >= 6, 0, dist).clamp(max=3)
    types = torch.randint(0, 4, (2, 6, 6, 3), generator=g)
    return types, lengths


case("graphormer_spatial_b2_n7_h3", 7, kind="mod", b=2, h=3, tables={"table": _rand_table(3, 5)})(
    lambda t: (gym.graphormer_spatial(_spatial_inputs(), t["table"]), None,
               og_graphormer_spatial(t["table"], _spatial_inputs())))
case("graphormer_edge_b2_n6_k3", 6, kind="mod", b=2, h=2, tables={"table": _rand_table(2, 3, 4)})(
    lambda t: (gym.graphormer_edge(*_edge_inputs(), t["table"]), None, og_graphormer_edge(t["table"], *_edge_inputs())))
case("sandwich_h3_m9_5x9", 5, 9, kind="mod", h=3)(
    lambda t: (gym.sandwich(3, 9, d_bar=16, dtype=F64), None, og_sandwich(3, 9, 16)))
case("sandwich_h2_m12_11x11", 11, kind="mod")(
    lambda t: (gym.sandwich(2, 12, d_bar=8, dtype=F64), None, og_sandwich(2, 12, 8)))
case("t5_bidirectional_8_20", 13, 29, kind="mod", tables={"table": _rand_table(2, 8)})(
    lambda t: (gym.relative_position_bias(t["table"], 20), None, og_t5(t["table"], 8, 20, True)))
case("t5_causal_6_10", 17, kind="mod", tables={"table": _rand_table(2, 6)})(
    lambda t: (sm.compose(gym.relative_position_bias(t["table"], 10, bidirectional=False), gym.causal()),
               og_causal(), og_t5(t["table"], 6, 10, False)))

MASK_CASES = [c for c in CASES.values() if c._kind == "mask"]
TABLE_CASES = [c for c in CASES.values() if c.tables]


def params(cases, quick=None):
    """One pytest.param per case; with `quick` (ids), the other cases are marked slow."""
    return [pytest.param(c, id=c.id, marks=() if quick is None or c.id in quick else pytest.mark.slow) for c in cases]


# gradients in the quick set (~0.2 s each): a 1-D mask, documents, a 2-D neighbourhood, a per-batch
# map, score mods with and without a learned table, a mod under a mask
QUICK_GRADIENTS = {"causal_5x7", "document_inner_causal_docs_3_1_4_2", "natten_6x4_k3x3", "vsa_b2h2_t4_padded",
                   "softcap_0.5_causal", "graphormer_spatial_b2_n7_h3", "t5_causal_6_10"}


# =============================================================================== helpers


def qkv(c: Case, seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    shapes = ((c.b, c.h, c.sq, D), (c.b, c.h, c.skv, D), (c.b, c.h, c.skv, D))
    return [torch.randn(*s, generator=g, dtype=F64).requires_grad_(requires_grad) for s in shapes]


def fresh_tables(c: Case, requires_grad: bool = False) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return {n: f(g).requires_grad_(requires_grad) for n, f in c.tables.items()}


def port_mask(mod: sm.ScoreMod, b: int, h: int, sq: int, skv: int) -> torch.Tensor:
    """The port's dense (B, H, Sq, Skv) mask by eager evaluation: True where the score survives."""
    idx = (torch.arange(b).view(-1, 1, 1, 1), torch.arange(h).view(1, -1, 1, 1),
           torch.arange(sq).view(1, 1, -1, 1), torch.arange(skv).view(1, 1, 1, -1))
    zeros = torch.zeros(b, h, sq, skv, dtype=F64)
    out = mod.eager(zeros, *idx, torch.full((b, 1, 1, 1), sq), torch.full((b, 1, 1, 1), skv))
    return torch.isfinite(out).expand(b, h, sq, skv)


def oracle_mask(fn, b, h, sq, skv) -> torch.Tensor:
    return flex.create_mask(fn, b, h, sq, skv, device="cpu")


def ours(q, k, v, port):
    return fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=port, backend="reference")
