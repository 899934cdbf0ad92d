"""The attention *spec*: everything about a call except its tensors, validated once.

    spec, mod = resolve_spec(qkv_format="bshd", attn_mask_type="causal", score_mod=softcap(30.0))

`AttentionSpec` is immutable and hashable. Its score_mod part is *structural*: two specs with
score_mods of the same math (equal `cache_key`) are equal, whatever their float values or
tensor contents, so one call plan serves both; the values travel with each call (`mod`, the
second result of `resolve_spec`). `DotProductAttention` resolves its spec when it is built and
again when a configuration attribute changes; the functional API goes through a small bounded
memo keyed by its arguments (score_mod objects by identity, held weakly: a hit checks the very
same live object). Specs hold a mod's `structure_only()` (shapes, no data), never a user's tensor.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Hashable, Optional, Tuple

from . import validation as V
from .engine_table import names as backend_names
from .memo import BoundedMemo
from .problem import MASK_TYPES, QKV_FORMATS, Band

__all__ = ["AttentionSpec", "resolve_spec", "SOFTMAX_TYPES", "clear_spec_memo"]

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
_PADDING_TWIN = {"padding": "no_mask", "padding_causal": "causal"}


@dataclass(frozen=True)
class AttentionSpec:
    """The static configuration of an attention call.

    band: the diagonal band (causal / window) resolved from attn_mask_type and window_size;
    for thd the padding types equal their non-padding twins (thd always has lengths).
    padding: dense padding mask (lengths from cu_seqlens_q/kv). softmax_scale: None means
    1/sqrt(D) of the call's head dim. score_mod_key: the mod's structural key (None: no mod);
    `score_mod` is one mod of that structure (a template for lowering; not compared).
    softmax_type: "vanilla", "off-by-one" (a sink logit of 0 per head) or "learnable" (a
    per-head sink logit tensor given per call). dropout_p: attention dropout probability.
    """

    qkv_format: str
    attn_mask_type: str
    band: Optional[Band]
    padding: bool
    softmax_scale: Optional[float]
    score_mod_key: Hashable
    return_lse: bool
    deterministic: bool
    backend: str
    softmax_type: str = "vanilla"
    dropout_p: float = 0.0
    score_mod: Any = field(default=None, compare=False, hash=False, repr=False)
    #: A dense call whose band may leave keys no query attends, run on the attended ones
    #: (`key_range`). Not with a score_mod (it may read positions or key-sized tensors), dropout
    #: (its mask is laid out over all keys) or padding (served as packed sequences). Derived.
    trims_keys: bool = field(init=False, compare=False, hash=False, repr=False)
    #: A dense score_mod call with a band that `band_chunks` may serve as rectangles of the band
    #: (it decides per call signature). Derived.
    may_cut_band: bool = field(init=False, compare=False, hash=False, repr=False)
    _hash: int = field(init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "trims_keys", self.band is not None and self.qkv_format != "thd"
                           and not self.padding and self.score_mod_key is None and not self.dropout_p)
        object.__setattr__(self, "may_cut_band", self.band is not None and self.band.right is not None
                           and self.score_mod_key is not None and self.qkv_format != "thd" and not self.padding
                           and not self.dropout_p and self.backend != "reference")
        # a spec is hashed in every plan lookup: compute the hash once
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def is_packed(self) -> bool:
        return self.qkv_format == "thd"

    @property
    def has_sinks(self) -> bool:
        return self.softmax_type != "vanilla"


    def describe(self) -> str:
        """One line for errors and `explain`."""
        parts = [f"qkv_format={self.qkv_format!r}", f"attn_mask_type={self.attn_mask_type!r}"]
        if self.band is not None:
            parts.append(f"band={self.band}")
        if self.score_mod is not None:
            parts.append(f"score_mod={self.score_mod.name!r}")
        if self.softmax_type != "vanilla":
            parts.append(f"softmax_type={self.softmax_type!r}")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        if self.deterministic:
            parts.append("deterministic=True")
        parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)


def check_dropout(dropout_p: Any) -> float:
    """dropout_p: a float in [0, 1)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {dropout_p!r} ({type(dropout_p).__name__})")
    if not (0.0 <= float(dropout_p) < 1.0) or math.isnan(dropout_p):
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def _resolve(qkv_format: Any, attn_mask_type: Any, window_size: Any, softmax_scale: Any, score_mod: Any,
             score_mod_tensors: Any, score_mod_bprop: Any, score_mod_bprop_tensors: Any, return_lse: Any,
             backend: Any, deterministic: Any, softmax_type: Any, dropout_p: Any) -> Tuple[AttentionSpec, Any]:
    V.check_choice("qkv_format", qkv_format, QKV_FORMATS)
    V.check_choice("attn_mask_type", attn_mask_type, MASK_TYPES)
    V.check_choice("backend", backend, backend_names())
    V.check_choice("softmax_type", softmax_type, SOFTMAX_TYPES)
    V.check_bool("return_lse", return_lse)
    V.check_bool("deterministic", deterministic)
    dropout = check_dropout(dropout_p)
    window = V.check_window(window_size)
    packed = qkv_format == "thd"
    band = V.resolve_band(_PADDING_TWIN.get(attn_mask_type, attn_mask_type) if packed else attn_mask_type, window)
    scale = None if softmax_scale is None else V.check_scale(softmax_scale, 1)
    mod = None
    if any(x is not None for x in (score_mod, score_mod_tensors, score_mod_bprop, score_mod_bprop_tensors)):
        from score_mods import as_score_mod

        mod = as_score_mod(score_mod, tensors=score_mod_tensors, bprop=score_mod_bprop,
                           bprop_tensors=score_mod_bprop_tensors)
    spec = AttentionSpec(
        qkv_format=qkv_format, attn_mask_type=attn_mask_type, band=band,
        padding=not packed and attn_mask_type in V.PADDING_TYPES, softmax_scale=scale,
        score_mod_key=None if mod is None else mod.cache_key, return_lse=return_lse,
        deterministic=deterministic, backend=backend, softmax_type=softmax_type, dropout_p=dropout,
        score_mod=None if mod is None else mod.structure_only())
    return spec, mod


