"""Fixtures shared by every test folder. Helpers live in `tests/helpers` (a package: this
directory is on the path), e.g. `from helpers.attention import rand, band_mask`."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded CPU generator per test."""
    return torch.Generator().manual_seed(1234)
