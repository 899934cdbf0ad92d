"""score_mods: write an attention score modifier once, get cuDNN forward/backward and a torch reference.

Part of fused_attn: the fused-attn distribution installs it as its second top-level package, next
to `fused_attn` (the layout is fixed). It is not a separate project; it depends only on torch,
and no module of the standard library or of torch has this name, so it shadows none of them.
"""

from .base import LENGTH_OPERANDS, ScoreMod
from .expr import (
    TensorParam, abs, ceil, clamp, erf, exp, floor, kv_len, log, logical_and, logical_not, logical_or, logical_xor,
    maximum, minimum, pow, q_len, sigmoid, sqrt, tanh, where,
)
from .trace import TracedMod, mask_mod, score_mod
from .library import (
    alibi, alibi_slopes, and_masks, causal, causal_bottom_right, compose, document_mask, or_masks, padding_mask,
    post_scale_bias, sliding_window, softcap,
)
from .bias import materialize
from .parts import Trainable
from .raw import RawCallbackMod, add_release_listener, as_score_mod, raw_callback, remove_release_listener

__all__ = [
    "ScoreMod", "TracedMod", "RawCallbackMod", "LENGTH_OPERANDS", "score_mod", "mask_mod", "raw_callback",
    "as_score_mod", "add_release_listener", "remove_release_listener", "materialize", "Trainable",
    "TensorParam", "q_len", "kv_len", "tanh", "exp", "log", "abs", "sqrt", "sigmoid", "erf", "floor", "ceil",
    "pow", "clamp", "where", "minimum", "maximum", "logical_and", "logical_or", "logical_xor", "logical_not",
    "causal", "causal_bottom_right", "sliding_window", "softcap", "post_scale_bias", "alibi", "alibi_slopes",
    "document_mask", "padding_mask", "compose", "and_masks", "or_masks",
]

from . import gym  # noqa: E402  (attention-gym's masks and mods as factories: score_mods.gym.natten(...), ...)
