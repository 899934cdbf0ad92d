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

Modules: masks_1d, sequences (documents, trees, spans, groups), neighbourhoods (2-D / 3-D),
video, biases (score mods and activations), common (checks and factories); this package
re-exports their names.
"""

from __future__ import annotations

from .biases import (  # noqa: F401
    ACTIVATIONS, activation, alibi, graphormer_edge, graphormer_spatial, relative_position_bias, sandwich,
    sandwich_table, softcap,
)
from .common import NEG_INF, IntSeq, Predicate  # noqa: F401
from .masks_1d import causal, dilated_sliding_window, global_sliding_window, prefix_lm, sliding_window  # noqa: F401
from .neighbourhoods import _neighbours, morton_natten, natten, sta_2d, sta_3d, tiled_natten  # noqa: F401
from .sequences import (  # noqa: F401
    batchify, block_diffusion, document, document_causal, flamingo, jetspec_training, jetspec_tree, shared_prefix,
    tree_ancestors,
)
from .video import svg_spatial, svg_temporal, vsa, vsa_block_map  # noqa: F401

__all__ = [
    "causal", "sliding_window", "dilated_sliding_window", "global_sliding_window", "prefix_lm", "document",
    "document_causal", "shared_prefix", "natten", "tiled_natten", "morton_natten", "sta_2d", "sta_3d",
    "svg_spatial", "svg_temporal", "vsa", "vsa_block_map", "block_diffusion", "jetspec_tree", "jetspec_training",
    "tree_ancestors", "flamingo", "batchify", "alibi", "softcap", "activation", "graphormer_spatial",
    "graphormer_edge", "sandwich", "sandwich_table", "relative_position_bias",
]

