"""Score callbacks that never read a callback input next to a value computed from it.

Quirk `score_reused_in_pointwise` (quirks.py): on cuDNN 9.27 an SDPA graph faults with an
illegal address (err 700, the CUDA context is lost) when a pointwise op of a score_mod callback
takes the callback's input tensor (the score, or dS in the backward) together with another
operand computed from that same input: `s * s`, `-s * s`, `tanh(s) + s`,
`where(c, where(c2, s, -inf), s)`. Measured on an H200 with raw graphs: every such form faults;
the same graphs with the input read through one `identity` copy run and match (`tanh(s) *
sigmoid(s)`, whose operands are both computed, runs as is). cuDNN 9.19 runs all of them.

`IsolatingGraph` wraps the graph object handed to the callbacks (the library's lowering and
users' raw callbacks alike): it records which callback input each tensor depends on, and where
an op would read an input next to a value computed from it, it passes the input's identity copy
instead (one per input and graph). The values are unchanged: identity is exact.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Tuple

__all__ = ["IsolatingGraph"]


class IsolatingGraph:
    """Proxy of a cuDNN frontend graph for score_mod callbacks (see the module docstring).

    Call `root(t)` with each callback input (score, dS) before the callback runs; every other
    attribute is the graph's own, with its op methods wrapped."""

    def __init__(self, graph: Any, float_type: Any) -> None:
        self._graph = graph
        self._float = float_type
        self._deps: Dict[int, Tuple[Any, FrozenSet[int]]] = {}  # id -> (tensor kept alive, root ids)
        self._roots: Dict[int, Any] = {}
        self._copies: Dict[int, Any] = {}
        self.copies_made = 0

    def root(self, tensor: Any) -> Any:
        """Mark `tensor` as a callback input; returns it."""
        self._roots[id(tensor)] = tensor
        self._deps[id(tensor)] = (tensor, frozenset((id(tensor),)))
        return tensor

    def _dep(self, x: Any) -> FrozenSet[int]:
        entry = self._deps.get(id(x))
        return entry[1] if entry is not None and entry[0] is x else frozenset()

    def _is_root(self, x: Any) -> bool:
        return self._roots.get(id(x)) is x

    def _copy(self, x: Any) -> Any:
        got = self._copies.get(id(x))
        if got is None:
            got = self._graph.identity(x, compute_data_type=self._float)
            got.set_data_type(self._float)
            self._copies[id(x)] = got
            self._deps[id(got)] = (got, frozenset((id(x),)))
            self.copies_made += 1
        return got

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._graph, name)
        if not callable(attr):
            return attr

        def op(*args: Any, **kw: Any) -> Any:
            args = list(args)
            slots = [(i, a) for i, a in enumerate(args)] + list(kw.items())
            deps = [self._dep(v) for _, v in slots]
            for n, (slot, value) in enumerate(slots):
                if self._is_root(value) and any(id(value) in d for m, d in enumerate(deps) if m != n):
                    copy = self._copy(value)
                    if isinstance(slot, int):
                        args[slot] = copy
                    else:
                        kw[slot] = copy
            out = attr(*args, **kw)
            union = frozenset().union(*deps) if deps else frozenset()
            if union:
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if t is not None:
                        self._deps[id(t)] = (t, union)
            return out

        return op
