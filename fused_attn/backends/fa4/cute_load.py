"""Generated CuTe source (`cute_source.Source`) as flash-attn-4 callables, memoized per text.

The text is executed as a module whose source the CuTe DSL can read back (it registers the text
with `linecache` under a name of its own, as the DSL's preprocessor reads a function's source).
Each callable carries `__cute_hash__` (the text's digest), so FA4's compile cache keys on the
mod's structure, never on the Python object: a value change or a fresh mod of the same structure
reuses the compiled kernel. A mod that gathers from tensor parameters is read one element per
thread (`__vec_size__ = 1`), as FA4 requires for aux tensors.
"""

from __future__ import annotations

import linecache
from typing import Any, Callable, NamedTuple

from ...memo import BoundedMemo
from .cute_source import Source

__all__ = ["Callables", "load"]


class Callables(NamedTuple):
    score_mod: Callable[..., Any]
    score_mod_bwd: Callable[..., Any]


_LOADED: BoundedMemo = BoundedMemo(256, "fa4 cute callables")


def _build(source: Source) -> Callables:
    filename = f"<fused_attn-cute-{source.digest}>"
    lines = source.text.splitlines(keepends=True)
    linecache.cache[filename] = (len(source.text), None, lines, filename)
    namespace: dict = {"__name__": f"fused_attn_cute_{source.digest}", "__file__": filename}
    exec(compile(source.text, filename, "exec"), namespace)  # noqa: S102 - our own generated text
    fns = Callables(namespace["score_mod"], namespace["score_mod_bwd"])
    for fn in fns:
        for target in (fn, getattr(fn, "__wrapped__", None)):
            if target is None:
                continue
            try:
                target.__cute_hash__ = f"fused_attn-{source.digest}-{fn.__name__}"
                if source.uses_aux_tensors:
                    target.__vec_size__ = 1
            except AttributeError:  # pragma: no cover - a wrapper that takes no attributes
                pass
    return fns


def load(source: Source) -> Callables:
    """The (score_mod, score_mod_bwd) callables of `source` (imports cutlass on first use)."""
    return _LOADED.get_or_create(source.digest, lambda: _build(source))
