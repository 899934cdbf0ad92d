"""The zoo of attention-gym style mods (`helpers.zoo`): each mod's eager values against its
plain-torch oracle, and the pictures of the masks without one."""

import pytest
import torch

from fused_attn.testing import agreement_bound, assert_close
from helpers.zoo import H, S, block_diffusion, dilated_window, grid, zoo


@pytest.mark.parametrize("name", list(zoo()))
def test_zoo_eager_matches_plain_torch_oracle(name):
    mod, oracle = zoo()[name]
    if oracle is None:
        pytest.skip("checked against flex_attention and by its picture instead")
    s = torch.randn(1, H, S, S, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2
    idx = grid()
    got = mod.eager(s, *idx, S, S)
    want = oracle(s, *idx).expand_as(got)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    fin = torch.isfinite(want)
    assert_close(got[fin], want[fin], agreement_bound(want[fin]), name)


def _loop_block_diffusion(i, j):
    half, block = S // 2, 2
    qn, kn = i < half, j < half
    qb, kb = (i % half) // block, (j % half) // block
    return (qb == kb and qn == kn) or (qb > kb and qn and not kn) or (qb >= kb and not qn and not kn)


def test_zoo_pictures():
    picture = block_diffusion.describe(S, S).splitlines()
    assert picture[0] == "block_diffusion (16x16): x attend, . masked"
    assert picture[1:] == [" ".join("x" if _loop_block_diffusion(i, j) else "." for j in range(S)) for i in range(S)]
    assert dilated_window(window=2, dilation=2).describe(5, 5) == "\n".join([
        "dilated_window (5x5): x attend, . masked",
        "x . x . .",
        ". x . x .",
        "x . x . x",
        ". x . x .",
        ". . x . x",
    ])
