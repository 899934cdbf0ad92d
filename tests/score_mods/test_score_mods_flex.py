"""`.to_flex()` gives flex_attention the same math as the library's own backends."""

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn.testing import agreement_bound, assert_close

flex_mod = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, SQ, SKV, D = 2, 4, 48, 64, 16


def _mods():
    g = torch.Generator().manual_seed(3)
    return {
        "softcap": sm.softcap(2.0),
        "alibi": sm.alibi(sm.alibi_slopes(H)),
        "bias": sm.post_scale_bias(torch.randn(1, H, SQ, SKV, generator=g)),
        "causal_bottom_right": sm.causal_bottom_right(),
        "window_br": sm.sliding_window(8, 0, bottom_right=True),
        "compose": sm.compose(sm.softcap(5.0), sm.alibi(sm.alibi_slopes(H)), sm.causal_bottom_right()),
    }


@pytest.mark.slow  # flex_attention on CPU
@pytest.mark.parametrize("name", list(_mods()))
def test_to_flex_matches_flex_attention(name):
    mod = _mods()[name]
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, SQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, SKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, SKV, D, generator=g, dtype=torch.float64)
    flex = flex_mod.flex_attention(q, k, v, score_mod=mod.to_flex(q_len=SQ, kv_len=SKV))
    ours = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=mod, backend="reference")
    assert not torch.equal(ours, fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", backend="reference"))
    assert_close(ours, flex, agreement_bound(flex), name)


# --------------------------------------------------------------------------- the attention-gym zoo

from helpers.zoo import H as ZH, S as ZS, zoo  # noqa: E402


def _qkv(b, h, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.slow  # flex_attention on CPU
@pytest.mark.parametrize("name", list(zoo()))
def test_zoo_to_flex_matches_flex_attention(name):
    """Reference backend (our eager on full score blocks) == flex_attention running to_flex()
    under vmap, float64: the integer ops, gathers and bit tricks mean the same in both."""
    mod, _ = zoo()[name]
    q, k, v = _qkv(1, ZH, ZS, 16, 11)
    ours = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=mod, backend="reference")
    flex = flex_mod.flex_attention(q, k, v, score_mod=mod.to_flex(q_len=ZS, kv_len=ZS))
    assert_close(ours, flex, agreement_bound(flex), name)
    if mod.mask_condition() is not None:  # the same mask as a flex BlockMask
        block = flex_mod.create_block_mask(mod.to_flex_mask(ZS, ZS), 1, ZH, ZS, ZS, device="cpu", BLOCK_SIZE=4)
        assert_close(flex_mod.flex_attention(q, k, v, block_mask=block), ours, agreement_bound(ours), name + " mask")


def test_to_flex_mask_refuses_score_mods():
    with pytest.raises(ValueError, match="not a pure mask"):
        sm.softcap(2.0).to_flex_mask()
