"""layouts: format <-> logical (B, H, S, D) views without copies, output allocation."""

from __future__ import annotations

import pytest
import torch

from fused_attn import layouts
from helpers.attention import rand


@pytest.mark.parametrize("fmt,shape", [("bshd", (2, 5, 3, 4)), ("sbhd", (5, 2, 3, 4)), ("bhsd", (2, 3, 5, 4))])
def test_roundtrip_is_a_view(gen, fmt, shape):
    t = rand(gen, *shape)
    logical = layouts.to_logical(t, fmt)
    assert logical.shape == (2, 3, 5, 4) and logical.data_ptr() == t.data_ptr()
    assert layouts.dims(t, fmt) == (2, 3, 5, 4)
    assert layouts.format_shape(fmt, 2, 3, 5, 4) == shape
    back = layouts.from_logical(logical, fmt)
    assert back.shape == shape and back.data_ptr() == t.data_ptr() and torch.equal(back, t)
    # element [b, s, h, d] of bshd equals logical [b, h, s, d]
    assert logical[1, 2, 3, 0] == back[layouts.format_shape(fmt, 1, 2, 3, 0)]




@pytest.mark.parametrize("batch", [1, 3])
def test_token_rows_of_a_per_position_tensor(gen, batch):
    lse = rand(gen, batch, 4, 7)  # (B, H, S)
    rows = layouts.token_rows(lse)
    assert rows.shape == (batch * 7, 4) and rows.is_contiguous()
    for b in range(batch):
        for s in range(7):
            assert torch.equal(rows[b * 7 + s], lse[b, :, s])
    # already token-major (the transpose of packed rows): no copy
    packed = rand(gen, batch * 7, 4)
    again = layouts.token_rows(packed.t().reshape(4, batch, 7).transpose(0, 1))
    assert again.data_ptr() == packed.data_ptr() and torch.equal(again, packed)
