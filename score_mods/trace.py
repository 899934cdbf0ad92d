"""`@score_mod`: trace a flex-style Python function into a `TracedMod` (a ScoreMod).

    @score_mod
    def softcap(score, b, h, q_idx, kv_idx, cap=30.0):
        return cap * tanh(score / cap)

    softcap                 # a ScoreMod with cap = 30.0
    softcap(cap=50.0)       # the same graph (same cache_key), cap bound to 50.0
    softcap.bind(cap=50.0)  # same as above

Parameters after the five index arguments must have defaults: a float (pass-by-value runtime
scalar), or a tensor parameter declared with `TensorParam("float"|"int")` (or a torch.Tensor
default). The function is traced once, at decoration, with symbolic arguments.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Hashable, Optional, Union

import torch

from . import eager as eager_mod
from . import expr, lower_cudnn
from .base import ScoreMod
from .expr import Node, Sym, TensorParam, TensorSym

class ParamSpec:
    """One declared parameter: kind "float" (runtime scalar) or "tensor" (graph input, tkind float|int)."""

    __slots__ = ("name", "kind", "tkind", "default_value")

    def __init__(self, name: str, kind: str, tkind: Optional[str], default_value: Any):
        self.name, self.kind, self.tkind, self.default_value = name, kind, tkind, default_value

    @classmethod
    def from_default(cls, mod: str, name: str, default: Any) -> "ParamSpec":
        if isinstance(default, TensorParam):
            return cls(name, "tensor", default.kind, None)
        if isinstance(default, torch.Tensor):
            return cls(name, "tensor", _tensor_kind(mod, name, default), default)
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            return cls(name, "float", None, float(default))
        if default is inspect.Parameter.empty:
            raise TypeError(
                f"score_mod {mod!r}: parameter {name!r} has no default; give a float default (runtime scalar) "
                f"or {name}=score_mods.TensorParam() for a tensor parameter"
            )
        raise TypeError(
            f"score_mod {mod!r}: parameter {name!r} has default {default!r} ({type(default).__name__}); "
            "parameters must be floats or tensor parameters (score_mods.TensorParam() or a torch.Tensor)"
        )


def _tensor_kind(mod: str, name: str, t: torch.Tensor) -> str:
    if t.is_floating_point():
        return "float"
    if t.dtype in (torch.int32, torch.int64):
        return "int"
    raise TypeError(
        f"score_mod {mod!r}: tensor parameter {name!r} has dtype {t.dtype}; use a floating dtype (bias, slopes) "
        "or int32/int64 (ids)"
    )


_ARGS = ("score", "b", "h", "q_idx", "kv_idx")


def _param_specs(fn: Callable) -> Dict[str, ParamSpec]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"score_mod needs a Python function, got {fn!r}") from exc
    params = list(sig.parameters.values())
    name = getattr(fn, "__name__", "score_mod")
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"score_mod {name!r}: *args / **kwargs are not supported; name every parameter")
    if len(params) < 5 or any(p.default is not p.empty for p in params[:5]):
        raise TypeError(
            f"score_mod {name!r} must take (score, b, h, q_idx, kv_idx, **params) with no defaults on the "
            f"first five; got {sig}"
        )
    specs: Dict[str, ParamSpec] = {}
    for p in params[5:]:
        specs[p.name] = ParamSpec.from_default(name, p.name, p.default)
    return specs


def trace(fn: Callable, specs: Dict[str, ParamSpec]) -> Node:
    """Run fn once on symbols; return the float root node."""
    name = getattr(fn, "__name__", "score_mod")
    args = [Sym(Node("score"))] + [Sym(Node("index", attr=a)) for a in expr.INDEX_AXES]
    kwargs = {
        p: (TensorSym(p) if s.kind != "float" else Sym(Node("param", attr=p))) for p, s in specs.items()
    }
    with expr._TraceScope():
        try:
            out = fn(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"while tracing score_mod {name!r}: {exc}") from exc
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        raise TypeError(f"score_mod {name!r} returned the constant {out!r}; it must return an expression of score")
    if not isinstance(out, Sym):
        raise TypeError(
            f"score_mod {name!r} returned {type(out).__name__}; it must return a symbolic float "
            "(if it used torch or math functions, use the score_mods math namespace: tanh, exp, where, ...)"
        )
    if out.node.dtype != "f":
        raise TypeError(
            f"score_mod {name!r} returned a boolean condition; return a score, e.g. where(cond, score, -inf) for a mask"
        )
    return out.node


def score_mod(fn: Optional[Callable] = None, *, name: Optional[str] = None) -> Union[TracedMod, Callable[[Callable], TracedMod]]:
    """Decorator: trace `fn(score, b, h, q_idx, kv_idx, **params)` into a TracedMod.

    Errors at decoration time (TypeError/ValueError) for unsupported Python: branching on a
    symbol, math.* / torch.* calls on symbols, parameters without a float or tensor default,
    badly indexed tensor parameters, a boolean or constant result.
    """

    def wrap(f: Callable) -> TracedMod:
        specs = _param_specs(f)
        root = trace(f, specs)
        values = {p: s.default_value for p, s in specs.items()}
        return TracedMod(name or getattr(f, "__name__", "score_mod"), root, specs, values)

    return wrap(fn) if fn is not None else wrap


# --------------------------------------------------------------------------- the traced ScoreMod

class TracedMod(ScoreMod):
    """A score_mod traced into a DAG; immutable (binding returns a new object).

    cache_key: the DAG's structure (ops, literal constants, param names, tensor index axes)
    plus each tensor parameter's kind, dtype and rank. The Python function's name is not part
    of it: two functions with the same math share graphs. Float parameter values never are.
    """

    def __init__(self, name: str, root: Node, specs: Dict[str, ParamSpec], values: Dict[str, Any]):
        self.name, self.root, self.specs, self._values = name, root, dict(specs), dict(values)
        self._operands: Optional[Dict[str, torch.Tensor]] = None
        # Structural facts the backends ask on every call, computed once here, in eager code
        # (torch.compile cannot trace the DAG walks behind them).
        self.uses_lengths, self.needs_host_lengths  # noqa: B018

    # binding -----------------------------------------------------------------
    def private_copy(self) -> "TracedMod":
        """A copy that owns its state (for holders that later update values in place)."""
        copy = TracedMod(self.name, self.root, self.specs, self._values)
        if getattr(self, "native_band", None) is not None:
            copy.native_band = self.native_band
        return copy

    def take_values(self, other: "TracedMod") -> bool:
        """Adopt `other`'s float values in place if it has the same structure and the same tensor
        parameters (return True); the scalar tensor is updated, not replaced. Otherwise False."""
        if other.cache_key != self.cache_key or any(self.tensors()[n] is not t for n, t in other.tensors().items()):
            return False
        self._values = dict(other._values)
        self._operands = None
        self.scalar_tensor().copy_(other.scalar_tensor())
        return True

    def bind(self, **params: Any) -> "TracedMod":
        """A copy with the given parameters bound (floats by value, tensors by reference)."""
        values = dict(self._values)
        for k, v in params.items():
            spec = self.specs.get(k)
            if spec is None:
                raise TypeError(f"score_mod {self.name!r} has no parameter {k!r}; parameters: {sorted(self.specs) or 'none'}")
            if spec.kind == "float":
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise TypeError(f"score_mod {self.name!r}: parameter {k!r} must be a float, got {v!r} ({type(v).__name__})")
                values[k] = float(v)
            else:
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"score_mod {self.name!r}: tensor parameter {k!r} must be a torch.Tensor, got {type(v).__name__}")
                if _tensor_kind(self.name, k, v) != spec.tkind:
                    raise TypeError(
                        f"score_mod {self.name!r}: tensor parameter {k!r} must have a "
                        f"{'floating' if spec.tkind == 'float' else 'int32/int64'} dtype, got {v.dtype}"
                    )
                values[k] = v
        return TracedMod(self.name, self.root, self.specs, values)

    def __call__(self, *args: Any, **params: Any) -> "TracedMod":
        if args:
            raise TypeError(
                f"score_mod {self.name!r} binds parameters by keyword ({self.name}(name=value)); to evaluate it use "
                ".eager(...) or .to_flex()"
            )
        return self.bind(**params)

    def rebind(self, scalars: Dict[str, float], tensors: Dict[str, torch.Tensor]) -> "TracedMod":
        """Bind float and tensor parameters from dicts (torch.compile custom-op path)."""
        return self.bind(**scalars, **tensors)

    def renamed(self, name: str) -> "TracedMod":
        return TracedMod(name, self.root, self.specs, self._values)

    # ScoreMod contract ------------------------------------------------------
    @property
    def cache_key(self) -> Hashable:
        order = expr.topo_order(self.root)
        index = {n: i for i, n in enumerate(order)}
        dag = tuple((n.op, n.attr, n.dtype, tuple(index[a] for a in n.args)) for n in order)
        tparams = []
        for p, s in self.specs.items():
            if s.kind == "tensor":
                t = self._values.get(p)
                tparams.append((p, s.tkind, None if t is None else (str(t.dtype), t.dim())))
        return ("traced", dag, tuple(tparams))

    @property
    def uses_lengths(self) -> bool:
        got = self.__dict__.get("_uses_lengths")
        if got is None:
            got = self._uses_lengths = bool(expr.leaves(self.root, "length"))
        return got

    @property
    def has_backward(self) -> bool:
        """False for mods reading integer tensor parameters (document ids): measured on the
        H100, cuDNN's backward graph recomputes such masks wrongly (gradients off by ~100%)
        while the forward is right, so their gradients come from the reference backend (or use
        doc_packed_attn / thd, where documents are sequences)."""
        return not any(s.kind == "tensor" and s.tkind == "int" for s in self.specs.values())

    @property
    def needs_host_lengths(self) -> bool:
        """True when the cuDNN lowering folds q_len/kv_len on the host (dense problems only)."""
        got = self.__dict__.get("_needs_host_lengths")
        if got is None:
            got = self._needs_host_lengths = bool(lower_cudnn.plan_for(self.root).length_folds)
        return got

    def scalars(self) -> Dict[str, float]:
        return {p: self._values[p] for p, s in self.specs.items() if s.kind == "float"}

    def scalar_tensor(self) -> torch.Tensor:
        """The float parameters as one CPU float64 tensor (in `scalars()` order), made once per
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
                    raise ValueError(f"score_mod {self.name!r}: tensor parameter {p!r} is not bound; call {self.name}({p}=tensor)")
                out[p] = t
        return out

    def check(self, *, device: torch.device, batch: int, heads: int, seqlen_q: int, seqlen_kv: int) -> None:
        tensors = self.tensors()
        if not tensors:  # nothing to check (and nothing for torch.compile to trace here)
            return
        sizes = {"b": batch, "h": heads, "q_idx": seqlen_q, "kv_idx": seqlen_kv}
        device = torch.device(device)
        for n in expr.leaves(self.root, "tparam"):
            p, axes = n.attr
            t = tensors[p]
            if t.device.type != device.type or (device.index is not None and t.device.index not in (None, device.index)):
                raise ValueError(f"score_mod {self.name!r}: tensor parameter {p!r} is on {t.device}, the inputs on {device}")
            if t.dim() != len(axes):
                raise ValueError(
                    f"score_mod {self.name!r}: tensor parameter {p!r} is indexed by {axes} so it must have {len(axes)} "
                    f"dims, got shape {tuple(t.shape)}"
                )
            want = tuple(sizes[a] for a in axes)
            ok = all(d == w or (d == 1 and a in ("b", "h")) for d, w, a in zip(t.shape, want, axes))
            if not ok:
                legend = ", ".join(f"{a}: {sizes[a]}{' (or 1)' if a in ('b', 'h') else ''}" for a in axes)
                raise ValueError(
                    f"score_mod {self.name!r}: tensor parameter {p!r} has shape {tuple(t.shape)}, expected ({legend})"
                )

    def eager(self, score, b, h, q_idx, kv_idx, q_len, kv_len) -> torch.Tensor:
        env = eager_mod.index_env(score, b, h, q_idx, kv_idx, q_len, kv_len)
        params = dict(self.scalars())
        params.update(self.tensors())
        return eager_mod.evaluate(self.root, env, params)

    def to_flex(self, q_len: Optional[int] = None, kv_len: Optional[int] = None) -> Callable:
        """A flex_attention score_mod `(score, b, h, q_idx, kv_idx) -> score`.

        flex_attention has no per-sequence lengths: q_len / kv_len are the full Sq / Skv,
        which must be given here when the mod uses them.
        """
        if self.uses_lengths and (q_len is None or kv_len is None):
            raise ValueError(f"score_mod {self.name!r} reads q_len/kv_len; call to_flex(q_len=Sq, kv_len=Skv)")

        def flex_mod(score, b, h, q_idx, kv_idx):
            return self.eager(score, b, h, q_idx, kv_idx, q_len, kv_len)

        flex_mod.__name__ = f"{self.name}_flex"
        return flex_mod

    def cudnn_operands(self) -> Dict[str, torch.Tensor]:
        if self._operands is None:
            plan = lower_cudnn.plan_for(self.root)
            ops = lower_cudnn.scalar_operands(plan, self.scalars())
            tensors = self.tensors()
            for n, name in plan.tensor_names.items():
                ops[name] = _view4d(tensors[n.attr[0]], n.attr[1])
            self._operands = ops
        return dict(self._operands)

    def length_operands(self, q_len: int, kv_len: int) -> Dict[str, torch.Tensor]:
        plan = lower_cudnn.plan_for(self.root)
        return lower_cudnn.scalar_operands(plan, self.scalars(), {"q_len": q_len, "kv_len": kv_len})

    def lower_forward(self, graph, score, operands, memo):
        return lower_cudnn.lower_forward(lower_cudnn.plan_for(self.root), graph, score, operands, memo, self.name)

    def lower_backward(self, graph, dscore, operands, memo):
        return lower_cudnn.lower_backward(lower_cudnn.plan_for(self.root), graph, dscore, operands, memo, self.name)

    def __repr__(self) -> str:
        vals = ", ".join(f"{p}={v}" if not isinstance(v, torch.Tensor) else f"{p}=Tensor{tuple(v.shape)}" for p, v in self._values.items())
        return f"<ScoreMod {self.name}({vals})>"


def _view4d(t: torch.Tensor, axes: tuple) -> torch.Tensor:
    """(1|.., 1|.., 1|.., 1|..) view of a tensor parameter; int64 ids become int32."""
    shape = [1, 1, 1, 1]
    for d, a in enumerate(axes):
        shape[expr.INDEX_AXES.index(a)] = t.shape[d]
    if t.dtype == torch.int64:
        t = t.to(torch.int32)
    return t.reshape(shape)
