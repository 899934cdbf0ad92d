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
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import threading
import weakref
from typing import Any, Callable, Dict, Hashable, Optional, Tuple, Union

import torch

from . import eager as eager_mod
from . import expr, lower_cudnn
from .base import ScoreMod, meta_like
from .expr import Node, Sym, TensorParam, TensorSym

_NEG_INF = -math.inf

# Origins by name: torch.compile'd code hands an origin to eager code as its name (a string is a
# constant in every torch version; some accept no object there). Weak values: an entry lives as
# long as its origin (every mod bound from it holds it), so the table is bounded by live mods.
_ORIGINS: "weakref.WeakValueDictionary[str, TracedMod]" = weakref.WeakValueDictionary()
_ORIGINS_LOCK = threading.Lock()
_ORIGIN_IDS = itertools.count()


def _register_origin(mod: "TracedMod") -> str:
    with _ORIGINS_LOCK:
        name = f"origin{next(_ORIGIN_IDS)}"
        _ORIGINS[name] = mod
    return name


def origin_named(name: str) -> "TracedMod":
    """The live origin mod registered under `name` (`TracedMod.origin_name`)."""
    with _ORIGINS_LOCK:
        got = _ORIGINS.get(name)
    if got is None:
        raise KeyError(f"no live score_mod origin named {name!r}")
    return got


class ParamSpec:
    """One declared parameter: kind "float" / "int" (runtime scalars) or "tensor" (tkind
    float|int|bool). `check(name, value)` optionally validates scalar values (raises ValueError)."""

    __slots__ = ("name", "kind", "tkind", "default_value", "check")

    def __init__(self, name: str, kind: str, tkind: Optional[str], default_value: Any,
                 check: Optional[Callable[[str, float], None]] = None):
        self.name, self.kind, self.tkind, self.default_value, self.check = name, kind, tkind, default_value, check

    def renamed(self, name: str) -> "ParamSpec":
        return ParamSpec(name, self.kind, self.tkind, self.default_value, self.check)

    @classmethod
    def from_default(cls, mod: str, name: str, default: Any) -> "ParamSpec":
        if isinstance(default, TensorParam):
            return cls(name, "tensor", default.kind, None)
        if isinstance(default, torch.Tensor):
            return cls(name, "tensor", _tensor_kind(mod, name, default), default)
        if isinstance(default, int) and not isinstance(default, bool):
            return cls(name, "int", None, default)
        if isinstance(default, float):
            if math.isnan(default):
                raise ValueError(f"score_mod {mod!r}: parameter {name!r} has the default NaN; give a number")
            return cls(name, "float", None, default)
        if default is inspect.Parameter.empty:
            raise TypeError(
                f"score_mod {mod!r}: parameter {name!r} has no default; give a float or int default (runtime scalar) "
                f"or {name}=score_mods.TensorParam() for a tensor parameter"
            )
        raise TypeError(
            f"score_mod {mod!r}: parameter {name!r} has default {default!r} ({type(default).__name__}); "
            "parameters must be floats, ints or tensor parameters (score_mods.TensorParam() or a torch.Tensor)"
        )


def _tensor_kind(mod: str, name: str, t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    if t.is_floating_point():
        return "float"
    if t.dtype in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
        return "int"
    raise TypeError(
        f"score_mod {mod!r}: tensor parameter {name!r} has dtype {t.dtype}; use a floating dtype (bias, slopes, "
        "tables), an integer dtype (ids, distances) or torch.bool (flags)"
    )


_KIND_WORDS = {"float": "floating", "int": "integer", "bool": "torch.bool"}


def _param_specs(fn: Callable, nargs: int, what: str) -> Dict[str, ParamSpec]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} needs a Python function, got {fn!r}") from exc
    params = list(sig.parameters.values())
    name = getattr(fn, "__name__", what)
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{what} {name!r}: *args / **kwargs are not supported; name every parameter")
    if nargs == 4 and params and params[0].name == "score":
        raise TypeError(
            f"{what} {name!r} takes (b, h, q_idx, kv_idx, **params): no score (it returns a condition); use "
            "@score_mods.score_mod for a function of the score"
        )
    if len(params) < nargs or any(p.default is not p.empty for p in params[:nargs]):
        first = "(score, b, h, q_idx, kv_idx, **params)" if nargs == 5 else "(b, h, q_idx, kv_idx, **params)"
        raise TypeError(
            f"{what} {name!r} must take {first} with no defaults on the first {nargs}; got {sig}"
        )
    return {p.name: ParamSpec.from_default(name, p.name, p.default) for p in params[nargs:]}


