"""score_mods.gym: the attention-gym masks and score mods, ported to the score_mod language.

Every port is checked against an oracle written in plain torch from attention-gym's
definition (a flex_attention mask_mod / score_mod; nothing of attention-gym is imported;
`helpers.gym_oracles`), at awkward sizes (`helpers.gym_cases`): S = 1, odd lengths, Sq != Skv
where the mask allows it, canvases that are not powers of two.

* forward: `dot_product_attention(backend="reference")` and `flex_attention(port.to_flex(...))`
  both equal `flex_attention(oracle score_mod, block_mask=create_block_mask(oracle mask_mod))`,
  float64, within `fused_attn.testing.tolerance`;
* masks: the port's dense mask equals the oracle's exactly, and every mask picture in a gym
  docstring is the mask of the call it names;
* gradients of query, key, value and of every learnable table equal float64 autograd through
  the oracle (`fused_attn.testing.reference_attention`);
* a learned T5-style relative position bias trains, with the oracle's table gradient.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import fused_attn
import score_mods as sm
from fused_attn.testing import agreement_bound, assert_close, reference_attention, tolerance
from helpers.gym_cases import (CASES, MASK_CASES, QUICK_GRADIENTS, Case, doc_offsets, fresh_tables, oracle_mask,
                               ours, params, port_mask, qkv)
from helpers.gym_oracles import (ACTIVATIONS, D, F64, morton_code, og_document, og_natten_as_published,
                                 og_prefix_lm, og_sliding_window, og_t5, og_tiled_natten, t5_bucket)
from score_mods import gym

flex = pytest.importorskip("torch.nn.attention.flex_attention")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # flex_attention's eager-mode notice

# =============================================================================== tests


@pytest.mark.slow  # flex_attention on CPU: 2-24 s a case
@pytest.mark.parametrize("c", params(CASES.values()))
def test_forward_matches_flex_oracle(c: Case):
    """reference backend == flex(port.to_flex) == flex(oracle score_mod, oracle block mask), float64;
    for masks also flex(block_mask from port.to_flex_mask)."""
    torch._dynamo.reset()  # flex traces every mod with dynamo: keep cases independent (see the xfail below)
    if c.id.startswith("graphormer_edge") and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 11):
        pytest.skip("torch 2.10's flex_attention cannot trace the oracle's data-dependent table index "
                    "(the hand-written oracle, not the port)")
    q, k, v = qkv(c)
    tables = fresh_tables(c)
    port, mask_fn, score_fn = c.make(tables)
    block_mask = flex.create_block_mask(mask_fn, c.b, c.h, c.sq, c.skv, device="cpu") if mask_fn else None
    expected = flex.flex_attention(q, k, v, score_mod=score_fn, block_mask=block_mask)
    dense = oracle_mask(mask_fn, c.b, c.h, c.sq, c.skv) if mask_fn else None
    bound = tolerance(q, k, v, 1 / math.sqrt(D), F64, mask=dense, score_fn=score_fn)
    assert_close(ours(q, k, v, port), expected, bound, "reference backend vs flex oracle")
    via_flex = flex.flex_attention(q, k, v, score_mod=port.to_flex(q_len=c.sq, kv_len=c.skv))
    assert_close(via_flex, expected, bound, "flex(port.to_flex()) vs flex oracle")
    if port.mask_condition() is not None:
        port_blocks = flex.create_block_mask(port.to_flex_mask(q_len=c.sq, kv_len=c.skv), c.b, c.h, c.sq, c.skv,
                                             device="cpu")
        assert_close(flex.flex_attention(q, k, v, block_mask=port_blocks), expected, bound,
                     "flex(block_mask=port.to_flex_mask()) vs flex oracle")
    if c.nontrivial:
        plain = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", backend="reference")
        assert (plain - expected).abs().max() > 1e-3, "the case does not exercise the port at this size"


@pytest.mark.parametrize("c", params(MASK_CASES))
def test_mask_equals_oracle(c: Case):
    """The port's dense mask is the oracle's, position for position, and it is a pure mask."""
    port, mask_fn, _ = c.make(fresh_tables(c))
    assert port.mask_condition() is not None, "a mask port must be a pure mask"
    got = port_mask(port, c.b, c.h, c.sq, c.skv)
    want = oracle_mask(mask_fn, c.b, c.h, c.sq, c.skv)
    if not torch.equal(got, want):
        diff = (got != want).nonzero().tolist()[:5]
        raise AssertionError(f"{c.id}: masks differ at (b, h, q, kv) {diff}")


@pytest.mark.parametrize("c", params(CASES.values(), quick=QUICK_GRADIENTS))
def test_gradients_match_float64_autograd(c: Case):
    """dq, dk, dv and every learnable table's gradient == float64 autograd through the oracle."""
    q, k, v = qkv(c, requires_grad=True)
    tables = fresh_tables(c, requires_grad=True)
    port, mask_fn, score_fn = c.make(tables)
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(c.b, c.h, c.sq, D, generator=g, dtype=F64)
    leaves = [q, k, v, *tables.values()]
    got = torch.autograd.grad(ours(q, k, v, port), leaves, dout, allow_unused=True)

    leaves2 = [t.detach().clone().requires_grad_(True) for t in leaves]
    tables2 = dict(zip(tables, leaves2[3:]))
    _, mask_fn2, score_fn2 = c.make(tables2)
    dense = oracle_mask(mask_fn2, c.b, c.h, c.sq, c.skv) if mask_fn2 else None
    out, _ = reference_attention(*leaves2[:3], 1 / math.sqrt(D), mask=dense, score_fn=score_fn2)
    want = torch.autograd.grad(out, leaves2, dout, allow_unused=True)
    for name, a, e in zip(["dq", "dk", "dv", *(f"d{n}" for n in tables)], got, want):
        assert a is not None and e is not None, f"{name}: no gradient"
        assert_close(a, e, agreement_bound(e), name)


