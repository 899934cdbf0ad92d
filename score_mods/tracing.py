"""Tracing: run a flex-style Python function once on symbols and return its DAG.

`_param_specs` reads the parameters after the index arguments into `ParamSpec`s (float, int or
tensor, from their defaults); `trace` / `trace_mask` run the function on `Sym`s and check that it
returns a score / a condition; `mask_root` is the score_mod of a mask. `TracedMod` (trace.py)
wraps the result.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Dict, Optional

import torch

from . import expr
from .expr import Node, Sym, TensorParam, TensorSym

_NEG_INF = -math.inf


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



def _defaults(specs: Dict[str, ParamSpec]) -> Dict[str, Any]:
    return {p: s.default_value for p, s in specs.items()}


def _fmt(v: Any) -> str:
    """30.0 -> '30', 2.5 -> '2.5' (for names carrying values)."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return repr(v) if isinstance(v, float) else str(v)

