"""The quick / slow split of parametrized tests: `quick_cover` keeps a covering few quick."""

from __future__ import annotations

import itertools
from typing import Sequence

import pytest

__all__ = ["quick_cover"]


def quick_cover(*axes: Sequence) -> list:
    """Every combination of the axes' values as pytest.params, for one parametrize over all their
    names: the few combinations that together take each value of each axis at least once (the
    i-th value of every axis, cycling the shorter axes) stay in the quick set, the others are
    marked `slow`. A tuple value of an axis gives several arguments (wrap a tuple meant as one
    argument in a 1-tuple)."""
    longest = max(len(a) for a in axes)
    quick = {tuple(i % len(a) for a in axes) for i in range(longest)}
    params = []
    for index in itertools.product(*(range(len(a)) for a in axes)):
        values = []
        for a, i in zip(axes, index):
            v = a[i]
            values.extend(v if isinstance(v, tuple) else (v,))
        params.append(pytest.param(*values, marks=() if index in quick else pytest.mark.slow))
    return params