@pytest.mark.slow  # flex_attention on CPU: 2-24 s a case
def test_to_flex_with_a_constant_index_after_a_shape_change():
    torch._dynamo.reset()
    first = CASES["alibi_h1_1"]
    flex.flex_attention(*qkv(first), score_mod=first.make({})[0].to_flex())
    c = CASES["graphormer_edge_b2_n6_k3"]
    flex.flex_attention(*qkv(c), score_mod=c.make(fresh_tables(c))[0].to_flex())


# ------------------------------------------------------------------------------- docstring pictures

PICTURE = re.compile(r"Mask of ``(.+?)`` \(Sq = (\d+), Skv = (\d+)\):\n\n((?:[ ]+[x.](?: [x.])*\n)+)")
MASK_FACTORIES = {
    "causal", "sliding_window", "dilated_sliding_window", "global_sliding_window", "prefix_lm", "document",
    "document_causal", "shared_prefix", "natten", "tiled_natten", "morton_natten", "sta_2d", "sta_3d", "svg_spatial",
    "svg_temporal", "vsa", "block_diffusion", "jetspec_tree", "jetspec_training", "flamingo", "batchify",
}
GYM = {"torch": torch, **{n: getattr(gym, n) for n in gym.__all__}}


def _pictures():
    out = []
    for name in gym.__all__:
        for m in PICTURE.finditer(getattr(gym, name).__doc__ or ""):
            rows = [" ".join(ln.split()) for ln in m.group(4).strip("\n").split("\n")]
            out.append(pytest.param(m.group(1), int(m.group(2)), int(m.group(3)), rows, id=m.group(1)[:40]))
    return out


def test_every_mask_factory_draws_its_mask():
    drawn = {p.values[0].split("(")[0] for p in _pictures()}
    assert drawn == MASK_FACTORIES, f"mask factories without a picture: {MASK_FACTORIES - drawn}"


