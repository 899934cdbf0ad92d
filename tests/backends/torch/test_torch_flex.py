"""The torch engine's score_mod path (flex_attention compiled on CPU, inference) against float64:
the shapes torch 2.13's CPU kernel computes wrong unpadded (head dims 8 and 16 with Skv % 16 == 8,
`torch_flex.padded_head_dim`), the library mods and one of each attention-gym port
(`score_mods.gym`) with causal / window / padding masks, float32 and bfloat16; compiled functions
reused across values; what the path refuses. Compiling flex on CPU takes 5-30 s per mod structure
and shape, so every test that compiles is `slow`."""

from __future__ import annotations

import math

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn.backends import torch_flex
from fused_attn.layouts import from_logical
from fused_attn.testing import assert_close, bound_from, max_error
from score_mods import gym

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # flex_attention's eager-mode notice (create_block_mask)

F64 = torch.float64


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _inputs(seed, b, h, hkv, sq, skv, d, dtype, fmt="bshd"):
    gen = torch.Generator().manual_seed(seed)
    logical = [torch.randn(b, n, s, d, generator=gen, dtype=F64).to(dtype) for n, s in ((h, sq), (hkv, skv), (hkv, skv))]
    return [from_logical(t, fmt).contiguous() for t in logical]


def check_flex(mod, q, k, v, what, **kw):
    """The auto engine runs the call on torch flex; its output is within the project's bound of the
    float64 reference (the bound: the same-dtype reference's own error). Returns the max error."""
    why = fused_attn.explain(q, k, v, score_mod=mod, **kw)
    assert why.backend == "torch", f"{what}: {why.reason}"
    out = fused_attn.dot_product_attention(q, k, v, score_mod=mod, **kw)
    exact = fused_attn.dot_product_attention(q.double(), k.double(), v.double(), score_mod=mod, backend="reference",
                                             **kw)
    same = fused_attn.dot_product_attention(q, k, v, score_mod=mod, backend="reference", **kw)
    assert_close(out, exact, bound_from(same, exact, q.dtype), what)
    return max_error(out, exact)


# ----------------------------------------------------------------------------- torch's head-dim fault


def test_padded_head_dim():
    assert [torch_flex.padded_head_dim(d) for d in (4, 8, 12, 16, 17, 24, 32, 64)] == [4, 24, 12, 24, 17, 24, 32, 64]


@pytest.mark.slow
@pytest.mark.parametrize("d,sq,skv,mask", [(16, 8, 8, "causal"), (16, 13, 24, "no_mask"), (8, 9, 40, "no_mask"),
                                           (16, 5, 136, "causal_bottom_right")])
def test_head_dims_torch_computes_wrong_unpadded(d, sq, skv, mask):
    """The call that showed the path wrong (softcap(3), causal, B2 S8 H4 D16 float32: off by 3.1)
    and other head dims 8 / 16 with Skv % 16 == 8, where torch's kernel stores past its score tile."""
    q, k, v = _inputs(d + skv, 2, 4, 4 if d == 16 else 2, sq, skv, d, torch.float32)
    check_flex(sm.softcap(3.0), q, k, v, f"D{d} Sq{sq} Skv{skv} {mask}", attn_mask_type=mask)