def _symbols(specs: Dict[str, ParamSpec]) -> Dict[str, Any]:
    out = {}
    for p, s in specs.items():
        if s.kind == "tensor":
            out[p] = TensorSym(p, s.tkind)
        else:
            out[p] = Sym(Node("param", attr=p, dtype="i" if s.kind == "int" else "f"))
    return out


def _index_syms() -> list:
    return [Sym(Node("index", attr=a, dtype="i")) for a in expr.INDEX_AXES]


def _run(fn: Callable, name: str, what: str, args: list, specs: Dict[str, ParamSpec]) -> Any:
    with expr._TraceScope():
        try:
            return fn(*args, **_symbols(specs))
        except (TypeError, ValueError, AttributeError) as exc:
            raise type(exc)(f"while tracing {what} {name!r}: {exc}") from exc


def trace(fn: Callable, specs: Dict[str, ParamSpec]) -> Node:
    """Run fn once on symbols; return the float root node."""
    name = getattr(fn, "__name__", "score_mod")
    out = _run(fn, name, "score_mod", [Sym(Node("score"))] + _index_syms(), specs)
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        raise TypeError(f"score_mod {name!r} returned the constant {out!r}; it must return an expression of score")
    if not isinstance(out, Sym):
        raise TypeError(
            f"score_mod {name!r} returned {type(out).__name__}; it must return a symbolic float "
            "(if it used torch or math functions, use the score_mods math namespace: tanh, exp, where, ...)"
        )
    if out.node.dtype == "b":
        raise TypeError(
            f"score_mod {name!r} returned a boolean condition; return a score, e.g. where(cond, score, -inf) for a "
            "mask, or decorate it with @score_mods.mask_mod (signature (b, h, q_idx, kv_idx))"
        )
    if out.node.dtype == "i":  # an integer result is a float score
        out = Sym(Node("add", (out.node, expr.const(0.0)), dtype="f"))
    return out.node


def trace_mask(fn: Callable, specs: Dict[str, ParamSpec]) -> Node:
    """Run a mask_mod once on symbols; return its condition node."""
    name = getattr(fn, "__name__", "mask_mod")
    out = _run(fn, name, "mask_mod", _index_syms(), specs)
    if not isinstance(out, Sym) or out.node.dtype != "b":
        got = repr(out) if isinstance(out, bool) else (expr.what(out.node) if isinstance(out, Sym) else type(out).__name__)
        raise TypeError(
            f"mask_mod {name!r} must return a condition on the index arguments (e.g. kv_idx <= q_idx), got {got}"
        )
    return out.node


def mask_root(cond: Node) -> Node:
    """where(cond, score, -inf): the score_mod of a mask."""
    return Node("where", (cond, Node("score"), expr.const(_NEG_INF)))


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


def _defaults(specs: Dict[str, ParamSpec]) -> Dict[str, Any]:
    return {p: s.default_value for p, s in specs.items()}