@pytest.mark.parametrize("call, sq, skv, rows", _pictures())
def test_docstring_picture_is_the_mask(call, sq, skv, rows):
    """Each docstring picture is what `describe` draws for the call it names (and the eager mask)."""
    mod = eval(call, GYM)  # noqa: S307 - our own docstrings
    head, *drawn = mod.describe(sq, skv).split("\n")
    assert head.startswith(f"{mod.name} ({sq}x{skv}") and drawn == rows, f"the picture of {call} is not its mask"
    as_bool = torch.tensor([[c == "x" for c in r.split()] for r in rows])
    assert torch.equal(port_mask(mod, 1, 1, sq, skv)[0, 0], as_bool)


# ------------------------------------------------------------------------------- names, structure, validation

NAMES = [
    ("sliding_window(3)", "sliding_window_3"),
    ("sliding_window(3).bind(left=5)", "sliding_window_5"),
    ("dilated_sliding_window(4, 2)", "dilated_sliding_window_4_d2"),
    ("dilated_sliding_window(4, 2).bind(window=6)", "dilated_sliding_window_6_d2"),
    ("global_sliding_window(2, [1, 0])", "global_sliding_window_2"),
    ("prefix_lm(128)", "prefix_lm_128"),
    ("prefix_lm(128).bind(prefix=64)", "prefix_lm_64"),
    ("document([0, 2, 3])", "document"),
    ("natten(16, 16, 7, 7)", "natten_16x16_k7x7"),
    ("tiled_natten(16, 8, 7, 3, 4, 4)", "tiled_natten_16x8_k7x3_t4x4"),
    ("morton_natten(16, 16, 7, 7)", "morton_natten_16x16_k7x7"),
    ("sta_2d((24, 24), (12, 12), (4, 4))", "sta_2d_c24x24_k12x12_t4x4"),
    ("sta_3d((24, 24, 24), (12, 12, 12), (4, 4, 4), text_len=8)", "sta_3d_c24x24x24_k12x12x12_t4x4x4_text8"),
    ("svg_spatial(226, 1350, width=2)", "svg_spatial_p226_s226_b2688"),
    ("svg_temporal(226, 13, 1350, width=2)", "svg_temporal_p226_t1350_b207"),
    ("vsa(torch.ones(1, 1, 2, 2, dtype=torch.bool), 64)", "vsa_t64"),
    ("block_diffusion(12, 4)", "block_diffusion_12_b4"),
    ("jetspec_tree(5, tree_ancestors([-1, 0, 0]))", "jetspec_tree_p5_n3"),
    ("jetspec_training(5, 4)", "jetspec_training_p5_b4"),
    ("flamingo([[0, 7], [7, 12]], 3)", "flamingo_2x3"),
    ("batchify(4)", "batchify_4"),
    ("alibi(16)", "alibi_h16"),
    ("softcap(30)", "softcap_30"),
    ("activation('gelu')", "activation_gelu"),
    ("sandwich(8, 64)", "sandwich_h8_m64"),
    ("relative_position_bias(torch.zeros(8, 32), 128)", "relative_position_bias_32_128"),
]


@pytest.mark.parametrize("call, name", NAMES, ids=[n for _, n in NAMES])
def test_names_carry_values(call, name):
    assert eval(call, GYM).name == name  # noqa: S307


def _key(call):
    return eval(call, GYM).cache_key  # noqa: S307


