"""Cache keys for raw cuDNN callbacks: they must change whenever the graph a callback builds can.

* A plain function (module-level, nested, lambda) is keyed by module, qualified name and a
  sha256 digest of its code: bytecode, constants (recursively through nested code objects),
  names it reads, defaults, closure cell values, and the functions / simple values of its
  module that it reads by name (recursively). The digest is stable across processes, and a
  function redefined under the same name (a notebook re-run) with other code gets another key.
  A closure cell or default holding something without a stable encoding (a tensor, an
  arbitrary object) is refused (TypeError): pass cache_key=. So is a function reading a
  module-level object whose contents may change under the same code (a dict such as
  CFG["cap"], a list, an instance's attribute): ValueError, pass cache_key= (or give the
  callback's class score_mod_graph_cache_key()). Two functions with identical code, names and
  reads (two module-level lambdas of the same text) share a key: harmless, they build the
  same graph.
* A bound method (or a callable object) whose class defines `score_mod_graph_cache_key()`
  (Transformer Engine's protocol) is keyed by that method's result (dicts, lists and sets
  frozen; tensors and NaN refused) plus the method's qualified name.
* Any other bound method or callable object is keyed to the live object through a token from a
  weakref registry (never id(): an address reused by a new object never meets an old graph).
  When the object is collected, every listener added with `add_release_listener(fn)` is called
  with its token, so a graph cache can drop that object's graphs.
* A user `cache_key=` must be hashable and equal to itself (a NaN inside never hits).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
import itertools
import logging
import math
import threading
import types
import weakref
from typing import Any, Callable, Dict, Hashable, List, Tuple

import torch

_log = logging.getLogger(__name__)


class Unkeyable(TypeError):
    """A value with no stable encoding was found while digesting a function."""


class ReadsMutableGlobal(Unkeyable):
    """A function reads a module-level object whose contents may change (a dict, a list, an
    instance's attributes) without changing the function's code: no code key can follow it."""


# --------------------------------------------------------------------------- code digests

def _enc(x: Any, seen: set, depth: int) -> Any:
    """A canonical, process-independent encoding of x (a nested tuple of strings)."""
    if x is None or isinstance(x, (bool, int, str, bytes)) or x is Ellipsis:
        return (type(x).__name__, repr(x))
    if isinstance(x, float):
        return ("float", x.hex())
    if isinstance(x, complex):
        return ("complex", x.real.hex(), x.imag.hex())
    if isinstance(x, tuple):
        return ("tuple",) + tuple(_enc(v, seen, depth) for v in x)
    if isinstance(x, frozenset):
        return ("frozenset",) + tuple(sorted((_enc(v, seen, depth) for v in x), key=repr))
    if isinstance(x, types.CodeType):
        return _enc_code(x, seen, depth)
    if inspect.isfunction(x):
        return _enc_function(x, seen, depth)
    if isinstance(x, type):
        return ("type", x.__module__, x.__qualname__)
    if isinstance(x, enum.Enum):
        return ("enum", type(x).__module__, type(x).__qualname__, x.name)
    if isinstance(x, torch.dtype):
        return ("dtype", str(x))
    if isinstance(x, types.ModuleType):
        return ("module", x.__name__)
    if isinstance(x, (types.BuiltinFunctionType, types.MethodWrapperType)):
        return ("builtin", getattr(x, "__module__", None) or "", getattr(x, "__qualname__", repr(x)))
    raise Unkeyable(f"{type(x).__name__} value {_short(x)}")


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) < 40 else text[:37] + "..."


def _enc_code(code: types.CodeType, seen: set, depth: int) -> Any:
    return ("code", code.co_code.hex(), tuple(_enc(c, seen, depth) for c in code.co_consts), code.co_names,
            code.co_varnames, code.co_freevars, code.co_argcount, code.co_kwonlyargcount, code.co_flags)


def _enc_function(fn: types.FunctionType, seen: set, depth: int) -> Any:
    if fn in seen or depth > 8:  # recursion (mutual or deep): the name stands for the function
        return ("function-ref", fn.__module__, fn.__qualname__)
    seen = seen | {fn}
    parts: List[Any] = ["function", fn.__module__, fn.__qualname__, _enc_code(fn.__code__, seen, depth + 1)]
    try:
        parts.append(_enc(fn.__defaults__, seen, depth + 1))
        parts.append(_enc(tuple(sorted((fn.__kwdefaults__ or {}).items())), seen, depth + 1))
    except Unkeyable as exc:
        raise Unkeyable(f"a default of {fn.__qualname__!r} is a {exc}") from None
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned later)
            parts.append((name, "empty"))
            continue
        try:
            parts.append((name, _enc(value, seen, depth + 1)))
        except Unkeyable as exc:
            raise Unkeyable(f"closure variable {name!r} of {fn.__qualname__!r} holds a {exc}") from None
    glob = fn.__globals__
    for name in _global_names(fn.__code__):
        value = glob.get(name, _MISSING)
        if value is _MISSING or isinstance(value, types.ModuleType) or _is_code_like(value):
            if inspect.isfunction(value) and value.__module__ == fn.__module__:
                parts.append((name, _enc_function(value, seen, depth + 1)))
            continue
        try:
            parts.append((name, _enc(value, seen, depth + 1)))
        except Unkeyable:
            raise ReadsMutableGlobal(
                f"{fn.__qualname__!r} reads the module-level name {name!r}, a {type(value).__name__} "
                f"({_short(value)}) whose contents can change while the code stays the same") from None
    return tuple(parts)


def _is_code_like(value: Any) -> bool:
    """Module-level names a callback may read without entering its key by value: functions,
    classes, builtins (their own code is what they are), and torch dtypes."""
    return (inspect.isfunction(value) or isinstance(value, (type, types.BuiltinFunctionType, types.MethodWrapperType,
                                                            torch.dtype, enum.Enum)) or inspect.isbuiltin(value))


_MISSING = object()


def _global_names(code: types.CodeType) -> Tuple[str, ...]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.update(_global_names(c))
    return tuple(sorted(names))


def code_digest(fn: Callable) -> str:
    """sha256 (hex, 32 chars) of a function's canonical encoding; raises Unkeyable."""
    return hashlib.sha256(repr(_enc_function(fn, set(), 0)).encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- user keys

def _check_self_equal(key: Any, path: str) -> None:
    if isinstance(key, float) and math.isnan(key):
        raise ValueError(f"cache_key {path} is NaN; NaN != NaN, so that key would never hit a cached graph")
    if isinstance(key, complex) and (math.isnan(key.real) or math.isnan(key.imag)):
        raise ValueError(f"cache_key {path} holds NaN; NaN != NaN, so that key would never hit a cached graph")
    if isinstance(key, (tuple, list)):
        for i, v in enumerate(key):
            _check_self_equal(v, f"{path}[{i}]")
    elif isinstance(key, frozenset):
        for v in key:
            _check_self_equal(v, f"{path} (a member)")
    elif dataclasses.is_dataclass(key) and not isinstance(key, type):
        for f in dataclasses.fields(key):
            _check_self_equal(getattr(key, f.name), f"{path}.{f.name}")
    else:
        try:
            same = key == key
            if isinstance(same, torch.Tensor):
                raise ValueError(f"cache_key {path} is a tensor; keys describe structure, pass tensors as operands")
            same = bool(same)
        except ValueError:
            raise
        except Exception:  # noqa: BLE001 - objects with odd __eq__
            same = False
        if not same:
            raise ValueError(f"cache_key {path} ({_short(key)}) does not compare equal to itself, so it would never hit")


def check_user_key(key: Any, what: str = "raw_callback") -> Hashable:
    """A user-given cache_key: hashable and equal to itself (ValueError / TypeError otherwise)."""
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"{what}: cache_key must be hashable, got {type(key).__name__}") from None
    _check_self_equal(key, "value" if not isinstance(key, tuple) else "tuple")
    return key


def freeze(value: Any) -> Hashable:
    """Transformer Engine's score_mod_graph_cache_key() result as a hashable value: mappings,
    lists and sets frozen into tuples; tensors refused."""
    if isinstance(value, torch.Tensor):
        raise TypeError(
            "score_mod_graph_cache_key() must not include tensors; pass runtime tensors through "
            "score_mod_tensors / score_mod_bprop_tensors"
        )
    if isinstance(value, dict):
        return tuple(sorted(((freeze(k), freeze(v)) for k, v in value.items()), key=repr))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted((freeze(v) for v in value), key=repr))
    return check_user_key(value, "score_mod_graph_cache_key()")


