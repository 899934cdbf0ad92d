"""qkv_format <-> logical (B, H, S, D) views, without copies.

Formats (shape legend in `fused_attn.problem`):
    bshd: (B, S, H, D)   sbhd: (S, B, H, D)   bhsd: (B, H, S, D)   thd: (T, H, D) packed

Dense formats map to the logical (B, H, S, D) order by a permute (a view); the memory layout
stays in the strides. thd has no 4-D logical view: backends read it per sequence.
"""

from __future__ import annotations

from typing import Tuple

import torch


DENSE_FORMATS = ("bshd", "sbhd", "bhsd")

# Permutation taking a format tensor to logical (B, H, S, D), and its inverse.
_TO_LOGICAL = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}
_FROM_LOGICAL = {"bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3), "bhsd": (0, 1, 2, 3)}


def to_logical(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """Format tensor -> logical (B, H, S, D) view (dense formats only)."""
    return t.permute(_TO_LOGICAL[qkv_format])


def logical_shape(t: torch.Tensor, qkv_format: str) -> Tuple[int, ...]:
    """(B, H, S, D) of a dense tensor without creating a view (thd: (1, H, T, D))."""
    shape = t.shape
    if qkv_format == "thd":
        return 1, shape[1], shape[0], shape[2]
    return tuple(shape[i] for i in _TO_LOGICAL[qkv_format])


def from_logical(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """Logical (B, H, S, D) view -> the format's dim order (a view)."""
    return t.permute(_FROM_LOGICAL[qkv_format])


def format_shape(qkv_format: str, batch: int, heads: int, seqlen: int, head_dim: int) -> Tuple[int, ...]:
    """Shape of a dense tensor in `qkv_format` for logical (batch, heads, seqlen, head_dim)."""
    logical = (batch, heads, seqlen, head_dim)
    return tuple(logical[i] for i in _FROM_LOGICAL[qkv_format])


def dims(t: torch.Tensor, qkv_format: str) -> Tuple[int, int, int, int]:
    """(B, H, S, D) of a dense tensor in `qkv_format` (thd: (1, H, T, D))."""
    b, h, s, d = logical_shape(t, qkv_format)
    return b, h, s, d


def token_rows(t: torch.Tensor) -> torch.Tensor:
    """Values per (batch, head, position) (B, H, S) as rows of the flat (B * S) tokens: (B * S, H),
    contiguous (one copy at most): the layout of a packed call's log-sum-exp rows."""
    return t.transpose(1, 2).reshape(-1, t.shape[1]).contiguous()
