"""The torch engine's score_mod path: torch.compile'd flex_attention on CPU (inference only).

One compiled function per (mod structure, integer parameter values, scale, GQA, dtype, shapes), kept in a
bounded, lock-protected LRU (`FLEX_CACHE`, cleared by `fused_attn.graph_cache.clear()`). Float
parameters and tensor parameters are inputs of the compiled function, so a new value never
recompiles; shapes are static (one entry per shape: torch 2.13's CPU flex template with dynamic
shapes and a block mask emits C++ that does not compile), so a new shape compiles once (10-30 s on
a small CPU). Each entry has its own code object, so torch.compile's per-function recompile limit
never makes one entry fall back to eager because of another.

The band (causal, windows, bottom-right alignment) is a flex BlockMask (cached per band and shape in
the same LRU): tiles no query attends are skipped, the others masked after the mod as the reference
does; rows with no allowed key give out 0 (flex's convention).
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch

from ..layouts import from_logical
from ..memo import BoundedMemo

__all__ = ["refusal", "FlexRunner", "FLEX_CACHE"]

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


#: Compiled flex functions, band mask_mods and block masks (a block mask's factory fetches its
#: mask_mod: another key, so no factory waits on itself).
FLEX_CACHE = BoundedMemo(32, "torch_flex.compiled")


def _make_call(prog: Any, float_names: tuple, tensor_names: tuple, ints: dict, scale: float, gqa: bool,
               tag: int) -> Callable:
    """A compiled (q, k, v, floats (n,) fp64, tensors, block_mask or None) -> out (B, H, Sq, Dv)
    for one mod structure."""
    from score_mods import eager as eager_mod
    from torch.nn.attention.flex_attention import flex_attention

    def call(q, k, v, floats, tensors, block_mask):
        params = dict(ints)
        for i, name in enumerate(float_names):
            params[name] = floats[i]
        params.update(zip(tensor_names, tensors))
        sq, skv = q.shape[2], k.shape[2]

        def score_fn(score, b, h, q_idx, kv_idx):
            return eager_mod.run(prog, eager_mod.index_env(score, b, h, q_idx, kv_idx, sq, skv), params)

        return flex_attention(q, k, v, score_mod=score_fn, block_mask=block_mask, scale=scale, enable_gqa=gqa)

    # a code object of its own: torch.compile counts recompilations per code object
    code = call.__code__.replace(co_name=f"fused_attn_flex_{tag}")
    fn = types.FunctionType(code, call.__globals__, code.co_name, call.__defaults__, call.__closure__)
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _band_mask_mod(left: Optional[int], right: Optional[int], shift: int) -> Callable:
    """flex mask_mod of the band -left <= kv_idx - (q_idx + shift) <= right (None: unbounded)."""

    def band_mask(b, h, q_idx, kv_idx):
        d = kv_idx - q_idx - shift
        ok = (d <= right) if right is not None else (d == d)
        return ok & (d >= -left) if left is not None else ok

    return band_mask


def _block_mask(band: Any, sq: int, skv: int) -> Any:
    """The flex BlockMask of `band` at (Sq, Skv), cached (tiles with no allowed key are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    shift = skv - sq if band.bottom_right else 0

    def make():
        mask_mod = FLEX_CACHE.get_or_create(("mask_mod", band.left, band.right, shift),
                                            lambda: _band_mask_mod(band.left, band.right, shift))
        return create_block_mask(mask_mod, None, None, sq, skv, device="cpu")

    return FLEX_CACHE.get_or_create(("block_mask", band, sq, skv), make)


def _float_names(mod: Any) -> tuple:
    """The mod's float parameters (inputs of the compiled function; ints are baked in)."""
    return tuple(n for n, spec in mod.specs.items() if spec.kind == "float")


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

    def _compiled(self, mod: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable:
        from score_mods import eager as eager_mod

        st = self.static
        typed = mod.scalars_typed()
        floats = _float_names(mod)
        ints = {n: x for n, x in typed.items() if n not in floats}
        tensors = tuple(mod.tensors())
        gqa = st.heads != st.kv_heads
        shapes = tuple((tuple(t.shape), t.stride()) for t in (q, k, v))
        params = tuple((n, tuple(t.shape), t.stride(), t.dtype) for n, t in mod.tensors().items())
        key = (mod.cache_key, tuple(sorted(ints.items())), floats, params, st.scale, gqa, q.dtype, shapes)
        prog = eager_mod.program(mod.root)
        return FLEX_CACHE.get_or_create(
            key, lambda: _make_call(prog, floats, tensors, ints, st.scale, gqa, FLEX_CACHE.info().misses))

    def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=None, dest=None):
        ql, kl, vl = (t.permute(self.perm) for t in (q, k, v))
        fn = self._compiled(mod, ql, kl, vl)
        typed = mod.scalars_typed()
        floats = torch.tensor([float(typed[n]) for n in _float_names(mod)], dtype=torch.float64)
        with torch.no_grad():
            if ql.shape[2] == 0 or kl.shape[2] == 0:
                o = ql.new_zeros(ql.shape[:3] + (vl.shape[3],))
            else:
                band = self.static.spec.band
                block = None if band is None else _block_mask(band, ql.shape[2], kl.shape[2])
                o = fn(ql, kl, vl, floats, tuple(mod.tensors().values()), block)
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