@pytest.mark.slow
def test_plain_flex_with_zero_padded_head_dim_is_exact():
    """The workaround on plain torch: compiled flex_attention with q and k zero-padded from head
    dim 16 to 24 (explicit scale) equals float64 math at Skv % 16 == 8, the shape it gets wrong."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = _inputs(3, 1, 2, 2, 8, 24, 16, torch.float32, "bhsd")
    pad = lambda t: torch.nn.functional.pad(t, (0, 8))
    softcap = lambda s, b, h, i, j: 3.0 * torch.tanh(s / 3.0)
    out = torch.compile(flex_attention, dynamic=False, fullgraph=True)(pad(q), pad(k), v, score_mod=softcap, scale=0.25)
    s = 3.0 * torch.tanh(q.double() @ k.double().transpose(-1, -2) * 0.25 / 3.0)
    exact = s.softmax(-1) @ v.double()
    naive = (3.0 * torch.tanh(q @ k.transpose(-1, -2) * 0.25 / 3.0)).softmax(-1) @ v
    assert_close(out, exact, bound_from(naive, exact, torch.float32), "flex(q, k padded to 24)")


# ----------------------------------------------------------------------------- the library mods


_DOCS = torch.tensor([0] * 9 + [1] * 4 + [2] * 11)
LIBRARY = {  # name -> (mod, call keywords, Sq, Skv); H 4 / Hkv 2, D 32
    "softcap": (sm.softcap(3.0), {}, 11, 24),
    "softcap causal": (sm.softcap(3.0), dict(attn_mask_type="causal"), 11, 24),
    "alibi window": (sm.alibi(sm.alibi_slopes(4)), dict(window_size=(4, 1)), 11, 24),
    "bias causal_bottom_right": (sm.post_scale_bias(torch.randn(1, 4, 11, 24, generator=torch.Generator().manual_seed(1))),
                                 dict(attn_mask_type="causal_bottom_right"), 11, 24),
    "causal mod": (sm.causal(), {}, 11, 24),
    "causal_bottom_right mod": (sm.causal_bottom_right(), {}, 11, 24),
    "sliding_window mod": (sm.sliding_window(3, 0, bottom_right=True), {}, 11, 24),
    "document_mask": (sm.document_mask(_DOCS), {}, 24, 24),
    "document_mask contiguous causal": (sm.document_mask(_DOCS, contiguous=True), dict(attn_mask_type="causal"), 24, 24),
    "compose": (sm.compose(sm.softcap(5.0), sm.alibi(sm.alibi_slopes(4)), sm.causal_bottom_right()), {}, 11, 24),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LIBRARY))
def test_library_mods_float32(name):
    mod, kw, sq, skv = LIBRARY[name]
    check_flex(mod, *_inputs(5, 2, 4, 2, sq, skv, 32, torch.float32), name, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("name,fmt", [("softcap causal", "sbhd"), ("alibi window", "bhsd"), ("compose", "bshd")])
def test_library_mods_bfloat16(name, fmt):
    mod, kw, sq, skv = LIBRARY[name]
    check_flex(mod, *_inputs(6, 2, 4, 2, sq, skv, 32, torch.bfloat16, fmt), name, qkv_format=fmt, **kw)


def _garbage_padded(lq, lkv, sq, skv, dtype, seed):
    """bshd q, k, v with NaN past each sequence's length (uninitialised memory reaches nothing)."""
    q, k, v = _inputs(seed, len(lq), 4, 2, sq, skv, 16, dtype)
    for t, lens in ((q, lq), (k, lkv), (v, lkv)):
        for i, n in enumerate(lens):
            t[i, n:] = math.nan
    return q, k, v


@pytest.mark.slow
@pytest.mark.parametrize("mask,window,dtype,mod", [
    ("padding", None, torch.float32, sm.softcap(3.0)),
    ("padding_causal", None, torch.float32, sm.alibi(sm.alibi_slopes(4))),
    ("padding", (2, 1), torch.float32, sm.causal_bottom_right()),  # the mods read each sequence's lengths
    ("padding", None, torch.float32, sm.padding_mask()),
    ("padding_causal", None, torch.bfloat16, sm.softcap(3.0)),
])
def test_padding_lengths(mask, window, dtype, mod):
    """Dense padding: the mod sees each sequence's lengths, rows past them give 0, NaN in padded
    positions reaches nothing; an empty sequence and a sequence longer than its keys included."""
    lq, lkv = [8, 3, 0, 5], [10, 6, 4, 2]
    q, k, v = _garbage_padded(lq, lkv, 8, 10, dtype, seed=7)
    kw = dict(attn_mask_type=mask, window_size=window, cu_seqlens_q=_cu(lq), cu_seqlens_kv=_cu(lkv))
    check_flex(mod, q, k, v, f"{mod.name} {mask} {window}", **kw)
    out = fused_attn.dot_product_attention(q, k, v, score_mod=mod, **kw)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.equal(out[1, 3:], torch.zeros_like(out[1, 3:]))


@pytest.mark.slow
def test_new_values_reuse_the_compiled_function():
    """A new float value or a new tensor of the same shape runs the compiled function again (no new
    entry); graph_cache.clear() drops every entry."""
    slopes = sm.alibi_slopes(4)
    q, k, v = _inputs(8, 2, 4, 2, 19, 19, 32, torch.float32)
    check_flex(sm.alibi(slopes), q, k, v, "alibi")
    check_flex(sm.softcap(2.0), q, k, v, "softcap 2")
    made = torch_flex.FLEX_CACHE.info().misses
    check_flex(sm.alibi(slopes * 3), q, k, v, "alibi x3")
    check_flex(sm.softcap(7.5), q, k, v, "softcap 7.5")
    assert torch_flex.FLEX_CACHE.info().misses == made
    fused_attn.graph_cache.clear()
    assert len(torch_flex.FLEX_CACHE) == 0


# ----------------------------------------------------------------------------- attention-gym's ports


