"""Cases of tests/distributed/test_distributed.py that run inside spawned gloo process groups (CPU, float64,
reference backend). Every rank runs every case of its list in the same order (collectives stay
in step); each case raises on failure, and the runner records (name, ok, message) per rank.

DTensor cases compare with the unsharded call of the same entry point (the same local math:
held to 1e-12 relative). Context-parallel cases compare with the unsharded call too; the lse
of each block travels as fp32, so they are held to `cp_bound` (2e-6 relative): the error of
fp32 merge weights exp(lse_i - lse) at |lse| ~ 10, with a 10x margin.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
import zlib
from typing import Any, Callable, Dict, List, Tuple

import torch


def cp_bound(expected: torch.Tensor) -> float:
    return 2e-6 * max(1.0, float(expected.detach().abs().max()))


def exact_bound(expected: torch.Tensor) -> float:
    return 1e-12 * max(1.0, float(expected.detach().abs().max()))


class Ctx:
    def __init__(self, rank: int, world: int) -> None:
        import fused_attn
        import fused_attn.distributed as fd
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world, self.fa, self.fd = rank, world, fused_attn, fd
        self.mesh = init_device_mesh("cpu", (world,))
        self.gen = torch.Generator().manual_seed(1234)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64)


def close(actual: torch.Tensor, expected: torch.Tensor, bound: float, what: str) -> None:
    from fused_attn.testing import assert_close

    assert_close(actual, expected, bound, what)


# ----------------------------------------------------------------------------- DTensor


def _dt_compare(ctx: Ctx, ref_fn: Callable, dt_fn: Callable, inputs: List[torch.Tensor], placements: List[Any],
                what: str, grad_of: Tuple[Any, Any] = None) -> Any:
    """ref_fn / dt_fn on (copies of) inputs; forward, every input gradient; DTensor placements kept."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    ref_in = [t.clone().requires_grad_(True) for t in inputs]
    ref = ref_fn(*ref_in)
    dout = ctx.randn(*ref.shape)
    (ref * dout).sum().backward()
    dts = [distribute_tensor(t.clone(), ctx.mesh, [p]).requires_grad_(True) for t, p in zip(inputs, placements)]
    out = dt_fn(*dts)
    assert isinstance(out, DTensor), f"{what}: expected a DTensor, got {type(out).__name__}"
    assert tuple(out.placements) == (placements[0],), f"{what}: output placements {out.placements}"
    d_dout = distribute_tensor(dout, ctx.mesh, out.placements)
    (out * d_dout).sum().backward()
    close(out.full_tensor(), ref, exact_bound(ref), f"{what} out")
    for name, d, r in zip("qkv", dts, ref_in):
        assert tuple(d.grad.placements) == tuple(d.placements), f"{what} d{name} placements {d.grad.placements}"
        close(d.grad.full_tensor(), r.grad, exact_bound(r.grad), f"{what} d{name}")
    return out


def dt_dense(fmt: str, placement_dim: int, mask: str = "no_mask", mod: str = None, gqa: bool = False):
    def case(ctx: Ctx) -> None:
        from score_mods import softcap
        from torch.distributed.tensor import Shard

        shapes = {"bshd": (4, 8, 4, 16), "sbhd": (8, 4, 4, 16), "bhsd": (4, 4, 8, 16)}[fmt]
        hd = {"bshd": 2, "sbhd": 2, "bhsd": 1}[fmt]
        kshape = list(shapes)
        if gqa:
            kshape[hd] = 2
        q, k, v = ctx.randn(*shapes), ctx.randn(*kshape), ctx.randn(*kshape)
        sm = softcap(3.0) if mod == "softcap" else None
        kw = dict(qkv_format=fmt, attn_mask_type=mask, score_mod=sm)
        _dt_compare(ctx, lambda a, b, c: ctx.fa.dot_product_attention(a, b, c, **kw),
                    lambda a, b, c: ctx.fd.dot_product_attention(a, b, c, **kw), [q, k, v], [Shard(placement_dim)] * 3,
                    f"{fmt} Shard({placement_dim}) {mask} {mod}")
    return case