# --------------------------------------------------------------------------- live-object tokens

_LOCK = threading.Lock()
_TOKENS: Dict[int, Tuple[weakref.ref, int]] = {}
_NEXT = itertools.count(1)
_LISTENERS: List[Callable[[int], None]] = []


def add_release_listener(fn: Callable[[int], None]) -> None:
    """Call fn(token) when an object keyed by a token (a bound-method callback's owner) is collected."""
    if not callable(fn):
        raise TypeError(f"add_release_listener: expected a callable, got {type(fn).__name__}")
    with _LOCK:
        if fn not in _LISTENERS:
            _LISTENERS.append(fn)


def remove_release_listener(fn: Callable[[int], None]) -> None:
    with _LOCK:
        if fn in _LISTENERS:
            _LISTENERS.remove(fn)


def _released(slot: int, token: int, _ref: Any) -> None:
    with _LOCK:
        entry = _TOKENS.get(slot)
        if entry is not None and entry[1] == token:
            del _TOKENS[slot]
        listeners = list(_LISTENERS)
    for fn in listeners:
        try:
            fn(token)
        except Exception:  # noqa: BLE001 - a listener must not break garbage collection
            _log.exception("score_mods release listener %r failed for token %d", fn, token)


def object_token(obj: Any) -> int:
    """A token for the live object `obj`, unique for the process's lifetime (never reused)."""
    with _LOCK:
        entry = _TOKENS.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        token = next(_NEXT)
        try:
            ref = weakref.ref(obj, lambda r, slot=id(obj), tok=token: _released(slot, tok, r))
        except TypeError:
            raise TypeError(
                f"a callback bound to a {type(obj).__name__} object cannot be keyed: the object does not support weak "
                "references; pass cache_key= or give the class a score_mod_graph_cache_key() method"
            ) from None
        _TOKENS[id(obj)] = (ref, token)
        return token