def _gym_cases():
    """name -> (mod, B, Sq, Skv); H 2 (GQA 2/1 in the test), sizes the ports' tables fit."""
    g = torch.Generator().manual_seed(0)
    offsets = [0, 3, 4, 8, 10]
    parents = [-1, 0, 1, 1, 3, 3, 0]
    topk = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(2 * 2 * 3)]).view(2, 2, 3, 2)
    dist = torch.randint(0, 5, (2, 7, 7), generator=g)
    types, lengths = torch.randint(0, 4, (2, 6, 6, 3), generator=g), torch.randint(0, 4, (2, 6, 6), generator=g)
    return {
        "causal": (gym.causal(), 1, 5, 7),
        "sliding_window": (gym.sliding_window(3), 1, 11, 11),
        "dilated_sliding_window": (gym.dilated_sliding_window(5, 3), 1, 7, 10),
        "global_sliding_window": (gym.global_sliding_window(1, [1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]), 1, 11, 11),
        "prefix_lm": (gym.prefix_lm(5), 1, 3, 8),
        "document": (gym.document(offsets), 1, 10, 10),
        "document_causal": (gym.document_causal(offsets), 1, 10, 10),
        "shared_prefix": (gym.shared_prefix([0, 2, 5, 6, 10, 12], [0, 0, 0, 3, 3]), 1, 12, 12),
        "natten": (gym.natten(6, 4, 3, 3), 1, 24, 24),
        "tiled_natten": (gym.tiled_natten(6, 4, 3, 3, 3, 2), 1, 24, 24),
        "morton_natten": (gym.morton_natten(6, 6, 3, 3), 1, 52, 52),
        "sta_2d": (gym.sta_2d((4, 6), (4, 4), (2, 2), text_len=3), 1, 27, 27),
        "sta_3d": (gym.sta_3d((2, 4, 6), (2, 4, 2), (1, 2, 2), text_len=2), 1, 50, 50),
        "svg_spatial": (gym.svg_spatial(2, 6, width=1, attn_sink=True, round_width=4), 1, 32, 32),
        "svg_temporal": (gym.svg_temporal(3, 4, 5, width=2), 1, 23, 23),
        "vsa": (gym.vsa(gym.vsa_block_map(topk, 4), 4, [4, 3, 4, 2]), 2, 12, 16),
        "block_diffusion": (gym.block_diffusion(6, 4), 1, 12, 12),
        "jetspec_tree": (gym.jetspec_tree(3, gym.tree_ancestors(parents)), 1, 7, 10),
        "jetspec_training": (gym.jetspec_training(3, 4), 1, 8, 11),
        "flamingo": (gym.flamingo([[0, 4], [2, 9], [9, 11]], 2), 1, 12, 6),
        "batchify": (gym.batchify(3, lambda b, h, q, kv: kv <= q), 1, 8, 8),
        "alibi": (gym.alibi(2), 1, 5, 7),
        "softcap": (gym.softcap(0.5), 1, 6, 9),
        "activation": (gym.activation("gelu_tanh", 0.5), 1, 5, 7),
        "graphormer_spatial": (gym.graphormer_spatial(dist, torch.randn(2, 5, generator=g)), 2, 7, 7),
        "graphormer_edge": (gym.graphormer_edge(types, lengths, torch.randn(2, 3, 4, generator=g)), 2, 6, 6),
        "sandwich": (gym.sandwich(2, 9, d_bar=16), 1, 5, 9),
        "relative_position_bias": (gym.relative_position_bias(torch.randn(2, 8, generator=g), 20), 1, 13, 29),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_gym_cases()))
def test_gym_ports_float32(name):
    """Each attention-gym port once (head dim 8: also the padded head-dim path), GQA 2/1."""
    mod, b, sq, skv = _gym_cases()[name]
    check_flex(mod, *_inputs(9, b, 2, 1, sq, skv, 8, torch.float32), name)


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", [("natten", dict(attn_mask_type="causal")), ("sta_3d", {}),
                                     ("graphormer_edge", dict(window_size=(2, 2))),
                                     ("relative_position_bias", dict(attn_mask_type="causal_bottom_right"))])
def test_gym_ports_bfloat16(name, kw):
    mod, b, sq, skv = _gym_cases()[name]
    check_flex(mod, *_inputs(10, b, 2, 2, sq, skv, 64, torch.bfloat16), name, **kw)


# ----------------------------------------------------------------------------- refusals (no compile)


def _small(dtype=torch.float32, grad=False):
    return [t.requires_grad_(grad) for t in _inputs(11, 1, 2, 2, 5, 5, 16, dtype)]


def test_refuses_a_cpu_torch_does_not_compile_flex_for(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    got = fused_attn.explain(*_small(), score_mod=sm.softcap(3.0))
    assert got.backend == "reference" and "AVX2 or AVX-512" in got.reason and "'DEFAULT'" in got.reason


def test_gradients_stay_on_the_reference_and_say_so():
    got = fused_attn.explain(*_small(grad=True), score_mod=sm.softcap(3.0))
    assert got.backend == "reference" and "no CPU backward" in got.reason and "reference computes" in got.reason