def dt_bias(kind: str, dtensor_bias: bool):
    """post_scale_bias under batch or heads sharding: a plain bias (1, H, S, S) broadcast over the
    batch (its gradient is a per-shard sum, Partial) or a (B, H, S, S) DTensor sharded like the inputs."""
    def case(ctx: Ctx) -> None:
        from score_mods import post_scale_bias
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        q, k, v = (ctx.randn(4, 8, 4, 16) for _ in range(3))
        bias = ctx.randn(4 if dtensor_bias else 1, 4, 8, 8)
        rb = bias.clone().requires_grad_(True)
        ref = ctx.fa.dot_product_attention(q, k, v, score_mod=post_scale_bias(rb))
        ref.sum().backward()
        if dtensor_bias:
            db = distribute_tensor(bias.clone(), ctx.mesh, [Shard(0 if kind == "batch" else 1)]).requires_grad_(True)
        else:
            db = bias.clone().requires_grad_(True)
        pl = Shard(0 if kind == "batch" else 2)
        out = ctx.fd.dot_product_attention(*(distribute_tensor(t, ctx.mesh, [pl]) for t in (q, k, v)),
                                           score_mod=post_scale_bias(db))
        out.sum().backward()
        close(out.full_tensor(), ref, exact_bound(ref), "bias out")
        g = db.grad.full_tensor() if isinstance(db.grad, DTensor) else db.grad
        close(g, rb.grad, 1e-12 * max(1.0, float(rb.grad.abs().max())), "dbias")
    return case


def dt_alibi_heads(ctx: Ctx) -> None:
    from score_mods import alibi, alibi_slopes
    from torch.distributed.tensor import Shard, distribute_tensor

    slopes = alibi_slopes(4).double()
    d_slopes = distribute_tensor(slopes, ctx.mesh, [Shard(0)])
    _dt_compare(ctx, lambda a, b, c: ctx.fa.dot_product_attention(a, b, c, score_mod=alibi(slopes)),
                lambda a, b, c: ctx.fd.dot_product_attention(a, b, c, score_mod=alibi(d_slopes)),
                [ctx.randn(2, 8, 4, 16) for _ in range(3)], [Shard(2)] * 3, "alibi heads")


def _thd(ctx: Ctx):
    cu = torch.tensor([0, 5, 5, 16, 24], dtype=torch.int32)
    return [ctx.randn(24, 4, 16) for _ in range(3)], cu


def dt_thd_heads_lse(ctx: Ctx) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    (q, k, v), cu = _thd(ctx)
    kw = dict(qkv_format="thd", attn_mask_type="causal", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11,
              max_seqlen_kv=11, return_lse=True)
    ref, ref_lse = ctx.fa.dot_product_attention(q, k, v, **kw)
    out, lse = ctx.fd.dot_product_attention(*(distribute_tensor(t, ctx.mesh, [Shard(1)]) for t in (q, k, v)), **kw)
    assert tuple(lse.placements) == (Shard(0),), f"thd lse placements {lse.placements}"
    close(out.full_tensor(), ref, exact_bound(ref), "thd out")
    close(lse.full_tensor(), ref_lse, 1e-6, "thd lse")


def dt_varlen_heads(ctx: Ctx) -> None:
    from torch.distributed.tensor import Shard

    (q, k, v), cu = _thd(ctx)
    _dt_compare(ctx, lambda a, b, c: ctx.fa.varlen_attn(a, b, c, cu, cu, 11, 11, window_size=(-1, 0)),
                lambda a, b, c: ctx.fd.varlen_attn(a, b, c, cu, cu, 11, 11, window_size=(-1, 0)), [q, k, v],
                [Shard(1)] * 3, "varlen heads")


def dt_module(dim: int):
    def case(ctx: Ctx) -> None:
        from score_mods import softcap
        from torch.distributed.tensor import Shard

        attn = ctx.fa.DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type="causal", score_mod=softcap(4.0))
        q, k, v = ctx.randn(4, 8, 4, 16), ctx.randn(4, 8, 2, 16), ctx.randn(4, 8, 2, 16)
        _dt_compare(ctx, lambda a, b, c: attn(a, b, c), lambda a, b, c: ctx.fd.module_forward(attn, a, b, c),
                    [q, k, v], [Shard(dim)] * 3, f"module Shard({dim})")
    return case


def dt_doc_packed(dim: int):
    def case(ctx: Ctx) -> None:
        from score_mods import softcap
        from torch.distributed.tensor import Shard

        cu = torch.tensor([[0, 5, 16], [0, 16, 16], [0, 1, 16], [0, 8, 16]], dtype=torch.int32)
        kw = dict(is_causal=True, score_mod=softcap(3.0))
        _dt_compare(ctx, lambda a, b, c: ctx.fa.doc_packed_attn(a, b, c, cu, **kw),
                    lambda a, b, c: ctx.fd.doc_packed_attn(a, b, c, cu, **kw),
                    [ctx.randn(4, 16, 4, 16) for _ in range(3)], [Shard(dim)] * 3, f"doc_packed Shard({dim})")
    return case


