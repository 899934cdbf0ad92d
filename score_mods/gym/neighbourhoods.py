"""2-D / 3-D neighbourhood masks on images and videos: NATTEN (row-major, tiled, Morton) and
sliding tile attention (STA, 2-D and 3-D)."""

from __future__ import annotations

import math
from typing import Sequence, Tuple

from ..base import ScoreMod
from .common import _int, _mask, _shape

__all__ = ["natten", "tiled_natten", "morton_natten", "sta_2d", "sta_3d"]


def _check_kernel(fn: str, canvas: Sequence[int], kernel: Sequence[int], names: str) -> None:
    for c, k, n in zip(canvas, kernel, names):
        if k > c or k % 2 == 0:
            raise ValueError(f"{fn}: kernel_{n} must be odd and at most canvas_{n}, got kernel {k}, canvas {c}")


def _neighbours(q_row, q_col, k_row, k_col, canvas_w, canvas_h, kernel_w, kernel_h):
    """The NATTEN window: a kernel centred on the query, its centre clamped inside the canvas."""
    rw, rh = kernel_w // 2, kernel_h // 2
    c_row = q_row.clamp(rh, canvas_h - 1 - rh)
    c_col = q_col.clamp(rw, canvas_w - 1 - rw)
    return ((k_row - c_row).abs() <= rh) & ((k_col - c_col).abs() <= rw)