def live_tokens() -> int:
    with _LOCK:
        return len(_TOKENS)


# --------------------------------------------------------------------------- callback keys

def callback_key(fn: Callable, what: str) -> Tuple[Hashable, Tuple[int, ...]]:
    """(key, object tokens the key depends on) for a raw cuDNN callback; TypeError if unkeyable."""
    how = f"pass cache_key=<a hashable value that changes whenever the {what}'s graph changes>"
    if inspect.ismethod(fn):
        owner, func = fn.__self__, fn.__func__
        name = (getattr(func, "__module__", None), getattr(func, "__qualname__", repr(func)))
        if hasattr(type(owner), "score_mod_graph_cache_key"):
            return ("te", name, freeze(owner.score_mod_graph_cache_key())), ()
        token = object_token(owner)
        return ("bound", token, name, _digest_or_raise(func, what, how)), (token,)
    if inspect.isfunction(fn):
        return ("function", fn.__module__, fn.__qualname__, _digest_or_raise(fn, what, how)), ()
    if callable(fn) and not isinstance(fn, (types.BuiltinFunctionType, type)):
        cls = type(fn)
        name = (cls.__module__, cls.__qualname__)
        if hasattr(cls, "score_mod_graph_cache_key"):
            return ("te-callable", name, freeze(fn.score_mod_graph_cache_key())), ()
        call = getattr(cls, "__call__", None)
        if inspect.isfunction(call):
            token = object_token(fn)
            return ("callable", token, name, _digest_or_raise(call, what, how)), (token,)
    raise TypeError(f"{what} {fn!r} is not a function, method or callable object with code to key; {how}")


def _digest_or_raise(fn: Callable, what: str, how: str) -> str:
    try:
        return code_digest(fn)
    except ReadsMutableGlobal as exc:
        raise ValueError(f"{what} {fn.__qualname__!r} cannot be keyed by its code: {exc}, so a cached graph would "
                         f"go stale; {how}, or give the callback's class a score_mod_graph_cache_key() method") from None
    except Unkeyable as exc:
        raise TypeError(f"{what} {fn.__qualname__!r} cannot be keyed by its code: {exc}; {how}") from None