_SAME = object()  # the entry's normalized mod is the given score_mod itself


def frozen_template(mod: Any) -> Any:
    """`mod.structure_only()`, as an object of its own when that is `mod` itself and `mod` may be
    updated in place (a module's compile-stable mod, `TracedMod.take_values`): what outlives a
    call (a plan's or a registered spec's template) never changes behind its key."""
    if mod is None:
        return None
    template = mod.structure_only()
    if template is mod:
        template = mod.private_copy()
    return template


def stored_mod(mod: Any, given: Any) -> Any:
    """What a memo keyed by the given score_mod's identity stores for its normalized mod: a
    marker when they are one object (the memo then never holds the user's mod)."""
    return _SAME if mod is given else mod


def loaded_mod(stored: Any, given: Any) -> Any:
    """The normalized mod from `stored_mod`'s value, for the same given score_mod."""
    return given if stored is _SAME else stored
#: Resolved specs keyed by the call's configuration arguments. The score_mod enters the key by
#: identity and the entry holds it weakly (a hit checks it is the very same, live object): the memo
#: keeps no user's mod, nor its tensors, alive. The spec holds the mod's `structure_only()`; the
#: normalized mod is held only when it is not the given object and holds no tensor (a traced
#: plain function), else rebuilt from the given one.
_MEMO = BoundedMemo(256, "spec.resolved")


def clear_spec_memo() -> None:
    """Drop the memoized specs."""
    _MEMO.clear()


def _memo_get(key: tuple, score_mod: Any) -> Optional[Tuple[AttentionSpec, Any]]:
    """The memoized (spec, mod) for `key`, or None; TypeError if `key` is unhashable. On every
    call's path, so read without the lock or the LRU refresh (`peek`): an entry costs tens of
    microseconds to remake (no graph), and the memo's bound still holds."""
    if score_mod is None:  # None's id is never reused: no identity entry is needed
        return _MEMO.peek(key)
    hit = _MEMO.peek_identity(key, (score_mod,))
    if hit is None:
        return None
    spec, mod = hit
    return spec, loaded_mod(mod, score_mod)


def _memo_put(key: tuple, score_mod: Any, spec: AttentionSpec, mod: Any) -> None:
    if mod is not score_mod and mod is not None and mod.structure_only() is not mod:
        return  # a normalized mod holding tensors: not memoized
    if score_mod is None:  # a plain entry: None's id is never reused
        _MEMO.put(key, (spec, mod))
        return
    try:
        weakref.ref(score_mod)
    except TypeError:
        return  # not weakly referenceable: not memoized (the memo would keep it alive)
    _MEMO.put_identity(key, (score_mod,), (spec, stored_mod(mod, score_mod)))


def _typed(value: Any) -> Any:
    """`value` with the types of its scalars, so 1 / 1.0 / True never share a memo entry."""
    if isinstance(value, tuple):
        return tuple(_typed(v) for v in value)
    return (type(value), value)


def resolve_spec(qkv_format: Any = "bshd", attn_mask_type: Any = "no_mask", window_size: Any = None,
                 softmax_scale: Any = None, score_mod: Any = None, score_mod_tensors: Any = None,
                 score_mod_bprop: Any = None, score_mod_bprop_tensors: Any = None, return_lse: Any = False,
                 backend: Any = "auto", deterministic: Any = False, softmax_type: Any = "vanilla",
                 dropout_p: Any = 0.0) -> Tuple[AttentionSpec, Any]:
    """(AttentionSpec, the normalized score_mod or None); memoized; raises ValueError /
    TypeError naming a bad argument. Raw-callback dicts bypass the memo (their contents may change)."""
    raw = score_mod_tensors is not None or score_mod_bprop is not None or score_mod_bprop_tensors is not None
    key = None
    if not raw:
        # the types go into the key with the values, so 1 / 1.0 / True never share an entry
        window = window_size
        if window is not None:
            window = _typed(tuple(window) if isinstance(window, (list, tuple)) else window)
        key = (qkv_format, attn_mask_type, window, softmax_scale, type(softmax_scale), id(score_mod), return_lse,
               type(return_lse), backend, deterministic, type(deterministic), softmax_type, dropout_p, type(dropout_p))
        try:
            hit = _memo_get(key, score_mod)
        except TypeError:  # an unhashable argument: resolved without the memo (which names a bad one)
            key = None
        else:
            if hit is not None:
                return hit
    spec, mod = _resolve(qkv_format, attn_mask_type, window_size, softmax_scale, score_mod, score_mod_tensors,
                         score_mod_bprop, score_mod_bprop_tensors, return_lse, backend, deterministic,
                         softmax_type, dropout_p)
    if key is not None:
        _memo_put(key, score_mod, spec, mod)
    return spec, mod