def dt_compile_fullgraph(ctx: Ctx) -> None:
    """fd.dot_product_attention on DTensors under torch.compile(fullgraph=True), fwd and bwd."""
    from score_mods import softcap
    from torch.distributed.tensor import Shard

    sm = softcap(3.0)
    for mod in (sm, None):
        torch._dynamo.reset()
        fn = torch.compile(lambda a, b, c: ctx.fd.dot_product_attention(a, b, c, attn_mask_type="causal",
                                                                          score_mod=mod),
                           fullgraph=True, backend="aot_eager")
        _dt_compare(ctx, lambda a, b, c: ctx.fa.dot_product_attention(a, b, c, attn_mask_type="causal",
                                                                       score_mod=mod),
                    fn, [ctx.randn(2, 8, 4, 16) for _ in range(3)], [Shard(2)] * 3, f"compiled {mod}")


def dt_strategies(ctx: Ctx) -> None:
    """The OpStrategy of attn_fwd enumerates the servable kinds (what AutoParallel reads)."""
    from score_mods import softcap
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._op_schema import OpSchema

    from fused_attn import ops
    from fused_attn.spec import resolve_spec

    prop = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.fused_attn.attn_fwd.default

    def kinds(fmt: str, mod: Any, shape: tuple) -> set:
        spec, _ = resolve_spec(qkv_format=fmt, score_mod=mod, backend="reference")
        key = ops._register(spec)
        t = distribute_tensor(ctx.randn(*shape), ctx.mesh, [Replicate()])
        spec_t = t._spec
        schema = OpSchema(op, (spec_t, spec_t, spec_t, None, None, None, None, None, None, None,
                               distribute_tensor(torch.zeros(0, dtype=torch.float64), ctx.mesh, [Replicate()])._spec,
                               [], None, key), {})
        strategy = prop.op_strategy_funcs[op](prop._wrap_with_op_strategy(schema))
        return {s.output_specs[0].placements[0] for s in strategy.strategies}

    assert kinds("bshd", None, (4, 8, 4, 16)) == {Replicate(), Shard(0), Shard(2)}
    assert kinds("thd", None, (8, 4, 16)) == {Replicate(), Shard(1)}
    assert kinds("bhsd", softcap(2.0), (4, 4, 8, 16)) == {Replicate(), Shard(0), Shard(1)}
    assert kinds("bshd", lambda s, b, h, qi, ki: s + h, (4, 8, 4, 16)) == {Replicate(), Shard(0)}


def expect_error(exc: type, match: str, fn: Callable) -> None:
    import re

    try:
        fn()
    except exc as e:
        assert re.search(match, str(e)), f"{exc.__name__} message {str(e)!r} does not match {match!r}"
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"expected {exc.__name__} matching {match!r}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {exc.__name__} matching {match!r}, nothing raised")


def dt_errors(ctx: Ctx) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor import DTensor

    from score_mods import alibi, alibi_slopes

    fd, mesh = ctx.fd, ctx.mesh
    full = [ctx.randn(4, 8, 4, 16) for _ in range(3)]
    d = lambda p: [distribute_tensor(t, mesh, [p]) for t in full]  # noqa: E731
    expect_error(ValueError, r"sharded along its sequence dim .*context_parallel_attention",
                 lambda: fd.dot_product_attention(*d(Shard(1))))
    expect_error(ValueError, r"share their placement .*query S\(0\), key S\(2\)",
                 lambda: fd.dot_product_attention(d(Shard(0))[0], *d(Shard(2))[1:]))
    expect_error(TypeError, r"key and value are plain tensors but query is a DTensor",
                 lambda: fd.dot_product_attention(d(Shard(0))[0], full[1], full[2]))
    other = DeviceMesh("cpu", list(range(ctx.world)), mesh_dim_names=("other",))
    expect_error(ValueError, r"different device meshes", lambda: fd.dot_product_attention(
        d(Shard(0))[0], distribute_tensor(full[1], other, [Shard(0)]), distribute_tensor(full[2], other, [Shard(0)])))
    expect_error(NotImplementedError, r"reads the index 'h' arithmetically",
                 lambda: fd.dot_product_attention(*d(Shard(2)), score_mod=lambda s, b, h, qi, ki: s + h))
    expect_error(ValueError, r"head_dim", lambda: fd.dot_product_attention(*d(Shard(3))))
    expect_error(ValueError, r"slopes.* plain tensor .*Shard\(dim=0\)",
                 lambda: fd.dot_product_attention(*d(Shard(2)), score_mod=alibi(alibi_slopes(4).double())))
    partial = [DTensor.from_local(t, mesh, [Partial()]) for t in full]
    expect_error(ValueError, r"Partial DTensor", lambda: fd.dot_product_attention(*partial))
    (q, k, v), cu = _thd(ctx)
    expect_error(ValueError, r"token dim", lambda: fd.varlen_attn(
        *(distribute_tensor(t, mesh, [Shard(0)]) for t in (q, k, v)), cu, cu, 11, 11))
    expect_error(ValueError, r"cu_seq is a DTensor with placements", lambda: fd.doc_packed_attn(
        *d(Shard(0)), distribute_tensor(torch.tensor([[0, 8]] * 4, dtype=torch.int32), mesh, [Replicate()])))


