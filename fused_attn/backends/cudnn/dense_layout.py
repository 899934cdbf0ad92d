"""Dense (bshd / sbhd / bhsd) layouts for the cuDNN runner: the format <-> logical (B, H, S, D)
permutations of shapes and strides, strides normalized where a size-1 dim addresses nothing, and
`Into`, the layouts of caller-owned destinations (the rectangles of a band)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from .graphs import dense_strides_like

__all__ = ["Into", "normalized"]

_PERM = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}
_INV = {"bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3), "bhsd": (0, 1, 2, 3)}


def _format_shape(fmt: str, dims: Tuple[int, int, int, int]) -> Tuple[int, ...]:
    return tuple(dims[i] for i in _INV[fmt])


def _logical_strides(fmt: str, strides: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(strides[i] for i in _PERM[fmt])


def normalized(dims: Tuple[int, ...], strides: Tuple[int, ...]) -> Tuple[int, ...]:
    """Strides with those of size-1 dims replaced by their dense value (they address nothing),
    so layouts that differ only there share one graph."""
    dense = dense_strides_like(dims, strides)
    return tuple(d_s if n == 1 else s for n, s, d_s in zip(dims, strides, dense))


class Into(NamedTuple):
    """Layouts of the buffers a runner writes when they are views of the caller's larger tensors
    (the rectangles of a band, `band_chunks`): out (and dO) strides in the call's format, the
    forward's Stats strides of its logical (B, H, Sq, 1) view (the backward reads Stats packed),
    dQ / dK / dV strides in the call's format (None: the runner's own dense layout, in a fresh
    buffer)."""

    out: Tuple[int, ...]
    stats: Tuple[int, ...]
    grads: Tuple[Optional[Tuple[int, ...]], Optional[Tuple[int, ...]], Optional[Tuple[int, ...]]]


def _format_axis(fmt: str, logical_axis: int) -> int:
    """The dim of a `fmt` tensor holding logical axis `logical_axis` of (B, H, S, D)."""
    return _PERM[fmt][logical_axis]


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    out, step = [0] * len(shape), 1
    for i in reversed(range(len(shape))):
        out[i] = step
        step *= max(shape[i], 1)
    return tuple(out)


def _logical_to_format(fmt: str, logical_strides: Tuple[int, ...]) -> Tuple[int, ...]:
    """Strides of the format tensor whose logical (B, H, S, D) view has `logical_strides`."""
    return tuple(logical_strides[i] for i in _INV[fmt])
