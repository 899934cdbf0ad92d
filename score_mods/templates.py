"""Mod structures made once per structural arguments, reachable from torch.compile'd code.

A library factory whose DAG depends on its arguments (`sliding_window`: which sides are
bounded; `compose` / `and_masks` / `or_masks`: which parts) gets its structure here and binds
the call's values into it:

    mod = template(_window_structure, left_bounded, right_bounded, bottom_right).bind(left=..., right=...)

So a factory traces no DAG per call (eager calls get cheaper), and it works inside a function
compiled with torch.compile(fullgraph=True): the structure is built eagerly at trace time
(`template_key` is an assume_constant_result function; its arguments are plain constants --
bools, ints, strings, parts as their origins' names, `TracedMod.origin_name` -- since some torch
versions hand no object to such a function) and comes back as an attribute of a module-level
holder, which the compiler resolves live and can guard (an object returned by such a function
could not be used in traced code). The holder is bounded (least recently used structures are
dropped) and written under a lock.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Callable

import torch

from . import caches

__all__ = ["template", "template_key"]


class _Slots:
    """Holds each structure as an attribute named by its key's digest: compiled code reaches it
    with getattr, which the compiler resolves on the live object (a dict read there would come
    from its snapshot of the dict, taken before a structure built during the same trace)."""


_SLOTS = _Slots()
_ORDER: "OrderedDict[str, None]" = OrderedDict()  # slot names, least recently used first
_LOCK = threading.Lock()
_MAX = 512


def _info() -> caches.Info:
    with _LOCK:
        return ("score_mods.templates", 0, 0, 0, len(_ORDER), _MAX, 0, None)


caches.register("score_mods.templates", _info, None,
                keeps="compiled code reaches each structure by its slot name; the structures hold no tensor data")
_PLAIN = (bool, int, float, str, type(None))


def _arg_key(a: Any) -> str:
    """A plain value by type and repr."""
    if not isinstance(a, _PLAIN):
        raise TypeError(f"template arguments must be bools, ints, floats, strings or None, got {type(a).__name__}")
    return f"{type(a).__name__}:{a!r}"


def _same_args(stored: tuple, args: tuple) -> bool:
    return len(stored) == len(args) and all(type(a) is type(b) and a == b for a, b in zip(stored, args))


@torch.compiler.assume_constant_result
def template_key(builder: Callable[..., Any], *args: Any) -> str:
    """Build `builder(*args)` once (eagerly, also under torch.compile) and return its slot name."""
    key = f"{builder.__module__}.{builder.__qualname__}(" + ",".join(_arg_key(a) for a in args) + ")"
    name = "t_" + hashlib.sha1(key.encode()).hexdigest()
    with _LOCK:
        got = getattr(_SLOTS, name, None)
        if got is not None and _same_args(got._template_args, args):
            _ORDER.move_to_end(name)
            return name
    built = builder(*args)
    built._template_args = args
    with _LOCK:
        setattr(_SLOTS, name, built)
        _ORDER[name] = None
        _ORDER.move_to_end(name)
        while len(_ORDER) > _MAX:
            delattr(_SLOTS, _ORDER.popitem(last=False)[0])
    return name


def template(builder: Callable[..., Any], *args: Any) -> Any:
    """`builder(*args)`, made once per arguments (see the module docstring)."""
    name = template_key(builder, *args)
    got = getattr(_SLOTS, name, None)
    if got is None:  # dropped by another thread in between (eager code only)
        got = builder(*args)
    return got
