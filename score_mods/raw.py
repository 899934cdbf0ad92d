"""Raw cuDNN callbacks (the expert path, Transformer Engine style) and `as_score_mod`.

    def my_fprop(graph, score, tensors):           # tensors: name -> cuDNN graph tensor
        return graph.mul(score, tensors["scale"])

    mod = raw_callback(my_fprop, bprop=my_bprop, tensors={"scale": torch.tensor(0.5)},
                       reference=lambda s, b, h, q, k: s * 0.5)

CPU scalar tensors in `tensors` / `bprop_tensors` become pass-by-value (1, 1, 1, 1) operands;
device tensors must be 4-D (B|1, H|1, Sq|1, Skv|1). Cache keys (keys.py): a function is keyed
by its name and a digest of its code (so a redefinition with other code gets another key); a
bound method of a class with `score_mod_graph_cache_key()` (Transformer Engine's protocol) by
that method's result; any other bound method by a token for its live object (listeners added
with `add_release_listener(fn)` hear the token when the object is collected); a callback whose
code cannot be keyed (a closure over a tensor) must give `cache_key=`, and so must one reading a
module-level object whose contents can change under the same code (`CFG["cap"]`, `OBJ.cap`):
without a key such a callback is refused with a ValueError (its cached graph would go stale).
Two module-level lambdas with identical code share a key: harmless, they build the same graph.

Tensors in `bprop_tensors` (and `tensors`) are version-checked between a forward and its
backward: an in-place update in between raises torch's "modified by an inplace operation" error.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Hashable, Iterable, Optional, Tuple

import torch

from .base import ScoreMod, meta_like
from .keys import add_release_listener, callback_key, check_user_key, remove_release_listener  # noqa: F401


def _operand(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"raw callback tensor {name!r} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "cpu":
        if t.numel() != 1:
            raise ValueError(f"raw callback tensor {name!r}: CPU tensors must be scalars (pass-by-value), got shape {tuple(t.shape)}")
        return t.reshape(1, 1, 1, 1)
    if t.dim() != 4:
        raise ValueError(f"raw callback tensor {name!r} must be 4-D (B|1, H|1, Sq|1, Skv|1), got shape {tuple(t.shape)}")
    return t


def _tensor_dict(arg: str, d: Optional[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    if d is None:
        return {}
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise TypeError(f"{arg} must be a dict of name -> torch.Tensor, got {type(d).__name__}")
    return {k: _operand(k, v) for k, v in d.items()}


def _structure(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: torch.zeros((1, 1, 1, 1), dtype=t.dtype) if t.device.type == "cpu" else meta_like(t)
            for k, t in tensors.items()}


class RawCallbackMod(ScoreMod):
    """A score_mod given as cuDNN callbacks `fn(graph, score, tensors) -> tensor`."""

    def __init__(self, fn: Callable, *, bprop: Optional[Callable] = None, tensors=None, bprop_tensors=None,
                 cache_key: Optional[Hashable] = None, reference: Optional[Callable] = None, name: Optional[str] = None):
        if not callable(fn):
            raise TypeError(f"raw_callback: fn must be callable, got {type(fn).__name__}")
        if bprop is not None and not callable(bprop):
            raise TypeError(f"raw_callback: bprop must be callable or None, got {type(bprop).__name__}")
        if reference is not None and not callable(reference):
            raise TypeError(f"raw_callback: reference must be callable or None, got {type(reference).__name__}")
        if bprop is None and bprop_tensors:
            raise ValueError(
                "score_mod_bprop_tensors (bprop_tensors=) given without score_mod_bprop (bprop=): the tensors are "
                "only bound to the backward callback; pass bprop= too, or drop them"
            )
        tokens: Tuple[int, ...] = ()
        if cache_key is None:
            fkey, tokens = callback_key(fn, "score_mod callback")
            bkey = None
            if bprop is not None:
                bkey, btokens = callback_key(bprop, "score_mod_bprop callback")
                tokens += tuple(t for t in btokens if t not in tokens)
            user_key = (fkey, bkey)
        else:
            user_key = check_user_key(cache_key, "raw_callback")
        #: tokens of the live objects this key depends on (see keys.add_release_listener)
        self.object_tokens = tokens
        self.fn, self.bprop, self.reference = fn, bprop, reference
        self.fwd_tensors = _tensor_dict("tensors", tensors)
        self.bwd_tensors = _tensor_dict("bprop_tensors", bprop_tensors)
        self.name = name or getattr(fn, "__name__", "raw_callback")
        self._key = ("raw", user_key, bprop is not None, tuple(sorted(self.fwd_tensors)), tuple(sorted(self.bwd_tensors)))

    @property
    def cache_key(self) -> Hashable:
        return self._key

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    @property
    def has_backward(self) -> bool:
        return self.bprop is not None

    def check(self, *, device, batch, heads, seqlen_q, seqlen_kv) -> None:
        device = torch.device(device)
        for name, t in {**self.fwd_tensors, **self.bwd_tensors}.items():
            if t.device.type != "cpu" and t.device.type != device.type:
                raise ValueError(f"score_mod {self.name!r}: tensor {name!r} is on {t.device}, the inputs on {device}")

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {**{f"fwd_{k}": v for k, v in self.fwd_tensors.items()}, **{f"bwd_{k}": v for k, v in self.bwd_tensors.items()}}

    def structure_only(self) -> "RawCallbackMod":
        """See ScoreMod.structure_only: device tensors as meta tensors, CPU scalars as fresh CPU
        scalars of their dtype (still pass-by-value); the callbacks and the key are kept."""
        if not self.fwd_tensors and not self.bwd_tensors:
            return self
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.fwd_tensors, copy.bwd_tensors = _structure(self.fwd_tensors), _structure(self.bwd_tensors)
        return copy

    def cudnn_operands(self, dims=None, *, device=None) -> Dict[str, torch.Tensor]:
        return self.tensors()

    def eager(self, score, b, h, q_idx, kv_idx, q_len, kv_len) -> torch.Tensor:
        if self.reference is None:
            raise NotImplementedError(
                f"raw cuDNN score_mod {self.name!r} has no eager reference; pass reference=fn(score, b, h, q_idx, kv_idx) "
                "to raw_callback / as_score_mod to use the reference backend or numerical checks"
            )
        out = self.reference(score, b, h, q_idx, kv_idx)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"raw cuDNN score_mod {self.name!r}: reference= must return a torch.Tensor, got "
                            f"{type(out).__name__}")
        try:
            shape = torch.broadcast_shapes(out.shape, score.shape)
        except RuntimeError:
            shape = None
        if shape != tuple(score.shape) or out.dim() != score.dim() or not out.is_floating_point():
            raise ValueError(f"raw cuDNN score_mod {self.name!r}: reference= must return floating scores with as "
                             f"many dims as the score, broadcastable to the score's shape {tuple(score.shape)}, got "
                             f"{out.dtype} of shape {tuple(out.shape)}")
        return out if out.shape == score.shape else out.expand(score.shape)

    def lower_forward(self, graph, score, operands, memo):
        return self.fn(graph, score, {k: operands[f"fwd_{k}"] for k in self.fwd_tensors})

    def lower_backward(self, graph, dscore, operands, memo):
        if self.bprop is None:
            raise NotImplementedError(f"raw cuDNN score_mod {self.name!r} has no bprop; pass bprop= (score_mod_bprop=) for training")
        return self.bprop(graph, dscore, {k: operands[f"bwd_{k}"] for k in self.bwd_tensors})


def raw_callback(fn: Callable, bprop: Optional[Callable] = None, tensors: Optional[Dict[str, torch.Tensor]] = None,
                 bprop_tensors: Optional[Dict[str, torch.Tensor]] = None, cache_key: Optional[Hashable] = None,
                 reference: Optional[Callable] = None) -> RawCallbackMod:
    """Wrap a raw cuDNN callback `fn(graph, score, tensors)` (and optional bprop) as a ScoreMod."""
    return RawCallbackMod(fn, bprop=bprop, tensors=tensors, bprop_tensors=bprop_tensors, cache_key=cache_key, reference=reference)


def _library_factory_call(obj: Any) -> Optional[str]:
    """`softcap(30.0)` when `obj` is a public factory of the score_mods package (`softcap`, `gym.natten`:
    functions that return a ScoreMod), else None."""
    module, name = getattr(obj, "__module__", None) or "", getattr(obj, "__name__", "")
    if not inspect.isfunction(obj) or name.startswith("_") or module.split(".")[0] != __name__.split(".")[0]:
        return None
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return None
    if [p.name for p in params[:5]] == ["score", "b", "h", "q_idx", "kv_idx"]:
        return None
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    args = required or [repr(p.default) for p in params[:1] if p.default is not inspect.Parameter.empty]
    return f"{name}({', '.join(args)})"


def as_score_mod(obj: Any, *, tensors=None, bprop=None, bprop_tensors=None, cache_key=None, reference=None) -> Optional[ScoreMod]:
    """Normalize what `dot_product_attention(score_mod=...)` receives into a ScoreMod (None stays None).

    A ScoreMod passes through; a callable with bprop/tensors/bprop_tensors/cache_key is a raw
    cuDNN callback; a plain `(score, b, h, q_idx, kv_idx) -> score` callable is traced.
    """
    raw_args = {"tensors": tensors, "bprop": bprop, "bprop_tensors": bprop_tensors, "cache_key": cache_key}
    given = [k for k, v in raw_args.items() if v is not None]
    if obj is None or isinstance(obj, ScoreMod):
        if given or reference is not None:
            what = "no score_mod" if obj is None else f"the ScoreMod {obj.name!r}"
            raise ValueError(f"{', '.join(given + (['reference'] if reference is not None else []))} given with {what}; "
                             "they only apply to raw cuDNN callbacks")
        return obj
    if not callable(obj):
        raise TypeError(f"score_mod must be a ScoreMod, a function (score, b, h, q_idx, kv_idx) -> score, or a raw "
                        f"cuDNN callback; got {type(obj).__name__}")
    if given:
        return raw_callback(obj, reference=reference, **raw_args)
    factory = _library_factory_call(obj)
    if factory is not None:
        raise TypeError(f"score_mod={obj.__name__} is the factory; call it, e.g. score_mod={factory}")
    try:
        nparams = len(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        nparams = -1
    if nparams == 3:
        raise TypeError(
            f"score_mod {getattr(obj, '__name__', obj)!r} takes 3 arguments like a raw cuDNN callback (graph, score, "
            "tensors); wrap it with score_mods.raw_callback(fn, bprop=..., cache_key=...) or pass score_mod_bprop="
        )
    from .trace import score_mod

    try:
        mod = score_mod(obj)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"score_mod {getattr(obj, '__name__', obj)!r} could not be traced ({exc}). Write it with operators and the "
            "score_mods namespace (score_mods.tanh, exp, where(cond, score, -inf), ...) instead of torch/math calls "
            "or Python if, or pass a raw cuDNN callback with score_mod_bprop="
        ) from exc
    if reference is not None:
        raise ValueError("reference= only applies to raw cuDNN callbacks; a traced score_mod is its own reference")
    return mod


def _of_parts(flag: str, combine: Callable[[Iterable[bool]], bool], optional: bool = False) -> property:
    """A ChainMod flag: `combine` (any / all) of its parts' `flag` (optional: False for a part without it)."""
    if optional:
        return property(lambda self: combine(getattr(p, flag, False) for p in self.parts))
    return property(lambda self: combine(getattr(p, flag) for p in self.parts))