RUNTIME = [  # (a, b): one graph, only runtime scalars differ
    ("sliding_window(3)", "sliding_window(5)"),
    ("prefix_lm(2)", "prefix_lm(7)"),
    ("dilated_sliding_window(4, 2)", "dilated_sliding_window(9, 2)"),
    ("global_sliding_window(1, [0, 1, 0])", "global_sliding_window(2, [1, 0, 0])"),
    ("svg_spatial(2, 6, width=1)", "svg_spatial(5, 7, width=3, attn_sink=True)"),
    ("svg_temporal(3, 4, 5, width=2)", "svg_temporal(3, 2, 5, width=2)"),
    ("sta_2d((4, 4), (2, 2), (2, 2), text_len=1)", "sta_2d((4, 4), (2, 2), (2, 2), text_len=7)"),
    ("softcap(30)", "softcap(50)"),
    ("activation('relu', 1.0)", "activation('relu', 3.0)"),
]
STRUCTURE = [  # (a, b): different graphs
    ("dilated_sliding_window(4, 2)", "dilated_sliding_window(4, 3)"),
    ("natten(5, 5, 3, 3)", "natten(7, 5, 3, 3)"),
    ("natten(5, 5, 3, 3)", "natten(5, 5, 5, 3)"),
    ("svg_temporal(3, 4, 5, width=2)", "svg_temporal(4, 4, 5, width=2)"),
    ("block_diffusion(6, 2)", "block_diffusion(6, 3)"),
    ("alibi(8)", "alibi(16)"),
    ("activation('relu')", "activation('sigmoid')"),
]


@pytest.mark.parametrize("a, b", RUNTIME, ids=[a for a, _ in RUNTIME])
def test_runtime_sizes_share_a_graph(a, b):
    assert _key(a) == _key(b)


@pytest.mark.parametrize("a, b", STRUCTURE, ids=[f"{a} vs {b}" for a, b in STRUCTURE])
def test_structural_sizes_change_the_graph(a, b):
    assert _key(a) != _key(b)


