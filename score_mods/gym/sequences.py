"""Masks over packed or structured sequences: documents, shared prefixes, Block Diffusion's noised
and clean blocks, JetSpec's draft trees and blocks, Flamingo's image spans, batchify's groups."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

import score_mods as sm

from ..base import ScoreMod
from .common import IntSeq, Predicate, _int, _ints, _mask, _offsets

__all__ = [
    "document", "document_causal", "shared_prefix", "block_diffusion", "tree_ancestors", "jetspec_tree",
    "jetspec_training", "flamingo", "batchify",
]


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

    Mask of ``document([0, 2, 5, 6], inner=lambda b, h, q, kv: (kv <= q) & (kv >= q - 1))`` (Sq = 6, Skv = 6):

        x . . . . .
        x x . . . .
        . . x . . .
        . . x x . .
        . . . x x .
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
    The mask of ``document(offsets, inner=lambda b, h, q, kv: kv <= q)``, without the doc_ids table.

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
