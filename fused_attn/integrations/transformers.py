"""fused_attn as a Hugging Face transformers attention implementation (transformers >= 5.17).

    import fused_attn.integrations.transformers as fa_hf
    fa_hf.register()                                   # adds attn_implementation="fused_attn"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fused_attn")
    # or, for a loaded model: model.set_attn_implementation("fused_attn")

`register()` adds two functions to transformers under one name: the attention function (the
`AttentionInterface` signature, called by every attention layer) and a mask function (the
`AttentionMaskInterface`, called once per forward and layer type by `create_causal_mask` /
`create_sliding_window_causal_mask`), so the model never builds a dense (B, 1, Sq, Skv) mask.

How transformers' arguments map onto `fused_attn.dot_product_attention`:

* query (B, H, Sq, D), key/value (B, Hkv, Skv, D|Dv): GQA is not expanded; the result is
  (B, Sq, H, Dv) (the call runs on bshd views, so the output needs no transpose copy).
* `is_causal` (kwarg, else `module.is_causal`, default True): "causal" when Sq == Skv, else
  "causal_bottom_right" (the queries are the last Sq keys: a KV cache).
* `sliding_window=W` (Mistral / Qwen2 / Gemma 2 / gpt-oss, the flash-attention convention of
  transformers): a causal query sees W keys including its own, i.e. eager's
  `kv_idx > q_idx - W`: window_size=(W - 1, 0); non-causal: (W - 1, W - 1). Omitted when it
  cannot exclude a key (W >= every length).
* `softcap=c` (Gemma 2's attn_logit_softcapping): score_mod `score_mods.softcap(c)`, one object
  per value (shared by every layer, so plans, graphs and compiled code are reused); masks and
  windows apply after it, as in eager.
* `s_aux` (gpt-oss sinks, (H,)): softmax_type="learnable", sinks=s_aux (trained: it gets a gradient).
* `scaling` -> softmax_scale; `dropout` -> dropout_p (models pass 0.0 outside training).
* Padding: the mask function returns the 2-D padding mask (bool (B, W), W = keys up to the last
  query); the attention function turns it, once per mask tensor, into packed thd with
  `cu_seqlens_*` and `cu_seqlens_*_padded` (no copy of q/k/v when their layout allows a view):
  left, right and per-row contiguous padding. Causal: padded query positions get 0 (as
  flash-attention; eager gives them an average of every value); bidirectional: every query
  attends the row's tokens (eager's semantics).
* Packed batches (`DataCollatorWithFlattening`): `cu_seq_lens_q/k` + `max_length_q/k` kwargs (no
  host sync), else the packing transformers detects in `position_ids` (when no cache is used:
  pass use_cache=False, as for eager and sdpa), which the mask function returns as int32
  segment ids (B, S) (0 = padding). transformers >= 5.24 evaluates such a row's pattern at
  per-sequence positions; for causal / bidirectional / window patterns that is the same mask.
* A prepared 4-D mask (bool, or additive 0 / large negative) is reduced to lengths when it is
  exactly causal/window + contiguous padding; anything else raises NotImplementedError.

Refused with NotImplementedError naming the case (never silently different): `or_mask_function`
/ custom and chunked / block-wise mask patterns, 4-D masks with biases or irregular patterns,
flex BlockMasks, the keywords in `UNSUPPORTED_KWARGS` (`position_bias`, sparse-attention
`indices` / `block_indices`, per-token `sinks`, `head_mask`), padding with holes inside a row,
a non-causal sliding window with a KV cache, packed position_ids with a padding mask or a cache. Padded batches cost one
host read per forward (per mask tensor, shared by the layers); dense and `cu_seq_lens_*` calls
cost none. torch.compile works with graph breaks at the mask handling (fullgraph=True does not:
transformers' mask closures cannot be read while tracing).

This module registers the integration and is its import path; the code lives in
`_hf_attention` (the attention function), `_hf_masks` (the mask function) and `_hf_lengths`
(padding masks and packed batches -> thd lengths).
"""

from __future__ import annotations

# _WARNED, _softcap_mod: internals the tests reach through this module
from ._hf_attention import _WARNED, UNSUPPORTED_KWARGS, _softcap_mod, attention_forward, make_attention_forward
from ._hf_masks import MaskPattern, attention_mask_function, parse_mask_function

__all__ = ["NAME", "register", "unregister", "make_attention_forward", "attention_forward", "attention_mask_function",
           "MaskPattern", "parse_mask_function", "UNSUPPORTED_KWARGS"]

#: The attn_implementation name `register()` uses by default.
NAME = "fused_attn"
_INSTALL = "pip install -e '.[hf]' from the fused_attn checkout (transformers>=5.17,<6)"


# ----------------------------------------------------------------------------- registration

def register(name: str = NAME, *, backend: str = "auto", deterministic: bool = False) -> str:
    """Register fused_attn with transformers as `attn_implementation=name`; returns `name`.

    backend / deterministic: passed to every `dot_product_attention` call ("auto": cuDNN on
    CUDA when it can serve, else the reference backend with a FallbackWarning).
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as exc:  # pragma: no cover - the tests skip without transformers
        raise ImportError(f"fused_attn.integrations.transformers needs transformers: {_INSTALL}") from exc
    AttentionInterface.register(name, make_attention_forward(backend=backend, deterministic=deterministic))
    AttentionMaskInterface.register(name, attention_mask_function)
    return name


def unregister(name: str = NAME) -> None:
    """Remove `name` from transformers' attention and mask interfaces (no error if absent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)