def dt_gqa_uneven(ctx: Ctx) -> None:
    """4 ranks cannot split 2 key/value heads: refused, naming the head counts."""
    from torch.distributed.tensor import Shard, distribute_tensor

    q, k, v = ctx.randn(2, 8, 4, 16), ctx.randn(2, 8, 2, 16), ctx.randn(2, 8, 2, 16)
    expect_error(NotImplementedError, r"GQA with 4 query heads and 2 key/value heads",
                 lambda: ctx.fd.dot_product_attention(*(distribute_tensor(t, ctx.mesh, [Shard(2)]) for t in (q, k, v))))


def dt_2d_mesh(ctx: Ctx) -> None:
    """Batch on one mesh dim and heads on the other (4 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    q, k, v = (ctx.randn(4, 8, 4, 16) for _ in range(3))
    ref = ctx.fa.dot_product_attention(q, k, v, attn_mask_type="causal")
    out = ctx.fd.dot_product_attention(*(distribute_tensor(t, mesh, [Shard(0), Shard(2)]) for t in (q, k, v)),
                                       attn_mask_type="causal")
    assert tuple(out.placements) == (Shard(0), Shard(2)), out.placements
    close(out.full_tensor(), ref, exact_bound(ref), "2-D mesh out")


def dtensor_cases(world: int) -> Dict[str, Callable]:
    cases: Dict[str, Callable] = {}
    if world == 2:
        cases.update({
            "dt_bshd_batch": dt_dense("bshd", 0),
            "dt_bshd_heads_causal_softcap": dt_dense("bshd", 2, "causal", "softcap"),
            "dt_sbhd_batch_causal": dt_dense("sbhd", 1, "causal"),
            "dt_bhsd_heads": dt_dense("bhsd", 1),
            "dt_bshd_heads_gqa": dt_dense("bshd", 2, "causal", gqa=True),
            "dt_bias_batch_plain": dt_bias("batch", False),
            "dt_bias_batch_dtensor": dt_bias("batch", True),
            "dt_bias_heads_dtensor": dt_bias("heads", True),
            "dt_alibi_heads": dt_alibi_heads,
            "dt_thd_heads_lse": dt_thd_heads_lse,
            "dt_varlen_heads": dt_varlen_heads,
            "dt_module_batch": dt_module(0),
            "dt_module_heads": dt_module(2),
            "dt_doc_packed_batch": dt_doc_packed(0),
            "dt_doc_packed_heads": dt_doc_packed(2),
            "dt_compile_fullgraph": dt_compile_fullgraph,
            "dt_strategies": dt_strategies,
            "dt_errors": dt_errors,
        })
    else:
        cases.update({
            "dt_bshd_heads_causal_softcap": dt_dense("bshd", 2, "causal", "softcap"),
            "dt_doc_packed_batch": dt_doc_packed(0),
            "dt_gqa_uneven": dt_gqa_uneven,
            "dt_2d_mesh": dt_2d_mesh,
        })
    return cases


# ----------------------------------------------------------------------------- the runner


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    """Spawned entry: run every case of this world size, write results_<rank>.json."""
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    from helpers.cp_cases import cp_cases

    results = {}
    try:
        ctx = Ctx(rank, world)
        cases = dict(dtensor_cases(world))
        cases.update(cp_cases(world))
        for name, fn in cases.items():
            ctx.gen.manual_seed(zlib.crc32(name.encode()))
            try:
                fn(ctx)
                results[name] = [True, ""]
            except Exception as e:  # noqa: BLE001 - reported by the test
                results[name] = [False, f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"]
            dist.barrier()
    finally:
        with open(os.path.join(outdir, f"results_{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def case_names(world: int) -> List[str]:
    """Names of the cases of a world size (without importing torch.distributed.tensor early)."""
    from helpers.cp_cases import cp_cases

    return list(dtensor_cases(world)) + list(cp_cases(world))