def natten(canvas_w: int, canvas_h: int, kernel_w: int, kernel_h: int) -> ScoreMod:
    """Neighbourhood attention (``generate_natten``) on a row-major canvas_h x canvas_w image:
    token i = row * canvas_w + col sees the kernel_h x kernel_w window centred on it, the centre
    clamped so the window stays inside the canvas (every query sees exactly kh * kw keys).
    All sizes are structure (they enter // and %); kernels are odd.

    attention-gym clamps the row with the kernel and canvas *widths* (and the column with the
    heights); that only agrees with this port on square canvases. On a 6-wide, 3-high canvas
    with a 3 x 3 kernel its every query sees only columns 0-2, and the last row only 2 rows.

    Mask of ``natten(4, 3, 3, 3)`` (Sq = 12, Skv = 12):

        x x x . x x x . x x x .
        x x x . x x x . x x x .
        . x x x . x x x . x x x
        . x x x . x x x . x x x
        x x x . x x x . x x x .
        x x x . x x x . x x x .
        . x x x . x x x . x x x
        . x x x . x x x . x x x
        x x x . x x x . x x x .
        x x x . x x x . x x x .
        . x x x . x x x . x x x
        . x x x . x x x . x x x
    """
    fn = "natten"
    cw, ch, kw, kh = (_int(fn, n, v) for n, v in
                      (("canvas_w", canvas_w), ("canvas_h", canvas_h), ("kernel_w", kernel_w), ("kernel_h", kernel_h)))
    _check_kernel(fn, (cw, ch), (kw, kh), "wh")

    def natten(b, h, q_idx, kv_idx):
        return _neighbours(q_idx // cw, q_idx % cw, kv_idx // cw, kv_idx % cw, cw, ch, kw, kh)

    return _mask(f"natten_{cw}x{ch}_k{kw}x{kh}", natten)


def tiled_natten(canvas_w: int, canvas_h: int, kernel_w: int, kernel_h: int, tile_w: int, tile_h: int) -> ScoreMod:
    """NATTEN on a tile-major layout (``generate_tiled_natten``): tokens are ordered tile by tile
    (tiles row-major), row-major inside each tile_h x tile_w tile; the mask is `natten`'s on the
    decoded (row, col). Sizes are structure; the canvas must be a whole number of tiles.

    Mask of ``tiled_natten(4, 2, 3, 1, 2, 2)`` (Sq = 8, Skv = 8):

        x x . . x . . .
        x x . . x . . .
        . . x x . . x .
        . . x x . . x .
        . x . . x x . .
        . x . . x x . .
        . . . x . . x x
        . . . x . . x x
    """
    fn = "tiled_natten"
    cw, ch, kw, kh, tw, th = (_int(fn, n, v) for n, v in (
        ("canvas_w", canvas_w), ("canvas_h", canvas_h), ("kernel_w", kernel_w), ("kernel_h", kernel_h),
        ("tile_w", tile_w), ("tile_h", tile_h)))
    _check_kernel(fn, (cw, ch), (kw, kh), "wh")
    if cw % tw or ch % th:
        raise ValueError(f"{fn}: the canvas {cw}x{ch} must be a whole number of {tw}x{th} tiles")
    per_tile, tiles_per_row = tw * th, cw // tw

    def row_col(idx):
        tile, within = idx // per_tile, idx % per_tile
        return (tile // tiles_per_row) * th + within // tw, (tile % tiles_per_row) * tw + within % tw

    def tiled_natten(b, h, q_idx, kv_idx):
        return _neighbours(*row_col(q_idx), *row_col(kv_idx), cw, ch, kw, kh)

    return _mask(f"tiled_natten_{cw}x{ch}_k{kw}x{kh}_t{tw}x{th}", tiled_natten)


def morton_natten(canvas_w: int, canvas_h: int, kernel_w: int, kernel_h: int) -> ScoreMod:
    """NATTEN on a Morton (Z-order) layout (``generate_morton_natten``): token index = the bits of
    col (even positions) interleaved with the bits of row (odd positions). Codes that decode
    outside the canvas (non-power-of-two canvases leave holes) are never attended. The number
    of bits decoded follows the canvas; all sizes are structure. On a 4 x 2 canvas the Morton
    order is the tile-major order of 2 x 2 tiles: the mask is ``tiled_natten(4, 2, 3, 1, 2, 2)``'s
    (pictured there). On the 3 x 2 canvas below, codes 5 and 7 decode to column 3, outside the
    canvas: no query attends them.

    Mask of ``morton_natten(3, 2, 3, 1)`` (Sq = 8, Skv = 8):

        x x . . x . . .
        x x . . x . . .
        . . x x . . x .
        . . x x . . x .
        x x . . x . . .
        x x . . x . . .
        . . x x . . x .
        . . x x . . x .
    """
    fn = "morton_natten"
    cw, ch, kw, kh = (_int(fn, n, v) for n, v in
                      (("canvas_w", canvas_w), ("canvas_h", canvas_h), ("kernel_w", kernel_w), ("kernel_h", kernel_h)))
    _check_kernel(fn, (cw, ch), (kw, kh), "wh")
    bits = max(cw - 1, ch - 1, 1).bit_length()

    def row_col(code):
        col = code & 1
        row = (code >> 1) & 1
        for k in range(1, bits):
            col = col | (((code >> (2 * k)) & 1) << k)
            row = row | (((code >> (2 * k + 1)) & 1) << k)
        return row, col

    def morton_natten(b, h, q_idx, kv_idx):
        return _neighbours(*row_col(q_idx), *row_col(kv_idx), cw, ch, kw, kh)

    return _mask(f"morton_natten_{cw}x{ch}_k{kw}x{kh}", morton_natten)


def _sta(fn: str, canvas: Tuple[int, ...], kernel: Tuple[int, ...], tile: Tuple[int, ...], text_len: int) -> ScoreMod:
    for axis, (c, k, t) in enumerate(zip(canvas, kernel, tile)):
        if c % t or k % t:
            raise ValueError(f"{fn}: canvas and kernel must be whole numbers of tiles on every axis; axis {axis} has "
                             f"canvas {c}, kernel {k}, tile {t}")
        if k > c:
            raise ValueError(f"{fn}: the kernel must fit in the canvas; axis {axis} has kernel {k} > canvas {c}")
    tiles = [c // t for c, t in zip(canvas, tile)]
    ktiles = [k // t for k, t in zip(kernel, tile)]
    numel, vision = math.prod(tile), math.prod(canvas)

    def tile_coords(idx):
        tid, out = idx // numel, []
        for axis in range(len(tiles) - 1, 0, -1):
            out.append(tid % tiles[axis])
            tid = tid // tiles[axis]
        out.append(tid)
        return out[::-1]

    def sta(b, h, q_idx, kv_idx, text_len=0):
        near = (q_idx < vision) & (kv_idx < vision)
        for qt, kt, k, n in zip(tile_coords(q_idx), tile_coords(kv_idx), ktiles, tiles):
            before, after = k // 2, k // 2 + k % 2 - 1  # k tiles: centred when odd, one more before when even
            centre = qt.clamp(before, n - 1 - after)
            near = near & (kt >= centre - before) & (kt <= centre + after)
        to_text = (q_idx < vision) & (kv_idx >= vision) & (kv_idx < vision + text_len)
        from_text = (q_idx >= vision) & (kv_idx < vision + text_len)
        return near | to_text | from_text

    dims = lambda s: "x".join(map(str, s))  # noqa: E731
    name = f"{fn}_c{dims(canvas)}_k{dims(kernel)}_t{dims(tile)}"
    return _mask(lambda v: name + (f"_text{v['text_len']}" if v["text_len"] else ""), sta, text_len=text_len)


def sta_2d(canvas_hw: Tuple[int, int], kernel_hw: Tuple[int, int], tile_hw: Tuple[int, int],
           text_len: int = 0) -> ScoreMod:
    """Sliding tile attention, 2-D (``generate_sta_mask_mod_2d``). Vision tokens come first, tile
    by tile (tiles row-major), then `text_len` text tokens. A vision query sees the
    kernel_h x kernel_w window of *tiles* around its tile (clamped inside the canvas; an even
    tile count reaches one tile further back than forward) and all text; text sees everything.
    Canvas and kernel are whole numbers of tiles (structure); `text_len` is a runtime int.

    Mask of ``sta_2d((2, 4), (2, 2), (1, 2), text_len=1)`` (Sq = 9, Skv = 9):

        x x . . x x . . x
        x x . . x x . . x
        . . x x . . x x x
        . . x x . . x x x
        x x . . x x . . x
        x x . . x x . . x
        . . x x . . x x x
        . . x x . . x x x
        x x x x x x x x x
    """
    fn = "sta_2d"
    canvas, kernel, tile = (_shape(fn, n, v, 2) for n, v in (("canvas_hw", canvas_hw), ("kernel_hw", kernel_hw),
                                                              ("tile_hw", tile_hw)))
    return _sta(fn, canvas, kernel, tile, _int(fn, "text_len", text_len, 0))


def sta_3d(canvas_thw: Tuple[int, int, int], kernel_thw: Tuple[int, int, int], tile_thw: Tuple[int, int, int],
           text_len: int = 0) -> ScoreMod:
    """Sliding tile attention, 3-D (``generate_sta_mask_mod_3d``): `sta_2d` over a time x height x
    width video, tiles ordered t-major.

    Mask of ``sta_3d((2, 1, 4), (2, 1, 2), (1, 1, 2))`` (Sq = 8, Skv = 8):

        x x . . x x . .
        x x . . x x . .
        . . x x . . x x
        . . x x . . x x
        x x . . x x . .
        x x . . x x . .
        . . x x . . x x
        . . x x . . x x
    """
    fn = "sta_3d"
    canvas, kernel, tile = (_shape(fn, n, v, 3) for n, v in (("canvas_thw", canvas_thw), ("kernel_thw", kernel_thw),
                                                              ("tile_thw", tile_thw)))
    return _sta(fn, canvas, kernel, tile, _int(fn, "text_len", text_len, 0))
