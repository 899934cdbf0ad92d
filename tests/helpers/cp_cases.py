"""Context-parallel cases of tests/distributed/test_distributed.py (spawned gloo groups, float64, CPU).

Each case shards full inputs with `shard_sequence`, runs `context_parallel_attention`, gathers
the output and the input gradients with `unshard_sequence`, and compares them with the
unsharded `dot_product_attention` (bound: `cp_bound`, see dist_cases).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, List

import torch

from helpers.dist_cases import Ctx, close, cp_bound, expect_error


def _run_cp(ctx: Ctx, inputs: List[torch.Tensor], kw: Dict[str, Any], comm: str, layout: str, fmt: str = "bshd",
            cu: torch.Tensor = None, module: Any = None, mod_leaf: torch.Tensor = None,
            make_mod: Callable = None) -> None:
    fd, fa = ctx.fd, ctx.fa
    shard = lambda t: fd.shard_sequence(t, layout=layout, qkv_format=fmt, cu_seqlens=cu)  # noqa: E731
    unshard = lambda t: fd.unshard_sequence(t, layout=layout, qkv_format=fmt, cu_seqlens=cu)  # noqa: E731
    ref_in = [t.clone().requires_grad_(True) for t in inputs]
    ref_kw, cp_kw = dict(kw), dict(kw)
    ref_leaf = cp_leaf = None
    if make_mod is not None:
        ref_leaf, cp_leaf = mod_leaf.clone().requires_grad_(True), mod_leaf.clone().requires_grad_(True)
        ref_kw["score_mod"], cp_kw["score_mod"] = make_mod(ref_leaf), make_mod(cp_leaf)
    ref = module(*ref_in, **ref_kw) if module is not None else fa.dot_product_attention(*ref_in, **ref_kw)
    dout = ctx.randn(*ref.shape)
    (ref * dout).sum().backward()
    loc = [shard(t).requires_grad_(True) for t in inputs]
    if module is not None:
        out = fd.ContextParallelAttention(module, None, comm, layout=layout)(*loc, **cp_kw)
    else:
        out = fd.context_parallel_attention(*loc, None, comm, layout=layout, **cp_kw)
    (out * shard(dout)).sum().backward()
    what = f"{comm} {layout} {fmt}"
    close(unshard(out.detach()), ref, cp_bound(ref), f"{what} out")
    for name, l, r in zip("qkv", loc, ref_in):
        close(unshard(l.grad), r.grad, cp_bound(r.grad), f"{what} d{name}")
    if cp_leaf is not None:
        close(cp_leaf.grad, ref_leaf.grad, cp_bound(ref_leaf.grad), f"{what} score_mod tensor gradient")


def _mask_kw(mask: str) -> Dict[str, Any]:
    from score_mods import softcap

    if mask == "causal_softcap":
        return dict(attn_mask_type="causal", score_mod=softcap(3.0))
    return dict(attn_mask_type=mask)


def cp_dense(comm: str, layout: str, mask: str):
    def case(ctx: Ctx) -> None:
        s = 4 * ctx.world
        q, k, v = ctx.randn(2, s, 4, 16), ctx.randn(2, s, 2, 16), ctx.randn(2, s, 2, 16)  # GQA 4 / 2
        _run_cp(ctx, [q, k, v], _mask_kw(mask), comm, layout)
    return case


def _thd_inputs(ctx: Ctx, layout: str):
    units = (2 if layout == "load_balanced" else 1) * ctx.world
    lens = [2 * units, 0, units, 3 * units]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    return [ctx.randn(int(cu[-1]), 4, 16) for _ in range(3)], cu, max(lens)


def cp_thd(comm: str, layout: str, mask: str):
    def case(ctx: Ctx) -> None:
        (q, k, v), cu, mx = _thd_inputs(ctx, layout)
        kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx, max_seqlen_kv=mx,
                  **_mask_kw(mask))
        _run_cp(ctx, [q, k, v], kw, comm, layout, fmt="thd", cu=cu)
    return case


def cp_position_mod(comm: str, which: str, fmt: str = "bshd"):
    """Position-dependent score_mods at global positions (reference backend)."""
    def case(ctx: Ctx) -> None:
        from score_mods import alibi, alibi_slopes, causal, post_scale_bias

        kw: Dict[str, Any] = dict(backend="reference")
        extra: Dict[str, Any] = {}
        if fmt == "thd":
            (q, k, v), cu, mx = _thd_inputs(ctx, "load_balanced")
            kw.update(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx, max_seqlen_kv=mx)
            extra = dict(fmt="thd", cu=cu)
            s = mx
        else:
            s = 4 * ctx.world
            q, k, v = (ctx.randn(2, s, 4, 16) for _ in range(3))
        if which == "alibi":
            kw.update(attn_mask_type="causal")
            extra.update(mod_leaf=alibi_slopes(4).double(), make_mod=alibi)
        elif which == "causal_mod":
            kw.update(score_mod=causal())
        else:  # a trained bias indexed by q_idx / kv_idx
            extra.update(mod_leaf=ctx.randn(1, 4, s, s), make_mod=post_scale_bias)
            kw.update(attn_mask_type="causal")
        _run_cp(ctx, [q, k, v], kw, comm, "load_balanced", **extra)
    return case


def cp_module(fmt: str, comm: str):
    def case(ctx: Ctx) -> None:
        from score_mods import softcap

        s = 4 * ctx.world
        shape = {"sbhd": (s, 2, 4, 16), "bhsd": (2, 4, s, 16)}[fmt]
        kshape = {"sbhd": (s, 2, 2, 16), "bhsd": (2, 2, s, 16)}[fmt]
        attn = ctx.fa.DotProductAttention(4, 16, num_gqa_groups=2, qkv_format=fmt, attn_mask_type="causal",
                                          score_mod=softcap(2.0))
        _run_cp(ctx, [ctx.randn(*shape), ctx.randn(*kshape), ctx.randn(*kshape)], {}, comm, "load_balanced", fmt=fmt,
                module=attn)
    return case


def cp_module_argument(comm: str):
    """DotProductAttention(..., cp_group=...) takes local shards and returns the local output,
    equal to the same module without cp_group on the full sequence, forward and backward."""
    def case(ctx: Ctx) -> None:
        import torch.distributed as dist
        from score_mods import softcap

        fd, s = ctx.fd, 4 * ctx.world
        cfg = dict(num_gqa_groups=2, attn_mask_type="causal", score_mod=softcap(2.0))
        full = ctx.fa.DotProductAttention(4, 16, **cfg)
        sharded = ctx.fa.DotProductAttention(4, 16, **cfg, cp_group=dist.group.WORLD, cp_comm=comm)
        assert f"cp_comm={comm!r}" in repr(sharded)
        inputs = [ctx.randn(2, s, 4, 16), ctx.randn(2, s, 2, 16), ctx.randn(2, s, 2, 16)]
        ref_in = [t.clone().requires_grad_(True) for t in inputs]
        ref = full(*ref_in)
        dout = ctx.randn(*ref.shape)
        (ref * dout).sum().backward()
        loc = [fd.shard_sequence(t).requires_grad_(True) for t in inputs]
        out = sharded(*loc)
        (out * fd.shard_sequence(dout)).sum().backward()
        close(fd.unshard_sequence(out.detach()), ref, cp_bound(ref), f"module cp_group {comm} out")
        for name, l, r in zip("qkv", loc, ref_in):
            close(fd.unshard_sequence(l.grad), r.grad, cp_bound(r.grad), f"module cp_group {comm} d{name}")
    return case


def cp_return_lse_and_no_overlap(ctx: Ctx) -> None:
    """return_lse gives the global lse's local rows; cp_overlap=False gives identical results."""
    fd = ctx.fd
    s = 4 * ctx.world
    q, k, v = (ctx.randn(2, s, 4, 16) for _ in range(3))
    ref, ref_lse = ctx.fa.dot_product_attention(q, k, v, attn_mask_type="causal", return_lse=True)
    loc = [fd.shard_sequence(t) for t in (q, k, v)]
    out, lse = fd.context_parallel_attention(*loc, attn_mask_type="causal", return_lse=True)
    out2 = fd.context_parallel_attention(*loc, attn_mask_type="causal", cp_overlap=False)
    assert torch.equal(out, out2), "cp_overlap=False changed the result"
    gathered = fd.unshard_sequence(lse.transpose(1, 2).contiguous()).transpose(1, 2)  # (B, H, S)
    close(gathered, ref_lse.double(), 1e-5, "lse")
    close(fd.unshard_sequence(out), ref, cp_bound(ref), "out")


