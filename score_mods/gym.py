"""attention-gym's masks and score mods, written in the score_mod language.

Each factory returns a ScoreMod named with its values (``natten_16x16_k7x7``) that runs on every
backend (cuDNN forward/backward, the eager reference, flex_attention via ``to_flex``). Masks are
``@sm.mask_mod`` conditions (a closed position scores -inf); score mods add to or reshape the
score. i = q_idx and j = kv_idx throughout; pictures show x where query row i attends key j.

Masks            attention-gym                                  here
    causal                causal_mask                                    causal()
    sliding window        generate_sliding_window                        sliding_window(w)
    dilated window        generate_dilated_sliding_window                dilated_sliding_window(w, d)
    Longformer            generate_global_sliding_window                 global_sliding_window(w, is_global)
    prefix LM             generate_prefix_lm_mask                        prefix_lm(n)
    packed documents      generate_doc_mask_mod                          document(offsets, inner)
                          generate_packed_causal_doc_mask_mod            document_causal(offsets)
    shared prefix         generate_shared_prefix_mask_mod                shared_prefix(offsets, prefix_doc)
    NATTEN                generate_natten / _tiled_natten / _morton_natten  natten, tiled_natten, morton_natten
    STA                   generate_sta_mask_mod_2d / _3d                 sta_2d, sta_3d
    Sparse VideoGen       generate_spatial/temporal_head_mask_mod        svg_spatial, svg_temporal
    VSA                   generate_vsa_mask_mod / _block_map_mask_mod    vsa(block_map, tile) (+ vsa_block_map)
    Block Diffusion       generate_block_diffusion_mask                  block_diffusion(n, block)
    JetSpec               generate_jetspec_tree_causal / _training_mask  jetspec_tree, jetspec_training
    Flamingo              generate_vision_cross_attention_mask_mod       flamingo(intervals, image_len)
    batchify              batchify_mask_mod                              batchify(size, inner)
Score mods
    ALiBi                 generate_alibi_bias                            alibi(num_heads)
    softcapping           generate_tanh_softcap                          softcap(cap)
    activation            generate_activation_score_mod                  activation(kind, offset)
    Graphormer            generate_graphormer_spatial_bias / _edge_bias  graphormer_spatial, graphormer_edge
    Sandwich              generate_sandwich_bias                         sandwich(num_heads, max_len)
    (T5, not in the gym)  -                                              relative_position_bias(table, ...)

Structure or runtime value. A size that only bounds a comparison (a window, a prefix length, a
band width, a text length) is an int parameter: a runtime scalar, checked >= 0 on every bind,
so a new value never rebuilds a cuDNN graph and the name follows it (``prefix_lm(4).bind(
prefix=9).name == "prefix_lm_9"``). A size that enters integer arithmetic (a canvas width in
``//`` and ``%``, a tile, a kernel radius in a clamp, a dilation, a block size, bit positions,
a table offset) is a Python int baked into the expression: it is structure, validated once
against the sizes it is tied to (kernel odd and inside the canvas, canvas a whole number of
tiles), and a new value is a new graph. Real-valued knobs (softcap's cap, activation's offset)
are float parameters. Per-token and per-key facts (document ids and starts, image spans,
global-token flags, tree ancestry, tile maps) are int or bool tensor parameters; learnable
tables (Graphormer, T5) are float tensor parameters gathered at computed integers.

Not score or mask mods, so not here (what to use instead):
* causal.create_causal_block_mask_fast, vsa.create_vsa_block_mask / create_vsa_flash_block_mask:
  flex_attention block-sparsity index tensors. cuDNN has no block-mask input; a pure causal or
  window mask runs as cuDNN's own band, which skips masked tiles.
* softcapping(approx=True): inline PTX ``tanh.approx.f32``, a kernel-level instruction choice;
  the math is ``softcap(cap)``, which cuDNN lowers with its own tanh.
* activation.undo_softmax: post-processing. Equivalent: ``out, lse = dot_product_attention(...,
  score_mod=activation(kind, offset), return_lse=True)`` then ``out * lse.exp()[..., None] -
  offset * v_sum`` recovers f(S) V (lse is fp32, so expect ~1e-7 relative error).
* graphormer.shortest_path_distances / shortest_path_edge_types, document_mask.length_to_offsets,
  jetspec.build_tree_ancestor_matrix (here ``tree_ancestors``), vsa's tiling, pooling, top-k,
  coarse attention and output mixing: tensor preprocessing around the attention call.
* latent_attention.generate_mla_rope_score_mod: adds scale * <q_rope[i], k_rope[j]>, a dot product
  over a feature dimension (a reduction, not a pointwise function of the score). Equivalent, and
  what MLA kernels do: concatenate, q' = [q, q_rope * scale / softmax_scale], k' = [k, k_rope]
  (k_rope repeated over heads), with the same softmax_scale.
* sandwich's padding of its table to a multiple of 8 (a vector-load trick) is not needed.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch

import score_mods as sm

from .base import ScoreMod
from .templates import template

NEG_INF = -math.inf
Predicate = Callable[[Any, Any, Any, Any], Any]
IntSeq = Union[torch.Tensor, Sequence[int]]

__all__ = [
    "causal", "sliding_window", "dilated_sliding_window", "global_sliding_window", "prefix_lm", "document",
    "document_causal", "shared_prefix", "natten", "tiled_natten", "morton_natten", "sta_2d", "sta_3d",
    "svg_spatial", "svg_temporal", "vsa", "vsa_block_map", "block_diffusion", "jetspec_tree", "jetspec_training",
    "tree_ancestors", "flamingo", "batchify", "alibi", "softcap", "activation", "graphormer_spatial",
    "graphormer_edge", "sandwich", "sandwich_table", "relative_position_bias",
]


# =============================================================================== checks

def _int(fn: str, name: str, v: Any, low: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{fn}: {name} must be an int, got {v!r} ({type(v).__name__})")
    if v < low:
        raise ValueError(f"{fn}: {name} must be >= {low}, got {v}")
    return v


def _float(fn: str, name: str, v: Any, low: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise TypeError(f"{fn}: {name} must be a finite number, got {v!r} ({type(v).__name__})")
    if v < low:
        raise ValueError(f"{fn}: {name} must be >= {low:g}, got {v!r}")
    return float(v)


def _ints(fn: str, name: str, v: Any, dims: int = 1) -> torch.Tensor:
    """An int64 tensor from a tensor or nested sequence of ints (bools become 0/1)."""
    t = v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
    if t.dtype == torch.bool:
        t = t.to(torch.int64)
    if t.is_floating_point() or t.is_complex():
        raise TypeError(f"{fn}: {name} must hold integers (or bools), got dtype {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{fn}: {name} must have {dims} dim(s), got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def _offsets(fn: str, offsets: IntSeq) -> torch.Tensor:
    t = _ints(fn, "offsets", offsets)
    if t.numel() < 2 or int(t[0]) != 0 or bool((t.diff() < 0).any()):
        raise ValueError(f"{fn}: offsets must start at 0 and not decrease (documents' cumulative lengths), "
                         f"got {t.tolist()}")
    return t


def _shape(fn: str, name: str, v: Any, rank: int) -> Tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or len(v) != rank:
        raise TypeError(f"{fn}: {name} must be a tuple of {rank} ints, got {v!r}")
    return tuple(_int(fn, f"{name}[{i}]", x) for i, x in enumerate(v))


def _non_negative(fn: str) -> Callable[[str, Any], None]:
    def check(name: str, v: Any) -> None:
        if v < 0:
            raise ValueError(f"{fn}: {name} must be >= 0, got {v!r}")
    return check


def _finish(mod: ScoreMod, name: Union[str, Callable[[dict], str]], **values: Any) -> ScoreMod:
    """Bind `values`; runtime int sizes are checked >= 0 on every bind. `name` is a string, or
    a function of the bound values (the name then follows `bind`)."""
    fn = mod.base_name
    for p, spec in mod.specs.items():
        if spec.kind == "int":
            spec.check = _non_negative(fn)
    if callable(name):
        mod._name_fn = name
    else:
        mod = mod.renamed(name)
    return mod.bind(**values) if values else mod


def _mask(name: Union[str, Callable[[dict], str]], body: Callable, **values: Any) -> ScoreMod:
    """Trace `body(b, h, q_idx, kv_idx, **params) -> condition` as a mask (see _finish)."""
    return _finish(sm.mask_mod(body, name=body.__name__), name, **values)


def _mod(name: Union[str, Callable[[dict], str]], body: Callable, **values: Any) -> ScoreMod:
    return _finish(sm.score_mod(body, name=body.__name__), name, **values)


# =============================================================================== 1-D masks

def causal() -> ScoreMod:
    """Causal mask (attention-gym ``causal_mask``): query i attends keys j <= i (top-left).

    Mask of ``causal()`` (Sq = 4, Skv = 6):

        x . . . . .
        x x . . . .
        x x x . . .
        x x x x . .

    This is the library's ``score_mods.causal()``, which runs as cuDNN's native causal band.
    """
    return sm.causal()


def sliding_window(window: int) -> ScoreMod:
    """Causal sliding window (``generate_sliding_window``): i - window <= j <= i, so each query
    sees itself and the `window` keys before it. `window` is the runtime scalar `left`
    (``sliding_window(2).bind(left=5)``).

    Mask of ``sliding_window(2)`` (Sq = 6, Skv = 6):

        x . . . . .
        x x . . . .
        x x x . . .
        . x x x . .
        . . x x x .
        . . . x x x

    The library's ``sliding_window(window, 0)``: it runs as cuDNN's native band.
    """
    window = _int("sliding_window", "window", window, 0)
    mod = sm.sliding_window(window, 0)
    out = mod.renamed("sliding_window")
    out._name_fn = lambda v: f"sliding_window_{int(v['left'])}"
    out.native_band = mod.native_band
    return out


def dilated_sliding_window(window: int, dilation: int) -> ScoreMod:
    """Dilated window (``generate_dilated_sliding_window``): |i - j| <= window and |i - j| is a
    multiple of `dilation`. `window` is a runtime int; `dilation` is structure (it is in a %).

    Mask of ``dilated_sliding_window(4, 2)`` (Sq = 7, Skv = 7):

        x . x . x . .
        . x . x . x .
        x . x . x . x
        . x . x . x .
        x . x . x . x
        . x . x . x .
        . . x . x . x
    """
    window = _int("dilated_sliding_window", "window", window, 0)
    dilation = _int("dilated_sliding_window", "dilation", dilation)

    def dilated_sliding_window(b, h, q_idx, kv_idx, window=0):
        dist = (q_idx - kv_idx).abs()
        return (dist <= window) & (dist % dilation == 0)

    return _mask(lambda v: f"dilated_sliding_window_{v['window']}_d{dilation}", dilated_sliding_window, window=window)


def global_sliding_window(window: int, is_global: IntSeq) -> ScoreMod:
    """Longformer (``generate_global_sliding_window``): |i - j| <= window, or either token is
    global. is_global: (S,) bools or 0/1 ints, a bool tensor parameter (Sq = Skv = S); `window` is
    a runtime int.

    Mask of ``global_sliding_window(1, [0, 0, 0, 1, 0, 0])`` (Sq = 6, Skv = 6):

        x x . x . .
        x x x x . .
        . x x x . .
        x x x x x x
        . . . x x x
        . . . x x x
    """
    window = _int("global_sliding_window", "window", window, 0)
    flags = _ints("global_sliding_window", "is_global", is_global)

    def global_sliding_window(b, h, q_idx, kv_idx, window=0, is_global=sm.TensorParam("bool")):
        return ((q_idx - kv_idx).abs() <= window) | is_global[q_idx] | is_global[kv_idx]

    return _mask(lambda v: f"global_sliding_window_{v['window']}", global_sliding_window, window=window,
                 is_global=flags != 0)


def prefix_lm(prefix_length: int) -> ScoreMod:
    """Prefix LM (``generate_prefix_lm_mask``): every query sees the first `prefix_length` keys,
    and keys j <= i (causal). `prefix` is a runtime int.

    Mask of ``prefix_lm(3)`` (Sq = 6, Skv = 6):

        x x x . . .
        x x x . . .
        x x x . . .
        x x x x . .
        x x x x x .
        x x x x x x
    """
    n = _int("prefix_lm", "prefix_length", prefix_length, 0)

    def prefix_lm(b, h, q_idx, kv_idx, prefix=0):
        return (kv_idx < prefix) | (kv_idx <= q_idx)

    return _mask(lambda v: f"prefix_lm_{v['prefix']}", prefix_lm, prefix=n)


def _doc_tables(fn: str, offsets: IntSeq) -> Tuple[torch.Tensor, torch.Tensor]:
    off = _offsets(fn, offsets)
    ids = torch.repeat_interleave(torch.arange(off.numel() - 1), off.diff())
    return ids.to(torch.int32), off[ids].to(torch.int32)


def document(offsets: IntSeq, inner: Optional[Predicate] = None) -> ScoreMod:
    """Packed documents (``generate_doc_mask_mod``): i and j in the same document and, when given,
    ``inner(b, h, i - start(i), j - start(j))`` on positions within the document.

    offsets: (D + 1,) cumulative document lengths starting at 0 (Sq = Skv = offsets[-1]).
    inner: a condition written in the language, e.g. ``lambda b, h, q, kv: kv <= q``. The
    per-token document id and start are int tensor parameters indexed by q_idx / kv_idx.

    Mask of ``document([0, 2, 5, 6], inner=lambda b, h, q, kv: kv <= q)`` (Sq = 6, Skv = 6):

        x . . . . .
        x x . . . .
        . . x . . .
        . . x x . .
        . . x x x .
        . . . . . x
    """
    ids, starts = _doc_tables("document", offsets)
    if inner is None:
        def document(b, h, q_idx, kv_idx, doc_ids=sm.TensorParam("int")):
            return doc_ids[q_idx] == doc_ids[kv_idx]

        return _mask("document", document, doc_ids=ids)
    if not callable(inner):
        raise TypeError(f"document: inner must be a function (b, h, q_idx, kv_idx) -> condition, got {inner!r}")

    def document(b, h, q_idx, kv_idx, doc_ids=sm.TensorParam("int"), doc_start=sm.TensorParam("int")):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return same & inner(b, h, q_idx - doc_start[q_idx], kv_idx - doc_start[kv_idx])

    return _mask(f"document_{getattr(inner, '__name__', 'inner')}".replace("<lambda>", "inner"), document,
                 doc_ids=ids, doc_start=starts)


def document_causal(offsets: IntSeq) -> ScoreMod:
    """Causal packed documents (``generate_packed_causal_doc_mask_mod``): start(i) <= j <= i, one
    contiguous key interval per query; doc_start is an int tensor parameter indexed by q_idx.

    Mask of ``document_causal([0, 2, 5, 6])`` (Sq = 6, Skv = 6):

        x . . . . .
        x x . . . .
        . . x . . .
        . . x x . .
        . . x x x .
        . . . . . x
    """
    _, starts = _doc_tables("document_causal", offsets)

    def document_causal(b, h, q_idx, kv_idx, doc_start=sm.TensorParam("int")):
        return (kv_idx >= doc_start[q_idx]) & (kv_idx <= q_idx)

    return _mask("document_causal", document_causal, doc_start=starts)


def shared_prefix(offsets: IntSeq, prefix_document_id: IntSeq) -> ScoreMod:
    """Shared prompt prefix (``generate_shared_prefix_mask_mod``): packed documents, each attending
    causally within itself and, unless it is a prefix, to all of its prefix document.

    offsets: (D + 1,) cumulative lengths; prefix_document_id: (D,) the prefix document of each
    document (a prefix maps to itself). Three per-query int tables (document start, prefix
    start, prefix end; an empty span for prefixes) make it
    ``start(i) <= j <= i  or  pstart(i) <= j < pend(i)``.

    Mask of ``shared_prefix([0, 2, 4, 5], [0, 0, 0])`` (Sq = 5, Skv = 5):

        x . . . .
        x x . . .
        x x x . .
        x x x x .
        x x . . x
    """
    fn = "shared_prefix"
    off = _offsets(fn, offsets)
    pdoc = _ints(fn, "prefix_document_id", prefix_document_id)
    n_docs = off.numel() - 1
    if pdoc.numel() != n_docs or bool(((pdoc < 0) | (pdoc >= n_docs)).any()) or bool((pdoc[pdoc] != pdoc).any()):
        raise ValueError(f"{fn}: prefix_document_id must hold, for each of the {n_docs} documents, a document "
                         f"index whose own prefix is itself; got {pdoc.tolist()}")
    ids = torch.repeat_interleave(torch.arange(n_docs), off.diff())
    own = pdoc[ids] == ids
    pstart = torch.where(own, 0, off[pdoc[ids]])
    pend = torch.where(own, 0, off[pdoc[ids] + 1])

    def shared_prefix(b, h, q_idx, kv_idx, doc_start=sm.TensorParam("int"), prefix_start=sm.TensorParam("int"),
             prefix_end=sm.TensorParam("int")):
        in_doc = (kv_idx >= doc_start[q_idx]) & (kv_idx <= q_idx)
        in_prefix = (kv_idx >= prefix_start[q_idx]) & (kv_idx < prefix_end[q_idx])
        return in_doc | in_prefix

    return _mask(fn, shared_prefix, doc_start=off[ids].to(torch.int32), prefix_start=pstart.to(torch.int32),
                 prefix_end=pend.to(torch.int32))


# =============================================================================== 2-D / 3-D neighbourhoods

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
    of bits decoded follows the canvas; all sizes are structure.

    Mask of ``morton_natten(4, 2, 3, 1)`` (Sq = 8, Skv = 8):

        x x . . x . . .
        x x . . x . . .
        . . x x . . x .
        . . x x . . x .
        . x . . x x . .
        . x . . x x . .
        . . . x . . x x
        . . . x . . x x
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


# =============================================================================== video and sparse masks

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


def block_diffusion(seq_len: int, block_size: int) -> ScoreMod:
    """Block Diffusion training mask (``generate_block_diffusion_mask``, BD3-LM) over 2n tokens:
    noised x_t at [0, n), clean x_0 at [n, 2n), both cut into blocks. Noised tokens see their own
    noised block and the clean blocks strictly before it; clean tokens see clean blocks up to and
    including their own. n and the block size are structure.

    Mask of ``block_diffusion(3, 2)`` (Sq = 6, Skv = 6):

        x x . . . .
        x x . . . .
        . . x x x .
        . . . x x .
        . . . x x .
        . . . x x x
    """
    n, bs = _int("block_diffusion", "seq_len", seq_len), _int("block_diffusion", "block_size", block_size)

    def block_diffusion(b, h, q_idx, kv_idx):
        q_noised, kv_noised = q_idx < n, kv_idx < n
        q_block, kv_block = (q_idx % n) // bs, (kv_idx % n) // bs
        own_block = (q_block == kv_block) & (q_noised == kv_noised)
        earlier_clean = (q_block > kv_block) & q_noised & ~kv_noised
        clean_causal = (q_block >= kv_block) & ~q_noised & ~kv_noised
        return own_block | earlier_clean | clean_causal

    return _mask(f"block_diffusion_{n}_b{bs}", block_diffusion)


def tree_ancestors(parents: Sequence[int]) -> torch.Tensor:
    """(N, N) int32 ancestor matrix of a tree given parent indices in parent-before-child order
    (entry 0, the root, is ignored): [i, j] = 1 when node j is on node i's path from the root."""
    parents = list(parents)
    if not parents:
        raise ValueError("tree_ancestors: the tree needs at least one node")
    out = torch.eye(len(parents), dtype=torch.int32)
    for node in range(1, len(parents)):
        p = parents[node]
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < node:
            raise ValueError(f"tree_ancestors: node {node}'s parent must be an int in [0, {node}), got {p!r}")
        out[node] |= out[p]
    return out