class ChainMod(ScoreMod):
    """Several ScoreMods applied left to right without fusing (used when a part is a raw callback)."""

    def __init__(self, name: str, parts):
        self.name, self.parts = name, tuple(parts)

    def _ns(self, i: int, d: Dict[str, Any]) -> Dict[str, Any]:
        return {f"m{i}_{k}": v for k, v in d.items()}

    @property
    def cache_key(self) -> Hashable:
        return ("chain",) + tuple(p.cache_key for p in self.parts)

    uses_lengths = _of_parts("uses_lengths", any)
    has_reference = _of_parts("has_reference", all)
    has_backward = _of_parts("has_backward", all)
    irregular_mask = _of_parts("irregular_mask", any)
    needs_host_lengths = _of_parts("needs_host_lengths", any, optional=True)
    needs_dims = _of_parts("needs_dims", any, optional=True)

    def check(self, **kw) -> None:
        for p in self.parts:
            p.check(**kw)

    def scalars(self) -> Dict[str, float]:
        return {k: v for i, p in enumerate(self.parts) for k, v in self._ns(i, p.scalars()).items()}

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {k: v for i, p in enumerate(self.parts) for k, v in self._ns(i, p.tensors()).items()}

    def structural_values(self) -> Hashable:
        return tuple(p.structural_values() for p in self.parts)

    def structure_only(self) -> "ChainMod":
        parts = tuple(p.structure_only() for p in self.parts)
        return self if all(a is b for a, b in zip(parts, self.parts)) else ChainMod(self.name, parts)

    @property
    def cudnn_unsupported(self) -> Optional[str]:
        reasons = [r for r in (getattr(p, "cudnn_unsupported", None) for p in self.parts) if r]
        return "; ".join(reasons) or None

    def cudnn_operands(self, dims=None, *, device=None) -> Dict[str, torch.Tensor]:
        return {k: v for i, p in enumerate(self.parts)
                for k, v in self._ns(i, p.cudnn_operands(dims, device=device)).items()}

    def length_operands(self, q_len: int, kv_len: int) -> Dict[str, torch.Tensor]:
        out = {}
        for i, p in enumerate(self.parts):
            if hasattr(p, "length_operands"):
                out.update(self._ns(i, p.length_operands(q_len, kv_len)))
        return out

    def _part_operands(self, i: int, operands: Dict[str, Any]) -> Dict[str, Any]:
        pre = f"m{i}_"
        sub = {k[len(pre):]: v for k, v in operands.items() if k.startswith(pre)}
        sub.update({k: operands[k] for k in ("q_len", "kv_len") if k in operands})
        return sub

    def eager(self, score, b, h, q_idx, kv_idx, q_len, kv_len) -> torch.Tensor:
        for p in self.parts:
            score = p.eager(score, b, h, q_idx, kv_idx, q_len, kv_len)
        return score

    def _forward(self, graph, score, operands, memo, scaled: bool):
        for i, p in enumerate(self.parts):
            lower = p.lower_scaled_forward if scaled and i == 0 else p.lower_forward
            score = lower(graph, score, self._part_operands(i, operands), memo.setdefault(("part", i), {}))
        return score

    def _backward(self, graph, dscore, operands, memo, scaled: bool):
        for i in reversed(range(len(self.parts))):
            p = self.parts[i]
            lower = p.lower_scaled_backward if scaled and i == 0 else p.lower_backward
            dscore = lower(graph, dscore, self._part_operands(i, operands), memo.setdefault(("part", i), {}))
        return dscore

    def lower_forward(self, graph, score, operands, memo):
        return self._forward(graph, score, operands, memo, scaled=False)

    def lower_backward(self, graph, dscore, operands, memo):
        return self._backward(graph, dscore, operands, memo, scaled=False)

    def score_scale(self) -> float:
        """Only the first part sees the score itself: its folded factor (later parts see its output)."""
        return self.parts[0].score_scale()

    def lower_scaled_forward(self, graph, score, operands, memo):
        return self._forward(graph, score, operands, memo, scaled=True)

    def lower_scaled_backward(self, graph, dscore, operands, memo):
        return self._backward(graph, dscore, operands, memo, scaled=True)