BAD = [
    (lambda: gym.sliding_window(-1), ValueError, "window must be >= 0"),
    (lambda: gym.sliding_window(2.5), TypeError, "window must be an int"),
    (lambda: gym.dilated_sliding_window(3, 0), ValueError, "dilation must be >= 1"),
    (lambda: gym.global_sliding_window(1, torch.zeros(2, 3, dtype=torch.bool)), ValueError,
     "is_global must have 1 dim"),
    (lambda: gym.global_sliding_window(1, torch.rand(4)), TypeError, "is_global must hold integers"),
    (lambda: gym.document([1, 3]), ValueError, "offsets must start at 0"),
    (lambda: gym.document([0, 3, 2]), ValueError, "not decrease"),
    (lambda: gym.document([0, 3], inner="causal"), TypeError, "inner must be a function"),
    (lambda: gym.shared_prefix([0, 2, 4], [1, 0]), ValueError, "prefix_document_id"),
    (lambda: gym.shared_prefix([0, 2, 4], [0]), ValueError, "prefix_document_id"),
    (lambda: gym.natten(5, 5, 4, 3), ValueError, "kernel_w must be odd"),
    (lambda: gym.natten(5, 3, 3, 5), ValueError, "kernel_h must be odd and at most canvas_h"),
    (lambda: gym.natten(0, 3, 1, 1), ValueError, "canvas_w must be >= 1"),
    (lambda: gym.tiled_natten(6, 4, 3, 3, 4, 2), ValueError, "whole number of 4x2 tiles"),
    (lambda: gym.morton_natten(4, 4, 5, 3), ValueError, "kernel_w must be odd and at most canvas_w"),
    (lambda: gym.sta_2d((4, 6), (4, 3), (2, 2)), ValueError, "whole numbers of tiles"),
    (lambda: gym.sta_2d((4, 6), (6, 2), (2, 2)), ValueError, "must fit in the canvas"),
    (lambda: gym.sta_3d((4, 6), (4, 2), (2, 2)), TypeError, "canvas_thw must be a tuple of 3 ints"),
    (lambda: gym.svg_spatial(2, 0), ValueError, "token_per_frame must be >= 1"),
    (lambda: gym.vsa(torch.ones(1, 1, 2, 3, dtype=torch.int32), 4, [4, 4]), ValueError, "one size per key tile"),
    (lambda: gym.vsa(torch.ones(2, 3, dtype=torch.int32), 4), ValueError, "block_map must have 4 dim"),
    (lambda: gym.vsa_block_map(torch.tensor([[[[0, 5]]]]), 4), ValueError, r"must lie in \[0, 4\)"),
    (lambda: gym.block_diffusion(4, 0), ValueError, "block_size must be >= 1"),
    (lambda: gym.tree_ancestors([-1, 0, 2]), ValueError, "node 2's parent"),
    (lambda: gym.jetspec_tree(1, torch.ones(2, 3, dtype=torch.int32)), ValueError, "square"),
    (lambda: gym.flamingo([[0, 1, 2]], 2), ValueError, r"shape \(num_images, 2\)"),
    (lambda: gym.batchify(2, inner=3), TypeError, "inner must be a function"),
    (lambda: gym.softcap(0.0), ValueError, "cap must be a finite float > 0"),
    (lambda: gym.activation("tanh"), ValueError, "kind must be one of"),
    (lambda: gym.activation("gelu", 0.1), ValueError, "offset must exceed 0.16997"),
    (lambda: gym.graphormer_spatial(torch.zeros(1, 3, 3, dtype=torch.int64), torch.zeros(5)), TypeError,
     "table must be a floating torch.Tensor with 2 dims"),
    (lambda: gym.graphormer_spatial(torch.full((1, 3, 3), 5), torch.zeros(2, 5, dtype=F64)), ValueError,
     r"distances must lie in \[0, 5\)"),
    (lambda: gym.graphormer_edge(torch.zeros(1, 3, 3, 2, dtype=torch.int64), torch.zeros(1, 3, 3, dtype=torch.int64),
                                 torch.zeros(2, 3, 4, dtype=F64)), ValueError, "one row per path position"),
    (lambda: gym.relative_position_bias(torch.zeros(2, 2, dtype=F64)), ValueError, "needs at least 4 buckets"),
    (lambda: gym.relative_position_bias(torch.zeros(2, 8, dtype=F64), bidirectional=1), TypeError, "must be a bool"),
    (lambda: gym.graphormer_edge(torch.full((1, 3, 3, 2), 4), torch.zeros(1, 3, 3, dtype=torch.int64),
                                 torch.zeros(2, 2, 4, dtype=F64)), ValueError, r"path_edge_types must lie in \[0, 4\)"),
    (lambda: gym.graphormer_edge(torch.zeros(1, 3, 3, 2, dtype=torch.int64), torch.full((1, 3, 3), 3),
                                 torch.zeros(2, 2, 4, dtype=F64)), ValueError, r"path_lengths must .* lie in \[0, 2\]"),
    (lambda: gym.prefix_lm(3).bind(prefix=-1), ValueError, "prefix must be >= 0"),
    (lambda: gym.global_sliding_window(1, [0, 1]).bind(window=2.5), TypeError, "int parameter"),
]