def jetspec_tree(prefix_length: int, ancestors: torch.Tensor) -> ScoreMod:
    """JetSpec tree-causal mask (``generate_jetspec_tree_causal_mask_mod``): N drafted tree nodes
    (queries) see the verified prefix and their own ancestors (themselves included).

    ancestors: (N, N) 0/1, [i, j] = node j is on node i's root path (`tree_ancestors`); Sq = N,
    Skv = prefix_length + N. The prefix length is structure (it shifts the table index).

    Mask of ``jetspec_tree(2, tree_ancestors([-1, 0, 0, 1]))`` (Sq = 4, Skv = 6):

        x x x . . .
        x x x x . .
        x x x . x .
        x x x x . x
    """
    fn = "jetspec_tree"
    p = _int(fn, "prefix_length", prefix_length, 0)
    anc = _ints(fn, "ancestors", ancestors, 2)
    n = anc.shape[0]
    if n == 0 or anc.shape[1] != n:
        raise ValueError(f"{fn}: ancestors must be a non-empty square (N, N) matrix, got shape {tuple(anc.shape)}")

    def jetspec_tree(b, h, q_idx, kv_idx, ancestors=sm.TensorParam("bool")):
        node = (kv_idx - p).clamp(0, n - 1)
        return (kv_idx < p) | ((kv_idx >= p) & (kv_idx < p + n) & ancestors[q_idx, node])

    return _mask(f"jetspec_tree_p{p}_n{n}", jetspec_tree, ancestors=anc != 0)