def _fmt(v: Any) -> str:
    """30.0 -> '30', 2.5 -> '2.5' (for names carrying values)."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return repr(v) if isinstance(v, float) else str(v)


# --------------------------------------------------------------------------- the traced ScoreMod

def _gather_ranks(root: Node) -> Dict[str, Tuple[int, ...]]:
    """{tensor parameter: the index counts it is gathered with} (each must equal its rank)."""
    out: Dict[str, Tuple[int, ...]] = {}
    for name, k in expr.reads(root).gathers:
        out[name] = out.get(name, ()) + (k,)
    return out


class TracedMod(ScoreMod):
    """A score_mod traced into a DAG; immutable (binding returns a new object).

    cache_key: the DAG's structure (ops, literal constants by their exact bits, param names and
    kinds, gather arities) plus each tensor parameter's kind, dtype and rank. The Python
    function's name is not part of it: two functions with the same math share graphs. Scalar
    parameter values never are.

    is_mask: whether the mod is a pure mask (where(cond, score, -inf) over the bare score).
    origin_name: the name of the mod this one was bound from (`origin_named`), constant under
    torch.compile.
    """

    def __init__(self, name: str, root: Node, specs: Dict[str, ParamSpec], values: Dict[str, Any],
                 name_fn: Optional[Callable[[Dict[str, Any]], str]] = None, origin: Optional["TracedMod"] = None):
        self._name, self._name_fn = name, name_fn
        self.root, self.specs, self._values = root, dict(specs), dict(values)
        self._operands: Optional[Dict[str, torch.Tensor]] = None
        if origin is None:
            # Structural facts the backends ask on every call, computed once here, in eager code
            # (torch.compile cannot trace the DAG walks behind them).
            from .parts import pure_mask_condition

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
        return self.origin_name, (tensors, getattr(self, "native_band", None))

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
        if getattr(self, "native_band", None) is not None:
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
        band = getattr(other, "native_band", None)
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
            order = expr.topo_order(self.root)
            index = {n: i for i, n in enumerate(order)}
            dag = tuple((n.op, expr.exact(n.attr), n.dtype, tuple(index[a] for a in n.args)) for n in order)
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

    @property
    def plan(self) -> "lower_cudnn.Plan":
        """The structural lowering plan (see lower_cudnn): what is in-graph, materialized, folded."""
        return lower_cudnn.plan_for(self.root)

    @property
    def irregular_mask(self) -> bool:
        """True when a mask condition reads a tensor parameter or a materialized operand that
        varies along kv_idx (document ids, 2-D neighbourhoods, ...): the cuDNN backend refuses
        such masks' backward where its quirk `irregular_mask_backward` applies (the engines
        recompute them wrongly: document masks ~100% off, 2-D neighbourhoods dQ off by up to
        4.0, while the forward is right)."""
        got = self.__dict__.get("_irregular_mask")
        if got is None:
            got = self._irregular_mask = bool(self.plan.mask_reads_key_inputs)
        return got

    @property
    def needs_host_lengths(self) -> bool:
        """True when the cuDNN lowering folds q_len/kv_len on the host (dense problems only)."""
        got = self.__dict__.get("_needs_host_lengths")
        if got is None:
            got = self._needs_host_lengths = self.plan.needs_host_lengths
        return got

    @property
    def needs_dims(self) -> bool:
        """True when `cudnn_operands` needs the graph dims (it materializes subexpressions)."""
        return bool(self.plan.materialized)

    @property
    def cudnn_unsupported(self) -> Optional[str]:
        """Why the cuDNN lowering cannot run this mod (a score-dependent op the engines lack),
        or None. The reference backend and to_flex() run every mod."""
        plan = self.plan
        return lower_cudnn.unsupported_message(plan, self.name) if plan.unsupported else None

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

    def eager(self, score, b, h, q_idx, kv_idx, q_len, kv_len) -> torch.Tensor:
        env = eager_mod.index_env(score, b, h, q_idx, kv_idx, q_len, kv_len)
        return eager_mod.evaluate(self.root, env, self._params())

    def to_flex(self, q_len: Optional[int] = None, kv_len: Optional[int] = None) -> Callable:
        """A flex_attention score_mod `(score, b, h, q_idx, kv_idx) -> score`.

        flex_attention has no per-sequence lengths: q_len / kv_len are the full Sq / Skv,
        which must be given here when the mod uses them.
        """
        if self.uses_lengths and (q_len is None or kv_len is None):
            raise ValueError(f"score_mod {self.name!r} reads q_len/kv_len; call to_flex(q_len=Sq, kv_len=Skv)")

        prog, params = eager_mod.program(self.root), self._params()  # made here, in eager code

        def flex_mod(score, b, h, q_idx, kv_idx):
            return eager_mod.run(prog, eager_mod.index_env(score, b, h, q_idx, kv_idx, q_len, kv_len), params)

        flex_mod.__name__ = f"{self.name}_flex"
        return flex_mod

    def mask_condition(self) -> Optional[Node]:
        """The condition of a pure mask (the mod is where(cond, score, -inf) chains over the bare
        score; nested masks are and-ed), else None."""
        from .parts import pure_mask_condition

        return pure_mask_condition(self.root)

    def to_flex_mask(self, q_len: Optional[int] = None, kv_len: Optional[int] = None) -> Callable:
        """For a pure mask: a flex_attention mask_mod `(b, h, q_idx, kv_idx) -> bool` (for
        create_block_mask). ValueError for mods that change scores."""
        cond = self.mask_condition()
        if cond is None:
            raise ValueError(f"score_mod {self.name!r} is not a pure mask (it changes scores); use to_flex()")
        if self.uses_lengths and (q_len is None or kv_len is None):
            raise ValueError(f"score_mod {self.name!r} reads q_len/kv_len; call to_flex_mask(q_len=Sq, kv_len=Skv)")

        prog, params = eager_mod.program(cond), self._params()  # made here, in eager code

        def flex_mask(b, h, q_idx, kv_idx):
            env = {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx, "q_len": q_len, "kv_len": kv_len}
            out = eager_mod.run(prog, env, params)
            return out if isinstance(out, torch.Tensor) else torch.full((), bool(out), dtype=torch.bool, device=q_idx.device)

        flex_mask.__name__ = f"{self.name}_flex_mask"
        return flex_mask

    # cuDNN ------------------------------------------------------------------
    def cudnn_operands(self, dims: Optional[Tuple[int, int, int, int]] = None, *, device: Any = None) -> Dict[str, torch.Tensor]:
        """See ScoreMod.cudnn_operands: scalars, tensor views and, given dims, materialized operands."""
        plan = self.plan
        if plan.unsupported:
            raise NotImplementedError(lower_cudnn.unsupported_message(plan, self.name))
        if self._operands is None:
            ops = lower_cudnn.scalar_operands(plan, self.scalars_typed())
            tensors = self.tensors()
            for name, (p, axes) in plan.views.items():
                ops[name] = _view4d(tensors[p], axes)
            self._operands = ops
        if not plan.materialized:
            return dict(self._operands)
        if dims is None:
            raise ValueError(
                f"score_mod {self.name!r} materializes index expressions ({', '.join(plan.materialized)}); the backend "
                "must call cudnn_operands(dims=(B, H, Sq, Skv), device=...) with the graph's dims"
            )
        from . import materialization

        tensors = self.tensors()
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors.values())
        # per-call fast path: this object's values are fixed, so (dims, device, tensor versions) decide
        memo_key = (tuple(dims), str(device), tuple((id(t), t._version) for t in tensors.values()))
        hit = self.__dict__.get("_op_memo")
        if hit is not None and hit[0] == memo_key and not grad:
            return dict(hit[1])
        out = dict(self._operands)
        out.update(materialization.operands(plan, self, dims, device))
        if not grad:
            self._op_memo = (memo_key, out)
        return dict(out)

    def length_operands(self, q_len: int, kv_len: int) -> Dict[str, torch.Tensor]:
        return lower_cudnn.scalar_operands(self.plan, self.scalars_typed(), {"q_len": q_len, "kv_len": kv_len})

    def lower_forward(self, graph, score, operands, memo):
        return lower_cudnn.lower_forward(self.plan, graph, score, operands, memo, self.name)

    def lower_backward(self, graph, dscore, operands, memo):
        return lower_cudnn.lower_backward(self.plan, graph, dscore, operands, memo, self.name)

    def score_scale(self) -> float:
        """The host value of the factor folded out of this mod (lower_cudnn.scaled_plan_for), or 1.0."""
        node = lower_cudnn.scaled_plan_for(self.root).score_scale
        if node is None:
            return 1.0
        hit = self.__dict__.get("_score_scale")
        if hit is not None and hit[0] is self._values:
            return hit[1]
        value = float(lower_cudnn.eval_scalar(node, self.scalars_typed()))
        self._score_scale = (self._values, value)
        return value

    def lower_scaled_forward(self, graph, score, operands, memo):
        return lower_cudnn.lower_forward(lower_cudnn.scaled_plan_for(self.root), graph, score, operands, memo,
                                         self.name)

    def lower_scaled_backward(self, graph, dscore, operands, memo):
        return lower_cudnn.lower_backward(lower_cudnn.scaled_plan_for(self.root), graph, dscore, operands, memo,
                                          self.name)

    # learned biases ---------------------------------------------------------
    def split_additive_bias(self) -> Tuple[Optional["TracedMod"], Optional["TracedMod"]]:
        """(score_part, bias_part) with mod(s) == score_part(s) + g; see parts.split_additive_bias."""
        from .parts import split_additive_bias

        return split_additive_bias(self)

    def trainable(self) -> Dict[str, Any]:
        """Tensor parameters that may be trained: name -> Trainable(floating, bias_only); see parts.trainable."""
        from .parts import trainable

        return trainable(self)

    # pictures ---------------------------------------------------------------
    def describe(self, q_len: int = 8, kv_len: int = 8, *, b: int = 0, h: int = 0) -> str:
        """A text picture of the mask (x attend, . masked) or of the added values; see show.py."""
        from .show import describe

        return describe(self, q_len, kv_len, b=b, h=h)

    def visualize(self, q_len: int = 16, kv_len: int = 16, path: Optional[str] = None, *, b: int = 0, h: int = 0) -> torch.Tensor:
        """Draw the mask / values into a PNG (matplotlib); return the (Sq, Skv) tensor drawn; see show.py."""
        from .show import visualize

        return visualize(self, q_len, kv_len, path, b=b, h=h)

    def __repr__(self) -> str:
        vals = ", ".join(f"{p}={v}" if not isinstance(v, torch.Tensor) else f"{p}=Tensor{tuple(v.shape)}" for p, v in self._values.items())
        return f"<ScoreMod {self.name}({vals})>"


@functools.lru_cache(maxsize=1024)
def _gather_nodes(root: Node) -> tuple:
    return tuple(n for n in expr.topo_order(root) if n.op == "gather")


def _view4d(t: torch.Tensor, axes: tuple) -> torch.Tensor:
    """(1|.., 1|.., 1|.., 1|..) view of a tensor parameter; integer ids become int32."""
    shape = [1, 1, 1, 1]
    for d, a in enumerate(axes):
        shape[expr.INDEX_AXES.index(a)] = t.shape[d]
    if not t.is_floating_point() and t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t.reshape(shape)
