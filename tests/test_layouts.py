"""layouts: format <-> logical (B, H, S, D) views without copies, output allocation."""

from __future__ import annotations

import pytest
import torch

from conftest import rand
from fused_attn import layouts


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


