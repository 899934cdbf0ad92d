"""The torch engine's score_mod path: torch.compile'd flex_attention on CPU (inference only).

One compiled function per (mod structure, integer parameter values, band, scale, GQA), kept in a
bounded, lock-protected LRU (`FLEX_CACHE`, cleared by `fused_attn.graph_cache.clear()`). Float
parameters and tensor parameters are inputs of the compiled function, so a new value never
recompiles; shapes are dynamic (sizes 0/1 specialize). Each entry has its own code object, so
torch.compile's per-function recompile limit is per entry, never shared across mods.

The band (causal, windows) is applied inside the score function as where(allowed, score, -inf)
after the mod, as the reference does; rows with no allowed key give out 0 (flex's convention).
"""

from __future__ import annotations

import math
import threading
import types
from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional

import torch

from ..layouts import from_logical

__all__ = ["refusal", "FlexRunner", "FLEX_CACHE", "clear"]

_PERM = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}
_FLEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def refusal(problem, mod: Any) -> Optional[str]:
    """Why flex on CPU cannot run this score_mod problem exactly (None: it can)."""
    spec = problem.spec
    if getattr(mod, "root", None) is None or not hasattr(mod, "specs"):
        return f"score_mod {getattr(mod, 'name', mod)!r} is not a traced score_mod (flex needs its torch form)"
    if problem.needs_grad:
        return "a score_mod with gradients: torch's flex_attention has no CPU backward"
    if spec.return_lse:
        return "return_lse=True with a score_mod: torch's compiled flex_attention returns no lse on CPU"
    if problem.dtype not in _FLEX_DTYPES:
        return f"a score_mod in {problem.dtype}: flex_attention on CPU takes float32, float16 and bfloat16"
    if spec.padding:
        return "a score_mod with a padding mask: flex_attention has no per-sequence lengths"
    return None


class _FlexCache:
    """Bounded, thread-safe LRU of compiled flex functions."""

    def __init__(self, maxsize: int = 32) -> None:
        self.maxsize = maxsize
        self._entries: "OrderedDict[Hashable, Callable]" = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0

    def get(self, key: Hashable, make: Callable[[], Callable]) -> Callable:
        with self._lock:
            fn = self._entries.get(key)
            if fn is not None:
                self._entries.move_to_end(key)
                return fn
            fn = make()
            self.compiles += 1
            self._entries[key] = fn
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
            return fn

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


FLEX_CACHE = _FlexCache()


def clear() -> None:
    """Drop every compiled flex function."""
    FLEX_CACHE.clear()


def _make_call(prog: Any, float_names: tuple, tensor_names: tuple, ints: dict, band: Any, scale: float,
               gqa: bool, tag: int) -> Callable:
    """A compiled (q, k, v, floats (n,) fp64, tensors) -> out (B, H, Sq, Dv) for one mod structure."""
    from score_mods import eager as eager_mod
    from torch.nn.attention.flex_attention import flex_attention

    def call(q, k, v, floats, tensors):
        params = dict(ints)
        for i, name in enumerate(float_names):
            params[name] = floats[i]
        params.update(zip(tensor_names, tensors))
        sq, skv = q.shape[2], k.shape[2]

        def score_fn(score, b, h, q_idx, kv_idx):
            s = eager_mod.run(prog, eager_mod.index_env(score, b, h, q_idx, kv_idx, sq, skv), params)
            if band is None:
                return s
            d = kv_idx - q_idx
            if band.bottom_right:
                d = d - (skv - sq)
            ok = None
            if band.right is not None:
                ok = d <= band.right
            if band.left is not None:
                ok = (d >= -band.left) if ok is None else ok & (d >= -band.left)
            return torch.where(ok, s, torch.full_like(s, -math.inf))

        return flex_attention(q, k, v, score_mod=score_fn, scale=scale, enable_gqa=gqa)

    # a code object of its own: torch.compile counts recompilations per code object
    code = call.__code__.replace(co_name=f"fused_attn_flex_{tag}")
    fn = types.FunctionType(code, call.__globals__, code.co_name, call.__defaults__, call.__closure__)
    return torch.compile(fn, dynamic=True, fullgraph=True)


class FlexRunner:
    """Runs a traced score_mod problem (no gradients) on compiled flex_attention.

    forward -> (out in the query's format, None, (), None); same interface as the reference runner."""

    backend = "torch"

    def __init__(self, problem) -> None:
        self.static = problem
        self.fmt = problem.spec.qkv_format
        self.perm = _PERM[self.fmt]

    def grad_inputs(self, mod: Any, sinks: Any) -> tuple:
        return ()

    def op_grads(self, mod: Any, sinks: Any, grads: tuple) -> list:
        return list(grads[3:])

    def _compiled(self, mod: Any) -> Callable:
        from score_mods import eager as eager_mod

        st = self.static
        typed = mod.scalars_typed()
        floats = tuple(n for n, x in typed.items() if isinstance(x, float))
        ints = {n: x for n, x in typed.items() if not isinstance(x, float)}
        tensors = tuple(mod.tensors())
        gqa = st.heads != st.kv_heads
        key = (mod.cache_key, tuple(sorted(ints.items())), floats, tensors, st.spec.band, st.scale, gqa)
        prog = eager_mod.program(mod.root)
        return FLEX_CACHE.get(key, lambda: _make_call(prog, floats, tensors, ints, st.spec.band, st.scale, gqa,
                                                      FLEX_CACHE.compiles))

    def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=None, dest=None):
        fn = self._compiled(mod)
        typed = mod.scalars_typed()
        floats = torch.tensor([x for x in typed.values() if isinstance(x, float)], dtype=torch.float64)
        ql, kl, vl = (t.permute(self.perm) for t in (q, k, v))
        with torch.no_grad():
            if ql.shape[2] == 0 or kl.shape[2] == 0:
                o = ql.new_zeros(ql.shape[:3] + (vl.shape[3],))
            else:
                o = fn(ql, kl, vl, floats, tuple(mod.tensors().values()))
            out = from_logical(o, self.fmt).contiguous()
            if dest is not None:
                dest[0].copy_(out)
        return out, None, (), None

    def backward(self, state, saved, grad_out):
        raise NotImplementedError("the torch engine's flex path has no backward (torch's CPU flex_attention has "
                                  "none); a call that needs gradients is planned on the reference")

    def backward_call(self, *args, **kwargs):
        return self.backward(None, (), None)

    def backward_with_lse(self, *args, **kwargs):
        return self.backward(None, (), None)