def jetspec_training(prefix_length: int, block_size: int) -> ScoreMod:
    """JetSpec draft-head training mask (``generate_jetspec_training_mask_mod``): queries are
    sampled blocks of `block_size` tokens; keys are the prefix then the same blocks. A query sees
    the whole prefix and the positions of its own block up to itself. Both sizes are structure.

    Mask of ``jetspec_training(2, 2)`` (Sq = 4, Skv = 6):

        x x x . . .
        x x x x . .
        x x . . x .
        x x . . x x
    """
    p = _int("jetspec_training", "prefix_length", prefix_length, 0)
    bs = _int("jetspec_training", "block_size", block_size)

    def jetspec_training(b, h, q_idx, kv_idx):
        r = kv_idx - p
        own = (kv_idx >= p) & (q_idx // bs == r // bs) & (r % bs <= q_idx % bs)
        return (kv_idx < p) | own

    return _mask(f"jetspec_training_p{p}_b{bs}", jetspec_training)


def flamingo(intervals: IntSeq, image_token_length: int) -> ScoreMod:
    """Flamingo vision cross-attention (``generate_vision_cross_attention_mask_mod``): keys are
    images of `image_token_length` tokens each; text token i sees image m when
    intervals[m, 0] <= i < intervals[m, 1]. Sq = text length, Skv = M * image_token_length; a text
    token that no image covers sees nothing (output 0). Each key's span is an int table on kv_idx.

    Mask of ``flamingo([[0, 2], [1, 3]], 2)`` (Sq = 4, Skv = 4):

        x x . .
        x x x x
        . . x x
        . . . .
    """
    fn = "flamingo"
    spans = _ints(fn, "intervals", intervals, 2)
    if spans.shape[-1] != 2:
        raise ValueError(f"{fn}: intervals must have shape (num_images, 2), got {tuple(spans.shape)}")
    L = _int(fn, "image_token_length", image_token_length)
    start, end = spans[:, 0].repeat_interleave(L), spans[:, 1].repeat_interleave(L)

    def flamingo(b, h, q_idx, kv_idx, image_start=sm.TensorParam("int"), image_end=sm.TensorParam("int")):
        return (q_idx >= image_start[kv_idx]) & (q_idx < image_end[kv_idx])

    return _mask(f"flamingo_{spans.shape[0]}x{L}", flamingo, image_start=start.to(torch.int32),
                 image_end=end.to(torch.int32))


def batchify(size: int, inner: Optional[Predicate] = None) -> ScoreMod:
    """Batchify (``batchify_mask_mod``): tokens in consecutive groups of `size` attend only within
    their group, and when given, ``inner(b, h, i % size, j % size)`` on positions in the group.
    `size` is structure.

    Mask of ``batchify(2, inner=lambda b, h, q, kv: kv <= q)`` (Sq = 5, Skv = 5):

        x . . . .
        x x . . .
        . . x . .
        . . x x .
        . . . . x
    """
    s = _int("batchify", "size", size)
    if inner is not None and not callable(inner):
        raise TypeError(f"batchify: inner must be a function (b, h, q_idx, kv_idx) -> condition, got {inner!r}")

    def batchify(b, h, q_idx, kv_idx):
        same = q_idx // s == kv_idx // s
        return same if inner is None else same & inner(b, h, q_idx % s, kv_idx % s)

    return _mask(f"batchify_{s}", batchify)


# =============================================================================== score mods

def alibi(num_heads: int) -> ScoreMod:
    """attention-gym's ALiBi (``generate_alibi_bias``): score + (j - i) * 2^(-8 (h + 1) / H).

    The slope is computed in the expression from h (no tensor); H is structure. Unlike the
    library's ``alibi(alibi_slopes(H))``, this is the plain geometric series for every H, also
    when H is not a power of two.
    """
    H = _int("alibi", "num_heads", num_heads)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) * sm.pow(2.0, (h + 1) * (-8.0 / H))

    return _mod(f"alibi_h{H}", alibi)