def cp_dtensor(ctx: Ctx) -> None:
    """DTensor inputs sharded along the sequence (contiguous layout); on 4 ranks, heads split too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    s = 4 * ctx.world
    full = [ctx.randn(2, s, 4, 16) for _ in range(3)]
    ref_in = [t.clone().requires_grad_(True) for t in full]
    ref = ctx.fa.dot_product_attention(*ref_in, attn_mask_type="causal")
    ref.sum().backward()
    if ctx.world == 4:
        mesh, pl = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp")), [Shard(1), Shard(2)]
    else:
        mesh, pl = ctx.mesh, [Shard(1)]
    dts = [distribute_tensor(t.clone(), mesh, pl).requires_grad_(True) for t in full]
    out = ctx.fd.context_parallel_attention(*dts, attn_mask_type="causal", layout="contiguous")
    assert tuple(out.placements) == tuple(pl), out.placements
    out.sum().backward()
    close(out.full_tensor(), ref, cp_bound(ref), "dtensor cp out")
    for name, d, r in zip("qkv", dts, ref_in):
        close(d.grad.full_tensor(), r.grad, cp_bound(r.grad), f"dtensor cp d{name}")


def cp_errors(ctx: Ctx) -> None:
    fd = ctx.fd
    s = 4 * ctx.world
    loc = [fd.shard_sequence(ctx.randn(2, s, 4, 16)) for _ in range(3)]
    cpa = fd.context_parallel_attention
    expect_error(NotImplementedError, r"sliding windows, got window_size=\(2, 0\)",
                 lambda: cpa(*loc, window_size=(2, 0)))
    expect_error(ValueError, r"cp_comm='tree' is not supported", lambda: cpa(*loc, None, "tree"))
    expect_error(ValueError, r"layout='zigzag' is not supported", lambda: cpa(*loc, layout="zigzag"))
    expect_error(NotImplementedError, r"does not support sinks", lambda: cpa(
        *loc, softmax_type="learnable", sinks=torch.zeros(4, dtype=torch.float64)))
    expect_error(NotImplementedError, r"'no_mask' and 'causal'.*got 'padding'",
                 lambda: cpa(*loc, attn_mask_type="padding"))
    odd = [t[:, :3] for t in loc]
    expect_error(ValueError, r"3 tokens, not a multiple of the 2 chunks", lambda: cpa(*odd))
    expect_error(NotImplementedError, r"needs equal query and key lengths", lambda: cpa(
        loc[0], loc[1][:, :2], loc[2][:, :2], attn_mask_type="causal"))
    from score_mods import causal

    from score_mods import raw_callback

    untraced = raw_callback(lambda graph, score, tensors: score, cache_key="identity",
                            reference=lambda s, b, h, q_idx, kv_idx: s)  # its index use is unknown
    expect_error(NotImplementedError, r"reads positions .*only traced score_mods get them on cuDNN", lambda: cpa(
        *loc, score_mod=untraced, backend="cudnn"))
    cu_ok = torch.tensor([0, 4 * ctx.world, 8 * ctx.world], dtype=torch.int32)
    packed = [ctx.randn(4, 4, 16) for _ in range(3)]
    expect_error(NotImplementedError, r"reads positions .*differ per sequence in a packed \(thd\) batch", lambda: cpa(
        *packed, qkv_format="thd", cu_seqlens_q=cu_ok, cu_seqlens_kv=cu_ok, max_seqlen_q=4 * ctx.world,
        max_seqlen_kv=4 * ctx.world, score_mod=causal(), backend="cudnn"))
    cu = torch.tensor([0, 2, 2 + 4 * ctx.world], dtype=torch.int32)  # 2 is no multiple of 2N
    t = [ctx.randn(1 + 2, 4, 16) for _ in range(3)]
    expect_error(ValueError, r"every sequence length must be a multiple of", lambda: cpa(
        *t, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4 * ctx.world,
        max_seqlen_kv=4 * ctx.world))
    expect_error(ValueError, r"does not split into", lambda: fd.shard_sequence(ctx.randn(2, 6, 4, 16)))
    from torch.distributed.tensor import Shard, distribute_tensor

    uneven = [distribute_tensor(ctx.randn(2, 2 * ctx.world + 1, 4, 16), ctx.mesh, [Shard(1)]) for _ in range(3)]
    expect_error(ValueError, r"global sequence of .* tokens, which does not split", lambda: cpa(*uneven,
                                                                                            layout="contiguous"))


def cp_cases(world: int) -> Dict[str, Callable]:
    cases: Dict[str, Callable] = {}
    if world == 2:
        for comm, layout, mask in itertools.product(("ring", "all_gather"), ("load_balanced", "contiguous"),
                                                    ("no_mask", "causal", "causal_softcap")):
            cases[f"cp_dense_{comm}_{layout}_{mask}"] = cp_dense(comm, layout, mask)
        for comm, mask in itertools.product(("ring", "all_gather"), ("no_mask", "causal", "causal_softcap")):
            cases[f"cp_thd_{comm}_load_balanced_{mask}"] = cp_thd(comm, "load_balanced", mask)
        cases["cp_thd_ring_contiguous_causal"] = cp_thd("ring", "contiguous", "causal")
        for comm, which in itertools.product(("ring", "all_gather"), ("alibi", "causal_mod", "bias_grad")):
            cases[f"cp_{comm}_{which}_reference"] = cp_position_mod(comm, which)
        cases["cp_ring_alibi_thd_reference"] = cp_position_mod("ring", "alibi", "thd")
        cases["cp_module_sbhd_ring"] = cp_module("sbhd", "ring")
        cases["cp_module_bhsd_all_gather"] = cp_module("bhsd", "all_gather")
        cases["cp_module_argument_ring"] = cp_module_argument("ring")
        cases["cp_module_argument_all_gather"] = cp_module_argument("all_gather")
        cases["cp_return_lse_and_no_overlap"] = cp_return_lse_and_no_overlap
        cases["cp_errors"] = cp_errors
    else:
        for comm in ("ring", "all_gather"):
            cases[f"cp_dense_{comm}_load_balanced_causal_softcap"] = cp_dense(comm, "load_balanced", "causal_softcap")
            cases[f"cp_thd_{comm}_load_balanced_causal"] = cp_thd(comm, "load_balanced", "causal")
        cases["cp_dense_ring_contiguous_no_mask"] = cp_dense("ring", "contiguous", "no_mask")
        cases["cp_ring_alibi_reference"] = cp_position_mod("ring", "alibi")
    cases["cp_dtensor"] = cp_dtensor
    return cases
