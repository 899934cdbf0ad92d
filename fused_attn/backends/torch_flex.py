"""The torch engine's score_mod path: torch.compile'd flex_attention on CPU (inference only).

One compiled function per (mod structure, integer parameter values, scale, GQA, dtype, shapes, lengths
and band when lengths are given), kept in a bounded, lock-protected LRU (`FLEX_CACHE`, cleared by
`fused_attn.graph_cache.clear()`). Float parameters and tensor parameters are inputs of the compiled
function, so a new value never recompiles; shapes are static (one entry per shape: torch 2.13's CPU
flex template with dynamic shapes and a block mask emits C++ that does not compile), so a new shape
compiles once (10-30 s on a small CPU). Each entry has its own code object, so torch.compile's
per-function recompile limit never makes one entry fall back to eager because of another.

The band (causal, windows, bottom-right alignment) is a flex BlockMask (cached per band and shape in
the same LRU): tiles no query attends are skipped, the others masked after the mod as the reference
does; rows with no allowed key give out 0 (flex's convention, the reference's too). Dense padding
(per-sequence lengths): the mod sees each sequence's lengths, positions past them are masked after
the mod inside the score function (and zeroed in q, k, v first, so garbage there reaches nothing);
the band's BlockMask still skips tiles where it does not depend on the lengths (top-left bands).

Head dims 8 and 16: q and k are zero-padded to 24 (`padded_head_dim`, the dot products and the
explicit scale unchanged): torch 2.13's CPU kernel is wrong there (see `padded_head_dim`).
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any, Callable, Optional

import torch

from ..layouts import from_logical
from ..memo import BoundedMemo

__all__ = ["refusal", "FlexRunner", "FLEX_CACHE"]

_PERM = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}
_FLEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def padded_head_dim(head_dim: int) -> int:
    """The head dim q and k are given to the CPU flex kernel: 8 and 16 are zero-padded to 24.

    torch 2.13's CPU flex kernel (inductor's C++ template) computes q @ k^T with a micro-GEMM of
    16-key tiles; for the last tile of a block narrower than 16 it takes a shortcut when head_dim
    is a multiple of the vector width and below 24, and, when the tail is exactly one vector wide
    (8 keys on AVX2: Skv % 16 == 8), it still stores a 16-key row: past the score tile into the
    running row maxima, reading keys past the end. The output is then off by O(1) and changes from
    run to run. From head_dim 24 on the kernel takes its general path; zero columns leave every
    dot product as it was (the scale is passed explicitly, so it does not follow the padding)."""
    return 24 if head_dim in (8, 16) else head_dim


def refusal(problem, mod: Any) -> Optional[str]:
    """Why flex on CPU cannot run this score_mod problem exactly (None: it can)."""
    spec = problem.spec
    if mod.root is None:
        return f"score_mod {mod.name!r} is not a traced score_mod (flex needs its torch form)"
    if problem.needs_grad:
        return ("a score_mod with gradients: torch's compiled flex_attention has no CPU backward (the reference "
                "computes the gradients)")
    if spec.return_lse:
        return "return_lse=True with a score_mod: torch's compiled flex_attention returns no lse on CPU"
    if problem.dtype not in _FLEX_DTYPES:
        return f"a score_mod in {problem.dtype}: flex_attention on CPU takes float32, float16 and bfloat16"
    isa = torch.backends.cpu.get_cpu_capability()
    if isa not in ("AVX2", "AVX512") or sys.platform == "darwin":
        return (f"a score_mod on a CPU with vector capability {isa!r} ({sys.platform}): torch compiles "
                "flex_attention for x86 CPUs with AVX2 or AVX-512 only")
    return None


#: Compiled flex functions, band mask_mods and block masks (a block mask's factory fetches its
#: mask_mod: another key, so no factory waits on itself).
FLEX_CACHE = BoundedMemo(32, "torch_flex.compiled")


def _make_call(prog: Any, float_names: tuple, tensor_names: tuple, ints: dict, scale: float, gqa: bool,
               pad: int, band: Optional[Any], tag: int) -> Callable:
    """A compiled (q, k, v, floats (n,) fp32, tensors, block_mask or None, lens) -> out (B, H, Sq, Dv)
    for one mod structure (floats in fp32, the kernel's score dtype: the reference's arithmetic with
    Python floats, and vectorised; fp64 values made the kernel compute the mod in fp64). pad: zero columns added to q and k (`padded_head_dim`). lens: None (the
    mod sees Sq and Skv; the band is the block mask's) or per-sequence lengths (q_lens (B,),
    kv_lens (B,)) int64: the mod sees them, and positions past them or outside `band` (aligned
    with those lengths) score -inf after the mod."""
    from score_mods import eager as eager_eval
    from torch.nn.attention.flex_attention import flex_attention

    def call(q, k, v, floats, tensors, block_mask, lens):
        params = dict(ints)
        for i, name in enumerate(float_names):
            params[name] = floats[i]
        params.update(zip(tensor_names, tensors))
        sq, skv = q.shape[2], k.shape[2]
        if pad:
            q = torch.nn.functional.pad(q, (0, pad))
            k = torch.nn.functional.pad(k, (0, pad))

        def score_fn(score, b, h, q_idx, kv_idx):
            if lens is None:
                return eager_eval.run(prog, eager_eval.index_env(score, b, h, q_idx, kv_idx, sq, skv), params)
            q_len, kv_len = lens[0][b], lens[1][b]
            s = eager_eval.run(prog, eager_eval.index_env(score, b, h, q_idx, kv_idx, q_len, kv_len), params)
            ok = (q_idx < q_len) & (kv_idx < kv_len)
            if band is not None:
                d = kv_idx - q_idx - (kv_len - q_len if band.bottom_right else 0)
                if band.right is not None:
                    ok = ok & (d <= band.right)
                if band.left is not None:
                    ok = ok & (d >= -band.left)
            return torch.where(ok, s, -math.inf)

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
        self.pad = padded_head_dim(problem.head_dim) - problem.head_dim
        band = problem.spec.band
        self.padding = problem.spec.padding
        # with lengths, only a top-left band's block mask is independent of them
        self.block_band = band if not (self.padding and band is not None and band.bottom_right) else None

    def grad_inputs(self, mod: Any, sinks: Any) -> tuple:
        return ()

    def op_grads(self, mod: Any, sinks: Any, grads: tuple) -> list:
        return list(grads[3:])

    def _compiled(self, mod: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable:
        from score_mods import eager as eager_eval

        st = self.static
        typed = mod.scalars_typed()
        floats = _float_names(mod)
        ints = {n: x for n, x in typed.items() if n not in floats}
        tensors = tuple(mod.tensors())
        gqa = st.heads != st.kv_heads
        shapes = tuple((tuple(t.shape), t.stride()) for t in (q, k, v))
        params = tuple((n, tuple(t.shape), t.stride(), t.dtype) for n, t in mod.tensors().items())
        lengths = ("lengths", st.spec.band) if self.padding else None
        key = (mod.cache_key, tuple(sorted(ints.items())), floats, params, st.scale, gqa, q.dtype, shapes, lengths)
        prog = eager_eval.program(mod.root)
        band = st.spec.band
        return FLEX_CACHE.get_or_create(key, lambda: _make_call(prog, floats, tensors, ints, st.scale, gqa, self.pad,
                                                                band if self.padding else None,
                                                                FLEX_CACHE.info().misses))

    def _lengths(self, q, k, v, varlen):
        """(q, k, v with positions past each sequence's lengths zeroed, (q_lens, kv_lens) int64 (B,))."""
        q_lens = (varlen.cu_seqlens_q[1:] - varlen.cu_seqlens_q[:-1]).to(torch.int64)
        kv_lens = (varlen.cu_seqlens_kv[1:] - varlen.cu_seqlens_kv[:-1]).to(torch.int64)
        q_ok = torch.arange(q.shape[2]).view(1, 1, -1, 1) < q_lens.view(-1, 1, 1, 1)
        kv_ok = torch.arange(k.shape[2]).view(1, 1, -1, 1) < kv_lens.view(-1, 1, 1, 1)
        return q.masked_fill(~q_ok, 0), k.masked_fill(~kv_ok, 0), v.masked_fill(~kv_ok, 0), (q_lens, kv_lens)

    def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=None, dest=None):
        ql, kl, vl = (t.permute(self.perm) for t in (q, k, v))
        typed = mod.scalars_typed()
        floats = torch.tensor([float(typed[n]) for n in _float_names(mod)], dtype=torch.float32)
        with torch.no_grad():
            if ql.shape[2] == 0 or kl.shape[2] == 0:
                o = ql.new_zeros(ql.shape[:3] + (vl.shape[3],))
            else:
                lens = None
                if self.padding:
                    ql, kl, vl, lens = self._lengths(ql, kl, vl, varlen)
                fn = self._compiled(mod, ql, kl, vl)
                band = self.block_band
                block = None if band is None else _block_mask(band, ql.shape[2], kl.shape[2])
                o = fn(ql, kl, vl, floats, tuple(mod.tensors().values()), block, lens)
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