def softcap(cap: float) -> ScoreMod:
    """tanh softcapping (``generate_tanh_softcap``): cap * tanh(score / cap); cap a runtime scalar.

    The library's ``softcap(cap)``, named with its value. ``approx=True`` (PTX tanh.approx) is a
    kernel-level instruction choice with the same math; cuDNN uses its own tanh.
    """
    mod = sm.softcap(cap)
    return mod.renamed(f"softcap_{mod.scalars()['cap']:g}")


def _gelu(x):
    return 0.5 * x * (1.0 + sm.erf(x * (1.0 / math.sqrt(2.0))))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + sm.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


#: name -> (activation in the language, its minimum over the reals: offset must exceed -minimum)
ACTIVATIONS = {
    "gelu": (_gelu, -0.16997),
    "gelu_tanh": (_gelu_tanh, -0.17004),
    "relu": (lambda x: sm.maximum(x, 0.0), 0.0),
    "sigmoid": (sm.sigmoid, 0.0),
    "silu": (lambda x: x * sm.sigmoid(x), -0.27847),
}


def activation(kind: Union[str, Callable] = "gelu", offset: float = 1.0) -> ScoreMod:
    """Softmax replaced by an activation f (``generate_activation_score_mod``): log(f(score) + offset),
    so the softmax numerator is f(s) + offset. `offset` (a runtime scalar) keeps the log's argument
    positive. kind: "gelu" (exact, via erf), "gelu_tanh", "relu", "sigmoid", "silu", or a
    function of one symbolic value written in the language.

    Recover f(S) V: ``out, lse = dot_product_attention(..., return_lse=True)``;
    ``out * lse.exp()[..., None] - offset * v_sum``, v_sum = the sum of the attended values.
    """
    if isinstance(kind, str):
        if kind not in ACTIVATIONS:
            raise ValueError(f"activation: kind must be one of {sorted(ACTIVATIONS)} or a function, got {kind!r}")
        f, low = ACTIVATIONS[kind]
        name = kind
    elif callable(kind):
        f, low, name = kind, 0.0, getattr(kind, "__name__", "custom").replace("<lambda>", "custom")
    else:
        raise TypeError(f"activation: kind must be a name or a function, got {kind!r}")
    offset = _float("activation", "offset", offset)
    if not offset > -low:
        raise ValueError(f"activation: offset must exceed {-low:g} so that {name}(s) + offset > 0, got {offset!r}")

    def activation(score, b, h, q_idx, kv_idx, offset=1.0):
        return sm.log(f(score) + offset)

    return _mod(f"activation_{name}", activation, offset=offset)


