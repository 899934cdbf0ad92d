"""One context-parallel comparison, run inside a spawned gloo group (see _cp4_cases).

`compare` draws full float64 inputs (the same on every rank of the CP group, distinct per group),
and holds the CP result in float32 to the project's rule against the exact float64 result:

    max |cp - exact| <= bound_from(single-process float32 result, exact, float32)

i.e. 2x the error of the same call on one process in float32 plus the float32 floor, for the
output and dq, dk, dv (and a score_mod tensor's gradient when one is trained).
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, List, Optional

import torch

F32, F64 = torch.float32, torch.float64


class Ctx:
    """Per-rank state of a case run: rank / world of the default group and a seeded generator."""

    def __init__(self, rank: int, world: int) -> None:
        import fused_attn
        import fused_attn.distributed as fd

        self.rank, self.world, self.fa, self.fd = rank, world, fused_attn, fd
        self.gen = torch.Generator()

    def seed(self, *parts: Any) -> None:
        self.gen.manual_seed(zlib.crc32(repr(parts).encode()))

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=F64)


def _grads(fn: Callable, inputs: List[torch.Tensor], dout: torch.Tensor, dtype: torch.dtype,
           leaf: Optional[torch.Tensor], make_mod: Optional[Callable]):
    xs = [t.detach().to(dtype).requires_grad_(True) for t in inputs]
    extra = {}
    lf = None
    if make_mod is not None:
        lf = leaf.detach().to(dtype).requires_grad_(True)
        extra["score_mod"] = make_mod(lf)
    out = fn(*xs, **extra)
    (out.to(F64) * dout).sum().backward()
    grads = [t.grad for t in xs] + ([lf.grad] if lf is not None else [])
    return out.detach(), grads


def compare(ctx: Ctx, inputs: List[torch.Tensor], kw: Dict[str, Any], comm: str, *, fmt: str = "bshd",
            cu: Optional[torch.Tensor] = None, group: Any = None, layout: str = "load_balanced",
            mod_leaf: Optional[torch.Tensor] = None, make_mod: Optional[Callable] = None,
            single_kw: Optional[Dict[str, Any]] = None) -> None:
    """Raise AssertionError naming the tensor unless the CP result (float32) meets the rule.

    inputs: full float64 q, k, v; kw: the dot_product_attention arguments (global lengths for
    thd); make_mod(leaf) builds a score_mod from a tensor leaf (its gradient is checked too).
    single_kw: arguments of the one-process calls when they differ (backend)."""
    from fused_attn.testing import assert_close, bound_from

    fa, fd = ctx.fa, ctx.fd
    ref_kw = dict(kw, **(single_kw or {}))
    exact_kw = dict(ref_kw, backend="reference")
    dout = ctx.randn(*inputs[0].shape[:-1], inputs[2].shape[-1])
    exact, g_exact = _grads(lambda *t, **e: fa.dot_product_attention(*t, **exact_kw, **e), inputs, dout, F64,
                            mod_leaf, make_mod)
    single, g_single = _grads(lambda *t, **e: fa.dot_product_attention(*t, **ref_kw, **e), inputs, dout, F32,
                              mod_leaf, make_mod)
    shard = lambda t: fd.shard_sequence(t, group, layout=layout, qkv_format=fmt, cu_seqlens=cu)  # noqa: E731
    unshard = lambda t: fd.unshard_sequence(t, group, layout=layout, qkv_format=fmt, cu_seqlens=cu)  # noqa: E731

    def run(*loc, **extra):
        return fd.context_parallel_attention(*loc, group, comm, layout=layout, **kw, **extra)

    loc_out, loc_grads = _grads(run, [shard(t) for t in inputs], shard(dout), F32, mod_leaf, make_mod)
    what = f"{comm} {layout} {fmt} {sorted(kw.get('attn_mask_type', 'no_mask').split())}"
    assert_close(unshard(loc_out), exact, bound_from(single, exact, F32), f"{what} out")
    names = ["dq", "dk", "dv", "d(score_mod tensor)"]
    for i, (g, gs, ge) in enumerate(zip(loc_grads, g_single, g_exact)):
        got = unshard(g) if i < 3 else g
        assert_close(got, ge, bound_from(gs, ge, F32), f"{what} {names[i]}")