@pytest.mark.parametrize("build, exc, match", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_are_refused(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


# ------------------------------------------------------------------------------- combinators


def test_gym_masks_combine_with_and_masks_and_or_masks():
    """attention-gym builds masks with and_masks / or_masks; the ports combine the same way."""
    s = 12
    off = doc_offsets([5, 4, 3])
    got = sm.and_masks(gym.document(off), gym.sliding_window(2))
    want = lambda b, h, q, kv: og_document(off)(b, h, q, kv) & og_sliding_window(2)(b, h, q, kv)  # noqa: E731
    assert torch.equal(port_mask(got, 1, 1, s, s), oracle_mask(want, 1, 1, s, s))
    got = sm.or_masks(gym.natten(4, 3, 3, 1), gym.prefix_lm(2))
    natten_4x3 = og_tiled_natten(4, 3, 3, 1, 1, 1)
    want = lambda b, h, q, kv: natten_4x3(b, h, q, kv) | og_prefix_lm(2)(b, h, q, kv)  # noqa: E731
    assert torch.equal(port_mask(got, 1, 1, s, s), oracle_mask(want, 1, 1, s, s))


# ------------------------------------------------------------------------------- NATTEN layouts


@pytest.mark.parametrize("canvas_w, canvas_h, kernel_w, kernel_h",
                         [(6, 3, 3, 3), (5, 7, 3, 5), (4, 4, 1, 3), (9, 2, 7, 1)])
def test_natten_every_query_sees_one_full_kernel(canvas_w, canvas_h, kernel_w, kernel_h):
    """On any canvas each query attends exactly kernel_w * kernel_h keys, within kernel reach."""
    s = canvas_w * canvas_h
    mask = port_mask(gym.natten(canvas_w, canvas_h, kernel_w, kernel_h), 1, 1, s, s)[0, 0]
    assert (mask.sum(-1) == kernel_w * kernel_h).all()
    rows, cols = torch.arange(s) // canvas_w, torch.arange(s) % canvas_w
    far = ((rows[:, None] - rows[None]).abs() >= kernel_h) | ((cols[:, None] - cols[None]).abs() >= kernel_w)
    assert not (mask & far).any()


def test_natten_as_published_is_not_a_neighbourhood_off_square():
    """Why the plain NATTEN oracle is attention-gym's tiled definition off square canvases: its
    `generate_natten` clamps rows with the canvas width, so on a 6 x 3 canvas rows miss keys."""
    s = 18
    published = oracle_mask(og_natten_as_published(6, 3, 3, 3), 1, 1, s, s)[0, 0]
    tiled = oracle_mask(og_tiled_natten(6, 3, 3, 3, 1, 1), 1, 1, s, s)[0, 0]
    assert (tiled.sum(-1) == 9).all() and not (published.sum(-1) == 9).all()
    assert torch.equal(oracle_mask(og_natten_as_published(5, 5, 3, 3), 1, 1, 25, 25),
                       oracle_mask(og_tiled_natten(5, 5, 3, 3, 1, 1), 1, 1, 25, 25))


@pytest.mark.parametrize("canvas_w, canvas_h, kernel_w, kernel_h, tile_w, tile_h",
                         [(4, 4, 3, 3, 2, 2), (4, 2, 3, 1, 2, 1), (8, 4, 5, 3, 4, 2)])
def test_natten_layouts_give_the_same_attention(canvas_w, canvas_h, kernel_w, kernel_h, tile_w, tile_h):
    """Row-major, tile-major and Morton-ordered tokens give the same outputs, token for token
    (attention-gym's own check, here on non-square canvases too)."""
    s = canvas_w * canvas_h
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, s, D, generator=g, dtype=F64) for _ in range(3))
    row, col = torch.arange(s) // canvas_w, torch.arange(s) % canvas_w  # row-major token -> (row, col)
    tile = (row // tile_h) * (canvas_w // tile_w) + col // tile_w
    tiled_pos = tile * tile_w * tile_h + (row % tile_h) * tile_w + col % tile_w
    morton_pos = morton_code(col, row)
    assert sorted(morton_pos.tolist()) == list(range(s)), "Morton codes of this canvas must fill [0, S)"
    base = ours(q, k, v, gym.natten(canvas_w, canvas_h, kernel_w, kernel_h))
    for port, pos in ((gym.tiled_natten(canvas_w, canvas_h, kernel_w, kernel_h, tile_w, tile_h), tiled_pos),
                      (gym.morton_natten(canvas_w, canvas_h, kernel_w, kernel_h), morton_pos)):
        order = torch.argsort(pos)  # order[p] = row-major token at layout position p
        out = ours(q[:, :, order], k[:, :, order], v[:, :, order], port)
        assert_close(out[:, :, pos], base, agreement_bound(base), port.name)


# ------------------------------------------------------------------------------- training and equivalents


@pytest.mark.slow
@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_relative_position_bias_trains(bidirectional):
    """A few SGD steps on a toy loss move the learned table (exactly the buckets these lengths
    reach); every step's table gradient equals float64 autograd through the oracle; the loss falls."""
    g = torch.Generator().manual_seed(6)
    H, nb, md, sq, skv = 2, 8, 20, 13, 29
    q, k, v = (torch.randn(1, H, s, D, generator=g, dtype=F64) for s in (sq, skv, skv))
    target = torch.randn(1, H, sq, D, generator=g, dtype=F64)
    table = torch.nn.Parameter(torch.zeros(H, nb, dtype=F64))
    port = gym.relative_position_bias(table, md, bidirectional)  # bound once: sees the updates
    opt = torch.optim.SGD([table], lr=2.0)
    losses = []
    for _ in range(6):
        oracle_table = table.detach().clone().requires_grad_(True)
        out, _ = reference_attention(q, k, v, 1 / math.sqrt(D), score_fn=og_t5(oracle_table, nb, md, bidirectional))
        (want,) = torch.autograd.grad(F.mse_loss(out, target), oracle_table)
        opt.zero_grad()
        loss = F.mse_loss(ours(q, k, v, port), target)
        loss.backward()
        assert_close(table.grad, want, agreement_bound(want), "table gradient")
        opt.step()
        losses.append(loss.item())
    rel = torch.arange(skv).view(1, -1) - torch.arange(sq).view(-1, 1)
    used = torch.bincount(t5_bucket(rel, nb, md, bidirectional).flatten(), minlength=nb) > 0
    assert (table.detach()[:, used] != 0).all() and (table.detach()[:, ~used] == 0).all()
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("kind", ["gelu", "relu", "sigmoid"])
def test_activation_recovers_activation_attention(kind):
    """out * exp(lse) - offset * sum(v) = f(S) V: the score_mod plus the LSE replace the softmax."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, s, D, generator=g, dtype=F64) for s in (5, 9, 9))
    out, lse = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=gym.activation(kind, 1.0),
                                                return_lse=True, backend="reference")
    recovered = out * lse.double().exp()[..., None] - 1.0 * v.sum(-2, keepdim=True)
    expected = ACTIVATIONS[kind](q @ k.transpose(-1, -2) / math.sqrt(D)) @ v
    assert_close(recovered, expected, agreement_bound(expected, torch.float32), "f(S) V (lse is fp32)")


@pytest.mark.slow
def test_mla_rope_score_mod_is_a_concatenation():
    """attention-gym's MLA RoPE score mod (score + scale * <q_rope[b, h, i], k_rope[b, 0, j]>) is out
    of scope as a score_mod; concatenating the rope features onto q and k is the same attention."""
    g = torch.Generator().manual_seed(2)
    B, H, S, Dr, rope_scale = 2, 4, 7, 8, 0.7
    q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=F64) for h in (H, 1, 1))
    q_rope, k_rope = torch.randn(B, H, S, Dr, generator=g, dtype=F64), torch.randn(B, 1, S, Dr, generator=g, dtype=F64)

    def mla(score, b, h, q_idx, kv_idx):
        return score + rope_scale * torch.dot(q_rope[b, h, q_idx], k_rope[b, h // H, kv_idx])

    expected = flex.flex_attention(q, k.expand(B, H, S, D), v.expand(B, H, S, D), score_mod=mla)
    softmax_scale = 1 / math.sqrt(D)
    q2 = torch.cat([q, q_rope * (rope_scale / softmax_scale)], -1)
    k2 = torch.cat([k, k_rope], -1)
    got = fused_attn.dot_product_attention(q2, k2, v, qkv_format="bhsd", softmax_scale=softmax_scale,
                                           backend="reference")
    assert_close(got, expected, agreement_bound(expected), "concatenated rope")
