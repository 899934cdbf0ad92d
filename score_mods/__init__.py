"""score_mods: write an attention score modifier once, get cuDNN forward/backward and a torch reference."""

from .base import LENGTH_OPERANDS, ScoreMod
from .expr import (
    TensorParam, abs, exp, kv_len, log, logical_and, logical_not, logical_or, maximum, minimum, q_len, sigmoid,
    sqrt, tanh, where,
)
from .trace import TracedMod, score_mod
from .library import (
    alibi, alibi_slopes, causal, causal_bottom_right, compose, document_mask, padding_mask, post_scale_bias,
    sliding_window, softcap,
)
from .raw import RawCallbackMod, as_score_mod, raw_callback

__all__ = [
    "ScoreMod", "TracedMod", "RawCallbackMod", "LENGTH_OPERANDS", "score_mod", "raw_callback", "as_score_mod",
    "TensorParam", "q_len", "kv_len", "tanh", "exp", "log", "abs", "sqrt", "sigmoid", "where", "minimum", "maximum",
    "logical_and", "logical_or", "logical_not",
    "causal", "causal_bottom_right", "sliding_window", "softcap", "post_scale_bias", "alibi", "alibi_slopes",
    "document_mask", "padding_mask", "compose",
]

from . import gym  # noqa: E402  (attention-gym's masks and mods as factories: score_mods.gym.natten(...), ...)
