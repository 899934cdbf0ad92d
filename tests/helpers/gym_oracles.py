"""attention-gym's masks and score mods re-derived in plain torch: the oracles the ports in
`score_mods.gym` are checked against (nothing of attention-gym is imported). Each works both under
vmap (flex's create_block_mask / create_mask) and on broadcast index tensors (reference_attention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

NEG_INF = -math.inf
D = 8
F64 = torch.float64


# =============================================================================== oracles
# attention-gym's definitions, re-derived in plain torch. Each works both under vmap (flex's
# create_block_mask / create_mask) and on broadcast index tensors (reference_attention).


def og_causal():
    return lambda b, h, q, kv: q >= kv


def og_sliding_window(window):  # look back `window` keys, never ahead
    return lambda b, h, q, kv: (q >= kv) & (q - kv <= window)


def og_dilated_sliding_window(window, dilation):
    def mask(b, h, q, kv):
        dist = (q - kv).abs()
        return (dist <= window) & (dist % dilation == 0)
    return mask


def og_global_sliding_window(window, is_global):
    return lambda b, h, q, kv: ((q - kv).abs() <= window) | is_global[q] | is_global[kv]


def og_prefix_lm(prefix):
    return lambda b, h, q, kv: (kv < prefix) | (q >= kv)


def _doc_ids(offsets):
    return torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets.diff())


def og_document(offsets, inner=None):
    doc = _doc_ids(offsets)

    def mask(b, h, q, kv):
        same = doc[q] == doc[kv]
        if inner is None:
            return same
        return same & inner(b, h, q - offsets[doc[q]], kv - offsets[doc[kv]])
    return mask


def og_document_causal(offsets):
    doc = _doc_ids(offsets)
    return lambda b, h, q, kv: (kv >= offsets[doc[q]]) & (q >= kv)


def og_shared_prefix(offsets, prefix_doc):
    doc = _doc_ids(offsets)

    def mask(b, h, q, kv):
        d = doc[q]
        p = prefix_doc[d]
        own = (kv >= offsets[d]) & (q >= kv)
        shared = (d != p) & (kv >= offsets[p]) & (kv < offsets[p + 1])
        return own | shared
    return mask


def og_natten_as_published(canvas_w, canvas_h, kernel_w, kernel_h):
    """attention-gym's `generate_natten` literally: the row index (idx // canvas_w) is clamped with
    the kernel and canvas *widths*, so it is only the neighbourhood mask for square canvases."""
    def mask(b, h, q, kv):
        qx, qy = q // canvas_w, q % canvas_w
        kx, ky = kv // canvas_w, kv % canvas_w
        cx = qx.clamp(kernel_w // 2, canvas_w - 1 - kernel_w // 2)
        cy = qy.clamp(kernel_h // 2, canvas_h - 1 - kernel_h // 2)
        return ((cx - kx).abs() <= kernel_w // 2) & ((cy - ky).abs() <= kernel_h // 2)
    return mask


def og_tiled_natten(canvas_w, canvas_h, kernel_w, kernel_h, tile_w, tile_h):
    """attention-gym's `generate_tiled_natten` (its axes are right for any canvas); with 1x1 tiles it
    is the row-major neighbourhood mask, the oracle for plain `natten` on non-square canvases."""
    tiles_per_row = canvas_w // tile_w

    def xy(idx):
        tile, within = idx // (tile_w * tile_h), idx % (tile_w * tile_h)
        col = (tile % tiles_per_row) * tile_w + within % tile_w
        row = (tile // tiles_per_row) * tile_h + within // tile_w
        return col, row

    def mask(b, h, q, kv):
        qx, qy = xy(q)
        kx, ky = xy(kv)
        cx = qx.clamp(kernel_w // 2, canvas_w - 1 - kernel_w // 2)
        cy = qy.clamp(kernel_h // 2, canvas_h - 1 - kernel_h // 2)
        return ((cx - kx).abs() <= kernel_w // 2) & ((cy - ky).abs() <= kernel_h // 2)
    return mask


def morton_xy(code):
    """(x, y) of a Z-order code: x from the even bits, y from the odd bits (16 bits each)."""
    x = torch.zeros_like(code)
    y = torch.zeros_like(code)
    for bit in range(16):
        x = x | (((code >> (2 * bit)) & 1) << bit)
        y = y | (((code >> (2 * bit + 1)) & 1) << bit)
    return x, y


def morton_code(x, y):
    return sum((((x >> bit) & 1) << (2 * bit)) | (((y >> bit) & 1) << (2 * bit + 1)) for bit in range(16))


def og_morton_natten(canvas_w, canvas_h, kernel_w, kernel_h):
    def mask(b, h, q, kv):
        qx, qy = morton_xy(q)
        kx, ky = morton_xy(kv)
        cx = qx.clamp(kernel_w // 2, canvas_w - 1 - kernel_w // 2)
        cy = qy.clamp(kernel_h // 2, canvas_h - 1 - kernel_h // 2)
        return ((cx - kx).abs() <= kernel_w // 2) & ((cy - ky).abs() <= kernel_h // 2)
    return mask


def _sta_window(q_tile, kv_tile, kernel_tiles, canvas_tiles):
    lo, hi = kernel_tiles // 2, kernel_tiles // 2 + kernel_tiles % 2 - 1
    centre = q_tile.clamp(lo, canvas_tiles - 1 - hi)
    return (kv_tile >= centre - lo) & (kv_tile <= centre + hi)


def og_sta(canvas, kernel, tile, text_len=0):
    """STA over a 2-D (h, w) or 3-D (t, h, w) canvas in tile-major order, then text tokens."""
    tiles = [c // t for c, t in zip(canvas, tile)]
    ktiles = [k // t for k, t in zip(kernel, tile)]
    numel, vision = math.prod(tile), math.prod(canvas)

    def coords(idx):
        tid, out = idx // numel, []
        for n in reversed(tiles):
            out.append(tid % n)
            tid = tid // n
        return out[::-1]

    def mask(b, h, q, kv):
        near = (q < vision) & (kv < vision)
        for qt, kt, k, c in zip(coords(q), coords(kv), ktiles, tiles):
            near = near & _sta_window(qt, kt, k, c)
        to_text = (q < vision) & (kv >= vision) & (kv < vision + text_len)
        text = (q >= vision) & (kv < vision + text_len)
        return near | to_text | text
    return mask


def og_svg_spatial(prompt, frames, per_frame, width, sink, round_width):
    band = math.floor(width * per_frame / round_width) * round_width
    first_cols = prompt + per_frame if sink else prompt
    return lambda b, h, q, kv: (kv < first_cols) | (q < prompt) | ((q - kv).abs() < band)


def og_svg_temporal(prompt, frames, per_frame, width):
    band = (width * per_frame) // frames

    def mask(b, h, q, kv):
        same_place = (((q - prompt) % per_frame) - ((kv - prompt) % per_frame)).abs() < band
        return (kv < prompt) | (q < prompt) | same_place
    return mask


def og_vsa(topk, tile, sizes=None):
    def mask(b, h, q, kv):
        chosen = topk[b, h, q // tile]
        hit = (chosen == (kv // tile).unsqueeze(-1)).any(-1)
        return hit if sizes is None else hit & (kv % tile < sizes[kv // tile])
    return mask


def og_block_diffusion(seq_len, block):
    def mask(b, h, q, kv):
        qn, kn = q < seq_len, kv < seq_len
        qb, kb = (q % seq_len) // block, (kv % seq_len) // block
        diagonal = (qb == kb) & (qn == kn)
        offset_causal = (qb > kb) & qn & ~kn
        block_causal = (qb >= kb) & ~qn & ~kn
        return diagonal | offset_causal | block_causal
    return mask


def ancestors(parents):
    n = len(parents)
    out = torch.eye(n, dtype=torch.bool)
    for node in range(1, n):
        out[node] |= out[parents[node]]
    return out


def og_jetspec_tree(prefix, anc):
    n = anc.shape[0]

    def mask(b, h, q, kv):
        node = (kv - prefix).clamp(0, n - 1)
        return (kv < prefix) | ((kv >= prefix) & (kv < prefix + n) & anc[q, node])
    return mask


def og_jetspec_training(prefix, block):
    def mask(b, h, q, kv):
        r = kv - prefix
        own = (kv >= prefix) & (q // block == r // block) & (r % block <= q % block)
        return (kv < prefix) | own
    return mask


def og_flamingo(intervals, image_len):
    image = torch.repeat_interleave(torch.arange(intervals.shape[0]), image_len)

    def mask(b, h, q, kv):
        span = intervals[image[kv]]
        return (q >= span[..., 0]) & (q < span[..., 1])
    return mask


def og_batchify(size, inner=None):
    def mask(b, h, q, kv):
        same = q // size == kv // size
        return same if inner is None else same & inner(b, h, q % size, kv % size)
    return mask


def og_alibi(num_heads):
    return lambda s, b, h, q, kv: s + (kv - q) * torch.exp2(-((h + 1).to(F64) * 8.0 / num_heads))


def og_softcap(cap):
    return lambda s, b, h, q, kv: cap * torch.tanh(s / cap)


ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
}


def og_activation(kind, offset):
    f = ACTIVATIONS[kind]
    return lambda s, b, h, q, kv: torch.log(f(s) + offset)


def og_graphormer_spatial(table, dist):
    return lambda s, b, h, q, kv: s + table[h, dist[b, q, kv]]


def og_graphormer_edge(table, types, lengths):
    def score(s, b, h, q, kv):
        n_valid = lengths[b, q, kv]
        total = 0.0
        for n in range(types.shape[-1]):
            total = total + torch.where(n_valid > n, table[h, n, types[b, q, kv, n]], 0.0)
        return s + total / n_valid.clamp(min=1)
    return score


def sandwich_rel(max_len, d_bar):
    freqs = 1.0 / 10000 ** (2 * torch.arange(d_bar // 2, dtype=F64) / d_bar)
    dist = torch.arange(-(max_len - 1), max_len, dtype=F64).abs()
    return torch.cos(dist[:, None] * freqs).sum(-1)


def og_sandwich(num_heads, max_len, d_bar):
    rel = sandwich_rel(max_len, d_bar)
    head = num_heads / (8.0 * torch.arange(1, num_heads + 1, dtype=F64))
    return lambda s, b, h, q, kv: s + rel[q - kv + max_len - 1] * head[h]


def t5_bucket(rel, num_buckets, max_distance, bidirectional):
    """The T5 (HF `_relative_position_bucket`) bucket of rel = kv - q."""
    out = torch.zeros_like(rel)
    n = num_buckets
    if bidirectional:
        n //= 2
        out = out + (rel > 0).long() * n
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    exact = n // 2
    large = exact + (torch.log(rel.double() / exact) / math.log(max_distance / exact) * (n - exact)).long()
    return out + torch.where(rel < exact, rel, large.clamp(max=n - 1))


def og_t5(table, num_buckets, max_distance, bidirectional):
    return lambda s, b, h, q, kv: s + table[h, t5_bucket(kv - q, num_buckets, max_distance, bidirectional)]


