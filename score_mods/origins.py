"""Origins by name: every mod made by tracing (not by binding) is registered under a name.

torch.compile'd code hands an origin to eager code as its name (a string is a constant in every
torch version; some accept no object there). Weak values: an entry lives as long as its origin
(every mod bound from it holds it), so the table is bounded by live mods.
"""

from __future__ import annotations

import itertools
import threading
import weakref

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