def _table(fn: str, name: str, t: Any, rank: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != rank:
        raise TypeError(f"{fn}: {name} must be a floating torch.Tensor with {rank} dims, got "
                        f"{type(t).__name__ if not isinstance(t, torch.Tensor) else (t.dtype, tuple(t.shape))}")
    return t


def graphormer_spatial(distances: torch.Tensor, table: torch.Tensor) -> ScoreMod:
    """Graphormer spatial encoding (``generate_graphormer_spatial_bias``): score + table[h, d(i, j)],
    d the shortest-path distance bucket between nodes i and j.

    distances: (B|1, N, N) ints in [0, num_buckets); table: (H, num_buckets) learnable (a float
    tensor parameter; pass an nn.Parameter, gradients flow on the reference backend).
    """
    fn = "graphormer_spatial"
    dist = _ints(fn, "distances", distances, 3)
    table = _table(fn, "table", table, 2)
    if dist.numel() and (int(dist.min()) < 0 or int(dist.max()) >= table.shape[1]):
        raise ValueError(f"{fn}: distances must lie in [0, {table.shape[1]}) (the table's buckets)")

    def graphormer_spatial(score, b, h, q_idx, kv_idx, table=sm.TensorParam(), distances=sm.TensorParam("int")):
        return score + table[h, distances[b, q_idx, kv_idx]]

    return _mod(f"graphormer_spatial_{table.shape[1]}", graphormer_spatial, table=table, distances=dist.to(torch.int32))


def graphormer_edge(path_edge_types: torch.Tensor, path_lengths: torch.Tensor, table: torch.Tensor) -> ScoreMod:
    """Graphormer edge encoding (``generate_graphormer_edge_bias``): score + the mean over the first
    len(i, j) edges of the shortest i-j path of table[h, n, type of edge n] (0 when len = 0).

    path_edge_types: (B|1, N, N, K) ints in [0, num_edge_types); path_lengths: (B|1, N, N) ints in
    [0, K]; table: (H, K, num_edge_types) learnable. The mean is written as a weighted sum,
    sum_n w[b, i, j, n] * table[h, n, type_n] with w = [n < len] / max(len, 1) computed here (a
    float tensor parameter, not learned), so the mod has no condition and keeps its cuDNN
    backward. The K path positions are unrolled (K is structure).
    """
    fn = "graphormer_edge"
    types = _ints(fn, "path_edge_types", path_edge_types, 4)
    lengths = _ints(fn, "path_lengths", path_lengths, 3)
    table = _table(fn, "table", table, 3)
    K = types.shape[-1]
    if K < 1 or table.shape[1] != K:
        raise ValueError(f"{fn}: table must have one row per path position (K = {K}), got shape {tuple(table.shape)}")
    if types.numel() and (int(types.min()) < 0 or int(types.max()) >= table.shape[2]):
        raise ValueError(f"{fn}: path_edge_types must lie in [0, {table.shape[2]}) (the table's edge types)")
    if lengths.shape != types.shape[:-1] or (lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > K)):
        raise ValueError(f"{fn}: path_lengths must have shape {tuple(types.shape[:-1])} and lie in [0, {K}]")
    positions = torch.arange(K, device=lengths.device)
    weight = (positions < lengths[..., None]).to(table.dtype) / lengths.clamp(min=1)[..., None].to(table.dtype)

    def graphormer_edge(score, b, h, q_idx, kv_idx, table=sm.TensorParam(), path_types=sm.TensorParam("int"),
                        path_weight=sm.TensorParam()):
        bias = 0.0
        for n in range(K):
            bias = bias + path_weight[b, q_idx, kv_idx, n] * table[h, n, path_types[b, q_idx, kv_idx, n]]
        return score + bias

    return _mod(f"graphormer_edge_k{K}", graphormer_edge, table=table, path_types=types.to(torch.int32),
                path_weight=weight)


