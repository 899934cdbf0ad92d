"""`@score_mod` / `@mask_mod`: trace a flex-style Python function into a `TracedMod` (a ScoreMod).

    @score_mod
    def softcap(score, b, h, q_idx, kv_idx, cap=30.0):
        return cap * tanh(score / cap)

    @mask_mod
    def block_diagonal(b, h, q_idx, kv_idx, block=64):
        return q_idx // block == kv_idx // block      # == where(cond, score, -inf)

    softcap                 # a ScoreMod with cap = 30.0
    softcap(cap=50.0)       # the same graph (same cache_key), cap bound to 50.0
    softcap.bind(cap=50.0)  # same as above

Parameters after the index arguments must have defaults: a float (a runtime scalar), an int (a
runtime integer scalar: usable with // % and bit operations), or a tensor parameter declared
with `TensorParam("float"|"int"|"bool")` (or a torch.Tensor default). The function is traced
once, at decoration, with symbolic arguments.

This module holds `TracedMod` (its structure, binding and values) and the decorators; the
tracing itself is tracing.py, the cuDNN members traced_cudnn.py, the eager and flex_attention
members traced_eager.py.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Hashable, Mapping, Optional, Tuple, Union

import torch

from .caches import register_lru
from . import expr, parts
from .bands import band_of
from .base import ScoreMod, meta_like
from .expr import Node, structure_key
from .origins import _register_origin, origin_named  # noqa: F401 - origin_named re-exported
from .parts import pure_mask_condition
from .traced_cudnn import CudnnLowering
from .traced_eager import EagerAdapters
from .tracing import (  # noqa: F401 - mask_root, trace re-exported
    _KIND_WORDS, ParamSpec, _defaults, _param_specs, _tensor_kind, mask_root, trace, trace_mask,
)


def score_mod(fn: Optional[Callable] = None, *, name: Optional[str] = None) -> Union["TracedMod", Callable[[Callable], "TracedMod"]]:
    """Decorator: trace `fn(score, b, h, q_idx, kv_idx, **params)` into a TracedMod.

    Errors at decoration time (TypeError/ValueError) for unsupported Python: branching on a
    symbol, math.* / torch.* calls on symbols, parameters without a float/int/tensor default,
    gathers at non-integer indices, bit operations on floats, a boolean or constant result.
    """

    def wrap(f: Callable) -> TracedMod:
        specs = _param_specs(f, 5, "score_mod")
        root = trace(f, specs)
        return TracedMod(name or getattr(f, "__name__", "score_mod"), root, specs, _defaults(specs))

    return wrap(fn) if fn is not None else wrap


def mask_mod(fn: Optional[Callable] = None, *, name: Optional[str] = None) -> Union["TracedMod", Callable[[Callable], "TracedMod"]]:
    """Decorator: trace `fn(b, h, q_idx, kv_idx, **params) -> condition` (flex's mask_mod form)
    into the TracedMod `where(condition, score, -inf)` (True = attend)."""

    def wrap(f: Callable) -> TracedMod:
        specs = _param_specs(f, 4, "mask_mod")
        cond = trace_mask(f, specs)
        return TracedMod(name or getattr(f, "__name__", "mask_mod"), mask_root(cond), specs, _defaults(specs))

    return wrap(fn) if fn is not None else wrap


def _gather_ranks(root: Node) -> Dict[str, Tuple[int, ...]]:
    """{tensor parameter: the index counts it is gathered with} (each must equal its rank)."""
    out: Dict[str, Tuple[int, ...]] = {}
    for name, k in expr.reads(root).gathers:
        out[name] = out.get(name, ()) + (k,)
    return out


class TracedMod(CudnnLowering, EagerAdapters, ScoreMod):
    """A score_mod traced into a DAG; immutable (binding returns a new object).

    cache_key: the DAG's structure (ops, literal constants by their exact bits, param names and
    kinds, gather arities) plus each tensor parameter's kind, dtype and rank. The Python
    function's name is not part of it: two functions with the same math share graphs. Scalar
    parameter values never are.

    is_mask: whether the mod is a pure mask (where(cond, score, -inf) over the bare score).
    origin_name: the name of the mod this one was bound from (`origin_named`), constant under
    torch.compile.

    The cuDNN members come from `CudnnLowering`, eager evaluation and flex exports from
    `EagerAdapters`.
    """

    def __init__(self, name: str, root: Node, specs: Dict[str, ParamSpec], values: Dict[str, Any],
                 name_fn: Optional[Callable[[Dict[str, Any]], str]] = None, origin: Optional["TracedMod"] = None):
        self._name, self._name_fn = name, name_fn
        self.root, self.specs, self._values = root, dict(specs), dict(values)
        self._operands: Optional[Dict[str, torch.Tensor]] = None
        if origin is None:
            # Structural facts the backends ask on every call, computed once here, in eager code
            # (torch.compile cannot trace the DAG walks behind them).
            self._origin = self
            self.origin_name = _register_origin(self)
            self._gather_ranks = _gather_ranks(root)
            self.is_mask = pure_mask_condition(root) is not None
            self.uses_lengths, self.needs_host_lengths  # noqa: B018
        else:
            # A copy with other values (bind): the structure, and every fact derived from it, is
            # the origin's, so making one walks no DAG (torch.compile traces binds inside a model)
            self._origin = origin
            self.origin_name = origin.origin_name
            self._gather_ranks = origin._gather_ranks
            self.is_mask = origin.is_mask
            self._uses_lengths, self._needs_host_lengths = origin.uses_lengths, origin.needs_host_lengths
        for p, v in self._values.items():
            if isinstance(v, torch.Tensor):
                self._check_rank(p, v)

    @property
    def name(self) -> str:  # type: ignore[override]
        """Short name; library mods carry their values ("softcap_30", "sliding_window_128_0")."""
        return self._name_fn(self._values) if self._name_fn is not None else self._name

    @property
    def base_name(self) -> str:
        """The name without values ("softcap"): stable across value changes."""
        return self._name

    @property
    def bound_values(self) -> Mapping[str, Any]:
        """See ScoreMod.bound_values: the values dict, replaced by `take_values`."""
        return self._values

    def _copy(self, values: Dict[str, Any], name: Optional[str] = None) -> "TracedMod":
        return type(self)(self._name if name is None else name, self.root, self.specs, values,
                          self._name_fn if name is None else None, origin=self._origin)

    def compile_structure(self) -> Tuple[str, tuple]:
        """(origin name, facts): what a compiled graph's spec depends on, as constants torch.compile
        can hand to eager code: the name of the eagerly made mod this one was bound from
        (`origin_named`), each bound tensor parameter's (name, dtype, rank) (shapes may be symbolic
        under torch.compile and enter no spec: a call plan takes them from its own call) and the
        native band. It serves mods bound inside a compiled function (softcap(c), alibi(slopes),
        post_scale_bias(bias), mod.bind(...)), objects torch.compile only tracks.
        `origin_named(name).stand_in(facts)` turns it back into a mod."""
        tensors = tuple((p, v.dtype, v.dim()) for p, v in self._values.items() if isinstance(v, torch.Tensor))
        return self.origin_name, (tensors, self.native_band)

    def stand_in(self, facts: tuple) -> "TracedMod":
        """This mod (an origin) bound to meta tensors of the dtypes and ranks in `facts`, with their
        native band: the cache_key and spec of the mod whose `compile_structure` gave `facts`
        (values and shapes enter neither), and no data."""
        tensors, band = facts
        metas = {p: torch.empty((1,) * rank, dtype=dtype, device="meta") for p, dtype, rank in tensors}
        mod = self._copy({**self._values, **metas})
        if band is not None:
            mod.native_band = band
        return mod

    def structural_values(self) -> Hashable:
        """The native band (left, right, bottom_right) a backend runs this mod as (its window
        values become the kernel's band), or (): see ScoreMod.structural_values."""
        band = self.__dict__.get("native_band")
        return () if band is None else band

    def structure_only(self) -> "TracedMod":
        """See ScoreMod.structure_only: tensor parameters as meta tensors; values and the native
        band kept (self when the mod holds no tensor)."""
        values = {p: meta_like(v) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
                  for p, v in self._values.items()}
        if all(v is self._values[p] for p, v in values.items()):
            return self
        copy = self._copy(values)
        band = self.__dict__.get("native_band")
        if band is not None:
            copy.native_band = band
        return copy

    # binding -----------------------------------------------------------------
    def private_copy(self) -> "TracedMod":
        """A copy that owns its state (for holders that later update values in place)."""
        copy = self._copy(self._values)
        if self.native_band is not None:
            copy.native_band = self.native_band
        return copy

    def take_values(self, other: "TracedMod") -> bool:
        """Adopt `other`'s scalar values in place if it has the same structure and the same tensor
        parameters (return True); the scalar tensor is replaced by a new one (same shape and dtype:
        torch.compile does not recompile), so a compiled forward that saved the old one for its
        backward still differentiates the function it computed. Otherwise False.
        The native band (a pure library mask served by the backend's own band) follows `other`."""
        if other.cache_key != self.cache_key or any(self.tensors()[n] is not t for n, t in other.tensors().items()):
            return False
        self._values = dict(other._values)
        self._operands = None
        self.__dict__.pop("_op_memo", None)
        self._scalar_tensor = other.scalar_tensor().clone()
        band = other.native_band
        if band is not None:
            self.native_band = band
        else:
            self.__dict__.pop("native_band", None)
        return True

    def _check_rank(self, p: str, t: torch.Tensor) -> None:
        if all(k == t.dim() for k in self._gather_ranks.get(p, ())):
            return
        for n in expr.topo_order(self.root):
            if n.op == "gather" and n.attr == p and len(n.args) != t.dim():
                raise ValueError(
                    f"score_mod {self._name!r}: tensor parameter {p!r} is indexed by {len(n.args)} indices "
                    f"({expr.show(n)}) so it must have {len(n.args)} dims, got shape {tuple(t.shape)}"
                )

    def bind(self, **params: Any) -> "TracedMod":
        """A copy with the given parameters bound (scalars by value, tensors by reference)."""
        values = dict(self._values)
        for k, v in params.items():
            spec = self.specs.get(k)
            if spec is None:
                raise TypeError(f"score_mod {self.name!r} has no parameter {k!r}; parameters: {sorted(self.specs) or 'none'}")
            if spec.kind in ("float", "int"):
                values[k] = self._scalar_value(spec, k, v)
            else:
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"score_mod {self.name!r}: tensor parameter {k!r} must be a torch.Tensor, got {type(v).__name__}")
                if _tensor_kind(self.name, k, v) != spec.tkind:
                    raise TypeError(
                        f"score_mod {self.name!r}: tensor parameter {k!r} must have a {_KIND_WORDS[spec.tkind]} dtype, "
                        f"got {v.dtype}"
                    )
                values[k] = v
        return self._copy(values)

    def _scalar_value(self, spec: ParamSpec, k: str, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"score_mod {self.name!r}: parameter {k!r} must be a {spec.kind}, got {v!r} ({type(v).__name__})")
        if math.isnan(v):
            raise ValueError(f"score_mod {self.name!r}: parameter {k!r} must not be NaN")
        if spec.kind == "int":
            if isinstance(v, float) and not v.is_integer():
                raise TypeError(f"score_mod {self.name!r}: parameter {k!r} is an int parameter, got {v!r}")
            v = int(v)
        else:
            v = float(v)
        if spec.check is not None:
            spec.check(k, v)
        return v

    def __call__(self, *args: Any, **params: Any) -> "TracedMod":
        if args:
            raise TypeError(
                f"score_mod {self.name!r} binds parameters by keyword ({self.base_name}(name=value)); to evaluate it use "
                ".eager(...) or .to_flex()"
            )
        return self.bind(**params)

    def rebind(self, scalars: Dict[str, float], tensors: Dict[str, torch.Tensor]) -> "TracedMod":
        """Bind scalar and tensor parameters from dicts (torch.compile custom-op path)."""
        return self.bind(**scalars, **tensors)

    def renamed(self, name: str) -> "TracedMod":
        return self._copy(self._values, name=name)

    # ScoreMod contract ------------------------------------------------------
    @property
    def cache_key(self) -> Hashable:
        got = self.__dict__.get("_cache_key")
        if got is None:
            dag = structure_key(self.root)
            tparams = []
            for p, s in self.specs.items():
                if s.kind == "tensor":
                    t = self._values.get(p)
                    tparams.append((p, s.tkind, None if t is None else (str(t.dtype), t.dim())))
            got = self._cache_key = ("traced", dag, tuple(tparams))
        return got

    @property
    def uses_lengths(self) -> bool:
        got = self.__dict__.get("_uses_lengths")
        if got is None:
            got = self._uses_lengths = expr.reads(self.root).lengths
        return got

    def scalars(self) -> Dict[str, float]:
        """Scalar (float and int) parameters by name, as floats (ints are exact in float64)."""
        return {p: float(self._values[p]) for p, s in self.specs.items() if s.kind in ("float", "int")}

    def scalars_typed(self) -> Dict[str, Any]:
        """Scalar parameters with their kinds: ints as int, floats as float."""
        return {p: self._values[p] for p, s in self.specs.items() if s.kind in ("float", "int")}

    def scalar_tensor(self) -> torch.Tensor:
        """The scalar parameters as one CPU float64 tensor (in `scalars()` order), made once per
        bound mod: torch.compile sees a tensor input, so a new value does not recompile."""
        t = self.__dict__.get("_scalar_tensor")
        if t is None:
            t = self._scalar_tensor = torch.tensor(list(self.scalars().values()), dtype=torch.float64)
        return t

    def tensors(self) -> Dict[str, torch.Tensor]:
        out = {}
        for p, s in self.specs.items():
            if s.kind == "tensor":
                t = self._values.get(p)
                if t is None:
                    raise ValueError(f"score_mod {self.name!r}: tensor parameter {p!r} is not bound; call {self.base_name}({p}=tensor)")
                out[p] = t
        return out

    def check(self, *, device: torch.device, batch: int, heads: int, seqlen_q: int, seqlen_kv: int) -> None:
        tensors = self.tensors()
        if not tensors:  # nothing to check (and nothing for torch.compile to trace here)
            return
        sizes = {"b": batch, "h": heads, "q_idx": seqlen_q, "kv_idx": seqlen_kv}
        device = torch.device(device)
        for p, t in tensors.items():
            if t.device.type != device.type or (device.index is not None and t.device.index not in (None, device.index)):
                raise ValueError(f"score_mod {self.name!r}: tensor parameter {p!r} is on {t.device}, the inputs on {device}")
        for n in _gather_nodes(self.root):
            p = n.attr
            t = tensors[p]
            if t.dim() != len(n.args):
                raise ValueError(
                    f"score_mod {self.name!r}: tensor parameter {p!r} is indexed by {len(n.args)} indices "
                    f"({expr.show(n)}) so it must have {len(n.args)} dims, got shape {tuple(t.shape)}"
                )
            axes = expr.direct_axes(n)
            if axes is None:  # computed indices: torch checks the range when it gathers
                continue
            want = tuple(sizes[a] for a in axes)
            ok = all(d == w or (d == 1 and a in ("b", "h")) for d, w, a in zip(t.shape, want, axes))
            if not ok:
                legend = ", ".join(f"{a}: {sizes[a]}{' (or 1)' if a in ('b', 'h') else ''}" for a in axes)
                raise ValueError(
                    f"score_mod {self.name!r}: tensor parameter {p!r} has shape {tuple(t.shape)}, expected ({legend})"
                )

    def _params(self) -> Dict[str, Any]:
        params = dict(self.scalars_typed())
        params.update(self.tensors())
        return params

    # learned biases ---------------------------------------------------------
    def split_additive_bias(self) -> Tuple[Optional["TracedMod"], Optional["TracedMod"]]:
        """(score_part, bias_part) such that mod(s) == score_part(s) + g everywhere (g finite), with
        bias_part the TracedMod `score + g` (see parts.additive_bias). (self, None) when there is no
        such g; score_part is None when what remains is the bare score (cuDNN then needs no
        score_mod, only the bias)."""
        roots = parts.additive_bias(self.root)
        if roots is None:
            return self, None
        score_root, bias_root = roots
        bias_part = self._part(bias_root, "bias")
        if score_root is None:
            return None, bias_part
        score_part = self._part(score_root, "score")
        band = band_of(score_part.root)
        if band is not None:  # a causal mask around the score: the backend's own band, not a score_mod
            score_part.native_band = band
        return score_part, bias_part

    def trainable(self) -> Dict[str, Any]:
        """Tensor parameters that may be trained: name -> Trainable(floating, bias_only); see
        parts.trainable_facts."""
        score_part, bias_part = self.split_additive_bias()
        return parts.trainable_facts(self.specs, None if score_part is None else score_part.root,
                                     None if bias_part is None else bias_part.root)

    def _part(self, root: Node, suffix: str) -> "TracedMod":
        """A new mod over `root` (a part of this one's DAG) with the parameters it reads."""
        used = {x.attr for x in expr.topo_order(root) if x.op in ("param", "gather")}
        specs = {p: s for p, s in self.specs.items() if p in used}
        values = {p: v for p, v in self._values.items() if p in used}
        return TracedMod(f"{self.name}_{suffix}", root, specs, values)

    def __repr__(self) -> str:
        vals = ", ".join(f"{p}={v}" if not isinstance(v, torch.Tensor) else f"{p}=Tensor{tuple(v.shape)}" for p, v in self._values.items())
        return f"<ScoreMod {self.name}({vals})>"


@register_lru("score_mods.trace.gather_nodes")
@functools.lru_cache(maxsize=1024)
def _gather_nodes(root: Node) -> tuple:
    return tuple(n for n in expr.topo_order(root) if n.op == "gather")

