"""score_mods.positions.at_positions: a traced mod evaluated at shifted positions (context parallelism's
blocks), against the unshifted mod evaluated at the shifted indices: eager values, the reference
backend's attention and gradients in float64, graph-key sharing, operands and errors."""

import math

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn.testing import assert_close, grad_tolerances, tolerance
from score_mods.positions import POSITION_PARAMS, at_positions

H, L = 4, 96  # heads, global sequence length


def _mods():
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(1, H, L, L, generator=g, dtype=torch.float64)
    return {
        "causal": sm.causal(),
        "alibi": sm.alibi(sm.alibi_slopes(H).double()),
        "window": sm.sliding_window(20, 0),
        "two_sided_window": sm.sliding_window(12, 7),
        "bottom_right": sm.causal_bottom_right(),
        "softcap_causal": sm.compose(sm.softcap(30.0), sm.causal()),
        "bias": sm.post_scale_bias(bias),
    }


MODS = _mods()
# (q offset, q rows, kv offset, kv columns): blocks of the global (L, L) problem
BLOCKS = [(0, 32, 0, 32), (64, 32, 16, 48), (32, 48, 48, 48), (48, 16, 0, 96)]


def _oracle(mod, qo: int, ko: int):
    """score_fn for reference_attention: the unshifted mod at global positions."""
    glen = torch.tensor(L).view(1, 1, 1, 1)
    return lambda s, b, h, qi, ki: mod.eager(s, b, h, qi + qo, ki + ko, glen, glen)


@pytest.mark.parametrize("name", sorted(MODS))
@pytest.mark.parametrize("block", BLOCKS)
def test_eager_values_are_the_mod_at_global_positions(name, block):
    mod = MODS[name]
    qo, sq, ko, skv = block
    shifted = at_positions(mod, qo, ko, L, L)
    s = torch.randn(2, H, sq, skv, dtype=torch.float64)
    b, h = torch.arange(2).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1)
    qi, ki = torch.arange(sq).view(1, 1, -1, 1), torch.arange(skv).view(1, 1, 1, -1)
    local = (torch.tensor(sq).view(1, 1, 1, 1), torch.tensor(skv).view(1, 1, 1, 1))
    want = _oracle(mod, qo, ko)(s, b, h, qi, ki)
    assert torch.equal(shifted.eager(s, b, h, qi, ki, *local), want)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODS))
def test_reference_attention_and_gradients_at_global_positions(name):
    """Attention of one block with the shifted mod (reference backend, float64) equals the float64
    attention whose scores the unshifted mod modifies at global positions, gradients included."""
    mod = MODS[name]
    qo, sq, ko, skv = 64, 32, 16, 48
    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(2, H, n, 16, generator=g, dtype=torch.float64) for n in (sq, skv, skv, sq))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fused_attn.dot_product_attention(*leaves, qkv_format="bhsd", backend="reference",
                                           score_mod=at_positions(mod, qo, ko, L, L))
    grads = torch.autograd.grad(out, leaves, do)
    scale, fn = 1 / math.sqrt(16), _oracle(mod, qo, ko)
    from fused_attn.testing import reference_attention

    exact, _ = reference_attention(q, k, v, scale, score_fn=fn)
    assert_close(out, exact, tolerance(q, k, v, scale, torch.float64, score_fn=fn), f"{name} out")
    want, bounds = grad_tolerances(q, k, v, do, scale, torch.float64, score_fn=fn)
    for n, got, w, bound in zip("qkv", grads, want, bounds):
        assert_close(got, w, bound, f"{name} d{n}")


@pytest.mark.parametrize("name", sorted(MODS))
def test_every_block_shares_one_structure(name):
    """Offsets and lengths are values bound per call: one cache_key (one cuDNN graph) for every
    block, rank and step; position parameters are int32 pass-by-value graph operands."""
    mod = MODS[name]
    keys = {at_positions(mod, qo, ko, L, L).cache_key for qo, _, ko, _ in BLOCKS}
    assert len(keys) == 1
    shifted = at_positions(mod, 64, 16, L, L)
    assert shifted.cudnn_unsupported is None
    ops = shifted.cudnn_operands((2, H, 32, 48), device=torch.device("cpu"))
    for p in POSITION_PARAMS:
        if p in ops:
            assert ops[p].dtype == torch.int32 and ops[p].shape == (1, 1, 1, 1) and ops[p].device.type == "cpu"
            assert int(ops[p]) == {"pos_q_offset": 64, "pos_kv_offset": 16}.get(p, L)
    assert at_positions(mod, 8, 0, L, L).cudnn_operands((2, H, 32, 48), device=torch.device("cpu")).keys() == ops.keys()


def test_comparisons_fold_offsets_into_one_host_scalar():
    """A mask compares kv_idx - q_idx with one folded scalar (the form the engines compute right)
    rather than adding an offset to an index."""
    summary = at_positions(sm.causal(), 64, 16, L, L).plan.summary()
    assert summary["in_graph"] == ["le", "select", "sub"]
    assert not set(POSITION_PARAMS) & set(summary["scalar"])


def test_tensor_parameters_are_checked_against_the_global_lengths():
    bias = torch.randn(1, H, L, L)
    shifted = at_positions(sm.post_scale_bias(bias), 32, 0, L, L)
    shifted.check(device=bias.device, batch=1, heads=H, seqlen_q=16, seqlen_kv=16)  # the block is smaller
    with pytest.raises(ValueError, match=r"'bias' has shape \(1, 4, 96, 96\), expected \(b: 1 \(or 1\), h: 4 \(or "
                                         r"1\), q_idx: 192"):
        at_positions(sm.post_scale_bias(bias), 32, 0, 2 * L, L).check(device=bias.device, batch=1, heads=H,
                                                                      seqlen_q=16, seqlen_kv=16)
    with pytest.raises(ValueError, match="a block of 16 query positions at offset 88 ends past the global query "
                                         "length 96"):
        at_positions(sm.post_scale_bias(bias), 88, 0, L, L).check(device=bias.device, batch=1, heads=H,
                                                                  seqlen_q=16, seqlen_kv=16)


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="q_offset must be an int, got 1.5"):
        at_positions(sm.causal(), 1.5, 0, L, L)
    with pytest.raises(ValueError, match=r"kv_len=-1 is outside"):
        at_positions(sm.causal(), 0, 0, L, -1)
    with pytest.raises(TypeError, match="takes a traced score_mod"):
        at_positions(object(), 0, 0, L, L)

    @sm.score_mod
    def clash(score, b, h, q_idx, kv_idx, pos_q_offset=1):
        return score + pos_q_offset

    with pytest.raises(ValueError, match="pos_q_offset"):
        at_positions(clash, 0, 0, L, L)