def sandwich_table(max_seq_len: int, d_bar: int = 128, dtype: torch.dtype = torch.float32,
                   device: Any = None) -> torch.Tensor:
    """(2 max_seq_len - 1,) Sandwich relative table: entry r + max_seq_len - 1 is
    sum_k cos(r w_k), w_k = 10000^(-2k / d_bar), k < d_bar / 2 (computed in float64)."""
    M, d = _int("sandwich_table", "max_seq_len", max_seq_len), _int("sandwich_table", "d_bar", d_bar, 2)
    w = torch.pow(10000.0, -2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    r = torch.arange(1 - M, M, dtype=torch.float64).abs()
    return torch.cos(r[:, None] * w).sum(-1).to(dtype=dtype, device=device)


def sandwich(num_heads: int, max_seq_len: int, d_bar: int = 128, dtype: torch.dtype = torch.float32,
             device: Any = None) -> ScoreMod:
    """Sandwich (``generate_sandwich_bias``): score + rel[i - j] * H / (8 (h + 1)), with rel the
    sinusoidal position-position inner product (`sandwich_table`) and ALiBi-like head ratios.

    The table is a tensor parameter indexed by i - j + max_seq_len - 1 (max_seq_len is
    structure; Sq and Skv must not exceed it); the head ratio is computed from h.
    """
    H = _int("sandwich", "num_heads", num_heads)
    M = _int("sandwich", "max_seq_len", max_seq_len)

    def sandwich(score, b, h, q_idx, kv_idx, rel=sm.TensorParam()):
        return score + rel[q_idx - kv_idx + (M - 1)] * (H / 8.0) / (h + 1)

    return _mod(f"sandwich_h{H}_m{M}", sandwich, rel=sandwich_table(M, d_bar, dtype, device))


def relative_position_bias(table: torch.Tensor, max_distance: int = 128, bidirectional: bool = True) -> ScoreMod:
    """Learned T5 relative position bias (not in attention-gym): score + table[h, bucket(j - i)].

    table: (H, num_buckets) learnable. Buckets as in T5: with `bidirectional`, half the buckets
    are for keys after the query; within a half, distances below half of it are exact and larger
    ones share log-spaced buckets up to `max_distance` (the last bucket takes the rest). The
    bucket count, max_distance and direction are structure.
    """
    fn = "relative_position_bias"
    table = _table(fn, "table", table, 2)
    md = _int(fn, "max_distance", max_distance)
    if not isinstance(bidirectional, bool):
        raise TypeError(f"{fn}: bidirectional must be a bool, got {bidirectional!r}")
    n = table.shape[1] // 2 if bidirectional else table.shape[1]
    exact = n // 2
    if exact < 1 or md <= exact:
        raise ValueError(f"{fn}: needs at least {4 if bidirectional else 2} buckets and max_distance > {exact}, "
                         f"got {table.shape[1]} buckets and max_distance {md}")
    # the structure is made once per (buckets, max_distance, direction): a model may build this
    # mod from its table in every forward, also under torch.compile(fullgraph=True)
    return template(_relative_position_structure, table.shape[1], md, bidirectional).bind(table=table)


def _relative_position_structure(buckets: int, md: int, bidirectional: bool) -> ScoreMod:
    n = buckets // 2 if bidirectional else buckets
    exact = n // 2
    log_scale = (n - exact) / math.log(md / exact)

    def relative_position_bias(score, b, h, q_idx, kv_idx, table=sm.TensorParam()):
        rel = kv_idx - q_idx
        if bidirectional:
            first, dist = sm.where(rel > 0, n, 0), rel.abs()
        else:
            first, dist = 0, sm.maximum(-rel, 0)
        far = exact + sm.floor(sm.log(sm.maximum(dist, exact) / exact) * log_scale)
        bucket = first + sm.where(dist < exact, dist, sm.minimum(far, n - 1))
        return score + table[h, bucket]

    name = f"relative_position_bias_{buckets}_{md}{'' if bidirectional else '_causal'}"
    return _mod(name, relative_position_bias)
