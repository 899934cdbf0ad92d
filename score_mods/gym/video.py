"""Video masks: Sparse VideoGen's spatial and temporal heads and video sparse attention (VSA)."""

from __future__ import annotations

from typing import Optional

import torch

import score_mods as sm

from ..base import ScoreMod
from .common import IntSeq, _int, _ints, _mask

__all__ = ["svg_spatial", "svg_temporal", "vsa_block_map", "vsa"]


def svg_spatial(prompt_length: int, token_per_frame: int, width: int = 2, attn_sink: bool = False,
                round_width: int = 128) -> ScoreMod:
    """Sparse VideoGen spatial head (``generate_spatial_head_mask_mod``): prompt rows and prompt
    columns (plus the first frame when `attn_sink`) are open, and |i - j| < band, with band =
    width * token_per_frame rounded down to a multiple of round_width. prompt, sink_cols and
    band are runtime ints (every size here only bounds a comparison).

    Mask of ``svg_spatial(1, 2, width=1, round_width=1)`` (Sq = 7, Skv = 7):

        x x x x x x x
        x x x . . . .
        x x x x . . .
        x . x x x . .
        x . . x x x .
        x . . . x x x
        x . . . . x x
    """
    fn = "svg_spatial"
    prompt = _int(fn, "prompt_length", prompt_length, 0)
    per_frame = _int(fn, "token_per_frame", token_per_frame)
    width, rounding = _int(fn, "width", width, 0), _int(fn, "round_width", round_width)
    band = (width * per_frame // rounding) * rounding
    sink = prompt + per_frame if attn_sink else prompt

    def svg_spatial(b, h, q_idx, kv_idx, prompt=0, sink_cols=0, band=0):
        return (kv_idx < sink_cols) | (q_idx < prompt) | ((q_idx - kv_idx).abs() < band)

    return _mask(lambda v: f"svg_spatial_p{v['prompt']}_s{v['sink_cols']}_b{v['band']}", svg_spatial,
                 prompt=prompt, sink_cols=sink, band=band)


def svg_temporal(prompt_length: int, num_frames: int, token_per_frame: int, width: int = 2) -> ScoreMod:
    """Sparse VideoGen temporal head (``generate_temporal_head_mask_mod``): prompt rows and columns
    are open, and video tokens attend tokens at nearby places in any frame: |p(i) - p(j)| < band
    with p(i) = (i - prompt) % token_per_frame and band = width * token_per_frame // num_frames.
    prompt and token_per_frame are structure (they enter %); band is a runtime int.

    Mask of ``svg_temporal(1, 2, 3, width=1)`` (Sq = 7, Skv = 7):

        x x x x x x x
        x x . . x . .
        x . x . . x .
        x . . x . . x
        x x . . x . .
        x . x . . x .
        x . . x . . x
    """
    fn = "svg_temporal"
    prompt = _int(fn, "prompt_length", prompt_length, 0)
    frames, per_frame = _int(fn, "num_frames", num_frames), _int(fn, "token_per_frame", token_per_frame)
    band = _int(fn, "width", width, 0) * per_frame // frames

    def svg_temporal(b, h, q_idx, kv_idx, band=0):
        place = ((q_idx - prompt) % per_frame - (kv_idx - prompt) % per_frame).abs()
        return (kv_idx < prompt) | (q_idx < prompt) | (place < band)

    return _mask(lambda v: f"svg_temporal_p{prompt}_t{per_frame}_b{v['band']}", svg_temporal, band=band)


def vsa_block_map(topk_indices: torch.Tensor, num_kv_tiles: int) -> torch.Tensor:
    """(B, H, Q_TILES, TOP_K) selected key tiles -> (B, H, Q_TILES, num_kv_tiles) int32 0/1 map."""
    idx = _ints("vsa_block_map", "topk_indices", topk_indices, 4)
    n = _int("vsa_block_map", "num_kv_tiles", num_kv_tiles)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ValueError(f"vsa_block_map: topk_indices must lie in [0, {n}), got [{int(idx.min())}, {int(idx.max())}]")
    out = torch.zeros(*idx.shape[:-1], n, dtype=torch.int32, device=idx.device)
    return out.scatter_(-1, idx, 1)


def vsa(block_map: torch.Tensor, tile_numel: int, variable_block_sizes: Optional[IntSeq] = None) -> ScoreMod:
    """Video sparse attention, fine pass (``generate_vsa_mask_mod`` / ``_block_map_mask_mod``):
    query tile i // T attends the key tiles its row of `block_map` selects, and with
    `variable_block_sizes` only the first sizes[t] tokens of each padded key tile t.

    block_map: (B|1, H|1, Q_TILES, KV_TILES) 0/1 (from top-k indices: `vsa_block_map`); T =
    tile_numel is structure; Sq = Q_TILES * T, Skv = KV_TILES * T. The map is a bool tensor
    parameter indexed by (b, h, i // T, j // T); the per-key validity a bool table on kv_idx.

    Mask of ``vsa(torch.tensor([[[[1, 0], [1, 1]]]]), 2, [2, 1])`` (Sq = 4, Skv = 4):

        x x . .
        x x . .
        x x x .
        x x x .
    """
    fn = "vsa"
    tiles = _ints(fn, "block_map", block_map, 4)
    T = _int(fn, "tile_numel", tile_numel)
    name = f"vsa_t{T}"
    if variable_block_sizes is None:
        def vsa(b, h, q_idx, kv_idx, tiles=sm.TensorParam("bool")):
            return tiles[b, h, q_idx // T, kv_idx // T]

        return _mask(name, vsa, tiles=tiles != 0)
    sizes = _ints(fn, "variable_block_sizes", variable_block_sizes)
    if sizes.numel() != tiles.shape[-1]:
        raise ValueError(f"{fn}: variable_block_sizes needs one size per key tile ({tiles.shape[-1]}), "
                         f"got {sizes.numel()}")
    kv_valid = torch.arange(sizes.numel() * T) % T < sizes.repeat_interleave(T)

    def vsa_padded(b, h, q_idx, kv_idx, tiles=sm.TensorParam("bool"), kv_valid=sm.TensorParam("bool")):
        return tiles[b, h, q_idx // T, kv_idx // T] & kv_valid[kv_idx]

    return _mask(name + "_padded", vsa_padded, tiles=tiles != 0, kv_valid=kv_valid)
